"""Draft trees (`blockpilot.tree`, verified by the static engine): the best-first tree holds the most probable
continuations; at T = 0 every tree policy decodes the target's greedy output, alone and beside chain rows; at T > 0
a row's output for a seed is the autoregressive one whatever its tree (so it samples the target's distribution, as
the static sampler's chi-square test shows); a larger budget commits at least as much a cycle on these prompts."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from support import greedy_reference

from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.decoding.engine import Engine
from blockpilot.policies.fixed import FixedBlockSize, FixedTree
from blockpilot.policies.resolve import PolicySpec, resolve_policy
from blockpilot.serving import BatchedDecoder, ServeLimits
from blockpilot.sweep import SweepConfig, sweep_prompt
from blockpilot.table import acceptance_table, table_columns, tables_from_row
from blockpilot.tree import DEAD, best_first_tree, grow_trees
from pipelines.openai_protocol import CompletionRequest, decode_request, parse_request

PROMPTS = ["Count from 3 to 14.", "Sort these numbers: 5 3 9 1", "def add(a, b):", "Write the numbers from 2 to 20."]


def brute_force_best(logprobs, nodes):
    """The `nodes` most probable continuations (as rank tuples) by enumerating every one."""
    depth, k = len(logprobs), len(logprobs[0])
    scored = []
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=length):
            scored.append((sum(logprobs[d][r] for d, r in enumerate(ranks)), ranks))
    return sorted(scored, reverse=True)[:nodes]


@pytest.mark.parametrize("seed", range(5))
def test_the_best_first_tree_holds_the_most_probable_continuations(seed):
    generator = torch.Generator().manual_seed(seed)
    depth, k, nodes = 4, 3, 12
    logprobs = torch.log_softmax(torch.randn(depth, k, generator=generator) * 2, dim=-1).sort(descending=True).values
    ids = torch.arange(depth * k).view(depth, k)  # token = d * k + rank: a node's ranks read back from its tokens
    tree = best_first_tree(logprobs.tolist(), ids.tolist(), nodes, slots=nodes + 3)
    assert tree.live == nodes and tree.parents[nodes + 1 :] == [DEAD, DEAD]
    paths = []
    for node in range(1, nodes + 1):
        ranks, walk = [], node
        while walk > 0:
            ranks.append(tree.tokens[walk] % k)
            assert tree.depths[walk] == tree.tokens[walk] // k + 1  # at the level of its slot
            assert tree.parents[walk] < walk  # a parent comes before its children
            walk = tree.parents[walk]
        paths.append(sum(logprobs[d][r] for d, r in enumerate(reversed(ranks))).item())
    expected = [score for score, _ in brute_force_best(logprobs.tolist(), nodes)]
    assert sorted(paths, reverse=True) == pytest.approx(expected)
    chain = best_first_tree([row[:1] for row in logprobs.tolist()], ids[:, :1].tolist(), 3, slots=4)
    assert chain.parents == [DEAD, 0, 1, 2] and chain.depths == [0, 1, 2, 3]
    cut = best_first_tree([[0.0], [-math.inf]], [[5], [6]], 4, slots=5)  # past the row's depth nothing grows
    assert cut.live == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_trees_grown_on_the_device_are_the_best_first_trees(seed):
    """`grow_trees` (fixed-shape tensor steps, compiled with the cycle) gives `best_first_tree`'s nodes, in its order,
    with its ancestors, for random distributions, depths, widths, budgets and slots."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(60):
        levels, k, slots = (
            int(torch.randint(low, high, (), generator=generator)) for low, high in ((1, 7), (1, 9), (2, 40))
        )
        logprobs = torch.log_softmax(3 * torch.randn(3, levels, 40, generator=generator), dim=-1)
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        depth = torch.randint(0, levels + 1, (3,), generator=generator)
        top_logprobs = top_logprobs.masked_fill(torch.arange(levels)[None, :, None] >= depth[:, None, None], -math.inf)
        budgets = torch.randint(0, 40, (3,), generator=generator)
        tokens, depths, parents, ancestors, probabilities = grow_trees(top_logprobs, top_ids, budgets, slots)
        for row in range(3):
            nodes = min(int(budgets[row]), slots - 1)
            tree = best_first_tree(top_logprobs[row].tolist(), top_ids[row].tolist(), nodes, slots)
            assert (tokens[row].tolist(), depths[row].tolist(), parents[row].tolist()) == (
                tree.tokens,
                tree.depths,
                tree.parents,
            )
            assert ancestors[row].tolist() == tree.ancestors()
            assert probabilities[row].tolist() == pytest.approx(tree.probabilities, rel=1e-5)


