"""The confidence rule: its means are those of the walks' cycles, its choice is priced (measured prices first), it
decodes losslessly switching between autoregression and drafting, live as on the acceptance table, and the cycle
hands it the anchor's top-1 probability and the engine's measured prices. Properties for any weights."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from support import context_writes, greedy_reference
from test_static import Alternating
from test_step_policy import sweep_anchors

from blockpilot.cost import CycleCost
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate, generate_many
from blockpilot.decoding.batch_pricing import PRICE_WARM_UP
from blockpilot.decoding.engine import Engine
from blockpilot.policies.base import BlockSizePolicy, PrefillState
from blockpilot.policies.confidence import ConfidencePolicy
from blockpilot.policies.fixed import Autoregressive
from blockpilot.policies.resolve import resolve_policy
from blockpilot.predictor.confidence import (
    ALL_ACCEPTED,
    EDGES,
    FIRST_OR_AUTOREGRESSIVE,
    OUTCOMES,
    PRIOR_DRAFTS,
    REJECTED,
    ConfidenceRule,
    DraftRecord,
    cycle_outcome,
    fit_confidence_rule,
    walk_rule,
)
from blockpilot.predictor.step_data import Anchors, StepRow, evaluate_step_model
from blockpilot.sweep import SweepConfig, sweep_prompt
from blockpilot.table import AcceptanceTable

CANDIDATES = (1, 4)


def rule_of(commits: dict[int, float], cost: dict[int, float], outcomes: dict[int, dict[int, float]] | None = None):
    """A rule over `CANDIDATES` at T = 0 whose every cell holds `commits` (b -> tokens), or `outcomes[o]` after
    outcome o."""
    means = np.zeros((1, len(EDGES) + 1, OUTCOMES, len(CANDIDATES)))
    for outcome in range(OUTCOMES):
        row = (outcomes or {}).get(outcome, commits)
        means[0, :, outcome] = [row[b] for b in CANDIDATES]
    return ConfidenceRule(CANDIDATES, (0.0,), means, np.full(means.shape[:-1], 100), cost)


def test_outcomes_of_a_cycle():
    assert cycle_outcome(None, None) == cycle_outcome(1, 1) == FIRST_OR_AUTOREGRESSIVE
    assert cycle_outcome(4, 4) == ALL_ACCEPTED and cycle_outcome(4, 2) == REJECTED


def test_the_means_are_those_of_the_fixed_walks_cycles():
    """One table of 9 tokens: b = 1 commits 1 everywhere, b = 4 commits 4 at cursor 1, 2 at cursor 5, 3 at cursor 7.
    The b = 4 walk visits cursors 1 (first), 5 (after all accepted) and 7 (after a rejection); the autoregressive
    walk every cursor, after an autoregressive cycle. Each cell's mean is over the cycles that landed in it."""
    four = np.array([4, 1, 1, 1, 2, 1, 3, 1], dtype=np.int16)
    table = AcceptanceTable(CANDIDATES, np.stack([np.ones(8, dtype=np.int16), four]), max_new_tokens=64)
    row = StepRow("p", 0.0, [table], [Anchors(np.full(8, 0.999, dtype=np.float32), 0.0)])
    rule = fit_confidence_rule([row], CycleCost({1: {1: 1.0, 4: 2.0}}), min_cycles=1)
    last = len(EDGES)  # every anchor is in the top bucket
    # First or after autoregression: the 8 cursors of the b = 1 walk and cursor 1 of the b = 4 walk.
    assert rule.commits[0, last, FIRST_OR_AUTOREGRESSIVE].tolist() == [1.0, (14 + 4) / 9]  # b = 4 over 8 cursors + 1
    assert rule.commits[0, last, ALL_ACCEPTED].tolist() == [1.0, 2.0]  # cursor 5
    assert rule.commits[0, last, REJECTED].tolist() == [1.0, 3.0]  # cursor 7
    assert rule.cycles[0, last].tolist() == [9, 1, 1] and rule.cycles[0, :last].sum() == 0
    assert rule.cost == {1: 1.0, 4: 2.0}
    pooled = fit_confidence_rule([row], CycleCost({1: {1: 1.0, 4: 2.0}}))  # every cell sparse: its bucket's mean
    assert np.allclose(pooled.commits[0, last], [1.0, (18 + 2 + 3) / 11])


