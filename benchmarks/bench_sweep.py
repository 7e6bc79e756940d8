"""Sweep throughput: prompts/s of the live sweep (one generation per block size) and of the acceptance-table
sweep (one reference generation, then every block size walked on its table), on the same prompts.

    python benchmarks/bench_sweep.py --zoo ZOO [--prompts 40] [--batch 8]  # ZOO from `blockpilot zoo build --out ZOO`

Runs both modes with the 5 candidates B-2..B+2 and with the BlockPilot code's 9 ({1,2,4,8,14..18}), in this
process (no Ray: this measures the sweep itself), `--batch` prompts per engine, and prints prompts/s, the
table/live ratio, how many prompts gave identical tau vectors (all of them, at T = 0), and the table sweep's seconds
split between its two stages: the reference generations and the tables. The ratio cannot pass the live seconds
over the reference seconds, however fast the tables.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from blockpilot.blocks import candidates_around
from blockpilot.data.sources import prompt_texts
from blockpilot.models import load_models
from blockpilot.sweep import SweepConfig, sweep_prompts

BLOCKPILOT_CANDIDATES = (1, 2, 4, 8, 14, 15, 16, 17, 18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True)
    parser.add_argument("--split", default="train", choices=("train", "heldout"))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=1, help="prompts per engine (batched generations)")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.zoo / "target", args.zoo / "drafter", device=args.device)
    prompts = [models.encode_prompt(text) for text in prompt_texts(f"zoo:{args.zoo}:{args.split}", limit=args.prompts)]
    stop = tuple(models.stop_token_ids())
    print(
        f"device={models.device} threads={torch.get_num_threads()} prompts={len(prompts)} "
        f"max_new_tokens={args.max_new_tokens} T={args.temperature} B={models.train_block_size} batch={args.batch}"
    )
    print(
        f"{'candidates':<34} {'live p/s':>9} {'table p/s':>11} {'ratio':>6} {'same tau':>9} "
        f"{'live s':>8} {'reference s':>12} {'tables s':>9}"
    )
    for candidates in (candidates_around(models.train_block_size), BLOCKPILOT_CANDIDATES):
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
        stages: dict[str, float] = {}
        for config in configs.values():
            sweep_prompts(models, prompts[:1], [0], config, max_batch=1)  # warm-up
        # Modes alternate chunk by chunk (and which goes first), so drift in the machine's speed hits both.
        for index in range(0, len(prompts), args.batch):
            chunk = prompts[index : index + args.batch]
            for mode in ("live", "replay") if (index // args.batch) % 2 == 0 else ("replay", "live"):
                started = time.perf_counter()
                sweeps = sweep_prompts(
                    models, chunk, [0] * len(chunk), configs[mode], max_batch=args.batch, stage_seconds=stages
                )
                seconds[mode] += time.perf_counter() - started
                taus[mode] += [sweep.tau for sweep in sweeps]
        same = sum(a == b for a, b in zip(taus["live"], taus["replay"], strict=True))
        live, replay = len(prompts) / seconds["live"], len(prompts) / seconds["replay"]
        print(
            f"{str(candidates):<34} {live:>9.2f} {replay:>11.2f} {replay / live:>5.2f}x {same:>4}/{len(prompts)} "
            f"{seconds['live']:>8.2f} {stages['reference']:>12.2f} {stages['tables']:>9.2f}"
        )


if __name__ == "__main__":
    main()