def requests(models, prompts, policies, max_new_tokens, stop: bool = True, **config):
    stops = tuple(models.stop_token_ids()) if stop else ()
    settings = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=stops, **config)
    return [GenerationRequest(p, settings, q) for p, q in zip(prompts, policies, strict=True)]


def test_greedy_tree_decoding_is_the_targets_greedy_output_beside_chain_rows(tiny_models):
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS]
    stop = tiny_models.stop_token_ids()
    expected = [greedy_reference(tiny_models.target, p, 40, stop) for p in prompts]
    B = tiny_models.train_block_size
    engine = Engine(tiny_models, max_batch=3, tree_nodes=16)
    policies = [FixedTree(16, B), FixedBlockSize(3), FixedTree(5, B), FixedTree(1, 2)]
    results = generate_many(tiny_models, requests(tiny_models, prompts, policies, 40), engine=engine)
    assert [r.token_ids for r in results] == expected
    assert all(r.policy == "tree" for r in results[::2]) and results[1].policy == "fixed"
    assert all(length <= 2 for length in results[3].acceptance_lengths)  # one node commits at most 2 tokens
    # A tree that keeps one token a level is the chain: branching into a slot's top 1, B - 1 nodes commit cycle by
    # cycle what a chain of B commits, whatever the weights.
    narrow = Engine(tiny_models, tree_nodes=B - 1, top_k=1)
    trees = generate_many(tiny_models, requests(tiny_models, prompts, [FixedTree(B - 1, B)] * 4, 40), engine=narrow)
    chains = generate_many(
        tiny_models, requests(tiny_models, prompts, [FixedBlockSize(B)] * 4, 40), engine=Engine(tiny_models)
    )
    assert [r.acceptance_lengths for r in trees] == [r.acceptance_lengths for r in chains]
    assert [r.token_ids for r in trees] == expected


def test_a_sampled_rows_output_for_a_seed_does_not_depend_on_its_tree(tiny_models):
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:2]] * 2
    B = tiny_models.train_block_size
    sampled = dict(temperature=0.9)
    config = [dict(sampled, seed=s) for s in (3, 4, 3, 4)]

    def decode(engine, policies):
        stop = tuple(tiny_models.stop_token_ids())
        batch = [
            GenerationRequest(p, GenerationConfig(max_new_tokens=30, stop_token_ids=stop, **c), q)
            for p, c, q in zip(prompts, config, policies, strict=True)
        ]
        return [r.token_ids for r in generate_many(tiny_models, batch, engine=engine)]

    alone = decode(Engine(tiny_models, max_batch=1, width=1), [None] * 4)
    trees = decode(Engine(tiny_models, max_batch=4, tree_nodes=12), [FixedTree(12, B), FixedTree(3, B)] * 2)
    assert trees == alone and alone[0] == alone[2] and alone[0] != alone[1]


def test_tree_policies_resolve_and_are_refused_where_they_cannot_run(tiny_models):
    policy = resolve_policy("tree:24", tiny_models)
    assert isinstance(policy, FixedTree) and policy.tree_nodes == 24 and policy.name == "tree"
    assert str(PolicySpec.parse("tree:24")) == "tree:24" and policy.tree_depth == tiny_models.train_block_size
    deep = resolve_policy("tree:24:9", tiny_models)
    assert (deep.tree_nodes, deep.tree_depth, str(PolicySpec.parse("tree:24:9"))) == (24, 9, "tree:24:9")
    with pytest.raises(ValueError, match="tree:<integer node budget>"):
        PolicySpec.parse("tree:many")
    with pytest.raises(ValueError, match="tree:<node budget>:<integer depth>"):
        PolicySpec.parse("tree:24:deep")
    with pytest.raises(ValueError, match="at least 2 deep"):
        PolicySpec.parse("tree:24:1")
    request = GenerationRequest([1, 2, 3], GenerationConfig(max_new_tokens=4), policy)
    with pytest.raises(ValueError, match="build the engine with tree_nodes"):
        Engine(tiny_models).submit(request)
    with pytest.raises(ValueError, match="at least 2 deep"):
        FixedTree(8, 1)