def test_a_choice_is_the_best_tokens_per_second_measured_prices_first(tmp_path):
    rule = rule_of({1: 1.0, 4: 3.0}, {1: 1.0, 4: 2.0})
    assert rule.choose(0.0, 0.5, REJECTED) == 4  # 1.5 tokens a unit against 1
    assert rule.choose(0.0, 0.5, REJECTED, {1: 1.0, 4: 4.0}) == 1  # measured: drafting costs 4
    assert rule.choose(0.0, 0.5, REJECTED, {1: 0.2, 4: 2.0}) == 1
    assert rule.choose(0.0, 0.5, REJECTED, {1: 1.0, 4: 3.0}) == 1  # a tie: the smaller b
    # What was not measured is the calibrated curve at the level of the nearest measured candidate (a device 2x or
    # 5x slower than the curve, a batch of many rows): the choice the curve makes, not one of mixed levels.
    assert rule.priced({4: 4.0}) == [2.0, 4.0] and rule.choose(0.0, 0.5, REJECTED, {4: 4.0}) == 4
    assert rule.priced({1: 0.2}) == pytest.approx([0.2, 0.4]) and rule.choose(0.0, 0.5, REJECTED, {1: 0.2}) == 4
    assert rule.priced(None) == rule.priced({3: 9.0}) == [1.0, 2.0]  # no candidate measured: the curve
    assert rule.choose(1.0, 0.5, REJECTED) == 4  # the nearest temperature's table
    loaded = ConfidenceRule.load(rule.save(tmp_path / "rule.json"))
    assert np.array_equal(loaded.commits, rule.commits) and loaded.cost == rule.cost
    assert loaded.candidates == CANDIDATES and loaded.edges == EDGES
    (tmp_path / "folder").mkdir()
    rule.save(tmp_path / "folder")
    assert ConfidenceRule.load(tmp_path / "folder").temperatures == (0.0,)
    with pytest.raises(FileNotFoundError, match="train-step"):
        ConfidenceRule.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="shape"):
        ConfidenceRule(CANDIDATES, (0.0,), np.zeros((1, 2, 3, 2)), np.zeros((1, 2, 3)), {1: 1.0, 4: 1.0})


def test_a_request_whose_drafts_accept_less_than_the_table_says_stops_drafting():
    """The table expects 3 accepted drafts of b = 4 (4 tokens at twice the price: drafting pays). A request whose
    drafts keep what the table says drafts on; one whose drafts are all rejected stops once its record, shrunk toward
    the table, says the drafts no longer pay; a cycle cut to the budget or run autoregressive by its batch is not
    counted; one the batch widened counts as the chosen b's prefix."""
    rule = rule_of({1: 1.0, 4: 4.0}, {1: 1.0, 4: 2.0})
    good, bad = DraftRecord(), DraftRecord()
    for _ in range(10):
        assert rule.choose(0.0, 0.99, FIRST_OR_AUTOREGRESSIVE, record=good) == 4
        good.settle(4, 4)
    assert good.scale == 1.0 and good.expected == 30.0
    sizes = []
    for _ in range(10):
        sizes.append(rule.choose(0.0, 0.99, FIRST_OR_AUTOREGRESSIVE, record=bad))
        bad.settle(sizes[-1], 1)
    # Drafting pays while 1 + 3 * scale > 2: scale = 8 / (8 + 3k) after k rejected cycles, > 1/3 for k < 16/3.
    assert sizes == [4] * 6 + [1] * 4 and bad.realized == 0 and bad.expected == 18.0
    assert bad.scale == PRIOR_DRAFTS / (PRIOR_DRAFTS + 18.0)
    cut = DraftRecord()
    rule.choose(0.0, 0.99, FIRST_OR_AUTOREGRESSIVE, record=cut)
    cut.settle(2, 1)  # the last cycle cut to 2 tokens, or a batch's autoregressive cycle (b = 1): not the choice
    assert cut.expected == cut.realized == 0 and cut.pending is None
    wide = DraftRecord()
    rule.choose(0.0, 0.99, FIRST_OR_AUTOREGRESSIVE, record=wide)
    wide.settle(8, 6)  # the batch widened the chain to 8: its first 3 drafts are the 4's, all kept
    assert (wide.expected, wide.realized) == (3.0, 3.0)
    rule.choose(0.0, 0.99, FIRST_OR_AUTOREGRESSIVE, record=wide)
    wide.settle(8, 2)  # one draft kept, then rejected: the 4 would have kept one too
    assert (wide.expected, wide.realized) == (6.0, 4.0)


