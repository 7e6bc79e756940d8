"""The per-step block-size model: lossless in the engine, the same choices live as on the acceptance table (one
feature declaration for both), training data from label rows, evaluation invariants, folder format, the resolver,
the per-request prior, loads and tokens. Properties for any weights."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from support import check_stats_invariants, greedy_reference

from blockpilot.blocks import flush_passes
from blockpilot.cost import CycleCost
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate, generate_many
from blockpilot.decoding.engine import Engine
from blockpilot.decoding.static import StaticDecoder
from blockpilot.policies.base import CycleState, PrefillState
from blockpilot.policies.learned import LearnedPolicy
from blockpilot.policies.resolve import resolve_policy
from blockpilot.policies.step import PriorStepPolicy, StepPolicy
from blockpilot.predictor.step_data import (
    Anchors,
    StepRow,
    evaluate_step_model,
    fixed_walk_cycles,
    format_prior_temperatures,
    format_step_metrics,
    prior_temperatures,
    regret_dataset,
    split_step_rows,
    step_rows,
    walk_step_model,
)
from blockpilot.predictor.step_features import NO_TOKEN, TOKEN_FEATURES, CycleView, anchor_tokens, tail_tokens
from blockpilot.predictor.step_model import StepModel, StepModelConfig, fit_step_model, regret_loss
from blockpilot.sweep import SweepConfig, sweep_prompt
from blockpilot.table import AcceptanceTable, tables_from_row
from blockpilot.walks import ADAPT_CONFIDENCE, ADAPT_MARGIN, fixed_walks_of_tables, step_oracle

CANDIDATES = (1, 2, 3, 4, 5, 6)
VOCAB = 64  # for models that run without a target


def step_config(candidates=CANDIDATES, vocab: int = VOCAB, **fields) -> StepModelConfig:
    return StepModelConfig(
        candidates, vocab_size=vocab, **{"hidden_size": 16, "train_block_size": 4, "token_dims": 4, **fields}
    )


def scaled(model: StepModel, factor: float = 8.0) -> StepModel:
    """Weights spread so that the choices spread over the candidates."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(factor)
    return model.eval()


def random_step_model(seed: int, candidates=CANDIDATES, vocab: int = VOCAB, **fields) -> StepModel:
    torch.manual_seed(seed)
    return scaled(StepModel(step_config(candidates, vocab, **fields)))


def random_prior_step_model(seed: int, candidates=CANDIDATES, vocab: int = VOCAB) -> StepModel:
    return random_step_model(seed, candidates, vocab, prior=True)


def mlp_input(model: StepModel, name: str) -> int:
    """Where feature `name` enters the MLP (standardized numeric columns first, then the token embeddings)."""
    return model._numeric.index(model.config.features.names.index(name))


def random_views(n: int, seed: int = 0, **known) -> CycleView:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(n, 2))
    return CycleView(rng.random(n), 0.0, np.arange(1, n + 1), tokens, **known)


def sweep_anchors(sweep) -> Anchors:
    return Anchors(np.asarray(sweep.anchor_top_probs)[:, 0], 0.0)


def growing_step_model(vocab: int, candidates=CANDIDATES, prior: bool = False) -> StepModel:
    """Hand-set weights: b grows with the cursor (1 early, 6 late), nudged by the anchor's top probability and by the
    last cycle, so the choices change within one generation whatever the target's weights (the tokens are left out:
    a zero embedding; with `prior`, its columns are read with weight 0)."""
    model = StepModel(step_config(candidates, vocab=vocab, hidden_size=3, prior=prior))
    first, out = model.net[0], model.net[2]
    with torch.no_grad():
        model.token_embedding.weight.zero_()
        first.weight.zero_()
        for name, weight in (("log_cursor", 1.0), ("anchor_top1", 0.05), ("log1p_last_accepted", 0.4)):
            first.weight[:, mlp_input(model, name)] = weight
        first.bias.copy_(-torch.log1p(torch.tensor([2.0, 6.0, 14.0])))
        k = torch.arange(len(candidates), dtype=torch.float32)
        out.weight.copy_(k[:, None].expand(-1, 3))  # logit_k = k * H - 0.3 k^2: argmax grows with H
        # logit_k = k * H - c k^2: the largest candidate from H = c (2K - 3), 2.7 whatever the number K of them
        # (H is at most 2.64 after a first cycle of at most 4 tokens, at least 6.2 by cursor 40, on any target of up
        # to 512 tokens): two candidates switch within one generation too
        out.bias.copy_(-2.7 / (2 * len(candidates) - 3) * k**2)
    return model.eval()


def check_live_equals_walk(tiny_models, model, policy, prior=None, max_new_tokens=40) -> list[int]:
    """Decode with `policy` and walk `model` over the same sequence's table: the same block sizes and acceptance
    lengths cycle by cycle, and the output is greedy. Returns the walk's block sizes."""
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    sweep = sweep_prompt(tiny_models, prompt, SweepConfig(CANDIDATES, max_new_tokens=max_new_tokens))
    (table,) = sweep.tables
    assert table.tokens.tolist() == sweep.token_ids
    b0, probabilities = (None, None) if prior is None else (prior.initial_block_size(sweep.prefill), prior.probabilities(sweep.prefill))
    sizes, lengths = walk_step_model(model, table, sweep_anchors(sweep), b0, probabilities)
    live = generate(tiny_models, prompt, policy=policy, config=GenerationConfig(max_new_tokens=max_new_tokens))
    assert live.token_ids == sweep.token_ids == greedy_reference(tiny_models.target, prompt, max_new_tokens)
    cursors = np.cumsum([1, *lengths[:-1]])
    cut = [table.block_size_at(int(c), b) for c, b in zip(cursors, sizes, strict=True)]  # live runs record the cut
    assert (live.block_sizes, live.acceptance_lengths) == (cut, lengths)
    return sizes