def test_the_serving_decoder_serves_trees(tiny_models):
    """The endpoint's decoder with `tree:8` as its adaptive policy, warmed up by a request of its own at start: a tree
    request and a forced chain (block_size) share the engine and each decodes the greedy output."""
    limits = ServeLimits(max_batch=2, max_tokens_cap=64, max_prompt_tokens=256)
    decoder = BatchedDecoder(tiny_models, adaptive="tree:8", limits=limits).start()
    assert decoder.warm_up_seconds is not None  # one request decoded before the first: the requests below still exact
    try:
        bodies = [
            {"prompt": "Count from 1 to 9.", "max_tokens": 40, "temperature": 0},
            {"prompt": "Spell cat.", "max_tokens": 30, "block_size": 3, "temperature": 0, "ignore_eos": True},
        ]
        handles = [decoder.submit(decode_request(decoder, parse_request(b, CompletionRequest))) for b in bodies]
        for body, handle in zip(bodies, handles, strict=True):
            events = list(handle.events(timeout_s=120))
            text = "".join(value for kind, value in events if kind == "delta")
            stats = next(value for kind, value in events if kind == "done")
            ids = decoder.encode_completion(body["prompt"])
            stop = () if body.get("ignore_eos") else tiny_models.stop_token_ids()  # the chain runs all its cycles
            expected = greedy_reference(tiny_models.target, ids, body["max_tokens"], stop)
            assert text == tiny_models.tokenizer.decode(expected, skip_special_tokens=True)
            bp = stats["blockpilot"]
            assert bp["policy"] == ("fixed" if "block_size" in body else "tree")
            assert len(bp["tree_nodes"]) == len(bp["acceptance_lengths"]) and max(bp["tree_nodes"], default=0) <= 8
            if "block_size" in body:  # a chain of 3 is a tree of 2 nodes (fewer near the budget's end)
                assert set(bp["tree_nodes"]) <= {0, 1, 2} and 2 in bp["tree_nodes"]
    finally:
        decoder.stop()


