"""The block-size predictor: kinds, folder format, policy, metrics, label checks, objectives, MLflow model."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from blockpilot.cost import CycleCost
from blockpilot.data.labels import rows_to_table
from blockpilot.decoding import GenerationConfig, generate
from blockpilot.files import MODEL_SCHEMA_VERSION
from blockpilot.policies.base import PrefillState
from blockpilot.policies.learned import LearnedPolicy
from blockpilot.policies.resolve import check_predictor_fits, resolve_policy
from blockpilot.predictor import BlockSizePredictor, PredictorConfig, PredictorInputs, input_arrays, load_predictor
from blockpilot.predictor.evaluation import evaluate_predictor, fixed_choices
from blockpilot.predictor.inputs import INPUT_COLUMNS, prefill_columns
from blockpilot.predictor.training import (
    PredictorTrainConfig,
    fit_epochs,
    is_validation,
    local_batches,
    make_optimizer,
    predictor_loss,
    split_by_prompt,
    training_columns,
    valid_rows,
)
from blockpilot.scoring import LabelArrays, choice_walks, evaluate_choices, label_arrays


def random_inputs(n: int, vocab: int, k: int, seed: int = 0) -> PredictorInputs:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=generator) * 3
    probs = torch.softmax(logits, dim=-1)
    top_probs, top_ids = probs.topk(k, dim=-1)
    entropy = -(probs * probs.log()).sum(-1)
    return PredictorInputs(top_ids, top_probs, entropy, torch.rand(n, generator=generator), probs)


def test_sparse_and_dense_compute_the_same_function():
    """With every token in the top k, the embedding bag equals the dense first layer sharing its weights."""
    vocab = 24
    dense = BlockSizePredictor(PredictorConfig("dense", (3, 4, 5), vocab, top_k=vocab, hidden_size=16, dropout=0.0))
    sparse = BlockSizePredictor(PredictorConfig("sparse", (3, 4, 5), vocab, top_k=vocab, hidden_size=16, dropout=0.0))
    with torch.no_grad():
        sparse.first.weight.copy_(dense.first.weight.T)
        sparse.first_bias.copy_(dense.first.bias)
        sparse.side.weight.copy_(dense.side.weight)
        sparse.out.load_state_dict(dense.out.state_dict())
    inputs = random_inputs(6, vocab, k=vocab)
    torch.testing.assert_close(sparse.eval()(inputs), dense.eval()(inputs), rtol=1e-5, atol=1e-5)


def test_dense_falls_back_to_the_top_k_when_labels_have_no_full_distribution():
    model = BlockSizePredictor(PredictorConfig("dense", (3, 4), 30, top_k=5, hidden_size=8))
    inputs = random_inputs(4, 30, k=5)
    dense_from_topk = model.dense_from_topk(inputs)
    assert dense_from_topk.shape == (4, 30)
    torch.testing.assert_close(dense_from_topk.sum(-1), inputs.topk_probs.sum(-1))
    no_probs = PredictorInputs(inputs.topk_ids, inputs.topk_probs, inputs.entropy, inputs.temperature)
    assert model.eval()(no_probs).shape == (4, 2)


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_folder_round_trip_without_pickle(tmp_path, kind):
    model = BlockSizePredictor(PredictorConfig(kind, (2, 3, 4, 5, 6), 40, top_k=8, hidden_size=16, train_block_size=4))
    folder = model.save(tmp_path / kind)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text())["kind"] == kind
    loaded = load_predictor(folder)
    inputs = random_inputs(5, 40, k=8)
    assert torch.equal(loaded(inputs), model.eval()(inputs))
    assert loaded.predict(inputs) == model.predict(inputs)
    assert set(loaded.predict(inputs)) <= {2, 3, 4, 5, 6}
    # The folder carries its schema version; one saved under another version is refused with what to rerun.
    config = json.loads((folder / "config.json").read_text())
    assert config["schema_version"] == MODEL_SCHEMA_VERSION
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "schema_version"}))
    with pytest.raises(ValueError, match="schema version before versions.*train it again .`blockpilot train`"):
        load_predictor(folder)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kind": "tree"}, "kind"),
        ({"candidates": (4, 4)}, "distinct"),
        ({"candidates": ()}, "empty"),
        ({"dropout": 1.0}, "dropout"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"temperatures": (0.0,), "fixed_at": ((1.0, 0),)}, r"temperature 1.0 is not among .*\[0.0\]"),
        ({"temperatures": (0.0,), "fixed_at": ((0.0, 2),)}, r"shape index 2 at T = 0.0: expected 0 .. 1"),
    ],
)
def test_bad_predictor_configs(changes, message):
    settings = {"kind": "sparse", "candidates": (3, 4), "vocab_size": 10, **changes}
    with pytest.raises(ValueError, match=message):
        PredictorConfig(**settings)


def test_missing_predictor_folder_and_unknown_uri(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor an MLflow model URI"):
        load_predictor(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a predictor folder"):
        load_predictor(tmp_path / "empty")


def test_learned_policy_plugs_into_generate(tiny_models, tmp_path):
    from dataclasses import replace

    vocab = tiny_models.target.get_output_embeddings().weight.shape[0]
    config = PredictorConfig("sparse", (2, 3, 4, 5, 6), vocab, top_k=8, hidden_size=16, train_block_size=4)
    model = BlockSizePredictor(config)
    policy = resolve_policy(f"learned:{model.save(tmp_path / 'p')}", tiny_models)
    assert isinstance(policy, LearnedPolicy) and policy.name == "learned"
    ids = tiny_models.encode_prompt("Count from 1 to 9.")
    result = generate(tiny_models, ids, policy=policy, config=GenerationConfig(max_new_tokens=20))
    assert result.block_size == policy.initial_block_size(result.prefill) and result.policy == "learned"
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        check_predictor_fits(replace(config, vocab_size=vocab + 1), tiny_models)
    with pytest.raises(ValueError, match="B=8; this drafter has B=4"):
        check_predictor_fits(replace(config, train_block_size=8), tiny_models)


def test_a_fixed_temperature_gets_its_shape_without_a_predictor_pass(tmp_path):
    """Where the config fixes a shape (`fixed_at`), every reader of the choice gets it (the live policy, the
    metrics' indices, a reloaded folder), by the labeled temperature nearest the request's; elsewhere the
    predictor's argmax. A live request there runs no pass until a step policy asks for its probabilities."""
    config = PredictorConfig("sparse", (1, 4, 6), 40, top_k=8, hidden_size=16, temperatures=(0, 1), fixed_at=[(0, 2)])
    model = BlockSizePredictor(config).eval()
    with torch.no_grad():
        model.out.bias.copy_(torch.tensor([0.0, 50.0, 0.0]))  # the predictor's own choice: b = 4 for every row
    loaded = load_predictor(model.save(tmp_path / "p"))
    assert loaded.config.fixed_at == ((0.0, 2),) and loaded.config.temperatures == (0.0, 1.0)
    temperatures = torch.tensor([0.0, 0.3, 0.5, 0.51, 1.0, 2.0])
    assert loaded.config.fixed_index(temperatures).tolist() == [2, 2, 2, -1, -1, -1]  # a tie goes to the lower
    inputs = random_inputs(6, 40, k=8)
    inputs.temperature = temperatures
    assert loaded.predict(inputs) == [6, 6, 6, 4, 4, 4]

    policy = LearnedPolicy(loaded)
    forward = loaded.forward
    loaded.forward = lambda _: pytest.fail("a request at a fixed temperature ran a predictor pass")
    cold = PrefillState(torch.randn(40), torch.arange(3), 0.0, 4)
    assert policy.initial_block_sizes([cold]) == [6] and policy.initial_tree_budgets([cold]) == [None]
    loaded.forward = forward
    hot = PrefillState(torch.randn(40), torch.arange(3), 1.0, 4)
    assert policy.initial_block_sizes([cold, hot]) == [6, 4]
    assert policy.probabilities(cold).shape == (3,) and policy.probabilities(cold).argmax() == 1  # asked: a pass
    assert policy.initial_block_sizes([cold]) == [6]  # the decision kept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_choices_keep_the_predictor_only_where_it_is_surely_faster_than_the_training_rows_best_shape(seed):
    """For any weights: at each temperature the validation rows decode (modeled) at the predictor's speed where it is
    faster by the asked margin than the single shape fastest on the training rows, and so in at least the asked
    share of resamples, at that shape's elsewhere; asked for neither, at the faster of the two. A predictor that
    always picks the worst shape is fixed everywhere, one that picks each row's best nowhere."""
    rows = label_rows(80)
    train = label_arrays(rows_to_table(rows[:40]))
    val = label_arrays(rows_to_table(rows[40:]))
    torch.manual_seed(seed)
    model = BlockSizePredictor(PredictorConfig("sparse", (2, 3, 4), 10, top_k=4, hidden_size=8, temperatures=(0, 1)))
    before = evaluate_predictor(model, val)
    for confidence, margin in ((0.0, 0.0), (0.5, 0.0), (0.9, 0.02)):
        fixed, metrics = fixed_choices(model, train, val, confidence, margin)
        gated = BlockSizePredictor(replace(model.config, fixed_at=fixed))
        gated.load_state_dict(model.state_dict())
        after = evaluate_predictor(gated, val)
        for t in (0, 1):
            pred, alone = metrics[f"T{t}/throughput_pred"], metrics[f"T{t}/throughput_fixed"]
            share = metrics[f"T{t}/p_faster"]
            assert pred == pytest.approx(before[f"T{t}/throughput_pred"]) and 0.0 <= share <= 1.0
            adapted = pred > (1 + margin) * alone and share >= confidence
            assert (t not in dict(fixed)) == adapted
            assert after[f"T{t}/throughput_pred"] == pytest.approx(pred if adapted else alone)
            if confidence == margin == 0.0:
                assert after[f"T{t}/throughput_pred"] == pytest.approx(max(pred, alone))
    with pytest.raises(ValueError, match="before its fixed_at is set"):
        fixed_choices(gated, train, val)

    oracle, wrong = (
        BlockSizePredictor(PredictorConfig("sparse", (2, 3, 4), 10, top_k=4, hidden_size=8, temperatures=(0, 1)))
        for _ in range(2)
    )
    with torch.no_grad():  # the top token's own hidden unit; its candidate is each row's best (label_rows)
        for module, classes in ((oracle, [0, 1, 2]), (wrong, [1, 2, 0])):
            for parameter in module.parameters():
                parameter.zero_()
            module.first.weight[:3, :3].copy_(torch.eye(3))
            module.out.weight[:3, :3].copy_(torch.eye(3)[classes])
    assert evaluate_predictor(oracle, val)["accuracy"] == 1.0 and evaluate_predictor(wrong, val)["accuracy"] == 0.0
    assert fixed_choices(oracle, train, val)[0] == ()
    assert [t for t, _ in fixed_choices(wrong, train, val)[0]] == [0.0, 1.0]


# ----------------------------------------------------------------------------- metrics and label checks


def hand_made_arrays(cost: CycleCost | None = None) -> LabelArrays:
    tau = np.array([[2.0, 3.0, 2.5], [3.0, 2.0, 2.0], [2.0, 2.0, 4.0], [1.0, 3.0, 2.0]], dtype=np.float32)
    return LabelArrays(
        prompt_ids=["a", "b", "c", "d"],
        sources=["x", "x", "y", "y"],
        inputs={"temperature": np.array([0, 0, 1, 1], dtype=np.float32)},
        tau=tau,
        cycles=np.full((4, 3), 10.0),
        candidates=(4, 5, 6),
        train_block_size=5,
        cost=cost or CycleCost.uniform(),
    )


def test_an_adaptive_choice_replaces_a_fixed_one_only_where_the_rows_surely_say_it_is_faster():
    """`adapts`: faster by the margin over the rows and in the asked share of paired bootstrap resamples. Walks that
    tie never adapt; walks faster on every row adapt at any confidence, unless by less than the margin; a gain that
    one row of twenty carries adapts only for a confidence that a resample without that row still meets."""
    from blockpilot.walks import adapts, faster_share

    fixed = np.tile([[10.0, 4.0, 4.0]], (20, 1))  # (tokens, cycles, cost) of each row's walks
    assert adapts(fixed, fixed.copy(), 0.0) == (False, 0.0)
    quicker = fixed * [1.0, 1.0, 0.9]  # 11% faster on every row
    assert adapts(quicker, fixed, 0.99, margin=0.1) == (True, 1.0)
    assert adapts(quicker, fixed, 0.0, margin=0.12) == (False, 0.0)  # not by the margin
    lucky = fixed * [1.0, 1.0, 1.01]  # 1% slower on 19 rows, 5x faster on one
    lucky[0, 2] = 0.8
    share = faster_share(lucky, fixed)
    assert share == faster_share(lucky, fixed) and 0.5 < share < 0.9  # seeded; the lucky row is in ~64% of draws
    assert adapts(lucky, fixed, 0.0, 0.0) == (True, share) and adapts(lucky, fixed, 0.9, 0.0) == (False, share)
    with pytest.raises(ValueError, match="the same rows"):
        faster_share(lucky, fixed[:3])
    with pytest.raises(ValueError, match=r"confidence must be in \[0, 1\)"):
        adapts(lucky, fixed, 1.0)
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
        adapts(lucky, fixed, 0.5, -0.1)


def test_metrics_of_choices():
    arrays = hand_made_arrays()
    metrics = evaluate_choices(np.array([1, 0, 2, 1]), arrays)  # the oracle's choices
    assert metrics["accuracy"] == 1.0
    assert metrics["tau_pred"] == metrics["tau_oracle"] == pytest.approx(3.25)
    assert metrics["tau_B"] == pytest.approx(2.5)  # b = 5 for everyone
    assert metrics["tau_best_fixed"] == pytest.approx(2.625) and metrics["best_fixed_b"] == 6
    assert metrics["gap_captured"] == pytest.approx(1.0)
    assert metrics["source/x/tau_pred"] == pytest.approx(3.0)
    assert metrics["T1/tau_oracle"] == pytest.approx(3.5)
    # Uniform cost: throughput is tokens per cycle, here the tau of the choices.
    assert metrics["throughput_pred"] == pytest.approx(3.25)
    fixed = evaluate_choices(np.array([1, 1, 1, 1]), arrays)
    assert fixed["gap_captured"] == pytest.approx(0.0) and fixed["accuracy"] == 0.5


def test_throughput_prices_cycles_with_the_cost():
    """b = 6 costs twice b = 4: the best b by throughput is not the best by tau."""
    arrays = hand_made_arrays(CycleCost({1: {4: 1.0, 6: 2.0}}))  # b = 5 interpolates to 1.5
    arrays.score = "throughput"
    metrics = evaluate_choices(np.array([2, 2, 2, 2]), arrays)
    assert metrics["throughput_pred"] == pytest.approx(2.625 / 2.0)
    # One best fixed b, the one of the highest throughput: b = 4 (2.0 tokens a unit), not b = 6 (the best tau).
    assert metrics["best_fixed_b"] == 4 and metrics["tau_best_fixed"] == pytest.approx(2.0)
    assert "throughput_best_fixed_b" not in metrics
    # Per row argmax of tau / c(b) (rows: 2, 2, 1.25 / 3, 1.33, 1 / 2, 1.33, 2 / 1, 2, 1), ties to the smaller b.
    assert arrays.best_index.tolist() == [0, 0, 0, 1]


def test_choices_over_shapes_are_scored_beside_the_chains():
    """Over shapes, a row's choices are the candidates then the tree budgets: tau, throughput (priced by the curve's
    tree cycles), the best choice per row and the shape oracle; the chains' own metrics do not move."""
    cost = CycleCost({1: {4: 1.0, 6: 1.0}}, trees={1: {16: 2.0, 64: 4.0}}, tree_depth=6)
    arrays = hand_made_arrays(cost)
    arrays.tree_budgets = (16, 64)
    arrays.tree_tau = np.array([[4.0, 5.0], [3.0, 3.0], [9.0, 9.0], [2.0, 2.0]], dtype=np.float32)
    arrays.tree_cycles = np.full((4, 2), 10.0)
    arrays.over_shapes, arrays.score = True, "throughput"
    assert arrays.shapes == 5 and arrays.cycle_cost.tolist() == [1.0, 1.0, 1.0, 2.0, 4.0]
    # Throughput per row (chains at 1, trees at 2 and 4): row 2's tree of 16 (9 / 2) beats its best chain (4).
    assert arrays.best_index.tolist() == [1, 0, 3, 1]
    metrics = evaluate_choices(np.array([1, 0, 3, 1]), arrays)
    assert metrics["accuracy"] == 1.0 and metrics["throughput_pred"] == metrics["throughput_shape_oracle"]
    assert metrics["throughput_pred"] == pytest.approx(180 / 50)  # 30 + 30 + 90 + 30 tokens for 10 + 10 + 20 + 10
    assert metrics["tau_best_fixed"] == evaluate_choices(np.array([1, 0, 2, 1]), hand_made_arrays(cost))["tau_best_fixed"]
    assert metrics["best_tree_nodes"] == 16 and metrics["gap_captured"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="carry no draft trees"):
        LabelArrays(["a"], ["x"], {}, np.ones((1, 1)), np.ones((1, 1)), (4,), 4, over_shapes=True)


def label_rows(n: int = 40, candidates=(2, 3, 4)) -> list[dict]:
    """Synthetic labels in which B* is a function of the top-1 token: learnable."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        top = int(rng.integers(0, 3))
        tau = [2.0, 2.0, 2.0]
        tau[top] = 3.0
        rows.append(
            {
                "prompt_id": f"p{i}",
                "source": "syn",
                "prompt": "",
                "turn": 0,
                "temperature": float(i % 2),
                "train_block_size": 3,
                "candidates": list(candidates),
                "tau": tau,
                "best_block_size": candidates[top],
                "cycles": [10, 10, 10],
                "topk_ids": [top, 5, 6, 7],
                "topk_probs": [0.7, 0.1, 0.1, 0.1],
                "entropy": 1.0,
                "vocab_size": 10,
                "error": None,
            }
        )
    return rows


def test_label_checks_name_what_is_wrong():
    table = rows_to_table(label_rows())
    with pytest.raises(ValueError, match=r"missing columns \['tau'\]"):
        valid_rows(table.drop_columns(["tau"]))
    mixed = label_rows()
    mixed[0]["candidates"] = [2, 3, 5]
    with pytest.raises(ValueError, match="mismatched candidates"):
        valid_rows(rows_to_table(mixed))
    broken = [{**row, "error": "empty prompt", "tau": None} for row in label_rows(3)]
    with pytest.raises(ValueError, match="zero valid rows among 3"):
        valid_rows(rows_to_table(broken))
    some_errors = label_rows(5) + [{**label_rows(1)[0], "prompt_id": "bad", "error": "boom", "tau": None}]
    assert valid_rows(rows_to_table(some_errors)).num_rows == 5


def test_split_by_prompt_is_deterministic_and_keeps_conversations_together():
    rows = label_rows(60) + [{**label_rows(1)[0], "prompt_id": f"mt:1#t{k}"} for k in range(2)]
    table = rows_to_table(rows)
    train, val = split_by_prompt(table, 0.25, seed=3)
    again_train, again_val = split_by_prompt(table, 0.25, seed=3)
    assert train.equals(again_train) and val.equals(again_val)
    assert not set(train["prompt_id"].to_pylist()) & set(val["prompt_id"].to_pylist())
    assert is_validation("mt:1#t0", 0.25, 3) == is_validation("mt:1#t1", 0.25, 3)
    with pytest.raises(ValueError, match="validation share"):
        split_by_prompt(table, 1.0, 0)


def test_objectives():
    logits = torch.tensor([[4.0, 0.0], [0.0, 4.0]])
    tau = torch.tensor([[3.0, 1.0], [1.0, 2.0]])
    best = torch.tensor([0, 1])
    assert predictor_loss(logits, tau, best, "ce") < predictor_loss(-logits, tau, best, "ce")
    assert predictor_loss(logits, tau, best, "expected-tau") < predictor_loss(-logits, tau, best, "expected-tau")
    temperature = torch.tensor([0.0, 1.0])
    good = predictor_loss(logits, tau, best, "normalized-gain", temperature)
    assert good < predictor_loss(-logits, tau, best, "normalized-gain", temperature)
    with pytest.raises(ValueError, match="temperatures"):
        predictor_loss(logits, tau, best, "normalized-gain")
    with pytest.raises(ValueError, match="objective"):
        predictor_loss(logits, tau, best, "hinge")


def test_normalized_gain_weighs_each_temperature_alike():
    """Rows at T = 1 whose tau differ by hundredths pull as hard as T = 0 rows that differ by tokens."""
    tau = torch.tensor([[2.0, 4.0], [3.0, 5.0], [1.20, 1.22], [1.30, 1.32]])
    temperature = torch.tensor([0.0, 0.0, 1.0, 1.0])
    best = torch.tensor([1, 1, 1, 1])

    def row_gradients(objective: str) -> torch.Tensor:
        logits = torch.zeros(4, 2, requires_grad=True)
        predictor_loss(logits, tau, best, objective, temperature).backward()
        return logits.grad.abs().sum(dim=-1)

    plain, normalized = row_gradients("expected-tau"), row_gradients("normalized-gain")
    assert plain[2] < plain[0] / 50
    assert float(normalized[2]) == pytest.approx(float(normalized[0]), rel=1e-4)


@pytest.mark.parametrize("objective", ["ce", "expected-tau", "normalized-gain"])
def test_training_learns_a_learnable_rule(objective):
    arrays = label_arrays(valid_rows(rows_to_table(label_rows(80))))
    model = BlockSizePredictor(PredictorConfig("sparse", arrays.candidates, 10, top_k=4, hidden_size=32, dropout=0.0))
    config = PredictorTrainConfig(epochs=40, batch_size=16, lr=1e-2, objective=objective)
    losses = []
    fit_epochs(
        model,
        make_optimizer(model, config),
        range(config.epochs),
        local_batches(arrays, 16, 0),
        config,
        lambda epoch, loss: losses.append(loss),
    )
    assert losses[-1] < losses[0]
    metrics = evaluate_predictor(model, arrays)
    assert metrics["accuracy"] == 1.0 and metrics["gap_captured"] == pytest.approx(1.0)


def test_training_columns_from_a_numpy_batch():
    table = rows_to_table(label_rows(5))
    batch = {name: np.asarray(table[name].to_pylist(), dtype=object) for name in table.column_names}
    columns = training_columns(batch)
    assert columns["topk_ids"].shape == (5, 4) and columns["score"].shape == (5, 3)
    assert columns["best_index"].tolist() == [r["candidates"].index(r["best_block_size"]) for r in label_rows(5)]
    # The same columns become the same tensors whichever way they come in: one input contract.
    from_rows = PredictorInputs.from_arrays(input_arrays(table.to_pydict(), dense=False))
    from_batch = PredictorInputs.from_arrays(columns)
    assert torch.equal(from_rows.topk_ids, from_batch.topk_ids) and torch.equal(from_rows.entropy, from_batch.entropy)
    # Over shapes: the tree budgets' tau join the candidates'; a tree of tau 5 is every row's best.
    trees = rows_to_table([{**row, "tree_budgets": [8, 16], "tree_tau": [2.5, 5.0], "tree_cycles": [7, 4]} for row in label_rows(5)])
    batch = {name: np.asarray(trees[name].to_pylist(), dtype=object) for name in trees.column_names}
    columns = training_columns(batch, over_shapes=True)
    assert columns["score"].shape == (5, 5) and columns["best_index"].tolist() == [4] * 5


def test_a_drafting_choice_pays_its_prompts_drafter_context_and_autoregression_does_not():
    """Priced with the prompt's drafter context (`CycleCost.prompt_context`), every drafting choice of a row (a chain,
    a tree) costs that much more a request than its cycles, autoregression nothing: a row's best choice moves to
    autoregression where its drafts save less than the context costs, and the scores training reads from a batch
    are the ones the walks price."""
    rows = [
        {**row, "candidates": [1, 2, 4], "tau": [1.0, 1.5, 2.0], "cycles": [20, 14, 10], "prompt_tokens": 10 * (i + 1),
         "samples": 1 + i % 2, "tree_budgets": [8], "tree_tau": [2.5], "tree_cycles": [8]}
        for i, row in enumerate(label_rows(6))
    ]
    table = rows_to_table(rows)
    plain = CycleCost({1: {1: 1.0, 2: 1.1, 4: 1.2}}, trees={1: {8: 1.3}}, tree_depth=4)
    priced = replace(plain, context_pass=1.0, context_token=0.1)
    free, paid = (label_arrays(table, cost=c, score="throughput", over_shapes=True) for c in (plain, priced))
    walks, walks_free = choice_walks(paid), choice_walks(free)
    for i, row in enumerate(rows):
        context = row["samples"] * (1.0 + 0.1 * row["prompt_tokens"])
        assert walks.cost[i].tolist() == pytest.approx((walks_free.cost[i] + [0.0, context, context, context]).tolist())
        assert paid.scores[i] == pytest.approx(walks.tokens[i] / walks.cost[i], rel=1e-6)
    assert paid.scores[:, 0].tolist() == free.scores[:, 0].tolist()  # autoregression pays no context
    assert (paid.best_index == 0).any() and not (free.best_index == 0).any()  # short prompts still draft
    assert paid.best_index[0] != 0 and paid.best_index[-1] == 0
    batch = {name: np.asarray(table[name].to_pylist(), dtype=object) for name in table.column_names}
    columns = training_columns(batch, cost=priced, score="throughput", over_shapes=True)
    assert columns["score"] == pytest.approx(paid.scores) and columns["best_index"].tolist() == paid.best_index.tolist()
    metrics = evaluate_choices(np.zeros(len(rows), dtype=np.int64), paid)  # autoregression chosen for every row
    assert metrics["throughput_pred"] == pytest.approx(metrics["throughput_autoregressive"])
    assert metrics["throughput_shape_oracle"] >= max(metrics["throughput_best_shape"], metrics["throughput_pred"])


@pytest.mark.parametrize("dense", [False, True])
def test_a_live_prefill_gives_the_predictor_the_numbers_its_label_row_stores(dense):
    """A request's decision reads its prefill in torch (`from_prefills`); a label row stores the same prefill as
    lists (`prefill_columns`): both are the same tensors, so a predictor decides live as it was scored offline."""
    generator = torch.Generator().manual_seed(3)
    prefills = [
        PrefillState(torch.randn(40, generator=generator) * 4, torch.arange(5), temperature, 4)
        for temperature in (0.0, 0.7, 1.0)
    ]
    live = PredictorInputs.from_prefills(prefills, top_k=6, dense=dense)
    rows = [prefill_columns(prefill, 6, dense) for prefill in prefills]
    stored = PredictorInputs.from_arrays(input_arrays({name: [row[name] for row in rows] for name in rows[0]}, dense))
    for name in ("topk_ids", "topk_probs", "entropy", "temperature", "probs"):
        expected, got = getattr(stored, name), getattr(live, name)
        assert (got is None) == (expected is None) and (got is None or torch.equal(got, expected)), name
    assert live.topk_ids.dtype == torch.long and live.topk_probs.dtype == torch.float32


# ----------------------------------------------------------------------------- as an MLflow model


def test_the_champion_is_crowned_only_against_figures_that_compare(tmp_path, monkeypatch):
    import mlflow

    from blockpilot.tracking import champion_context, log_predictor_model, start_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    folder = BlockSizePredictor(PredictorConfig("sparse", (2, 3, 4), 10, top_k=4, hidden_size=8)).save(tmp_path / "p")
    heldout = rows_to_table(label_rows(6))
    other_set = rows_to_table(label_rows(8))
    priced = CycleCost({1: {2: 1.0, 4: 2.0}})

    def context(cost=priced, batch=1, evaluation=heldout, target="t"):
        return champion_context(cost=cost, batch=batch, evaluation=evaluation, target_id=target, drafter_id="d")

    assert context(evaluation=None) is None, "no held-out set: nothing to compare"
    assert context() == context() and context()["unit"] == "tokens per s"
    assert context(cost=CycleCost.uniform())["unit"] == "tokens per cycle"

    def register(throughput, ctx):
        with start_run("blockpilot-predictor", "test") as tracker:
            return log_predictor_model(tracker, folder, heldout_throughput=throughput, context=ctx)

    assert register(5.0, None) == ("1", False), "a figure on training labels crowns nothing"
    assert register(2.0, context()) == ("2", True)
    # Higher figures in another context do not compare with the champion's: registered, never crowned.
    for incomparable in (
        context(cost=CycleCost.uniform()),
        context(batch=32),
        context(evaluation=other_set),
        context(target="another target"),
    ):
        assert register(100.0, incomparable)[1] is False
    assert register(1.0, context()) == ("7", False)
    assert register(3.0, context()) == ("8", True)
    champion = mlflow.MlflowClient().get_model_version_by_alias("blockpilot-predictor", "champion")
    assert str(champion.version) == "8"
    # A race lost: a worse run's late write moved the alias back to version 7 after 8 was crowned. The next run to
    # register (worse than 8 too) crowns the best registered version, 8, not itself.
    mlflow.MlflowClient().set_registered_model_alias("blockpilot-predictor", "champion", "7")
    assert register(2.5, context()) == ("9", False)
    champion = mlflow.MlflowClient().get_model_version_by_alias("blockpilot-predictor", "champion")
    assert str(champion.version) == "8"


def test_the_latest_comparison_is_the_newest_parent_that_nests_runs(tmp_path, monkeypatch):
    import time

    from blockpilot.predictor.evaluation import comparison_figure
    from blockpilot.tracking import PARENT_RUN_TAG, latest_comparison, parent_run, start_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert latest_comparison("blockpilot-predictor") is None  # no experiment yet

    def compare(names: tuple[str, ...]) -> str:
        parent = parent_run("blockpilot-predictor", "predictors")
        for tau, name in enumerate(names, start=2):
            with start_run("blockpilot-predictor", tags={PARENT_RUN_TAG: parent, "configuration": name}) as run:
                run.log_metrics({"eval/tau_pred": tau, "live/T0/tokens_per_s": 10.0 * tau})
            time.sleep(0.01)  # runs are ordered by their start time, in milliseconds
        return parent

    older = compare(("old",))
    newer = compare(("project", "paper"))
    parent_run("blockpilot-predictor", "predictors, nothing nested yet")
    with start_run("blockpilot-predictor", "a run on its own"):
        pass
    comparison = latest_comparison("blockpilot-predictor")
    assert comparison.parent_id == newer != older
    assert list(comparison.runs) == ["project", "paper"]  # in the order they were trained
    assert comparison.runs["paper"].under("eval/") == {"tau_pred": 3.0}
    assert comparison.runs["paper"].under("live/") == {"T0/tokens_per_s": 30.0}
    assert comparison_figure({name: run.under("eval/") for name, run in comparison.runs.items()}) is not None
    with pytest.raises(ValueError, match="no predictors"):
        comparison_figure({})


def test_registered_model_round_trip(tmp_path, monkeypatch):
    import mlflow

    from blockpilot.tracking import log_predictor_model, start_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    model = BlockSizePredictor(PredictorConfig("sparse", (2, 3, 4), 10, top_k=4, hidden_size=8))
    folder = model.save(tmp_path / "run-7")  # MLflow names the artifact's folder after it, not "predictor"
    context = {"unit": "tokens per s", "cost": "c1", "batch": "1", "evaluation": "e1", "target_id": "t", "drafter_id": "d"}
    versions = []
    for throughput in (2.0, 1.5, 2.5):
        with start_run("blockpilot-predictor", "test") as tracker:
            versions.append(log_predictor_model(tracker, folder, heldout_throughput=throughput, context=context))
    # The champion alias moves only to a version that beats it on held-out modeled throughput in the same context.
    assert versions == [("1", True), ("2", False), ("3", True)]
    assert str(mlflow.MlflowClient().get_model_version_by_alias("blockpilot-predictor", "champion").version) == "3"
    inputs = random_inputs(3, 10, k=4)
    assert load_predictor("models:/blockpilot-predictor@champion").predict(inputs) == model.predict(inputs)
    loaded = load_predictor("models:/blockpilot-predictor/2")
    assert loaded.predict(inputs) == model.predict(inputs)
    # An alias and `latest` load the version they name now, from that version's one kept download.
    from blockpilot.predictor.store import resolve_predictor_dir

    monkeypatch.setenv("BLOCKPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "no-temporary-downloads"))
    third = resolve_predictor_dir("models:/blockpilot-predictor/3")
    assert resolve_predictor_dir("models:/blockpilot-predictor@champion") == third
    assert resolve_predictor_dir("models:/blockpilot-predictor/latest") == third
    assert third.is_relative_to(tmp_path / "home") and third != resolve_predictor_dir("models:/blockpilot-predictor/1")
    mlflow.MlflowClient().set_registered_model_alias("blockpilot-predictor", "champion", "1")
    assert resolve_predictor_dir("models:/blockpilot-predictor@champion") == resolve_predictor_dir("models:/blockpilot-predictor/1")
    with pytest.raises(FileNotFoundError, match="could not fetch"):
        load_predictor("models:/blockpilot-predictor@nobody")
    # MLflow's own loader runs the models-from-code script: the pyfunc predicts block sizes.
    pyfunc = mlflow.pyfunc.load_model("models:/blockpilot-predictor/1")
    import pandas as pd

    frame = pd.DataFrame({name: getattr(inputs, name).tolist() for name in INPUT_COLUMNS})
    assert list(pyfunc.predict(frame)) == model.predict(inputs)
    with pytest.raises(FileNotFoundError, match="could not fetch"):
        load_predictor("models:/blockpilot-predictor/99")
