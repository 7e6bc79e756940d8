"""Priced verify widths (`blockpilot.decoding.width`): the arithmetic, and a batch whose greedy rows are capped."""

from __future__ import annotations

import pytest
from support import greedy_reference

from blockpilot.cost import CycleCost
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.decoding.width import AcceptanceRate, expected_commit, priced_width
from blockpilot.policies.fixed import FixedBlockSize


def test_expected_commit_runs_from_one_token_to_the_whole_block():
    assert expected_commit(0.0, 6) == 1.0
    assert expected_commit(1.0, 6) == 6.0
    curve = [expected_commit(0.7, b) for b in range(1, 10)]
    assert all(a < b for a, b in zip(curve, curve[1:])) and curve[-1] < 1 / (1 - 0.7)
    assert expected_commit(0.5, 3) == pytest.approx(1.75)
    with pytest.raises(ValueError, match=r"acceptance rate must lie in \[0, 1\], got 1.5"):
        expected_commit(1.5, 4)
    with pytest.raises(ValueError, match="block size must be >= 1, got 0"):
        expected_commit(0.5, 0)


def test_acceptance_rate_counts_drafts_and_first_rejections():
    rate = AcceptanceRate()
    assert rate.rate(prior=0.3, weight=2.0) == pytest.approx(0.3)
    rate.add(4, 3)  # every draft accepted: no rejection seen
    rate.add(4, 1)  # the second draft was wrong
    rate.add(1, 0)  # no draft: nothing learned
    assert (rate.accepted, rate.rejected) == (4, 1)
    assert rate.rate(prior=0.5, weight=2.0) == pytest.approx((4 + 1) / (5 + 2))
    with pytest.raises(ValueError, match="accepted 4 drafts of a block of 4; expected 0..3"):
        rate.add(4, 4)


def test_priced_width_trades_the_long_rows_gain_against_everyone_s_cost():
    sizes = [2, 2, 2, 8]
    steep = CycleCost({4: {2: 1.0, 8: 4.0}})  # the cycle costs as much as its width
    flat = CycleCost({4: {2: 1.0, 8: 1.0}})
    poor, good = [0.3] * 4, [0.99] * 4
    assert priced_width(sizes, poor, steep) == 2  # the long row's few extra tokens do not pay for 4x the cycle
    assert priced_width(sizes, poor, flat) == 8  # a wider cycle that costs nothing more is taken
    assert priced_width(sizes, good, CycleCost({4: {2: 1.0, 8: 1.2}})) == 8  # ~6 more tokens for 20% more time
    assert priced_width(sizes, poor, steep, floor=8) == 8  # a row that may not be capped
    assert priced_width([8], [0.0], steep) == 8  # one row: its own choice
    assert priced_width(sizes, poor, CycleCost.uniform()) == 8
    with pytest.raises(ValueError, match="one acceptance rate per row, got 3 for 4 rows"):
        priced_width(sizes, poor[:3], steep)
    with pytest.raises(ValueError, match="floor 9 exceeds the widest block 8"):
        priced_width(sizes, poor, steep, floor=9)


def test_capped_greedy_rows_stay_exact_and_sampled_rows_keep_their_blocks(tiny_models):
    """A cost that makes every slot dear caps the wide greedy rows to the sampled row's width in the first cycle;
    every greedy output is still the target's greedy decoding, and the sampled row's output for its seed is the one
    it gets alone."""
    prompts = [tiny_models.encode_prompt(p) for p in ("Count from 1 to 9.", "List four colors.", "Spell cat.")]
    greedy = [
        GenerationRequest(prompt, GenerationConfig(max_new_tokens=20), FixedBlockSize(b))
        for prompt, b in zip(prompts, (2, 6, 8), strict=True)
    ]
    sampled = GenerationRequest(prompts[0], GenerationConfig(max_new_tokens=20, temperature=1.0, seed=7), FixedBlockSize(3))
    steep = CycleCost({4: {1: 1.0, 8: 50.0}})
    *results, sampled_result = generate_many(tiny_models, [*greedy, sampled], cost=steep)
    for prompt, request, result in zip(prompts, greedy, results, strict=True):
        assert result.token_ids == greedy_reference(tiny_models.target, prompt, 20)
        assert max(result.block_sizes) <= request.policy.block_size
    assert [r.block_sizes[0] for r in results] == [2, 3, 3], "the wide rows capped at the sampled row's 3"
    alone = generate_many(tiny_models, [sampled])[0]
    assert (sampled_result.token_ids, sampled_result.block_sizes) == (alone.token_ids, alone.block_sizes)
    uncapped = generate_many(tiny_models, greedy)
    assert [r.block_sizes[0] for r in uncapped] == [2, 6, 8]
