"""The main job on embedded defaults: make tiny random models, then generate with them."""

from __future__ import annotations

from pathlib import Path

from blockpilot.home import blockpilot_home


def run_demo(home: Path | None = None) -> int:
    from blockpilot.cli import format_stats
    from blockpilot.decoding import EntropyHeuristic, FixedBlockSize, GenerationConfig, generate
    from blockpilot.models import load_models
    from blockpilot.zoo.random_models import write_random_zoo

    home = Path(home) if home is not None else blockpilot_home()
    zoo_dir = home / "demo" / "random-zoo"
    if not (zoo_dir / "drafter" / "config.json").is_file():
        print(f"[demo] writing random tiny models to {zoo_dir}")
        write_random_zoo(zoo_dir)
    else:
        print(f"[demo] reusing random tiny models in {zoo_dir}")
    models = load_models(zoo_dir / "target", zoo_dir / "drafter")
    prompt = "Count from one to ten."
    prompt_ids = models.encode_prompt(prompt)
    config = GenerationConfig(max_new_tokens=48, stop_token_ids=tuple(models.stop_token_ids()), seed=0)
    policies = {
        "autoregressive": None,
        f"fixed b={models.train_block_size}": FixedBlockSize(models.train_block_size),
        "entropy heuristic": EntropyHeuristic.around(models.train_block_size),
    }
    print(f"[demo] prompt: {prompt!r} ({len(prompt_ids)} tokens); random weights, so expect tau near 1")
    for name, policy in policies.items():
        run_models = models if policy is not None else _without_drafter(models)
        result = generate(run_models, prompt_ids, policy=policy, config=config)
        print(f"\n=== {name}")
        print(format_stats(result))
    return 0


def _without_drafter(models):
    from dataclasses import replace

    return replace(models, drafter=None, mask_token_id=None)