def vocab_of(tiny_models) -> int:
    return tiny_models.target.get_output_embeddings().weight.shape[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_policy_is_lossless_and_changes_b(tiny_models, seed):
    prompt = tiny_models.encode_prompt("Count from 1 to 9.")
    config = GenerationConfig(max_new_tokens=32)
    policy = StepPolicy(random_step_model(seed, vocab=vocab_of(tiny_models)))
    result = generate(tiny_models, prompt, policy=policy, config=config)
    assert result.token_ids == greedy_reference(tiny_models.target, prompt, 32)
    check_stats_invariants(result, 32)
    assert set(result.block_sizes) <= set(CANDIDATES) and result.policy == "learned-step"


def test_step_policies_batched_beside_other_rows_keep_their_outputs(tiny_models):
    prompts = [tiny_models.encode_prompt(p) for p in ("Count from 1 to 9.", "List four colors.", "Spell cat.")]
    config = GenerationConfig(max_new_tokens=24)
    vocab = vocab_of(tiny_models)
    policies = [
        StepPolicy(random_step_model(3, vocab=vocab)),
        resolve_policy("fixed:3", tiny_models),
        StepPolicy(random_step_model(4, vocab=vocab)),
    ]
    batched = generate_many(tiny_models, [GenerationRequest(p, config, q) for p, q in zip(prompts, policies)])
    for prompt, policy, result in zip(prompts, policies, batched, strict=True):
        alone = generate(tiny_models, prompt, policy=policy, config=config)
        assert result.token_ids == alone.token_ids == greedy_reference(tiny_models.target, prompt, 24)
        if not policy.adapts:  # a fixed b is the request's own; an adaptive row's, its batch may widen
            assert result.block_sizes == alone.block_sizes


def test_the_live_choices_are_the_table_walk_of_the_same_model(tiny_models):
    """The features the engine computes before a cycle are the ones labels keep for that anchor, with the last
    cycle the walk ran: one declaration builds both."""
    model = growing_step_model(vocab_of(tiny_models))
    spec = model.config.features
    assert (model.choose(spec.build(random_views(20, last_accepted=6, last_block_size=6))) != model.choose(
        spec.build(random_views(20))
    )).any(), "the model reads the last cycle"
    sizes = check_live_equals_walk(tiny_models, model, StepPolicy(model))
    assert len(set(sizes)) > 1, "a model that never changes b would not test the per-step hook"


def test_the_features_on_the_device_are_the_hosts():
    """`StepFeatures.cycle_parts` (the decision inside a compiled cycle) computes every column that changes from cycle
    to cycle as `build` does."""
    for features in (step_config(prior=True).features, step_config(loads=(1, 4)).features):
        view = random_views(12, last_accepted=np.arange(12) % 5, last_block_size=np.arange(12) % 3, batch_rows=4)
        if features.prior:
            probabilities = np.random.default_rng(1).dirichlet(np.ones(len(CANDIDATES)), size=12)
            view = replace(view, prior_block_size=np.full(12, 3), prior_probabilities=probabilities)
        tensors = {
            name: torch.as_tensor(value) if isinstance(value, np.ndarray) else value
            for name, value in vars(view).items()
        }
        on_device = torch.cat(features.cycle_parts(CycleView(**tensors)), dim=1)
        per_cycle = [features.names.index(name) for name in features.cycle_names]
        assert on_device.dtype == torch.float32 and "temperature" not in features.cycle_names
        assert np.allclose(on_device.numpy(), features.build(view)[:, per_cycle], atol=1e-6)


@pytest.mark.parametrize(
    ("compile", "prior", "candidates"),
    [
        ("off", False, CANDIDATES),
        ("off", True, CANDIDATES),
        pytest.param("compile", True, (1, 4), marks=pytest.mark.slow),  # two candidates: fewer widths to build
    ],
)
def test_a_lone_rows_choice_inside_the_cycle_is_the_hooks_and_asks_no_hook(tiny_models, compile, prior, candidates):
    """The step model run inside the cycle of a lone row (`Engine.decide_in_cycle`) chooses the b the hook on the
    host would, cycle by cycle (the table walk of the same model: its tokens, cursor, last cycle and, with a
    per-request prior, the prior's b0 and probabilities), and the hook is not asked; the output is greedy decoding.
    Compiled, the decision is part of the cycle's graph."""
    vocab = vocab_of(tiny_models)
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    sweep = sweep_prompt(tiny_models, prompt, SweepConfig(candidates, max_new_tokens=40))
    (table,) = sweep.tables
    # Eager with a prior: random weights that read every column; else weights whose b grows along the generation.
    random_weights = prior and compile == "off"
    grown = growing_step_model(vocab, candidates, prior)
    model = random_prior_step_model(14, candidates, vocab) if random_weights else grown
    if prior:
        first = LearnedPolicy(random_predictor(candidates, vocab, 5))
        policy = PriorStepPolicy(model, first)
        known = (first.initial_block_size(sweep.prefill), first.probabilities(sweep.prefill))
    else:
        policy, known = StepPolicy(model), ()
    sizes, lengths = walk_step_model(model, table, sweep_anchors(sweep), *known)
    asked = []
    choose = model.choose  # what the hook on the host asks (the walk too)
    model.choose = lambda features: asked.append(len(features)) or choose(features)
    engine = Engine(tiny_models, width=max(candidates), compile=compile, sampling=False, batch_pricing=False)
    (live,) = generate_many(
        tiny_models, [GenerationRequest(prompt, GenerationConfig(max_new_tokens=40), policy)], engine=engine
    )
    # Asked on the host only for the first b (from the prefill, where no per-request prior chooses it).
    assert engine.decide_in_cycle(policy) and asked == ([] if prior else [1])
    assert live.token_ids == sweep.token_ids == greedy_reference(tiny_models.target, prompt, 40)
    cursors = np.cumsum([1, *lengths[:-1]])
    cut = [table.block_size_at(int(c), b) for c, b in zip(cursors, sizes, strict=True)]
    assert (live.block_sizes, live.acceptance_lengths) == (cut, lengths)
    assert random_weights or len(set(sizes)) > 1, "a model that never changes b would not test the choice"


def test_the_decoder_holds_a_choice_only_after_a_cycle_that_chose(tiny_models):
    """`StaticDecoder.report`'s last column holds the b of the last cycle that computed the choice, and 0 after one
    that did not (a lone row's kept cycle, a cycle of two rows), each written by the cycle itself: the engine reads it
    after every chain cycle."""
    policy = StepPolicy(growing_step_model(vocab_of(tiny_models)))
    decision = policy.cycle_decision(torch.device("cpu"))
    decoder = StaticDecoder(tiny_models, rows=2, width=max(CANDIDATES), capacity=128, compile="off")
    decoder.set_decision(decision, decision.inputs)
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    decoder.prefill(0, [prompt, prompt])
    for row in (0, 1):
        decoder.place(row, length=len(prompt), last_token=int(prompt[-1]), temperature=0.0, seed=row)
    chosen = []
    for rows, decide in ((1, True), (1, False), (1, True), (2, True)):
        decoder.set_block_sizes([3] * rows)
        decoder.cycle(rows, width=3, decide=decide)
        chosen.append(decoder.report[:rows, -1].tolist())
    assert chosen[0][0] in CANDIDATES and chosen[2][0] in CANDIDATES
    assert chosen[1] == [0] and chosen[3] == [0, 0]


def test_a_row_that_runs_alone_after_a_batch_decides_inside_the_cycle_with_its_own_prior(tiny_models):
    """The cycle decides for a lone row only, so a row's per-request inputs (a bias from the prior's b0 and
    probabilities) are placed when it first runs alone: a row that starts beside another (asked on the host) and then runs alone in a
    cache row another request used chooses what the walk of the same model chooses, cycle by cycle."""
    vocab = vocab_of(tiny_models)
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    sweep = sweep_prompt(tiny_models, prompt, SweepConfig(CANDIDATES, max_new_tokens=40))
    (table,) = sweep.tables
    model = random_prior_step_model(14, CANDIDATES, vocab)
    first = LearnedPolicy(random_predictor(CANDIDATES, vocab, 5))
    policy = PriorStepPolicy(model, first)
    known = (first.initial_block_size(sweep.prefill), first.probabilities(sweep.prefill))
    sizes, lengths = walk_step_model(model, table, sweep_anchors(sweep), *known)
    engine = Engine(tiny_models, width=max(CANDIDATES), compile="off", sampling=False, batch_pricing=False)
    other = tiny_models.encode_prompt("Hi")
    # another request's inputs in cache row 0 first, then the short row beside ours
    generate_many(tiny_models, [GenerationRequest(other, GenerationConfig(max_new_tokens=8), policy)], engine=engine)
    beside = GenerationRequest(other, GenerationConfig(max_new_tokens=6), resolve_policy("fixed:2", tiny_models))
    _, live = generate_many(
        tiny_models, [beside, GenerationRequest(prompt, GenerationConfig(max_new_tokens=40), policy)], engine=engine
    )
    assert live.token_ids == greedy_reference(tiny_models.target, prompt, 40)
    cursors = np.cumsum([1, *lengths[:-1]])
    cut = [table.block_size_at(int(c), b) for c, b in zip(cursors, sizes, strict=True)]
    assert (live.block_sizes, live.acceptance_lengths) == (cut, lengths)
    own = engine.decoder.decision.row_inputs(sweep.prefill, known[0])  # its bias, from b0 and the probabilities
    assert engine.decoder.decision_inputs[0].tolist() == pytest.approx(own, abs=1e-4)


def test_regret_is_zero_at_the_per_step_oracle_and_evaluation_orders_policies(tiny_labels):
    rows = step_rows(pq.read_table(tiny_labels["train"]))
    candidates = rows[0].tables[0].candidates
    model = random_step_model(6, candidates, vocab=512)
    cost = CycleCost.uniform()
    features, regret = regret_dataset(rows, model, cost)
    assert features.shape == (regret.shape[0], len(model.config.features.names))
    cycles = sum(len(t.walk(b)) for r in rows for t in r.tables for b in t.candidates)
    assert features.shape[0] == cycles, "one example per cycle of every candidate's walk"
    assert (regret >= -1e-6).all() and np.allclose(regret.min(axis=1), 0.0)

    with pytest.raises(ValueError, match="candidates"):
        evaluate_step_model(random_step_model(6, (2, 3, 4)), rows, cost)
    metrics = evaluate_step_model(model, rows, cost)
    for group in ("", "T0/", "T1/"):
        step_oracle = metrics[f"{group}tau_step_oracle"]
        assert metrics[f"{group}tau_oracle"] <= step_oracle + 1e-9
        assert metrics[f"{group}tau_best_fixed"] <= metrics[f"{group}tau_oracle"] + 1e-9
        assert 1.0 <= metrics[f"{group}tau_step"] <= step_oracle + 1e-9
        assert metrics[f"{group}throughput_best_fixed"] >= metrics[f"{group}throughput_B"] - 1e-9
        assert int(metrics[f"{group}best_fixed_b"]) in candidates
    assert "step" in format_step_metrics("held-out", metrics)


def test_a_model_that_follows_the_oracle_walks_it():
    """On a hand-made table, choosing argmin Q at every cursor reaches the per-step oracle's cost."""
    commits = np.asarray([[1, 1, 1, 1, 1, 1, 1], [2, 1, 2, 2, 1, 2, 1], [3, 1, 1, 1, 2, 2, 1]], dtype=np.int16)
    table = AcceptanceTable((1, 2, 3), commits, max_new_tokens=8)
    cost = CycleCost.uniform()
    best, q = table.cost_to_go(cost)
    sizes, _ = table.walk_policy(lambda cursor, *_: (1, 2, 3)[int(np.argmin(q[:, cursor - 1]))])
    assert table.walk_cost(sizes, cost=cost) == pytest.approx(best[1])
    assert best[1] < min(len(table.walk(b)) for b in (1, 2, 3))


def test_the_option_oracle_prices_a_flush_before_each_draft_after_autoregressive_cycles():
    """Keeping the option to draft, a draft after autoregressive cycles pays their flush (`blocks.flush_passes`) and
    the switch (`blocks.switches`): on a hand-made table the oracle's Q, read in what the row kept before each cycle,
    adds up along any walk to its cycles plus what the request pays for them (`CycleCost.request`); without a flush
    it is `cost_to_go`'s; and a dear flush never makes it cheaper."""
    commits = np.asarray([[1, 1, 1, 1, 1, 1, 1], [2, 1, 2, 2, 1, 2, 1], [3, 1, 1, 1, 2, 2, 1]], dtype=np.int16)
    table = AcceptanceTable((1, 2, 3), commits, max_new_tokens=8)
    cost = CycleCost({1: {1: 1.0, 2: 1.2, 3: 1.3}}, flush=0.3, switch=0.1)
    best, q = table.cost_to_go(cost)
    free_best, free_q = table.cost_to_go_keeping_option(cost, 0.0)
    assert np.allclose(free_best[0], best) and np.allclose(free_best[1], best) and np.allclose(free_q[0], q)
    best, q = table.cost_to_go_keeping_option(cost, cost.after_autoregression)
    for pattern in ([1, 2], [2, 1, 1], [1, 1, 3], [3, 2]):
        cursor, held, regret, walked = 1, 0, 0.0, []
        while cursor < table.n:
            b = pattern[len(walked) % len(pattern)]
            index = table.candidates.index(b)
            regret += q[held, index, cursor - 1] - best[held, cursor]
            walked.append(b)
            cursor, held = cursor + int(commits[index, cursor - 1]), int(b == 1)
        beyond = cost.request(walked, 8, keeps_option=True) - cost.request(walked, 8)
        spent = table.walk_cost(walked, cost=cost) + 0.4 * flush_passes(walked)
        assert spent == pytest.approx(table.walk_cost(walked, cost=cost) + beyond)
        assert regret == pytest.approx(spent - best[0, 1])
    dear = table.cost_to_go_keeping_option(cost, 100.0)[0][0, 1]
    assert free_best[0, 1] <= best[0, 1] <= dear <= table.walk_cost([1] * (table.n - 1), cost=cost)


def test_a_walk_that_drafts_pays_its_prompts_context_and_the_oracle_weighs_it():
    """Priced beyond its cycles (`CycleCost.request`), every fixed walk pays its request's start once, one that drafts
    its prompt's drafter context too, and autoregression never that; the per-step oracle is the cheaper of
    autoregression throughout and the cheapest walk with the context added, never dearer than a fixed walk, and
    autoregression's once the context outweighs what drafting saves."""
    commits = np.asarray([[1, 1, 1, 1, 1, 1, 1], [2, 1, 2, 2, 1, 2, 1], [3, 1, 1, 1, 2, 2, 1]], dtype=np.int16)
    table = AcceptanceTable((1, 2, 3), commits, max_new_tokens=8)
    cost = CycleCost({1: {1: 1.0, 2: 1.2, 3: 1.3}})
    alone = table.walk_cost([1] * (table.n - 1), cost=cost)
    drafting = table.cost_to_go(cost)[0][1]
    assert drafting < alone
    for context_pass, expected in ((0.0, drafting), (0.5, drafting + 0.5), (100.0, alone)):
        priced = replace(cost, context_pass=context_pass, start_pass=0.25)
        walks = fixed_walks_of_tables([[table, table]], priced, [16])
        plain = fixed_walks_of_tables([[table, table]], cost)
        assert walks.cost[0] == pytest.approx(plain.cost[0] + 0.5 + np.asarray([0.0, 2 * context_pass, 2 * context_pass]))
        tokens, _, spent = step_oracle([table], priced, 16)
        assert tokens == table.n - 1 and spent == pytest.approx(0.25 + min(expected, alone))
        assert spent <= walks.cost[0].min() / 2 + 1e-9
        assert step_oracle([table], priced)[2] == pytest.approx(drafting)  # no prompt length: nothing beyond cycles


def test_training_cycles_carry_the_last_cycle_of_their_walk():
    commits = np.asarray([[1, 1, 1, 1, 1], [2, 1, 2, 1, 1], [3, 1, 1, 2, 1]], dtype=np.int16)
    table = AcceptanceTable((1, 2, 3), commits, max_new_tokens=8)  # n = 6: cursors 1..5
    cursors, last_accepted, last_sizes = fixed_walk_cycles(table)
    # b = 1: 1, 2, 3, 4, 5; b = 2: 1 (+2) 3 (+2) 5; b = 3: 1 (+3) 4 (+2) -> 6.
    assert cursors.tolist() == [1, 2, 3, 4, 5, 1, 3, 5, 1, 4]
    assert last_accepted.tolist() == [0, 1, 1, 1, 1, 0, 2, 2, 0, 3]
    assert last_sizes.tolist() == [0, 1, 1, 1, 1, 0, 2, 2, 0, 3]
    spec = step_config((1, 2, 3), prior=True).features
    view = random_views(3, last_accepted=np.array([0, 2, 3]), last_block_size=np.array([0, 4, 3]))
    features = spec.build(replace(view, prior_block_size=5, prior_probabilities=np.array([0.2, 0.3, 0.5])))
    columns = [spec.names.index(name) for name in ("log1p_last_accepted", "last_accepted_share", "log_prior_b")]
    expected = [[0.0, 0.0, np.log(5)], [np.log(3), 0.5, np.log(5)], [np.log(4), 1.0, np.log(5)]]
    assert np.allclose(features[:, columns], expected)
    assert np.allclose(features[:, spec.names.index("prior_p_b3")], 0.5)
    with pytest.raises(ValueError, match="per-request predictor"):
        spec.build(view)


def test_a_choice_is_the_argmax_of_the_model_before_and_after_its_weights_change():
    model = random_step_model(3)
    features = model.config.features.build(random_views(64, 1))
    model.standardize(features * 4 + 1)

    def argmax() -> list[int]:
        with torch.no_grad():
            return model(torch.as_tensor(features)).argmax(dim=-1).tolist()

    before = model.choose(features).tolist()
    assert before == argmax()
    with torch.no_grad():
        model.net[2].bias.copy_(torch.arange(len(CANDIDATES), dtype=torch.float32) * 1000)
    assert model.choose(features).tolist() == argmax() == [len(CANDIDATES) - 1] * 64 != before
    model.load_state_dict(random_step_model(4).state_dict())
    assert model.choose(features).tolist() == argmax() != [len(CANDIDATES) - 1] * 64


def test_the_folded_choice_is_the_forward_argmax_for_every_head_and_token():
    """`choose` computes `forward` folded (numpy, fewer operations): the same choices, load-aware heads and ids
    outside the vocabulary included, whatever the weights."""
    torch.manual_seed(5)
    model = StepModel(step_config(hidden_size=16, loads=(1, 8, 32)))
    view = random_views(400, 2, batch_rows=np.random.default_rng(2).integers(1, 64, 400))
    tokens = np.random.default_rng(3).integers(-1, VOCAB + 3, size=(400, 2))  # NO_TOKEN and unknown ids too
    features = model.config.features.build(replace(view, tokens=tokens))
    model.standardize(features)
    with torch.no_grad():
        scores = model.eval()(torch.as_tensor(features))
    assert len(set(scores.argmax(dim=-1).tolist())) > 1  # the test can tell choices apart
    assert model.choose(features).tolist() == scores.argmax(dim=-1).tolist()


@pytest.mark.parametrize("flush", [0.0, 0.7])
def test_the_regrets_of_a_walk_add_up_to_its_cost_over_the_per_step_oracle(tiny_labels, flush):
    """A regret is what a choice adds to the cost of the rest of the generation, so along every walk they sum to the
    walk's cost minus the per-step oracle's (in cycles of the smallest candidate): the mean regret is the loss. With
    the flush of the option to draft priced, the oracle is the option's and each cycle's regret is read in what the
    row kept before it."""
    rows = step_rows(pq.read_table(tiny_labels["train"]))
    cost = CycleCost({1: {1: 1.0, 8: 3.0}}, flush=flush)  # a wider block costs more
    _, regret = regret_dataset(rows, random_step_model(0, rows[0].tables[0].candidates, 512), cost)
    start = 0
    for t in (t for row in rows for t in row.tables if t.n >= 2):
        oracle, unit = t.cost_to_go_keeping_option(cost, flush)[0][0, 1], cost(min(t.candidates))
        for k, b in enumerate(t.candidates):
            cycles = len(t.walk(b))
            excess = t.walk_cost([b] * cycles, cost=cost) - oracle
            assert float(regret[start : start + cycles, k].sum()) * unit == pytest.approx(excess, rel=1e-4, abs=1e-4)
            start += cycles
    assert start == len(regret), "the cycles come table by table, each candidate's walk in order"
    assert (regret.max(axis=1) > 0).any(), "some choice must cost more than the oracle's for the check to bite"


def test_training_lowers_the_regret_loss(tiny_labels):
    rows = step_rows(pq.read_table(tiny_labels["train"]))
    model = random_step_model(7, rows[0].tables[0].candidates, 512)
    features, regret = regret_dataset(rows, model, CycleCost.uniform())
    x, r = torch.as_tensor(features), torch.as_tensor(regret)
    with torch.no_grad():
        before = float(regret_loss(model(x), r))
    losses = []
    fit_step_model(model, features, regret, epochs=5, on_epoch=lambda epoch, loss: losses.append(loss))
    with torch.no_grad():
        after = float(regret_loss(model(x), r))
    assert len(losses) == 5 and after < before


def test_a_fit_standardizes_its_numeric_inputs_on_the_training_cycles():
    rng = np.random.default_rng(4)
    model = random_step_model(2)
    names = model.config.features.names
    spread = np.arange(1, len(names) + 1)
    features = (rng.normal(size=(500, len(names))) * spread + 7).astype(np.float32)
    features[:, names.index("temperature")] = 1.0  # labels of one temperature: constant
    regret = rng.random((500, len(CANDIDATES)), dtype=np.float32)
    model = fit_step_model(model, features, regret, epochs=1)
    standardized = (torch.as_tensor(features) - model.feature_mean) / model.feature_scale
    varying = [k for k, name in enumerate(names) if name not in ("temperature", *TOKEN_FEATURES)]
    assert torch.allclose(standardized[:, varying].mean(dim=0), torch.zeros(len(varying)), atol=1e-4)
    assert torch.allclose(standardized[:, varying].std(dim=0, unbiased=False), torch.ones(len(varying)), atol=1e-4)
    assert model.feature_scale[names.index("temperature")] == 1.0
    tokens = [names.index(name) for name in TOKEN_FEATURES]
    assert model.feature_mean[tokens].tolist() == [0.0, 0.0] and model.feature_scale[tokens].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="standardize needs"):
        model.standardize(features[:, :-1])


