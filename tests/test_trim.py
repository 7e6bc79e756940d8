"""Draft-then-trim: lossless whatever it keeps, trims only when a verify's price outruns its expected gain,
and its calibration comes from acceptance tables. Properties for any weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import check_stats_invariants, greedy_reference

from blockpilot.cost import CycleCost
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate, generate_many
from blockpilot.policies.resolve import PolicySpec, resolve_policy
from blockpilot.policies.trim import (
    CONFIDENCE_BINS,
    DraftThenTrim,
    TrimCalibration,
    survival_hits,
    verify_count,
    walk_trim,
)
from blockpilot.sweep import calibrate_trim
from blockpilot.table import AcceptanceTable

STEEP = CycleCost({1: {1: 1.0, 2: 1.6, 8: 8.0}})  # each verified position costs more than it can return


def calibration(survival: float, block_size: int = 6, cost: CycleCost | None = None) -> TrimCalibration:
    return TrimCalibration(block_size, (survival,) * CONFIDENCE_BINS, (1,) * CONFIDENCE_BINS, cost or CycleCost.uniform())


def test_verify_count_weighs_expected_tokens_against_the_price():
    confidences = torch.full((7,), 0.95)
    assert verify_count(calibration(0.5), confidences) == 7  # uniform cost: every draft is worth verifying
    assert verify_count(calibration(0.1, cost=STEEP), confidences) == 0
    assert verify_count(calibration(1.0, cost=STEEP), confidences) == 1  # c(8) = 8: even sure drafts stop paying
    gentle = CycleCost({1: {1: 1.0, 8: 4.0}})
    assert verify_count(calibration(1.0, cost=gentle), confidences) == 7
    mixed = TrimCalibration(8, (0.0,) * 5 + (1.0,) * 5, (1,) * 10, CycleCost({1: {1: 1.0, 8: 1.7}}))
    # Confident early slots, then an unconfident one: verify up to it and no further.
    assert verify_count(mixed, torch.tensor([0.9, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9])) == 3


@pytest.mark.parametrize("survival", [0.05, 0.4, 0.9])
def test_trimmed_generations_are_greedy_and_beside_other_rows_unchanged(tiny_models, survival):
    prompts = [tiny_models.encode_prompt(p) for p in ("Count from 1 to 9.", "List four colors.")]
    config = GenerationConfig(max_new_tokens=32)
    trim = DraftThenTrim(calibration(survival, cost=CycleCost({1: {1: 1.0, 8: 3.0}})))
    alone = [generate(tiny_models, p, policy=trim, config=config) for p in prompts]
    for prompt, result in zip(prompts, alone, strict=True):
        assert result.token_ids == greedy_reference(tiny_models.target, prompt, 32)
        check_stats_invariants(result, 32)
        assert result.policy == "trim" and max(result.block_sizes) <= 6
    batched = generate_many(
        tiny_models, [GenerationRequest(p, config, q) for p, q in zip(prompts, (trim, resolve_policy("fixed:3", tiny_models)))]
    )
    assert batched[0].token_ids == alone[0].token_ids and batched[0].block_sizes == alone[0].block_sizes
    if survival < 0.1:
        assert set(alone[0].block_sizes) == {1}, "drafts that almost never survive are not worth verifying"


def test_a_policy_that_keeps_too_many_drafts_is_refused(tiny_models):
    class Greedy(DraftThenTrim):
        def verify_count(self, confidences):
            return len(confidences) + 1

    with pytest.raises(ValueError, match="kept 6 drafts"):
        generate(tiny_models, tiny_models.encode_prompt("Hi."), policy=Greedy(calibration(0.5)), config=GenerationConfig(max_new_tokens=8))


def test_calibration_from_tables_round_trips_and_resolves(tiny_models, tmp_path):
    prompts = [tiny_models.encode_prompt(p) for p in ("Count from 1 to 9.", "Write the numbers from 2 to 20.")]
    made = calibrate_trim(tiny_models, prompts, 6, cost=STEEP, max_new_tokens=32)
    assert all(0.0 <= s <= 1.0 for s in made.survival) and made.block_size == 6
    # Every anchor reaches its first slot when that slot drafts a token before the sequence's last; a slot is
    # reached only after every earlier one was right, so an anchor reaches at most those slots (the same tables,
    # rebuilt by a plain sweep).
    from blockpilot.sweep import SweepConfig, sweep_prompts

    config = SweepConfig((6,), max_new_tokens=32, stop_token_ids=tuple(tiny_models.stop_token_ids()))
    tables = [t for sweep in sweep_prompts(tiny_models, prompts, [0, 1], config) for t in sweep.tables]
    slots = [min(t.block_size_at(i, 6), t.n - i) - 1 for t in tables for i in range(1, t.n)]
    assert sum(1 for k in slots if k > 0) <= sum(made.counts) <= sum(slots)
    path = made.save(tmp_path / "trim.json")
    assert TrimCalibration.load(path) == made
    policy = resolve_policy(f"trim:{path}", tiny_models)
    assert isinstance(policy, DraftThenTrim) and policy.calibration == made
    assert str(PolicySpec.parse(f"trim:{path}")) == f"trim:{path}"
    with pytest.raises(ValueError, match="needs a calibration"):
        PolicySpec.parse("trim")
    with pytest.raises(FileNotFoundError, match="calibrate-trim"):
        resolve_policy(f"trim:{tmp_path / 'missing.json'}", tiny_models)


def test_survival_is_the_rate_of_right_drafts_among_those_reached():
    hits = np.zeros((CONFIDENCE_BINS, 2), dtype=np.int64)
    hits[9] = (9, 10)
    hits[2] = (1, 4)
    made = TrimCalibration.from_hits(8, hits)
    assert made.survival[9] == pytest.approx(0.9) and made.survival[2] == pytest.approx(0.25)
    assert made.survival[0] == pytest.approx(10 / 14)  # no evidence: the pooled rate
    with pytest.raises(ValueError, match="draft 6 cannot price trim's, which draft 8"):
        TrimCalibration.from_hits(8, hits, CycleCost({1: {1: 1.0, 6: 2.0}}, drafted=6))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        TrimCalibration(8, (1.5,) * CONFIDENCE_BINS, (1,) * CONFIDENCE_BINS)


def hand_made_table(confidences: np.ndarray, commits: list[int], max_new_tokens: int = 16) -> AcceptanceTable:
    """A table of candidates (2, 4) over n = len(commits) + 1 tokens, with b = 4's commits and confidences given."""
    row = np.asarray(commits, dtype=np.int16)
    return AcceptanceTable((2, 4), np.stack([np.minimum(row, 2), row]), max_new_tokens, confidences=confidences)


