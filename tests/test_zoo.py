"""The local model zoo: corpus, tokenizer, the drafter's training recipe, and the tiny zoo built here."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockpilot.cli import main
from blockpilot.models.drafter import DFlashDrafter
from blockpilot.models.drafter_training import DrafterObjective, drafter_hidden, loss_weights, sample_drafter_batch
from blockpilot.zoo.build import RECIPES, build_zoo, ends_in_loop, summarize_tau, zoo_cache_dir
from blockpilot.zoo.corpus import Corpus, CorpusSpec, split_files, stdlib_sources
from blockpilot.zoo.random_models import ModelShape, drafter_for, random_target
from blockpilot.zoo.tokenizer import train_byte_level_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "Count from 1 to 10.", "1 2 3 4 5 6 7 8 9 10"] * 50


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    tokenizer = train_byte_level_tokenizer(TEXTS, vocab_size=300)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["def add(a, b):\n    return a + b", "  leading spaces", "ünïcödé ✓ 日本", "tabs\tand\nnewlines\n"]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == text
    assert 260 < len(loaded) <= 300  # merges stop early when the corpus runs out of frequent pairs
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert loaded.decode(ids) == chat
    assert (loaded.eos_token, loaded.pad_token, loaded.mask_token) == ("<|im_end|>", "<|endoftext|>", "<|MASK|>")
    assert loaded.convert_tokens_to_ids("<|MASK|>") == loaded.mask_token_id
    # Special tokens are atomic: the mask token text encodes to its one id.
    assert loaded("<|MASK|>", add_special_tokens=False)["input_ids"] == [loaded.mask_token_id]


def test_corpus_is_deterministic_from_the_seed():
    spec = CorpusSpec({"code": 1.0, "count": 1.0, "copy": 1.0, "markov": 1.0})

    def draw(seed):
        corpus = Corpus(spec, seed)
        return corpus.draw("heldout", 30, "prompts"), corpus.draw("train", 60, "prompts")

    first, again, other = draw(1), draw(1), draw(2)
    assert first == again
    assert first != other


def test_heldout_prompts_never_appear_in_train():
    corpus = Corpus(CorpusSpec({"count": 1.0, "sort": 1.0, "arithmetic": 1.0}), seed=0)
    heldout = corpus.draw("heldout", 200, "prompts")
    train = corpus.draw("train", 2000, "lm")
    assert not {e.prompt for e in heldout} & {e.prompt for e in train}
    assert len({e.id for e in train}) == len(train)
    with pytest.raises(RuntimeError, match="held-out split first"):
        Corpus(CorpusSpec({"count": 1.0}), seed=0).draw("train", 5, "lm")


def test_code_is_split_by_file():
    files = stdlib_sources()
    train, heldout = split_files(files, seed=0)
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == len(files)
    assert split_files(files, seed=0) == (train, heldout)


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError, match="unknown task families"):
        CorpusSpec({"poetry": 1.0})


def test_loss_weights():
    weights = loss_weights(16, gamma=7)
    assert weights.shape == (15,)
    assert weights[0] == 1.0
    torch.testing.assert_close(weights, torch.exp(-torch.arange(15.0) / 7))
    assert torch.all(weights[1:] < weights[:-1])
    torch.testing.assert_close(loss_weights(8, gamma=4)[3], torch.tensor(float(torch.exp(torch.tensor(-3 / 4)))))


@pytest.fixture(scope="module")
def small_pair():
    shape = ModelShape(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        block_size=4,
        init_std=0.2,
    )
    target = random_target(40, shape, seed=0)
    return target, drafter_for(target, shape, mask_token_id=39, seed=1)


def _batch(target, drafter, rows, seed=0):
    rng = random.Random(seed)
    ids = [torch.randint(0, 38, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 15)]
    with torch.no_grad():
        feats = [
            torch.cat(
                [
                    h[0]
                    for h in (
                        target(i[None], output_hidden_states=True).hidden_states[k + 1]
                        for k in drafter.target_layer_ids
                    )
                ],
                -1,
            )
            for i in ids
        ]
    return sample_drafter_batch(ids, feats, [4, 5], rows, 3, drafter.block_size, rng)


def test_blocks_are_blind_to_each_other(small_pair):
    """A block's hidden states are the same alone or batched with blocks of its own and other sequences."""
    target, drafter = small_pair
    batch = _batch(target, drafter, [0, 1])
    embed = target.get_input_embeddings()
    with torch.no_grad():
        together = drafter_hidden(drafter, embed, batch, drafter.mask_token_id)
        for index in range(batch.anchors.shape[0]):
            alone = type(batch)(
                features=batch.features[batch.sequence_index[index]][None],
                first_tokens=batch.first_tokens[index : index + 1],
                anchors=batch.anchors[index : index + 1],
                labels=batch.labels[index : index + 1],
                sequence_index=torch.tensor([0]),
            )
            single = drafter_hidden(drafter, embed, alone, drafter.mask_token_id)
            torch.testing.assert_close(single[0], together[index], rtol=1e-5, atol=1e-5)