def test_switching_by_outcome_is_lossless_and_drafts_as_the_table_says(tiny_models, tmp_path):
    """A rule that drafts first and after a whole block accepted, and decodes autoregressively after a rejection:
    rows switch both ways; greedy alone and beside other rows, and resolved from its file."""
    rule = rule_of(
        {1: 1.0, 4: 1.0},
        {1: 1.0, 4: 2.0},
        outcomes={FIRST_OR_AUTOREGRESSIVE: {1: 1.0, 4: 4.0}, ALL_ACCEPTED: {1: 1.0, 4: 4.0}},
    )
    policy = resolve_policy(f"confidence:{rule.save(tmp_path / 'rule.json')}", tiny_models)
    assert isinstance(policy, ConfidencePolicy) and not policy.keeps_block_size and policy.name == "confidence"
    texts = ["Count from 1 to 30.", "List four colors.", "Spell cat.", "Write the numbers from 2 to 20."]
    prompts = [tiny_models.encode_prompt(text) for text in texts]
    config = GenerationConfig(max_new_tokens=32)
    requests = [GenerationRequest(p, config, policy) for p in prompts]
    batched = generate_many(tiny_models, requests)
    alone = [generate_many(tiny_models, [request])[0] for request in requests]
    for prompt, together, single in zip(prompts, batched, alone, strict=True):
        assert together.token_ids == single.token_ids == greedy_reference(tiny_models.target, prompt, 32)
    sizes = [b for result in alone for b in result.block_sizes]
    assert 1 in sizes and 4 in sizes
    # Sampled: a row's output for a seed is autoregressive sampling's with that seed, however it switches.
    sampled = GenerationConfig(max_new_tokens=32, temperature=1.0, seed=7)
    switching = generate_many(tiny_models, [GenerationRequest(p, sampled, policy) for p in prompts])
    plain = generate_many(tiny_models, [GenerationRequest(p, sampled, Autoregressive()) for p in prompts])
    assert [r.token_ids for r in switching] == [r.token_ids for r in plain]
    assert {1, 4} <= {b for result in switching for b in result.block_sizes}


def test_a_row_the_rule_would_never_draft_for_is_autoregressive_for_good(tiny_models):
    """Where the rule chooses b = 1 at every confidence after an autoregressive cycle (the outcome it then meets
    again), a row starting autoregressive never drafts: no drafter context is written for it and its per-cycle hook
    is not asked. Where it would draft at some confidence, the row keeps the context. Both greedy."""
    stays = rule_of({1: 1.0, 4: 2.0}, {1: 1.0, 4: 3.0})  # 2 tokens for 3x the price: never worth drafting
    assert stays.drafting_saves(0.0) == 0 and stays.drafting_saves(0.0, {1: 1.0, 4: 1.5}) > 0  # measured prices first
    confident = {FIRST_OR_AUTOREGRESSIVE: {1: 1.0, 4: 2.0}}
    drafts = rule_of({1: 1.0, 4: 1.0}, {1: 1.0, 4: 3.0}, outcomes=confident)
    drafts.commits[0, -1, FIRST_OR_AUTOREGRESSIVE] = [1.0, 4.0]  # at the most confident anchors it drafts
    assert drafts.drafting_saves(0.0) > 0

    class Counting(ConfidencePolicy):
        asked = 0

        def next_block_sizes(self, cycles):
            Counting.asked += len(cycles)
            return super().next_block_sizes(cycles)

    prompt = tiny_models.encode_prompt("Count from 1 to 30.")
    engine = Engine(tiny_models, max_batch=1)
    encoded = context_writes(engine)
    config = GenerationConfig(max_new_tokens=16)
    greedy = greedy_reference(tiny_models.target, prompt, 16)
    (result,) = generate_many(tiny_models, [GenerationRequest(prompt, config, Counting(stays, False))], engine=engine)
    assert result.token_ids == greedy and set(result.block_sizes) == {1}
    assert Counting.asked == 0 and encoded == []
    (result,) = generate_many(tiny_models, [GenerationRequest(prompt, config, Counting(drafts, False))], engine=engine)
    assert result.token_ids == greedy and Counting.asked > 0 and encoded[0] == len(prompt)