def test_an_engine_of_small_trees_runs_chains_as_wide_as_its_width_beside_them(tiny_models):
    """A chain of b is the tree of b - 1 nodes: an engine whose trees hold fewer nodes than its widest chain still
    runs that chain (a served tree replica once died on it) beside tree rows, and both stay greedy."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:2]]
    B = tiny_models.train_block_size
    engine = Engine(tiny_models, max_batch=2, tree_nodes=3)
    width = engine.width
    assert width - 1 > 3 and engine.tree_nodes >= width - 1
    policies = [FixedBlockSize(width), FixedTree(3, B)]
    results = generate_many(tiny_models, requests(tiny_models, prompts, policies, 32, stop=False), engine=engine)
    assert [r.token_ids for r in results] == [greedy_reference(tiny_models.target, p, 32) for p in prompts]
    assert max(results[0].block_sizes) == width


def test_tree_walks_on_the_labels_equal_live_tree_runs_at_temperature_0(tiny_models):
    """The label's t(i, N), walked, is cycle by cycle what a live run of the tree of N nodes commits (trees of
    several budgets sharing a batch); the tables are as deep as the largest candidate, and so are the live trees."""
    B = tiny_models.train_block_size
    candidates, budgets = (B - 1, B + 1), (3, 8, 16)
    stop = tuple(tiny_models.stop_token_ids())
    config = SweepConfig(candidates, max_new_tokens=40, stop_token_ids=stop, tree_budgets=budgets)
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[::3]]
    tables = [sweep_prompt(tiny_models, p, config).tables[0] for p in prompts]
    policies = [FixedTree(nodes, B + 1) for nodes in budgets]
    batch = requests(tiny_models, [p for p in prompts for _ in budgets], policies * len(prompts), 40)
    live = generate_many(tiny_models, batch, engine=Engine(tiny_models, max_batch=4, tree_nodes=16))
    walks = [table.walk_tree(nodes) for table in tables for nodes in budgets]
    assert [r.acceptance_lengths for r in live] == walks
    assert [r.token_ids for r in live] == [table.tokens.tolist() for table in tables for _ in budgets]


def test_tree_labels_grow_with_the_budget_and_a_top_1_tree_is_the_chain(tiny_models):
    """Whatever the weights: a tree is its larger budget's first nodes, so it commits no more at any cursor; branching
    into each slot's top 1, a tree of D - 1 nodes is the chain of D. Rows carry the trees' commits and read back."""
    B = tiny_models.train_block_size
    candidates = (B - 1, B + 1)
    prompt = tiny_models.encode_prompt(PROMPTS[0])
    (reference,) = generate_many(
        tiny_models, [GenerationRequest(prompt, GenerationConfig(max_new_tokens=40), FixedBlockSize(B), record=True)]
    )
    features = reference.record.context_features

    def table(budgets, top_k):
        return acceptance_table(
            tiny_models, len(prompt), reference.token_ids, features, candidates, 40, tree_budgets=budgets, top_k=top_k
        )

    wide = table((2, 5, 30), 8)
    assert (np.diff(wide.tree_commits.astype(int), axis=0) >= 0).all()
    assert (wide.tree_commits >= 1).all() and (wide.tree_commits <= 31).all()
    narrow = table((B,), 1)
    assert narrow.tree_commits[0].tolist() == narrow.row(B + 1).tolist()
    (back,) = tables_from_row({**table_columns([wide]), "candidates": list(candidates), "max_new_tokens": 40})
    assert back.tree_budgets == (2, 5, 30) and (back.tree_commits == wide.tree_commits).all()
    assert [back.walk_tree(n) for n in (2, 5, 30)] == [wide.walk_tree(n) for n in (2, 5, 30)]
    with pytest.raises(ValueError, match="trees of \\[2, 5, 30\\] nodes, not 4"):
        back.walk_tree(4)


def test_tree_policies_are_scored_on_the_labels_beside_the_chains():
    """tau and modeled throughput of every fixed budget, the best one, the best shape and each row's best shape, from
    hand-made tables: row 0 gains from a tree, row 1 does not; tree prices come from the curve, or tau alone."""
    from blockpilot.cost import CycleCost
    from blockpilot.table import AcceptanceTable
    from blockpilot.walks import fixed_walks_of_tables, tree_walks_of_tables, walk_metrics

    def table(chain, trees):  # 6 tokens: cursors 1 .. 5
        return AcceptanceTable(
            (1, 3),
            np.array([[1] * 5, chain], dtype=np.int16),
            6,
            tree_budgets=(4, 16),
            tree_commits=np.array(trees, dtype=np.int16),
        )

    rows = [
        [table([3, 2, 2, 2, 1], [[3, 2, 2, 2, 1], [5, 4, 3, 2, 1]])],  # chain 3: 2 cycles; tree 16: 1 cycle
        [table([3, 3, 3, 2, 1], [[2, 2, 2, 2, 1], [2, 2, 2, 2, 1]])],  # chain 3: 2 cycles; trees: 3 cycles
    ]
    everyone = {"": np.arange(2)}
    cost = CycleCost({1: {1: 1.0, 3: 1.0}}, trees={1: {4: 1.0, 16: 3.0}}, tree_depth=3)
    for curve, priced in [(CycleCost.uniform(), True), (cost, True), (CycleCost({1: {1: 1.0, 3: 1.0}}), False)]:
        trees = tree_walks_of_tables(rows, curve)
        assert trees.priced == priced and trees.budgets == (4, 16)
        metrics = walk_metrics(fixed_walks_of_tables(rows, curve), everyone, (1, 3), 3, trees=trees)
        assert metrics["tau_tree16"] == pytest.approx(10 / 4) and metrics["tau_tree4"] == pytest.approx(10 / 5)
        assert metrics["tau_best_fixed"] == pytest.approx(10 / 4)
        assert ("throughput_tree16" in metrics) == priced
    uniform = walk_metrics(
        fixed_walks_of_tables(rows, CycleCost.uniform()),
        everyone,
        (1, 3),
        3,
        trees=tree_walks_of_tables(rows, CycleCost.uniform()),
    )
    assert uniform["best_tree_nodes"] == 16 and uniform["tau_shape_oracle"] == pytest.approx(10 / 3)  # 1 + 2 cycles
    priced = walk_metrics(
        fixed_walks_of_tables(rows, cost), everyone, (1, 3), 3, trees=tree_walks_of_tables(rows, cost)
    )
    assert priced["throughput_tree16"] == pytest.approx(10 / 12) and priced["throughput_best_shape"] == pytest.approx(
        10 / 4
    )
    assert priced["throughput_shape_oracle"] == pytest.approx(10 / 4)  # at 3 s a tree cycle, chains win both rows


def test_a_predictor_over_shapes_chooses_a_tree_or_a_chain_per_request(tiny_models, tmp_path):
    """A per-request predictor over shapes (the candidates, then tree budgets) sets each row's tree or chain from its
    prefill: here a tree of 16 nodes at T > 0 and the chain of B at T = 0, by construction of the weights. Greedy rows
    stay greedy, sampled rows give the autoregressive sample of their seed; the eager engine and a step model refuse
    it."""
    from blockpilot.decoding import generate
    from blockpilot.decoding.engine import shape_for
    from blockpilot.policies.learned import LearnedPolicy
    from blockpilot.predictor import BlockSizePredictor, PredictorConfig

    B = tiny_models.train_block_size
    vocab = tiny_models.target.get_output_embeddings().weight.shape[0]
    config = PredictorConfig(
        "sparse", (B - 1, B, B + 1), vocab, top_k=8, hidden_size=4, train_block_size=B, tree_budgets=(8, 16)
    )
    predictor = BlockSizePredictor(config)
    with torch.no_grad():  # logit of tree:16 = 10 T; of b = B, 5: a tree at T = 1, the chain at T = 0
        for parameter in predictor.parameters():
            parameter.zero_()
        predictor.side.weight[0, 1] = 10.0
        predictor.out.weight[4, 0], predictor.out.bias[1] = 1.0, 5.0
    assert config.shapes == ((B - 1, None), (B, None), (B + 1, None), (B + 1, 8), (B + 1, 16))
    policy = resolve_policy(f"learned:{predictor.save(tmp_path / 'shapes')}", tiny_models)
    assert isinstance(policy, LearnedPolicy) and shape_for(policy) == (B + 1, 16)
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:2]]
    greedy = [greedy_reference(tiny_models.target, p, 30) for p in prompts]
    batch = [
        GenerationRequest(p, GenerationConfig(max_new_tokens=30, temperature=t, seed=s), policy)
        for p, t, s in ((prompts[0], 0.0, 0), (prompts[1], 1.0, 5), (prompts[1], 0.0, 0))
    ]
    chain, tree, other = generate_many(tiny_models, batch, engine=Engine(tiny_models, max_batch=3, tree_nodes=16))
    assert chain.token_ids == greedy[0] and other.token_ids == greedy[1]
    assert set(chain.block_sizes) <= set(range(1, B + 1)) and max(chain.tree_nodes) == B - 1  # the chain of B
    assert tree.policy == "learned" and max(tree.tree_nodes) == 16
    autoregressive = GenerationRequest(prompts[1], batch[1].config, None)
    alone = generate_many(tiny_models, [autoregressive], engine=Engine(tiny_models, max_batch=1, width=1))[0]
    assert tree.token_ids == alone.token_ids
    # Behind the endpoint's decoder as its adaptive policy: the blockpilot object shows each request's shape.
    limits = ServeLimits(max_batch=2, max_tokens_cap=64, max_prompt_tokens=256)
    decoder = BatchedDecoder(
        tiny_models, adaptive="learned:shapes", predictor=predictor, limits=limits
    ).start()
    try:
        bodies = [
            {"prompt": "Count from 1 to 9.", "max_tokens": 30, "temperature": t, "seed": 1, "ignore_eos": True}
            for t in (0.0, 1.0)
        ]
        handles = [decoder.submit(decode_request(decoder, parse_request(b, CompletionRequest))) for b in bodies]
        shown = [
            next(v for kind, v in handle.events(timeout_s=120) if kind == "done")["blockpilot"] for handle in handles
        ]
        assert [bp["policy"] for bp in shown] == ["learned", "learned"]
        assert max(shown[0]["tree_nodes"]) <= B - 1 and max(shown[1]["tree_nodes"]) > B - 1  # a chain; a tree
    finally:
        decoder.stop()
    assert generate(tiny_models, prompts[0], policy=policy).token_ids  # the library's engine is shaped for its trees
    with pytest.raises(ValueError, match="chooses among tree shapes"):
        resolve_policy("learned+step:a,b", tiny_models, predictor=predictor, step_model=object())
