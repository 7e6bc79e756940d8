"""The README's commands that need no Ray, run as a user types them (subprocesses, tiny and random zoos, small
limits): `zoo random`, `zoo build`, `zoo evaluate`, `calibrate` (plain and draft-then-trim), `calibrate-trim`,
and `generate` with each policy family that needs no trained model. `test_commands_on_ray.py` has the rest."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from commands import EMBEDDED_UNACTIONABLE, PROMPT, ROOT, run, user_env
from support import greedy_reference

from blockpilot.cli import main
from blockpilot.cost import CycleCost
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.decoding.engine import Engine

pytestmark = pytest.mark.slow

# As an install without the `ray` and `mlflow` extras (the lent GPU machine has neither): those packages do not import.
WITHOUT_EXTRAS = """import importlib.abc, sys


class MissingExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {"ray", "fastapi", "starlette", "mlflow"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, MissingExtras())
"""


def test_zoo_random_build_and_evaluate(tiny_zoo, tmp_path):
    """`zoo build` reuses the suite's cached tiny zoo (same recipe and seed, its home) and copies it out;
    `zoo evaluate` on the copy gives the build's own tau tables again."""
    env = user_env(tiny_zoo.parents[1])
    printed = run(f"blockpilot zoo random --out {tmp_path / 'rz'}", env)
    assert (tmp_path / "rz" / "target" / "tokenizer.json").is_file() and "drafter:" in printed

    zoo = tmp_path / "zoo"
    printed = run(f"blockpilot zoo build --size tiny --out {zoo}", env)
    assert "reusing" in printed and (zoo / "drafter" / "model.safetensors").is_file()

    evaluation = tmp_path / "evaluation.json"
    printed = run(f"blockpilot zoo evaluate --zoo {zoo} --out {evaluation}", env)
    again, built = json.loads(evaluation.read_text()), json.loads((zoo / "zoo.json").read_text())["evaluation"]
    assert again["tau_by_block_size"] == built["tau_by_block_size"]
    assert again["T1"]["tau_by_block_size"] == built["T1"]["tau_by_block_size"]
    assert sum(group["prompts"] for group in again["by_ending"].values()) == again["prompts"]
    assert all(f"  {source} " in printed for source in again["by_source"])
    assert "ends: stopped" in printed and "ends: budget" in printed


def test_calibrate_then_generate_with_every_policy_family_that_needs_no_training(
    tiny_zoo, tiny_models, tmp_path, capsys, monkeypatch
):
    env = user_env(tmp_path / "home")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(WITHOUT_EXTRAS)
    without_extras = user_env(tmp_path / "home", PYTHONPATH=str(tmp_path / "site"))
    models = f"--target {tiny_zoo / 'target'} --drafter {tiny_zoo / 'drafter'}"
    # Compiled, as the README's: a shape each (~16 s), so two, one built by a second process meanwhile (the cycles
    # that also compute a per-step model's choice are compiled in test_step_policy.py).
    small = "--block-sizes 1,4 --repeats 1 --cycles 2 --no-step-decision"
    printed = run(f"blockpilot calibrate {models} {small} --out {tmp_path / 'cost.json'}", env)
    assert json.loads((tmp_path / "cost.json").read_text())["seconds"]["1"].keys() == {"1", "4"}
    assert "b=4" in printed and "a second process builds 1 of 2" in printed and "second process failed" not in printed
    # The other forms in process (a subprocess costs about 8 s of imports here).
    static = f"calibrate {models} --block-sizes 1,3,4 --repeats 1 --cycles 2 --tree-nodes 4,8 --compile off"
    assert main(shlex.split(f"{static} --out {tmp_path / 'cost-static.json'}")) == 0
    printed = capsys.readouterr().out
    curve = json.loads((tmp_path / "cost-static.json").read_text())
    assert curve["seconds"]["1"].keys() == {"1", "3", "4"} and curve["trees"]["1"].keys() == {"4", "8"}
    assert curve["seconds"]["1"]["3"] == curve["seconds"]["1"]["4"]  # both run the width-4 cycle
    assert curve["tree_depth"] == 4 and "trees 4 deep: 4 nodes" in printed

    prompt_ids = tiny_models.encode_prompt(PROMPT)
    greedy = greedy_reference(tiny_models.target, prompt_ids, 24, tiny_models.stop_token_ids())
    generate = f"generate {models} --prompt '{PROMPT}' --max-new-tokens 24"
    # The command where Ray and MLflow are not installed (eager: what is checked is that it runs without the extras;
    # compiled as a user types it below); the other policies through the same entry point in process (a subprocess
    # costs about 8 s of imports here).
    command = f"python -m blockpilot {generate} --policy autoregressive --compile off --json"
    payload = json.loads(run(command, without_extras))
    assert payload["token_ids"] == greedy and payload["policy"] == "autoregressive"  # at T = 0 every policy: greedy
    for flags, policy in [
        ("--policy fixed:3", "fixed"),
        ("--policy entropy", "entropy"),
        ("--policy tree:8:6", "tree"),  # 6 deep: past the tiny drafter's B = 4
    ]:
        assert main(shlex.split(f"{generate} {flags} --compile off --json")) == 0
        payload = json.loads(capsys.readouterr().out)
        assert payload["token_ids"] == greedy and payload["policy"] == policy and payload["compile"] == "off", flags
    monkeypatch.setitem(sys.modules, "pipelines.serve", None)  # as without Ray Serve: `serve` says what to install
    assert main(shlex.split(f"serve {models}")) == 2
    assert "pip install 'blockpilot[ray]'" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(shlex.split(f"{generate} --policy entropy --temperature 0.8 --verify rejection --compile off")) == 0
    printed = capsys.readouterr().out
    assert "mean tau:" in printed and "block size:" in printed
    assert main(shlex.split(f"{generate} --compile off --temperature 0.8 --seed 3")) == 0
    printed = capsys.readouterr().out
    assert "engine (off): " in printed and "mean tau:" in printed
    # The command as a user types it, compiled by default (inductor, about 20 s here): the same sampled tokens as the
    # eager cycle for the seed, which are the autoregressive sample of the seed whatever the policy (so an in-process
    # run stands for the eager one), here from the distributions cut to the top 4 tokens and 0.9 of their mass (the
    # sort compiled in the cycle).
    compiled = json.loads(  # its steps replayed, not through dynamo each call (`compiled_replay`)
        run(
            f"blockpilot {generate} --policy fixed:3 --temperature 0.8 --top-k 4 --top-p 0.9 --seed 3 --json",
            env,
            noise=(*EMBEDDED_UNACTIONABLE, "cannot be replayed"),
        )
    )
    sampled = GenerationConfig(
        max_new_tokens=24,
        temperature=0.8,
        seed=3,
        stop_token_ids=tuple(tiny_models.stop_token_ids()),
        top_k=4,
        top_p=0.9,
    )
    (eager,) = generate_many(
        tiny_models, [GenerationRequest(prompt_ids, sampled, None)], engine=Engine(tiny_models)
    )
    assert compiled["token_ids"] == eager.token_ids and compiled["compile_seconds"] > 0
    assert compiled["compile"] == "compile" and compiled["policy"] == "fixed"  # what --compile auto is on a CPU