def test_an_interrupted_fit_continues_exactly(tmp_path):
    """Stopped after 2 of 4 epochs and restored from what a checkpoint holds (the model's folder and the
    optimizer's state), the fit ends on the weights of the fit that ran straight through."""
    features = random_step_model(1).config.features.build(random_views(300, 3))
    regret = np.random.default_rng(3).random((300, len(CANDIDATES)), dtype=np.float32)
    settings = dict(epochs=4, batch_size=64, seed=5)
    straight = fit_step_model(random_step_model(1), features, regret, **settings)

    first = random_step_model(1).train()
    optimizer = torch.optim.AdamW(first.parameters(), lr=3e-3)

    def stop_after_two(epoch: int, loss: float) -> None:
        if epoch == 1:
            first.save(tmp_path / "step")
            torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit_step_model(first, features, regret, optimizer=optimizer, on_epoch=stop_after_two, **settings)
    restored = StepModel.load(tmp_path / "step").train()
    optimizer = torch.optim.AdamW(restored.parameters(), lr=3e-3)
    optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    epochs = []
    fit_step_model(
        restored, features, regret, optimizer=optimizer, first_epoch=2, on_epoch=lambda e, _: epochs.append(e), **settings
    )
    assert epochs == [2, 3]
    for name, weight in straight.state_dict().items():
        assert torch.equal(weight, restored.state_dict()[name]), name
    with pytest.raises(ValueError, match="first_epoch"):
        fit_step_model(restored, features, regret, first_epoch=5, **settings)