def test_a_row_keeps_the_option_to_draft_only_where_its_drafts_save_more_than_the_option_costs():
    """At the most confident of 8 anchor buckets, met equally often, b = 4 commits 4 tokens for 3x an autoregressive
    cycle's price: the rule's drafts would save an autoregressive row 1/8 x (1 - 3/4) of its time. A row starting
    autoregressive keeps the option to draft where that beats what the engine measured the option to cost."""
    rule = rule_of({1: 1.0, 4: 1.0}, {1: 1.0, 4: 3.0})
    rule.commits[0, -1, FIRST_OR_AUTOREGRESSIVE] = [1.0, 4.0]
    assert rule.drafting_saves(0.0) == pytest.approx(0.25 / 8)
    assert rule.drafting_saves(0.0, {1: 1.0, 4: 4.5}) == 0  # measured prices first: no longer worth a draft
    policy = ConfidencePolicy(rule, measured_prices=False)
    prefill = PrefillState(torch.zeros(8), torch.tensor([1]), 0.0, 4)
    assert not policy.autoregressive_for_good(prefill, 1, option_price=0.03)
    assert policy.autoregressive_for_good(prefill, 1, option_price=0.04)
    assert not policy.autoregressive_for_good(prefill, 4, option_price=1.0)  # a row drafting now keeps it


def test_the_engine_prices_the_option_to_draft_from_what_it_measured(tiny_models):
    """A row that switches between drafting and autoregression has its prompt's drafter context written, what its
    autoregressive cycles kept flushed, and its hook asked: the engine times each (and the tokens the row generated)
    and hands the next row that joins the option's price, a share of an autoregressive row's time."""
    seen = []

    class Seeing(ConfidencePolicy):
        def autoregressive_for_good(self, prefill, block_size, option_price=0.0, saves=None):
            seen.append(option_price)
            return super().autoregressive_for_good(prefill, block_size, option_price, saves)

    engine = Engine(tiny_models, max_batch=1)
    config = GenerationConfig(max_new_tokens=24)
    first, second = (tiny_models.encode_prompt(text) for text in ("Count from 1 to 30.", "List four colors."))
    # One at a time, each a prompt's context: each kind of pass is a price after its warm-up.
    generate_many(tiny_models, [GenerationRequest(first, config, Alternating(4)) for _ in range(3)], engine=engine)
    price = engine.option_price
    assert price.passes["context"] == 3 > PRICE_WARM_UP
    assert price.context > 0 and price.flush > 0 and price.hook > 0 and price.tokens == 24
    rule = rule_of({1: 1.0, 4: 1.0}, {1: 1.0, 4: 3.0})
    generate_many(tiny_models, [GenerationRequest(second, config, Seeing(rule, False))], engine=engine)
    assert seen[0] > 0  # the autoregressive cycles of the first row priced it