def test_a_block_never_sees_its_own_anchor_feature(small_pair):
    """Changing the context feature at the anchor (or later) leaves the block's drafts unchanged."""
    target, drafter = small_pair
    batch = _batch(target, drafter, [1])
    anchor, owner = int(batch.anchors[0]), int(batch.sequence_index[0])
    embed, mask = target.get_input_embeddings(), drafter.mask_token_id
    with torch.no_grad():
        before = drafter_hidden(drafter, embed, batch, mask)[0]
        batch.features[owner, anchor:] += 5.0
        after = drafter_hidden(drafter, embed, batch, mask)[0]
        torch.testing.assert_close(before, after)
        batch.features[owner, anchor - 1] += 5.0
        assert not torch.allclose(before, drafter_hidden(drafter, embed, batch, mask)[0])


def test_labels_are_the_tokens_after_the_anchor(small_pair):
    target, drafter = small_pair
    batch = _batch(target, drafter, [0, 1])
    ids = [torch.randint(0, 38, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 15)]
    starts = [4, 5]
    for row in range(batch.anchors.shape[0]):
        seq, anchor = ids[int(batch.sequence_index[row])], int(batch.anchors[row])
        assert anchor >= starts[int(batch.sequence_index[row])]
        assert batch.first_tokens[row] == seq[anchor]
        expected = seq[anchor + 1 : anchor + 4].tolist()
        assert batch.labels[row, : len(expected)].tolist() == expected
        assert (batch.labels[row, len(expected) :] == -100).all()
    loss = DrafterObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), 2.0)(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_ends_in_loop():
    assert ends_in_loop([1, 2, 3, 7, 7, 7])
    assert ends_in_loop([5, 1, 2, 1, 2, 1, 2])
    assert not ends_in_loop([1, 2, 3, 4, 5, 6, 7, 8])
    assert not ends_in_loop([1, 1])


def test_the_tau_summary_splits_by_source_and_by_how_generations_end():
    def row(source, taus, stopped):
        tau = dict(zip((1, 2, 3, 4), taus, strict=True))
        return {"id": source, "source": source, "tau": tau, "loops": False, "stopped": stopped}

    rows = [
        row("sort", (1.0, 1.6, 1.2, 1.2), True),
        row("sort", (1.0, 1.4, 1.2, 1.0), True),
        row("count", (1.0, 2.0, 3.0, 3.0), False),
    ]
    summary = summarize_tau(rows, [1, 2, 3, 4], block=2)
    sort, count = summary["by_source"]["sort"], summary["by_source"]["count"]
    assert sort["tau_by_block_size"] == {"1": 1.0, "2": 1.5, "3": 1.2, "4": 1.1}
    assert (sort["prompts"], sort["peak_block_size"]) == (2, 2)
    assert (count["prompts"], count["peak_block_size"]) == (1, 3)
    assert (sort["budget_share"], count["budget_share"]) == (0.0, 1.0)
    assert summary["budget_share"] == pytest.approx(1 / 3)
    stopped, budget = summary["by_ending"]["stopped"], summary["by_ending"]["budget"]
    assert (stopped["prompts"], stopped["tau_by_block_size"]) == (2, sort["tau_by_block_size"])
    assert (budget["prompts"], budget["tau_by_block_size"]) == (1, count["tau_by_block_size"])
    assert summary["tau_by_block_size"]["3"] == pytest.approx((1.2 + 1.2 + 3.0) / 3, abs=1e-4)
    assert (summary["prompts"], summary["peak_block_size"]) == (3, 3)
    assert summary["tau_at_B"] == pytest.approx(5.0 / 3, abs=1e-4)

    none_ran_on = summarize_tau([{**r, "stopped": True} for r in rows], [1, 2, 3, 4], block=2)["by_ending"]["budget"]
    assert none_ran_on["prompts"] == 0 and none_ran_on["peak_block_size"] is None


# ----------------------------------------------------------------------------- the tiny zoo built here


def test_tiny_zoo_learned_something(tiny_zoo):
    info = json.loads((tiny_zoo / "zoo.json").read_text())
    assert info["size"] == "tiny" and info["block_size"] == 4
    evaluation = info["evaluation"]
    assert evaluation["tau_at_B"] > 1.3
    assert set(evaluation["tau_by_block_size"]) == {str(b) for b in range(1, 9)}
    assert sum(evaluation["best_block_size_histogram"].values()) == evaluation["prompts"]
    assert info["final_loss"]["target"] < info["losses"]["target"][0]
    assert info["final_loss"]["drafter"] < info["losses"]["drafter"][0]
    heldout = [json.loads(line) for line in (tiny_zoo / "prompts" / "heldout.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (tiny_zoo / "prompts" / "train.jsonl").read_text().splitlines()]
    assert set(heldout[0]) == {"id", "source", "prompt"}
    assert not {r["prompt"] for r in heldout} & {r["prompt"] for r in train}
    assert len({r["id"] for r in heldout + train}) == len(heldout) + len(train)


def test_zoo_evaluate_refuses_another_recipe_and_a_folder_that_is_no_zoo(tiny_zoo, tmp_path, capsys):
    info = json.loads((tiny_zoo / "zoo.json").read_text())
    info["recipe"]["response_tokens"] += 1
    (tmp_path / "zoo.json").write_text(json.dumps(info))
    assert main(["zoo", "evaluate", "--zoo", str(tmp_path)]) == 2
    assert "response_tokens" in capsys.readouterr().err
    assert main(["zoo", "evaluate", "--zoo", str(tmp_path / "elsewhere")]) == 2
    assert "no zoo.json" in capsys.readouterr().err


def test_the_saved_zoo_is_the_model_that_was_trained(tiny_zoo, tiny_zoo_trained):
    """The target and drafter read back from disk are bit-identical to the ones training left in memory."""
    if tiny_zoo_trained is None:
        pytest.skip("the tiny zoo came from a kept BLOCKPILOT_TEST_HOME: nothing was trained in this session")
    target = AutoModelForCausalLM.from_pretrained(tiny_zoo / "target")
    drafter = DFlashDrafter.from_pretrained(tiny_zoo / "drafter")
    for saved, trained in ((target.state_dict(), tiny_zoo_trained["target"]), (drafter.state_dict(), tiny_zoo_trained["drafter"])):
        assert saved.keys() == trained.keys()
        assert all(torch.equal(saved[name], trained[name]) for name in saved)
    tokenizer = AutoTokenizer.from_pretrained(tiny_zoo / "target")
    assert tokenizer.mask_token_id == drafter.mask_token_id


def test_a_second_build_reuses_the_cache(tiny_zoo, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKPILOT_HOME", str(tiny_zoo.parents[1]))  # the home the session's zoo was built in

    class NoTraining:
        def train_target(self, *args):
            raise AssertionError("the cached zoo should have been reused")

        def train_drafter(self, *args):
            raise AssertionError("the cached zoo should have been reused")

    out = build_zoo("tiny", tmp_path / "copy", trainer=NoTraining(), track=False, log=lambda _: None)
    assert (out / "drafter" / "model.safetensors").read_bytes() == (
        tiny_zoo / "drafter" / "model.safetensors"
    ).read_bytes()
    assert zoo_cache_dir(RECIPES["tiny"], 0) == tiny_zoo


def _mean_log_likelihood(target, sequences: list[list[int]], starts: list[int]) -> float:
    """Mean log-probability the target gives each sequence's tokens from its start on."""
    total, count = 0.0, 0
    with torch.no_grad():
        for sequence, start in zip(sequences, starts, strict=True):
            logits = target(input_ids=torch.tensor([sequence])).logits[0, :-1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(sequence[1:])[:, None])[start - 1 :]
            total, count = total + picked.sum().item(), count + picked.numel()
    return total / count


def _untrained_chat_target():
    """(tokenizer, shape, target): a random two-layer target over a small trained tokenizer."""
    tokenizer = train_byte_level_tokenizer(TEXTS, vocab_size=300)
    shape = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    return tokenizer, shape, random_target(len(tokenizer), shape, seed=0, eos_token_id=tokenizer.eos_token_id).eval()


def test_self_distillation_makes_the_target_surer_of_its_own_answers(tmp_path):
    """The stage fine-tunes the target on its own greedy responses: they become likelier. A finished stage is read
    back from disk instead of run again; a recipe without it leaves the target as it is."""
    from blockpilot.zoo.build import ZooBuild, chat_ids, greedy_responses
    from blockpilot.zoo.corpus import Example
    from blockpilot.zoo.training import Schedule

    tokenizer, shape, target = _untrained_chat_target()
    corpus = {"lm": [Example(f"lm-{i}", "count", f"Count from {i} to {i + 9}.", "") for i in range(40)]}
    recipe = dataclasses.replace(
        RECIPES["tiny"],
        self_distill_schedule=Schedule(steps=12, batch_size=8, lr=1e-2, warmup_steps=1, log_every=4),
        self_distill_prompts=16,
        response_tokens=10,
    )
    prompts = [chat_ids(tokenizer, e.prompt) for e in corpus["lm"][:16]]
    responses = greedy_responses(target, tokenizer, prompts, recipe.response_tokens)
    sequences, starts = [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts]
    before = _mean_log_likelihood(target, sequences, starts)

    from blockpilot.zoo.build import LocalTrainer

    build = ZooBuild(recipe, 0, tmp_path, torch.device("cpu"), log=lambda _: None)
    tuned = build.self_distill_stage(target, tokenizer, corpus, LocalTrainer())
    assert _mean_log_likelihood(tuned, sequences, starts) > before + 0.5
    assert len(build.losses["self_distill"]) == 3

    class NoTraining:
        def train_target(self, *args):
            raise AssertionError("the finished stage should have been read back")

    again = ZooBuild(recipe, 0, tmp_path, torch.device("cpu"), log=lambda _: None)
    reloaded = again.self_distill_stage(random_target(len(tokenizer), shape, seed=1), tokenizer, corpus, NoTraining())
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), tuned.state_dict().values()))
    assert again.losses["self_distill"] == build.losses["self_distill"]

    plain = ZooBuild(RECIPES["tiny"], 0, tmp_path / "plain", torch.device("cpu"), log=lambda _: None)
    assert plain.self_distill_stage(target, tokenizer, corpus, NoTraining()) is target
    assert not (tmp_path / "plain").exists()


def test_self_distillation_tunes_on_every_response_but_empty_ones(tmp_path, monkeypatch):
    """Looping responses stay (leaving them out moved no tau: docs/log.md, "The zoo"); empty ones are left out."""
    import blockpilot.zoo.build as build_module
    from blockpilot.zoo.corpus import Example
    from blockpilot.zoo.training import Schedule

    tokenizer, _, target = _untrained_chat_target()
    corpus = {"lm": [Example(f"lm-{i}", "count", f"Count from {i} to {i + 9}.", "") for i in range(4)]}
    ending, looping = [5, 6, 7, 8, tokenizer.eos_token_id], [4, 3, 4, 3, 4, 3, 4, 3]
    monkeypatch.setattr(build_module, "greedy_responses", lambda *args, **kwargs: [ending, looping, [9, 9, 9], []])

    class Capture:
        def train_target(self, target, fit):
            self.responses = [list(s[start:]) for s, start in zip(fit.sequences, fit.loss_from, strict=True)]
            return [0.0]

    schedule = Schedule(steps=1, batch_size=2, lr=1e-3, warmup_steps=0)
    recipe = dataclasses.replace(RECIPES["tiny"], self_distill_schedule=schedule, self_distill_prompts=4)
    trainer = Capture()
    build = build_module.ZooBuild(recipe, 0, tmp_path, torch.device("cpu"), log=lambda _: None)
    build.self_distill_stage(target, tokenizer, corpus, trainer)
    assert trainer.responses == [ending, looping, [9, 9, 9]]


def test_unknown_size():
    with pytest.raises(ValueError, match="unknown zoo size 'huge'"):
        build_zoo("huge")


@pytest.mark.slow
def test_ray_train_target_learns_the_responses_only_as_the_local_trainer(local_ray):
    """The Ray trainer runs the same recipe as the local one: same losses, prompt tokens left out of the loss."""
    from blockpilot.zoo.build import LocalTrainer
    from blockpilot.zoo.training import Schedule, TargetFit
    from pipelines.zoo_trainer import RayTrainer

    shape = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    rng = random.Random(0)
    sequences = [[rng.randrange(1, 40) for _ in range(rng.randrange(12, 30))] for _ in range(24)]
    loss_from = [len(s) // 2 for s in sequences]
    schedule = Schedule(steps=6, batch_size=4, lr=1e-2, warmup_steps=1, log_every=3)

    def losses(trainer, cuts):
        target = random_target(40, shape, seed=0)
        return trainer.train_target(target, TargetFit(sequences, cuts, 0, schedule, 0))

    local = losses(LocalTrainer(), loss_from)
    assert local != pytest.approx(losses(LocalTrainer(), [0] * len(sequences)), rel=1e-3)
    assert losses(RayTrainer(num_workers=1), loss_from) == pytest.approx(local, rel=1e-3)