def test_folder_round_trip_and_refusals(tmp_path, tiny_models):
    vocab = vocab_of(tiny_models)
    model = random_step_model(8, vocab=vocab)
    features = model.config.features.build(random_views(50, 1))
    model.standardize(features * 5)
    model.save(tmp_path / "step")
    loaded = StepModel.load(tmp_path / "step")
    assert loaded.config == model.config and loaded.choose(features).tolist() == model.choose(features).tolist()
    assert json.loads((tmp_path / "step" / "config.json").read_text())["features"] == list(model.config.features.names)
    policy = resolve_policy(f"learned-step:{tmp_path / 'step'}", tiny_models)
    assert policy.name == "learned-step"

    # A folder whose features are not the ones this version builds is refused, saying what to do.
    config_file = tmp_path / "step" / "config.json"
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**saved, "features": [n for n in saved["features"] if n not in TOKEN_FEATURES]}))
    with pytest.raises(ValueError, match="train it again"):
        StepModel.load(tmp_path / "step")

    with torch.no_grad():
        model.net[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        model.save(tmp_path / "broken")
    assert not (tmp_path / "broken").exists()

    other = random_step_model(9, vocab=vocab, train_block_size=tiny_models.train_block_size + 1)
    other.save(tmp_path / "other")
    with pytest.raises(ValueError, match="trained for a drafter with B="):
        resolve_policy(f"learned-step:{tmp_path / 'other'}", tiny_models)
    random_step_model(9, vocab=vocab + 1).save(tmp_path / "wider")
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        resolve_policy(f"learned-step:{tmp_path / 'wider'}", tiny_models)
    with pytest.raises(ValueError, match="needs a model"):
        resolve_policy("learned-step", tiny_models)
    with pytest.raises(ValueError, match="vocab_size"):
        StepModelConfig(CANDIDATES, vocab_size=0)


# ----------------------------------------------------------------------------- with the per-request predictor


def random_predictor(candidates, vocab: int, seed: int):
    from blockpilot.predictor import BlockSizePredictor, PredictorConfig

    torch.manual_seed(seed)
    return BlockSizePredictor(PredictorConfig("sparse", tuple(candidates), vocab, top_k=4, hidden_size=8)).eval()


def test_the_per_request_choice_drafts_first_then_the_step_model_with_it_as_a_feature(tiny_models):
    vocab = vocab_of(tiny_models)
    prompt = tiny_models.encode_prompt("Count from 1 to 9.")
    step_model = random_prior_step_model(10, vocab=vocab)
    with pytest.raises(ValueError, match="per-request predictor"):
        StepPolicy(step_model)
    with pytest.raises(ValueError, match="per-request predictor"):
        StepPolicy(step_model, resolve_policy("fixed:4", tiny_models))  # a prior without probabilities
    seen = []

    class Recording(PriorStepPolicy):
        def next_block_sizes(self, cycles):
            seen.extend(cycle.first_block_size for cycle in cycles)
            return super().next_block_sizes(cycles)

    for seed in (0, 1):
        prior = LearnedPolicy(random_predictor(CANDIDATES, vocab, seed))
        result = generate(tiny_models, prompt, policy=Recording(step_model, prior), config=GenerationConfig(max_new_tokens=32))
        assert result.token_ids == greedy_reference(tiny_models.target, prompt, 32)
        assert result.policy == "learned+step" and result.block_sizes[0] == result.block_size
        b0 = prior.initial_block_size(result.prefill)
        assert result.block_size == b0 and set(seen) == {b0}
        seen.clear()


def test_label_rows_carry_the_prior_and_evaluation_walks_it(tiny_labels):
    table = pq.read_table(tiny_labels["train"])
    plain = step_rows(table)
    candidates = plain[0].tables[0].candidates
    vocab = max(max(ids) for ids in table["topk_ids"].to_pylist() if ids) + 1
    predictor = random_predictor(candidates, vocab, 3)
    rows = step_rows(table, predictor)
    assert [r.prompt_id for r in rows] == [r.prompt_id for r in plain]
    cost = CycleCost.uniform()
    with_prior, without = random_prior_step_model(11, candidates, 512), random_step_model(11, candidates, 512)
    names = with_prior.config.features.names
    shared = len(without.config.features.names)
    assert names[:shared] == without.config.features.names, "the prior's columns come after the others"
    for row, plain_row in zip(rows, plain, strict=True):
        assert row.prior_block_size in candidates
        features, _ = regret_dataset([row], with_prior, cost)
        assert np.array_equal(features[:, :shared], regret_dataset([plain_row], without, cost)[0])
        assert np.allclose(features[:, names.index("log_prior_b")], np.log(row.prior_block_size))
        # Then the predictor's probability of every candidate, whose most likely one is b0.
        assert np.allclose(features[:, shared + 1 :], row.prior_probabilities)
        assert row.prior_probabilities.sum() == pytest.approx(1.0, abs=1e-5)
        assert candidates[int(np.argmax(row.prior_probabilities))] == row.prior_block_size
    with pytest.raises(ValueError, match="per-request predictor"):
        regret_dataset(plain, with_prior, cost)
    metrics = evaluate_step_model(with_prior, rows, cost)
    # The per-request walk is each row's fixed-b0 walk.
    fixed = np.array([[len(w) for w in (sum((t.walk(b) for t in r.tables), []) for b in candidates)] for r in rows])
    chosen = [candidates.index(r.prior_block_size) for r in rows]
    tokens = sum(t.n - 1 for r in rows for t in r.tables)
    assert metrics["tau_request"] == pytest.approx(tokens / sum(fixed[i, k] for i, k in enumerate(chosen)))
    assert metrics["tau_oracle"] + 1e-9 >= metrics["tau_request"]
    with pytest.raises(ValueError, match="candidates"):
        step_rows(table, random_predictor((2, 3), vocab, 3))


def test_a_model_reading_the_predictors_probabilities_decodes_as_it_walks_the_table(tiny_models):
    """The probabilities the engine's step policy reads (once per request, from the prefill) are the ones the
    table walk is given: the same block sizes cycle by cycle, and the output is still greedy decoding."""
    vocab = vocab_of(tiny_models)
    predictor = random_predictor(CANDIDATES, vocab, 5)
    model = random_prior_step_model(14, vocab=vocab)
    with torch.no_grad():  # lean the choice toward the predictor's most likely candidate, whatever else it reads
        model.token_embedding.weight.zero_()
        k = len(CANDIDATES)
        start = mlp_input(model, f"prior_p_b{CANDIDATES[0]}")
        model.net[0].weight[:k, start : start + k] += 40 * torch.eye(k)
        model.net[2].weight[:, :k] += 40 * torch.eye(k)
    prior = LearnedPolicy(predictor)
    passes = []
    hook = predictor.register_forward_hook(lambda *_: passes.append(1))
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    sweep = sweep_prompt(tiny_models, prompt, SweepConfig(CANDIDATES, max_new_tokens=40))
    b0, probabilities = prior.initial_block_size(sweep.prefill), prior.probabilities(sweep.prefill)
    assert prior.probabilities(sweep.prefill) is probabilities and len(passes) == 1, "one predictor pass a request"
    hook.remove()
    assert probabilities.shape == (len(CANDIDATES),) and CANDIDATES[int(np.argmax(probabilities))] == b0
    spec = model.config.features
    view = random_views(16, prior_block_size=b0)
    reversed_view = replace(view, prior_probabilities=probabilities[::-1].copy())
    assert (model.choose(spec.build(replace(view, prior_probabilities=probabilities))) != model.choose(
        spec.build(reversed_view)
    )).any()
    check_live_equals_walk(tiny_models, model, PriorStepPolicy(model, prior), prior)
    (table,) = sweep.tables
    with pytest.raises(ValueError, match="walk it with the prior"):
        walk_step_model(model, table, sweep_anchors(sweep), b0)


def test_the_resolver_pairs_a_predictor_with_a_step_model(tmp_path, tiny_models):
    vocab = vocab_of(tiny_models)
    random_predictor(CANDIDATES, vocab, 0).save(tmp_path / "predictor")
    random_prior_step_model(12, vocab=vocab).save(tmp_path / "step")
    policy = resolve_policy(f"learned+step:{tmp_path / 'predictor'},{tmp_path / 'step'}", tiny_models)
    assert isinstance(policy, PriorStepPolicy) and policy.name == "learned+step"
    with pytest.raises(ValueError, match="per-request predictor"):
        resolve_policy(f"learned-step:{tmp_path / 'step'}", tiny_models)
    random_predictor((2, 3, 4), vocab, 0).save(tmp_path / "narrow")
    with pytest.raises(ValueError, match="differ from the step model's"):
        resolve_policy(f"learned+step:{tmp_path / 'narrow'},{tmp_path / 'step'}", tiny_models)


def with_prior_at(model: StepModel, temperatures, kept) -> StepModel:
    """`model` whose requests keep the prior's b0 at `kept` of the labels' `temperatures` (the weights shared)."""
    gated = StepModel(replace(model.config, temperatures=tuple(temperatures), prior_temperatures=tuple(kept)))
    gated.load_state_dict(model.state_dict())
    return gated.eval()


def test_the_prior_is_kept_at_the_temperatures_where_the_models_walks_are_not_surely_faster(tiny_labels):
    """`prior_temperatures` compares the model's walks with the prior's per temperature; a model that keeps the prior
    there walks b0 to the end where kept, its own choices elsewhere: its own only where they were faster by the margin
    in the asked share of resamples, and, asked for neither, the faster of the two."""
    table = pq.read_table(tiny_labels["train"])
    candidates = step_rows(table)[0].tables[0].candidates
    vocab = max(max(ids) for ids in table["topk_ids"].to_pylist() if ids) + 1
    rows = step_rows(table, random_predictor(candidates, vocab, 3))
    cost = CycleCost({1: {b: 1.0 + 0.4 * b for b in candidates}})  # drafting costs: walks of each policy differ
    model = random_prior_step_model(11, candidates, 512)
    kept, compared = prior_temperatures(model, rows, cost)
    assert "T = 0" in format_prior_temperatures(kept, compared) and "T = 1" in format_prior_temperatures(kept, compared)
    loose, _ = prior_temperatures(model, rows, cost, confidence=0.0, margin=0.0)
    assert set(loose) <= set(kept)  # a surer gate adapts at fewer temperatures
    for forced in [kept, loose, (0.0,), (1.0,), (0.0, 1.0)]:
        metrics = evaluate_step_model(with_prior_at(model, (0.0, 1.0), forced), rows, cost)
        for t in (0, 1):
            own, prior = compared[f"T{t}/throughput_step"], compared[f"T{t}/throughput_request"]
            assert metrics[f"T{t}/throughput_step"] == pytest.approx(prior if t in forced else own)
            if forced == kept:
                surely = compared[f"T{t}/p_faster"] >= ADAPT_CONFIDENCE
                assert (t not in kept) == (own > (1 + ADAPT_MARGIN) * prior and surely)
            if forced == loose:
                assert metrics[f"T{t}/throughput_step"] == pytest.approx(max(own, prior))
    with pytest.raises(ValueError, match="before its temperatures are set"):
        prior_temperatures(with_prior_at(model, (0.0, 1.0), (0.0,)), rows, cost)
    with pytest.raises(ValueError, match="has none"):
        prior_temperatures(random_step_model(11, candidates, 512), step_rows(table), cost)
    fit, validation = split_step_rows(rows, 0.5, 0)
    assert validation and fit and {r.prompt_id for r in fit}.isdisjoint(r.prompt_id for r in validation)
    assert sorted(r.prompt_id for r in fit + validation) == sorted(r.prompt_id for r in rows)
    assert split_step_rows(rows[:1], 0.5, 0) == (rows[:1], [])  # a side would be empty: no validation


def test_the_models_walks_pay_the_choice_its_cycle_computes_and_the_prior_kept_pays_none(tiny_labels):
    """A curve that measured the cycle computing a step model's choice (`CycleCost.decided`) prices the model's lone
    walks with it and the prior's without: the model's modeled throughput drops, the prior's stays, and where that
    choice costs more than the model's walks can save, the prior is kept at every temperature; kept there, the model
    walks at the prior's price."""
    table = pq.read_table(tiny_labels["train"])
    candidates = step_rows(table)[0].tables[0].candidates
    vocab = max(max(ids) for ids in table["topk_ids"].to_pylist() if ids) + 1
    rows = step_rows(table, random_predictor(candidates, vocab, 3))
    cost = CycleCost({1: {b: 1.0 + 0.4 * b for b in candidates}})
    model = random_prior_step_model(11, candidates, 512)
    free = evaluate_step_model(model, rows, cost)
    priced = replace(cost, decided={b: value + 0.2 for b, value in cost.seconds[1].items()})
    paid = evaluate_step_model(model, rows, priced)
    for t in (0, 1):
        assert paid[f"T{t}/throughput_step"] < free[f"T{t}/throughput_step"]
        assert paid[f"T{t}/throughput_request"] == free[f"T{t}/throughput_request"]
    dear = replace(cost, decided={b: value + 100 for b, value in cost.seconds[1].items()})  # no walk saves that
    kept, _ = prior_temperatures(model, rows, dear)
    assert kept == (0.0, 1.0)
    gated = evaluate_step_model(with_prior_at(model, (0.0, 1.0), kept), rows, dear)
    assert all(gated[f"T{t}/throughput_step"] == pytest.approx(free[f"T{t}/throughput_request"]) for t in (0, 1))
    # trained at the model's own price: every lone cycle also costs the choice, so fewer, wider cycles gain
    _, plain_regrets = regret_dataset(rows, model, cost)
    _, paid_regrets = regret_dataset(rows, model, dear)
    assert not np.allclose(plain_regrets, paid_regrets)


def test_the_models_walks_pay_for_keeping_the_option_to_draft_and_the_prior_pays_nothing_more(tiny_labels):
    """Priced with the option to draft (`CycleCost.request`), each walk of the model costs that much more over its
    cycles, whatever its weights, and the prior's nothing; where it costs more than the model's walks can save, the
    prior is kept at every temperature."""
    from blockpilot.predictor.step_data import _step_walks

    table = pq.read_table(tiny_labels["train"])
    candidates = step_rows(table)[0].tables[0].candidates
    vocab = max(max(ids) for ids in table["topk_ids"].to_pylist() if ids) + 1
    rows = [replace(row, prior_block_size=1) for row in step_rows(table, random_predictor(candidates, vocab, 3))]
    assert all(row.prompt_tokens > 0 for row in rows)
    cost = CycleCost({1: {b: 1.0 + 0.4 * b for b in candidates}})
    optioned = replace(cost, context_token=0.01, flush=0.5)
    model = random_prior_step_model(11, candidates, 512)
    for row in rows[:8]:
        walks = [walk_step_model(model, t, a, 1, row.prior_probabilities)[0] for t, a in zip(row.tables, row.anchors)]
        extra = sum(optioned.request(sizes, row.prompt_tokens, keeps_option=True) for sizes in walks)
        assert extra >= 0.01 * row.prompt_tokens * len(walks)  # every walk starts autoregressive: its context
        assert _step_walks(row, model, optioned, 1)[2] == pytest.approx(_step_walks(row, model, cost, 1)[2] + extra)
    free, paid = evaluate_step_model(model, rows, cost), evaluate_step_model(model, rows, optioned)
    for t in (0, 1):
        assert paid[f"T{t}/throughput_step"] < free[f"T{t}/throughput_step"]
        assert paid[f"T{t}/throughput_request"] == free[f"T{t}/throughput_request"]
    kept, _ = prior_temperatures(model, rows, replace(cost, context_token=100.0))
    assert kept == (0.0, 1.0)


def test_the_prior_is_kept_by_the_nearest_labeled_temperature_and_only_with_a_prior(tmp_path):
    config = step_config(prior=True, temperatures=(1.0, 0.0), prior_temperatures=(0.0,))
    assert config.temperatures == (0.0, 1.0)
    temperatures = torch.tensor([0.0, 0.4, 0.5, 0.6, 1.0, 2.0])
    assert config.keeps_prior(temperatures).tolist() == [True, True, True, False, False, False]
    assert not step_config(prior=True).keeps_prior(temperatures).any()
    with pytest.raises(ValueError, match="among the labels' temperatures"):
        step_config(prior=True, temperatures=(0.0,), prior_temperatures=(1.0,))
    with pytest.raises(ValueError, match="must read one"):
        step_config(temperatures=(0.0,), prior_temperatures=(0.0,))
    model = random_step_model(3, prior=True, temperatures=(0.0, 1.0), prior_temperatures=(0.0,))
    model.save(tmp_path / "step")
    assert StepModel.load(tmp_path / "step").config == model.config
    config_file = tmp_path / "step" / "config.json"  # a folder saved before these fields keeps no prior
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({k: v for k, v in saved.items() if "temperatures" not in k}))
    assert StepModel.load(tmp_path / "step").config.prior_temperatures == ()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_request_at_a_kept_temperature_drafts_b0_every_cycle(tiny_models, max_batch):
    """Inside the cycle (a lone row) and by the hook (two rows, the batch not choosing): every cycle of a request at
    a temperature where the model keeps the prior drafts b0, cut only by the budget, with no hook asked and, alone,
    on the cycle that computes no choice (`_kept_cycle`), and with no predictor pass where the prior fixes the
    shape at that temperature; at another the model chooses as it would without the gate; both decode greedily."""
    vocab = vocab_of(tiny_models)
    predictor = random_predictor(CANDIDATES, vocab, 5)
    fixing = type(predictor)(replace(predictor.config, temperatures=(0.0, 1.0), fixed_at=((0.0, 3),)))
    fixing.load_state_dict(predictor.state_dict())
    prior = LearnedPolicy(fixing.eval())
    passes = prior._predicted
    grown = growing_step_model(vocab, prior=True)
    prompts = [tiny_models.encode_prompt(text) for text in ("Write the numbers from 2 to 20.", "Count from 1 to 9.")]
    results, hooks, kept_cycles, predicted = {}, {}, {}, {}
    for kept in [(), (0.0,), (1.0,)]:
        asked_prior = predicted[kept] = []
        prior._predicted = lambda prefills, asked=asked_prior: asked.append(len(prefills)) or passes(prefills)
        policy = PriorStepPolicy(with_prior_at(grown, (0.0, 1.0), kept), prior)
        asked = hooks[kept] = []
        hook = policy.next_block_sizes
        policy.next_block_sizes = lambda cycles, hook=hook, asked=asked: asked.append(len(cycles)) or hook(cycles)
        engine = Engine(tiny_models, max_batch=max_batch, width=max(CANDIDATES), sampling=False, batch_pricing=False)
        cycle = engine.decoder._kept_cycle
        ran = kept_cycles[kept] = []
        engine.decoder._kept_cycle = lambda *shape, cycle=cycle, ran=ran: ran.append(shape) or cycle(*shape)
        requests = [GenerationRequest(p, GenerationConfig(max_new_tokens=40), policy) for p in prompts[:max_batch]]
        results[kept] = generate_many(tiny_models, requests, max_batch=max_batch, engine=engine)
    assert hooks[(0.0,)] == [] and kept_cycles[()] == kept_cycles[(1.0,)] == []
    assert predicted[(0.0,)] == [] and predicted[()], "the model reads the prior's probabilities where it chooses"
    assert kept_cycles[(0.0,)] and all(rows == 1 for rows, *_ in kept_cycles[(0.0,)])  # alone, as the last one is
    for index, prompt in enumerate(prompts[:max_batch]):
        kept = results[(0.0,)][index]
        assert kept.token_ids == greedy_reference(tiny_models.target, prompt, 40)
        cut = [min(kept.block_size, 40 - (1 + sum(kept.acceptance_lengths[:i]))) for i in range(kept.cycles)]
        assert kept.block_sizes == cut
        free, other = results[()][index], results[(1.0,)][index]
        assert (other.block_sizes, other.token_ids) == (free.block_sizes, free.token_ids)
        assert len(set(free.block_sizes)) > 1, "a model that never changes b would not test the gate"


