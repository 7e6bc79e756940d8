"""Sweep throughput: prompts/s of the live and the replay sweep on the same prompts.

    python benchmarks/bench_sweep.py --zoo ~/.cache/blockpilot/zoo/small-seed0-v1-py311 [--prompts 40]

Runs both modes with the 5 candidates B-2..B+2 and with the BlockPilot code's 9 ({1,2,4,8,14..18}),
one prompt at a time in this process (no Ray: this measures the sweep itself), and prints prompts/s, the
replay/live ratio, and how many prompts gave identical tau vectors (all of them, at T = 0).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from blockpilot.models import load_models
from blockpilot.sweep import SweepConfig, default_candidates, sweep_prompt

BLOCKPILOT_CANDIDATES = (1, 2, 4, 8, 14, 15, 16, 17, 18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True)
    parser.add_argument("--split", default="train", choices=("train", "heldout"))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.zoo / "target", args.zoo / "drafter", device=args.device)
    rows = [json.loads(line) for line in (args.zoo / "prompts" / f"{args.split}.jsonl").read_text().splitlines()]
    prompts = [models.encode_prompt(row["prompt"]) for row in rows[: args.prompts]]
    stop = tuple(models.stop_token_ids())
    print(
        f"device={models.device} threads={torch.get_num_threads()} prompts={len(prompts)} "
        f"max_new_tokens={args.max_new_tokens} T={args.temperature} B={models.train_block_size}"
    )
    print(f"{'candidates':<34} {'live p/s':>9} {'replay p/s':>11} {'ratio':>6} {'same tau':>9}")
    for candidates in (default_candidates(models.train_block_size), BLOCKPILOT_CANDIDATES):
        configs = {
            mode: SweepConfig(
                candidates,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=stop,
                mode=mode,
            )
            for mode in ("live", "replay")
        }
        seconds, taus = {"live": 0.0, "replay": 0.0}, {"live": [], "replay": []}
        for config in configs.values():
            sweep_prompt(models, prompts[0], config)  # warm-up
        # Modes alternate prompt by prompt (and which goes first), so drift in the machine's speed hits both.
        for index, ids in enumerate(prompts):
            for mode in ("live", "replay") if index % 2 == 0 else ("replay", "live"):
                started = time.perf_counter()
                taus[mode].append(sweep_prompt(models, ids, configs[mode]).tau)
                seconds[mode] += time.perf_counter() - started
        same = sum(a == b for a, b in zip(taus["live"], taus["replay"], strict=True))
        live, replay = len(prompts) / seconds["live"], len(prompts) / seconds["replay"]
        print(f"{str(candidates):<34} {live:>9.2f} {replay:>11.2f} {replay / live:>5.2f}x {same:>4}/{len(prompts)}")


if __name__ == "__main__":
    main()
