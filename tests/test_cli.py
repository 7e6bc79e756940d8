"""The `blockpilot` command: zoo random, generate (text and --json), calibrate, and bad flags."""

from __future__ import annotations

import json

import pytest
from support import greedy_reference

from blockpilot.cli import main


def test_zoo_random_writes_loadable_models(tmp_path, capsys):
    assert main(["zoo", "random", "--out", str(tmp_path / "zoo"), "--seed", "3"]) == 0
    assert (tmp_path / "zoo" / "target" / "config.json").is_file()
    assert (tmp_path / "zoo" / "target" / "tokenizer.json").is_file()
    assert (tmp_path / "zoo" / "drafter" / "model.safetensors").is_file()
    assert "drafter" in capsys.readouterr().out


def test_generate_json_matches_the_library(random_zoo, random_models, capsys):
    argv = [
        "generate",
        "--target",
        str(random_zoo["target"]),
        "--drafter",
        str(random_zoo["drafter"]),
        "--prompt",
        "def add(a, b):",
        "--block-size",
        "4",
        "--max-new-tokens",
        "24",
        "--json",
        "--compile",  # what is checked here is the JSON; the default, compiled, is test_commands_offline.py's
        "off",
    ]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    prompt_ids = random_models.encode_prompt("def add(a, b):")
    expected = greedy_reference(random_models.target, prompt_ids, 24, random_models.stop_token_ids())
    assert payload["token_ids"] == expected
    assert payload["block_size"] == 4
    assert sum(payload["acceptance_lengths"]) == len(payload["token_ids"]) - 1
    assert payload["text"] == random_models.tokenizer.decode(expected, skip_special_tokens=True)
    assert isinstance(payload["tau"], float)


def test_generate_text_output_with_entropy_policy(random_zoo, capsys):
    argv = [
        "generate",
        "--target",
        str(random_zoo["target"]),
        "--drafter",
        str(random_zoo["drafter"]),
        "--prompt",
        "hello",
        "--policy",
        "entropy",
        "--temperature",
        "0.8",
        "--verify",
        "rejection",
        "--max-new-tokens",
        "16",
        "--compile",
        "off",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mean tau:" in out and "block size:" in out


def test_generate_samples_as_the_targets_generation_config_says_unless_told(random_zoo, capsys, tmp_path):
    """Temperature, top-k and top-p the command is not given come from the target's `generation_config.json` (as
    transformers' `generate` reads it), else greedy; a flag wins."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(random_zoo["target"], target)
    (target / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 3, "do_sample": True}))
    base = ["generate", "--target", str(target), "--prompt", "hi", "--max-new-tokens", "4", "--json"]
    base += ["--compile", "off"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] == {"temperature": 0.7, "top_k": 3}
    assert main([*base, "--temperature", "0", "--top-p", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] == {"temperature": 0.0, "top_k": 3, "top_p": 0.5}
    assert main(["generate", "--target", str(random_zoo["target"]), *base[3:]]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] == {"temperature": 0.0}  # no config: greedy


@pytest.mark.parametrize(
    "flags, flag_name",
    [
        (["--block-size", "0"], "--block-size"),
        (["--block-size", "two"], "--block-size"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--top-k", "-1"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--verify", "typical"], "--verify"),
    ],
)
def test_bad_flags_exit_nonzero_naming_the_flag(random_zoo, capsys, flags, flag_name):
    argv = ["generate", "--target", str(random_zoo["target"]), "--prompt", "hi", *flags]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    assert flag_name in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--target", "--drafter"])
def test_missing_paths_exit_nonzero_naming_the_flag(random_zoo, capsys, tmp_path, flag):
    paths = {"--target": str(random_zoo["target"]), "--drafter": str(random_zoo["drafter"])}
    paths[flag] = str(tmp_path / "missing")
    argv = ["generate", "--prompt", "hi", *[x for pair in paths.items() for x in pair]]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert flag in err and "missing" in err


def test_generate_reports_the_resolved_policy_and_rejects_two_policies(random_zoo, capsys):
    base = ["generate", "--target", str(random_zoo["target"]), "--drafter", str(random_zoo["drafter"]), "--prompt", "hi"]
    base += ["--compile", "off"]
    assert main([*base, "--policy", "entropy", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "entropy"
    assert main([*base, "--policy", "entropy", "--block-size", "3"]) == 2
    assert "give one of --policy, --block-size, --predictor" in capsys.readouterr().err
    # The engine verifies chains by either rule, trees by matching; anything else is refused, saying why.
    rejection = [*base, "--temperature", "1", "--verify", "rejection", "--max-new-tokens", "4", "--compile", "off"]
    assert main([*rejection, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compile"] == "off"
    assert main([*rejection, "--policy", "tree:4"]) == 2
    assert "needs chains" in capsys.readouterr().err
    assert main([*base, "--compile", "graph"]) == 2  # CUDA graphs need a GPU
    assert "needs a CUDA device" in capsys.readouterr().err


def test_calibrate_writes_the_fitted_curve_and_prints_every_point(random_zoo, capsys, tmp_path):
    out = tmp_path / "cost.json"
    argv = ["calibrate", "--target", str(random_zoo["target"]), "--drafter", str(random_zoo["drafter"])]
    argv += ["--block-sizes", "1,2,3", "--batch-sizes", "1,2", "--repeats", "1", "--cycles", "1", "--out", str(out)]
    argv += ["--compile", "off"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    cost = json.loads(out.read_text())
    assert set(cost["seconds"]) == set(cost["measured"]) == {"1", "2"}
    for batch in ("1", "2"):
        line = next(line for line in printed if line.startswith(f"batch {batch}: "))
        assert all(f"b={b} {cost['seconds'][batch][b] * 1000:.2f}" in line for b in ("1", "2", "3"))
        assert list(cost["seconds"][batch].values()) == sorted(cost["seconds"][batch].values())
    request = next(line for line in printed if line.startswith("batch 1, beyond a request's cycles"))
    assert f"{cost['flush'] * 1000:.3f}" in request and f"{cost['start_pass'] * 1000:.3f}" in request
    assert cost["context_token"] + cost["context_pass"] > 0 and cost["start_token"] + cost["start_pass"] > 0