def test_a_request_starting_autoregressive_where_the_prior_is_kept_keeps_no_drafter_context(tiny_models):
    vocab = vocab_of(tiny_models)
    prior = LearnedPolicy(random_predictor(CANDIDATES, vocab, 5))
    policy = PriorStepPolicy(with_prior_at(random_prior_step_model(3, vocab=vocab), (0.0, 1.0), (0.0,)), prior)
    prefill = PrefillState(torch.zeros(vocab), torch.tensor([1, 2]), 0.0, 4, 1, 5)
    assert policy.autoregressive_for_good(prefill, 1)
    assert not policy.autoregressive_for_good(prefill, 2)
    assert not policy.autoregressive_for_good(replace(prefill, temperature=1.0), 1)


def test_a_sample_without_a_cycle_walks_to_nothing_beside_the_prior():
    empty = AcceptanceTable((1, 2, 3), np.ones((3, 0), dtype=np.int16), max_new_tokens=8, tokens=np.array([5]))
    commits = np.asarray([[1, 1, 1], [2, 1, 1], [3, 2, 1]], dtype=np.int16)
    table = AcceptanceTable((1, 2, 3), commits, max_new_tokens=8, tokens=np.array([5, 6, 7, 8]))
    anchors = [Anchors(np.zeros(t.n - 1), 0.0) for t in (empty, table)]
    row = StepRow("p", 0.0, [empty, table], anchors, prior_block_size=3, prior_probabilities=np.full(3, 1 / 3))
    metrics = evaluate_step_model(random_prior_step_model(13, (1, 2, 3)), [row], CycleCost.uniform())
    assert metrics["tau_request"] == pytest.approx(3 / len(table.walk(3)))
    assert 1.0 <= metrics["tau_step"] <= metrics["tau_step_oracle"] + 1e-9