def test_the_rule_never_drafts_where_its_walks_are_not_surely_faster_than_autoregression(tmp_path):
    """At T = 1 every draft is rejected, at T = 0 every draft accepted, at twice autoregression's price; a request's
    drafter context costs a unit. The fitted rule drafts at T = 0 and never at T = 1, even where its table would
    (a cell pooled from every outcome): there it saves nothing, chooses b = 1 and walks as autoregression, keeping no
    option. Saved and loaded, the same; a rule saved before this gate loads drafting at every temperature."""
    rows = []
    for temperature, commits in ((0.0, 4), (1.0, 1)):
        four = np.minimum(commits, np.arange(64, 0, -1)).astype(np.int16)  # no block past the end
        table = AcceptanceTable(CANDIDATES, np.stack([np.ones_like(four), four]), max_new_tokens=512)
        anchors = Anchors(np.full(64, 0.85, dtype=np.float32), temperature)
        rows.append(StepRow(f"p{temperature}", temperature, [table], [anchors], prompt_tokens=8))
    cost = CycleCost({1: {1: 1.0, 4: 2.0}}, context_pass=1.0)
    rule = fit_confidence_rule(rows, cost, min_cycles=1)
    assert rule.autoregressive == (False, True)
    assert rule.choose(0.0, 0.85, FIRST_OR_AUTOREGRESSIVE) == 4 and rule.drafting_saves(0.0) > 0
    eager = replace(rule, autoregressive=(), commits=np.broadcast_to(rule.commits[:1], rule.commits.shape).copy())
    assert eager.choose(1.0, 0.85, ALL_ACCEPTED) == 4  # the table alone, with T = 0's means, would draft at T = 1
    gated = replace(eager, autoregressive=(False, True))
    assert gated.choose(1.0, 0.85, ALL_ACCEPTED) == 1 and gated.drafting_saves(1.0) == 0.0
    assert walk_rule(gated, rows[1].tables[0], rows[1].anchors[0]) == [1] * 64
    metrics = evaluate_step_model(None, rows[1:], cost, train_block_size=4, rule=gated)
    assert metrics["throughput_rule"] == pytest.approx(metrics["throughput_autoregressive"])  # no option kept
    loaded = ConfidenceRule.load(rule.save(tmp_path / "rule.json"))
    assert loaded.autoregressive == rule.autoregressive
    older = json.loads((tmp_path / "rule.json").read_text())
    del older["autoregressive"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert not ConfidenceRule.load(tmp_path / "older.json").never_drafts(1.0)
    with pytest.raises(ValueError, match="temperature groups"):
        replace(rule, autoregressive=(True,))


def test_live_choices_are_the_rules_walk_of_the_table(tiny_models):
    """Priced by its curve alone, the rule decodes live exactly as it walks the sequence's acceptance table: the
    cycle's anchor probability is the labels' anchor summary."""
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    sweep = sweep_prompt(tiny_models, prompt, SweepConfig(CANDIDATES, max_new_tokens=40))
    (table,) = sweep.tables
    anchors = sweep_anchors(sweep)
    # Drafting pays where the target is sure: the rule switches on the anchor, whatever the weights.
    commits = np.ones((1, len(EDGES) + 1, OUTCOMES, 2))
    commits[..., 1] = np.linspace(0.5, 6.0, len(EDGES) + 1)[None, :, None]
    rule = ConfidenceRule(CANDIDATES, (0.0,), commits, np.full(commits.shape[:-1], 100), {1: 1.0, 4: 2.5})
    sizes = walk_rule(rule, table, anchors)
    live = generate(
        tiny_models,
        prompt,
        policy=ConfidencePolicy(rule, measured_prices=False),
        config=GenerationConfig(max_new_tokens=40),
    )
    assert live.token_ids == sweep.token_ids
    cursors = np.cumsum([1, *live.acceptance_lengths[:-1]])
    assert live.block_sizes == [table.block_size_at(int(c), b) for c, b in zip(cursors, sizes, strict=True)]


class Recorder(BlockSizePolicy):
    """Drafts 4, autoregressive every third cycle; keeps every cycle state, with its anchor's top-1 probability
    computed on the spot (the anchor logits are a view the next cycle overwrites)."""

    name = "recorder"

    def __init__(self) -> None:
        self.states, self.top = [], []

    def initial_block_size(self, prefill):
        return 4

    def next_block_sizes(self, cycles):
        self.states += cycles
        self.top += [torch.softmax(cycle.anchor_logits.float(), dim=-1).max().item() for cycle in cycles]
        return [1 if cycle.cycle % 3 == 2 else 4 for cycle in cycles]


def test_a_cycle_hands_the_policy_its_anchor_probability_and_the_measured_prices(tiny_models):
    policy = Recorder()
    engine = Engine(tiny_models, max_batch=2, batch_pricing=False)  # every cycle the policy's b
    prompts = [tiny_models.encode_prompt(text) for text in ("Count from 1 to 30.", "List four colors.")]
    config = GenerationConfig(max_new_tokens=40)
    generate_many(tiny_models, [GenerationRequest(p, config, policy) for p in prompts], engine=engine)
    for state, expected in zip(policy.states, policy.top, strict=True):
        assert state.anchor_confidence == pytest.approx(expected, abs=1e-5)
    widths = {state.block_size for state in policy.states}  # the b each cycle ran, the last ones cut to the budget
    assert {1, 4} <= widths <= {1, 2, 3, 4}
    # The two rows' last cycle together (after it one row may run alone, in a bucket with no price yet).
    late = [state for state in policy.states if state.batch_rows == 2][-1].prices
    assert late is not None and all(late[b] > 0 for b in (1, 3, 4))  # width 4's bucket prices 3 and 4
    assert policy.states[0].prices is None or len(policy.states[0].prices) < 3  # none before a shape's warm-up
    assert PRICE_WARM_UP >= 1


def test_train_step_metrics_walk_the_rule(tiny_labels):
    import pyarrow.parquet as pq

    from blockpilot.predictor.step_data import step_rows

    rows = step_rows(pq.read_table(tiny_labels["train"]))
    cost = CycleCost({1: {b: 1.0 + 0.2 * b for b in rows[0].tables[0].candidates}})
    rule = fit_confidence_rule(rows, cost)
    metrics = evaluate_step_model(None, rows, cost, train_block_size=4, rule=rule)
    assert metrics["tau_rule"] >= 1.0
    assert metrics["throughput_rule"] <= metrics["throughput_step_oracle"] + 1e-9