def test_survival_counts_the_drafts_reached_and_says_nothing_past_the_end():
    sure, even, unsure = 0.95, 0.55, 0.15  # confidence bins 9, 5, 1
    confidences = np.array(
        [[sure, even, unsure], [sure] * 3, [even] * 3, [sure, unsure, unsure], [even, unsure, unsure], [unsure] * 3],
        np.float32,
    )
    # n = 7. Cursor 1 commits 2: slot 1 right, slot 2 wrong. Cursor 2: its 3 drafts right. Cursor 3: 2 right, the
    # third wrong. Cursor 4: slot 1 right, slot 2 wrong. Cursor 5 commits 2 = n - 5, up to the end: slot 1 right,
    # and its slot 2 drafted the last token, which a(i, b) capped there does not tell. Cursor 6: nothing before the end.
    hits = survival_hits(hand_made_table(confidences, [2, 4, 3, 2, 2, 1]))
    assert hits[9].tolist() == [5, 5] and hits[5].tolist() == [3, 5] and hits[1].tolist() == [0, 1]
    assert hits.sum(axis=0).tolist() == [8, 11]
    made = TrimCalibration.from_tables([hand_made_table(confidences, [2, 4, 3, 2, 2, 1])])
    assert made.block_size == 4 and made.survival[9] == 1.0 and made.survival[5] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="relabel"):
        survival_hits(AcceptanceTable((2, 4), np.ones((2, 3), np.int16), 16))
    with pytest.raises(ValueError, match="shape"):
        hand_made_table(confidences[:, :2], [2, 4, 3, 2, 2, 1])


def test_a_trim_walk_verifies_what_its_rule_keeps_and_commits_within_the_drafted_block():
    sure, unsure = 0.95, 0.15
    confidences = np.array(
        [[sure, sure, unsure], [unsure, sure, sure], [sure] * 3, [sure] * 3, [sure] * 3, [unsure] * 3], np.float32
    )
    table = hand_made_table(confidences, [4, 1, 3, 2, 2, 1])
    confident_only = TrimCalibration(4, (0.0,) * 5 + (1.0,) * 5, (1,) * 10, CycleCost({1: {1: 1.0, 4: 1.2}}))
    # Cursor 1 verifies its 2 confident drafts and commits 3 of a(1, 4) = 4; cursor 4 verifies all 3 and commits
    # a(4, 4) = 2; cursor 6 verifies none of its unconfident drafts.
    assert walk_trim(confident_only, table) == ([3, 4, 1], [3, 2, 1])
    everything = calibration(1.0, block_size=4)  # uniform cost: every draft is worth verifying
    assert walk_trim(everything, table) == ([4, 4], table.walk(4))
    with pytest.raises(ValueError, match="b = 6"):
        walk_trim(calibration(1.0), table)


@pytest.mark.parametrize("survival", [0.05, 0.5, None])
def test_a_trim_walk_on_the_table_is_the_live_trim_run(tiny_models, survival):
    """fp32 on the CPU: draft-then-trim walked on acceptance tables verifies and commits, cycle by cycle, what it
    does live (None: the calibration made from those tables)."""
    from blockpilot.sweep import SweepConfig, sweep_prompts

    prompts = [tiny_models.encode_prompt(p) for p in ("Count from 1 to 9.", "List four colors.", "Write a poem.")]
    stop = tuple(tiny_models.stop_token_ids())
    sweep = SweepConfig((2, 4, 6), max_new_tokens=32, stop_token_ids=stop)
    tables = [swept.tables[0] for swept in sweep_prompts(tiny_models, prompts, [0, 1, 2], sweep)]
    price = CycleCost({1: {1: 1.0, 6: 2.5}})
    made = TrimCalibration.from_tables(tables, price) if survival is None else calibration(survival, cost=price)
    generation = GenerationConfig(32, stop_token_ids=stop)
    for prompt, table in zip(prompts, tables, strict=True):
        live = generate(tiny_models, prompt, policy=DraftThenTrim(made), config=generation)
        assert walk_trim(made, table) == (live.block_sizes, live.acceptance_lengths)