def test_one_policy_shared_by_a_batch_decides_for_every_row_at_once_as_it_would_for_each(tiny_models):
    """The engine asks a policy shared by several rows once as they join (`initial_block_sizes`, one predictor
    pass) and once per cycle (`next_block_sizes`); its choices are the ones it makes for each row alone, rows
    that stop deciding (no anchor) included, and the outputs are greedy."""
    vocab = vocab_of(tiny_models)
    prompts = [tiny_models.encode_prompt(p) for p in ("Count from 1 to 9.", "List four colors.", "Spell cat.")]
    config = GenerationConfig(max_new_tokens=24)
    calls, joined, passes = [], [], []

    class Counting(PriorStepPolicy):
        def initial_block_sizes(self, prefills):
            joined.append(len(prefills))
            return super().initial_block_sizes(prefills)

        def next_block_sizes(self, cycles):
            calls.append(len(cycles))
            return super().next_block_sizes(cycles)

    predictor = random_predictor(CANDIDATES, vocab, 2)
    hook = predictor.register_forward_hook(lambda *_: passes.append(1))
    policy = Counting(random_prior_step_model(21, vocab=vocab), LearnedPolicy(predictor))
    engine = Engine(tiny_models, max_batch=len(prompts), batch_pricing=False)  # every cycle the policy's b
    batched = generate_many(tiny_models, [GenerationRequest(p, config, policy) for p in prompts], engine=engine)
    hook.remove()
    assert joined == [len(prompts)] and len(passes) == 1, "the joining rows were not decided together"
    assert max(calls) == len(prompts), "the rows' decisions were not asked together"
    for prompt, result in zip(prompts, batched, strict=True):
        alone = generate(tiny_models, prompt, policy=policy, config=config)
        assert result.token_ids == alone.token_ids == greedy_reference(tiny_models.target, prompt, 24)
        if not policy.adapts:  # a fixed b is the request's own; an adaptive row's, its batch may widen
            assert result.block_sizes == alone.block_sizes

    prefill = PrefillState(torch.randn(vocab), torch.tensor([0]), 0.0, 4, first_token=3)
    generator = torch.Generator().manual_seed(0)
    cycles = [
        CycleState(
            i,
            CANDIDATES[i % len(CANDIDATES)],
            1 + i % 3,
            3 + 5 * i,
            64,
            0.0,
            anchor_logits=None if i == 2 else torch.randn(vocab, generator=generator) * 3,
            first_block_size=CANDIDATES[-1 - i % 2],
            recent_tokens=(i, 2 * i + 1),
            prefill=prefill,
        )
        for i in range(6)
    ]
    together = policy.next_block_sizes(cycles)
    assert together == [policy.next_block_size(cycle) for cycle in cycles]
    assert together[2] == cycles[2].block_size and len(set(together)) > 1
    # Without a prior the model picks the first b from the prefill's distribution: one call for all, as alone.
    alone = StepPolicy(random_step_model(1, vocab=vocab))
    prefills = [
        PrefillState(torch.randn(vocab, generator=generator) * scale, torch.tensor([0]), temperature, 4, first_token=i)
        for i, (scale, temperature) in enumerate((s, t) for s in (0.1, 1.0, 3.0, 10.0, 30.0) for t in (0.0, 1.0))
    ]
    firsts = alone.initial_block_sizes(prefills)
    assert firsts == [alone.initial_block_size(prefill) for prefill in prefills] and len(set(firsts)) > 1