def test_the_gpu_cycle_benchmark_runs_on_a_small_shape(tmp_path):
    """`benchmarks/bench_cycle.py` (kept ready for a lent GPU) end to end on the CPU, eager, at a tiny shape of its
    Llama 3.1 preset (a llama3 RoPE, untied): a script that breaks would waste the rare minutes of a GPU lease."""
    config = json.loads((ROOT / "tests" / "fixtures" / "zlab_qwen3_4b_dflash_b16_config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        num_target_layers=4,
        vocab_size=512,
        layer_types=["full_attention"] * 2,
        dflash_config={"mask_token_id": 500, "target_layer_ids": [0, 2]},
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "results.json"
    printed = run(
        f"python benchmarks/bench_cycle.py --shape llama-3.1-8b --drafter-config {tmp_path / 'config.json'} "
        "--device cpu --batches 1,2 "
        f"--widths 1,4 --modes off --tree-nodes 8 --tree-points 2x6 --tree-parts --capacity 128 --cycles 2 --hf-steps 2 "
        "--engine-widths 4 "
        f"--out {out} --cost-out {tmp_path / 'cost.json'}",
        user_env(tmp_path / "home"),
    )
    results = json.loads(out.read_text())
    assert set(results["static_cycle_s"]["off"]) == {"1", "4"} and results["floor_s"] > 0
    cost = CycleCost.load(tmp_path / "cost.json")  # the grid, as eval_packed_load prices a load curve from it
    assert set(cost.seconds) == {1, 2} and all(set(by_b) == {1, 4} for by_b in cost.seconds.values())
    assert cost.measured[2][4] == results["static_cycle_s"]["off"]["4"]["2"] and "llama" in cost.device
    assert results["family"] == "llama" and "random llama" in printed
    assert "static cycle" in printed and "tree verify" in printed and "2x6" in results["tree_cycle_s"]["off"]
    grow, verify = results["tree_parts_s"]["off"]["2x6"]
    assert grow > 0 and verify > 0 and "as two steps: the drafter's pass and the trees' growth" in printed
    assert "failed" not in printed and "skipped" not in printed


def test_the_tree_benchmark_runs_on_the_tiny_zoo(tiny_zoo, tmp_path):
    """`benchmarks/bench_trees.py` end to end, eager and short: chains and trees, with its summary."""
    printed = run(
        f"python benchmarks/bench_trees.py --zoo {tiny_zoo} --prompts 2 --max-new-tokens 8 --budgets 4,8 --widths 3 "
        "--temperatures 0 --compile off --repeats 1",
        user_env(tmp_path / "home"),
    )
    assert "chain b = 3" in printed and "tree:8 (depth 4)" in printed
    assert "T = 0: tau, best tree" in printed
    assert "T = 0: tree:4 (depth 4): a cycle" in printed and "were it to cost the chain's" in printed