# ----------------------------------------------------------------------------- load-aware


def load_aware_model(loads=(1, 8, 32), candidates=CANDIDATES, vocab: int = VOCAB) -> StepModel:
    """Head j prefers candidate j whatever the other features: which head decided is visible in the choice."""
    model = StepModel(step_config(candidates, vocab, hidden_size=4, loads=loads))
    with torch.no_grad():
        for index, head in enumerate(model.heads):
            head[2].bias.zero_()
            head[2].bias[index] = 100.0
    return model.eval()


def test_a_load_aware_model_decides_each_row_with_the_head_of_its_nearest_load(tmp_path):
    model = load_aware_model()
    rows = np.array([1, 2, 5, 8, 16, 20, 32, 100])
    # Nearest of 1, 8, 32 as the cost curve prices a batch: 5 -> 8, 16 -> 8, 20 -> 8 (a tie goes to the smaller).
    expected = [0, 0, 1, 1, 1, 1, 2, 2]
    features = model.config.features.build(random_views(len(rows), batch_rows=rows))
    assert model.config.features.names[-1] == "log_batch_rows" and np.allclose(features[:, -1], np.log(rows))
    assert model.choose(features).tolist() == expected
    unordered = load_aware_model(loads=(8, 1))
    assert unordered.config.loads == (1, 8)
    loaded = StepModel.load(unordered.save(tmp_path / "aware"))
    assert loaded.config == unordered.config and loaded.choose(features).tolist() == unordered.choose(features).tolist()
    with pytest.raises(ValueError, match="loads"):
        step_config(loads=(8, 8))


def test_load_aware_training_cycles_are_every_cycle_once_per_load_priced_at_that_load(tiny_labels):
    rows = step_rows(pq.read_table(tiny_labels["train"]))
    candidates = rows[0].tables[0].candidates
    cost = CycleCost({1: {1: 0.010, 8: 0.011}, 8: {1: 0.020, 8: 0.045}})
    aware = load_aware_model((1, 8), candidates, 512)
    features, regret = regret_dataset(rows, aware, cost)
    plain = [regret_dataset(rows, random_step_model(0, candidates, 512), cost.at_batch(load)) for load in (1, 8)]
    cycles = len(plain[0][0])
    assert features.shape == (2 * cycles, plain[0][0].shape[1] + 1)
    for index, (load, (x, r)) in enumerate(zip((1, 8), plain, strict=True)):
        part = slice(index * cycles, (index + 1) * cycles)
        assert np.array_equal(features[part, :-1], x) and np.array_equal(regret[part], r)
        assert np.allclose(features[part, -1], np.log(load))
    assert not np.array_equal(plain[0][1], plain[1][1]), "the two loads should price the choices differently"


def test_a_load_aware_policy_reads_the_live_batch_and_stays_lossless(tiny_models):
    """The engine tells the hooks how many rows the next cycle runs: the joining batch, then the rows going on
    and the waiting ones that fit. Rows of one batch go to one head; the output is greedy whatever it picks. (With
    batch pricing, the default, the batch chooses the b of rows in a cycle of several, unasked.)"""
    seen = []

    class Recording(StepPolicy):
        def initial_block_sizes(self, prefills):
            seen.extend(("join", prefill.batch_rows) for prefill in prefills)
            return super().initial_block_sizes(prefills)

        def next_block_sizes(self, cycles):
            seen.extend(("cycle", cycle.batch_rows) for cycle in cycles)
            return super().next_block_sizes(cycles)

    policy = Recording(load_aware_model(loads=(1, 2), vocab=vocab_of(tiny_models)))
    texts = ("Count from 1 to 9.", "List four colors.", "Spell cat.")
    lengths = (6, 20, 30)  # rows end at different cycles: the batch thins
    requests = [
        GenerationRequest(tiny_models.encode_prompt(text), GenerationConfig(max_new_tokens=n), policy)
        for text, n in zip(texts, lengths, strict=True)
    ]
    results = generate_many(tiny_models, requests, engine=Engine(tiny_models, max_batch=2, batch_pricing=False))
    for request, result in zip(requests, results, strict=True):
        expected = greedy_reference(tiny_models.target, request.prompt_ids, request.config.max_new_tokens)
        assert result.token_ids == expected
        # Head 0 (one row) prefers b = 1, head 1 (two rows) b = 2: the choice follows the batch.
        assert set(result.block_sizes) <= {1, 2}
    assert ("join", 2) in seen and ("cycle", 1) in seen and ("cycle", 2) in seen
    assert all(1 <= rows <= 2 for _, rows in seen)
    assert any(b == 1 for r in results for b in r.block_sizes) and any(b == 2 for r in results for b in r.block_sizes)


# ----------------------------------------------------------------------------- token features


def token_step_model(vocab: int, seed: int = 0, loads: tuple[int, ...] = ()) -> StepModel:
    """A step model whose token embedding dominates, so the tokens decide most choices."""
    torch.manual_seed(seed)
    model = scaled(StepModel(step_config(vocab=vocab, loads=loads)), 4.0)
    with torch.no_grad():
        model.token_embedding.weight.mul_(4.0)
    return model


def test_token_features_are_the_blocks_first_token_and_the_one_before():
    generated = np.array([7, 3, 9, 4, 4])
    assert anchor_tokens(generated, [1, 2, 5]).tolist() == [[7, NO_TOKEN], [3, 7], [4, 4]]
    # The engine's tails give the same pair: the first token alone at cursor 1, the last two after.
    tails = [generated[:cursor][-2:].tolist() for cursor in (1, 2, 5)]
    assert tail_tokens(tails).tolist() == anchor_tokens(generated, [1, 2, 5]).tolist()
    with pytest.raises(ValueError, match="first token"):
        tail_tokens([[7], []])
    spec = step_config().features
    features = spec.build(replace(random_views(2), tokens=np.array([[5, 6], [7, NO_TOKEN]])))
    assert features[:, spec.token_columns].tolist() == [[5, 6], [7, NO_TOKEN]]
    with pytest.raises(ValueError, match="first tokens"):
        spec.build(replace(random_views(2), tokens=None))


def test_labels_keep_every_samples_sequence_and_training_reads_it(tiny_labels):
    table = pq.read_table(tiny_labels["train"])
    rows = step_rows(table)
    for label, row in zip(table.filter(pc.is_valid(table["table_commits"])).to_pylist(), rows, strict=True):
        assert sum(t.n for t in row.tables) == len(label["table_tokens"])
        for t in row.tables:
            assert len(t.tokens) == t.n and ((0 <= t.tokens) & (t.tokens < label["vocab_size"])).all()
    model = random_step_model(0, rows[0].tables[0].candidates, 512)
    features, _ = regret_dataset(rows, model, CycleCost.uniform())
    sequences = [t for r in rows for t in r.tables if t.n > 1]
    expected = np.concatenate([anchor_tokens(t.tokens, fixed_walk_cycles(t)[0]) for t in sequences])
    assert np.array_equal(features[:, model.config.features.token_columns], expected)
    unknown = [StepRow(r.prompt_id, r.temperature, [replace(t, tokens=None) for t in r.tables], r.anchors) for r in rows]
    with pytest.raises(ValueError, match="sequence"):
        regret_dataset(unknown, model, CycleCost.uniform())
    broken = {**table.slice(0, 1).to_pylist()[0]}
    broken["table_tokens"] = broken["table_tokens"][:-1]
    with pytest.raises(ValueError, match="table tokens"):
        tables_from_row(broken)


def test_a_token_model_embeds_ids_unscaled_and_reads_unknown_ids_as_no_token(tmp_path):
    vocab = 11
    model = token_step_model(vocab)
    spec = model.config.features
    view = random_views(40)
    tokens = np.random.default_rng(0).integers(0, vocab, size=(40, 2))
    features = spec.build(replace(view, tokens=tokens))
    model.standardize(features * 3 + 1)
    assert (model.choose(spec.build(replace(view, tokens=(tokens + 1) % vocab))) != model.choose(features)).any()
    outside = spec.build(replace(view, tokens=np.full((40, 2), vocab + 5)))
    none = spec.build(replace(view, tokens=np.full((40, 2), NO_TOKEN)))
    assert model.choose(outside).tolist() == model.choose(none).tolist()
    loaded = StepModel.load(model.save(tmp_path / "tokens"))
    assert loaded.config == model.config and loaded.choose(features).tolist() == model.choose(features).tolist()


@pytest.mark.parametrize("loads", [(), (1, 8)])
def test_a_token_model_decodes_losslessly_as_it_walks_the_table(tiny_models, loads):
    """The tokens the engine hands the hook (g_0 at the first cycle, the last two after) are the ones a label's
    sequence gives each cursor: the live choices are the table walk's, and the output is greedy."""
    vocab = vocab_of(tiny_models)
    model = token_step_model(vocab, seed=2, loads=loads)
    sizes = check_live_equals_walk(tiny_models, model, StepPolicy(model))
    assert len(set(sizes)) > 1, "a model that never changes b would not test the per-step hook"
    prompt = tiny_models.encode_prompt("Write the numbers from 2 to 20.")
    sweep = sweep_prompt(tiny_models, prompt, SweepConfig(CANDIDATES, max_new_tokens=40))
    (table,) = sweep.tables
    shifted = AcceptanceTable(table.candidates, table.commits, table.max_new_tokens, (table.tokens + 1) % vocab)
    assert walk_step_model(model, shifted, sweep_anchors(sweep))[0] != sizes, "the model reads the tokens"
    with pytest.raises(ValueError, match="sequence"):
        walk_step_model(model, replace(table, tokens=None), sweep_anchors(sweep))
