"""Sweep throughput: prompts/s of the live sweep (one generation per block size) and of the acceptance-table
sweep (one reference generation, then every block size walked on its table), on the same prompts.

    python benchmarks/bench_sweep.py --zoo ZOO [--prompts 40] [--batch 8] [--compile compile]

Runs the live sweep, the table sweep, and the table sweep with its reference generations on the static engine
(`--compile`), with the 5 candidates B-2..B+2 and with the BlockPilot code's 9 ({1,2,4,8,14..18}), in this process
(no Ray: this measures the sweep itself), `--batch` prompts per engine, and prints prompts/s, each table sweep's
ratio to the live one, how many prompts gave identical tau vectors in all three (all of them, at T = 0, but for a
near tie the static engine's rounding may flip), and the reference generations' seconds on each engine beside the
tables'. A ratio cannot pass the live seconds over the reference seconds, however fast the tables.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from blockpilot.blocks import candidates_around
from blockpilot.data.sources import prompt_texts
from blockpilot.decoding.compiled import COMPILE_MODES
from blockpilot.decoding.engine import Engine, keep_compiled_kernels
from blockpilot.models import load_models
from blockpilot.sweep import SweepConfig, sweep_prompts

BLOCKPILOT_CANDIDATES = (1, 2, 4, 8, 14, 15, 16, 17, 18)
MODES = ("live", "replay", "static")  # one run per b; the table sweep; its reference generations compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True)
    parser.add_argument("--split", default="train", choices=("train", "heldout"))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=1, help="prompts per engine (batched generations)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="compile", help="the static engine's")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    keep_compiled_kernels()
    models = load_models(args.zoo / "target", args.zoo / "drafter", device=args.device)
    prompts = [models.encode_prompt(text) for text in prompt_texts(f"zoo:{args.zoo}:{args.split}", limit=args.prompts)]
    stop = tuple(models.stop_token_ids())
    print(
        f"device={models.device} threads={torch.get_num_threads()} prompts={len(prompts)} "
        f"max_new_tokens={args.max_new_tokens} T={args.temperature} B={models.train_block_size} batch={args.batch}"
    )
    print(
        f"{'candidates':<34} {'live p/s':>9} {'table p/s':>10} {'static p/s':>11} {'ratio':>6} {'static':>7} "
        f"{'same tau':>9} {'live s':>7} {'ref s':>6} {'static ref s':>13} {'tables s':>9}"
    )
    engine = Engine(models, max_batch=args.batch, compile=args.compile, record=True)
    for candidates in (candidates_around(models.train_block_size), BLOCKPILOT_CANDIDATES):
        configs = {
            mode: SweepConfig(
                candidates,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=stop,
                mode="live" if mode == "live" else "replay",
            )
            for mode in MODES
        }
        engines = {"live": None, "replay": None, "static": engine}
        seconds, taus = dict.fromkeys(MODES, 0.0), {mode: [] for mode in MODES}
        stages: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
        for mode, config in configs.items():  # warm-up (the static engine's compiles)
            sweep_prompts(models, prompts[: args.batch], [0] * len(prompts[: args.batch]), config, max_batch=args.batch, engine=engines[mode])
        # Modes take turns chunk by chunk (and which goes first), so drift in the machine's speed hits them alike.
        for index in range(0, len(prompts), args.batch):
            chunk = prompts[index : index + args.batch]
            turn = (index // args.batch) % len(MODES)
            for mode in MODES[turn:] + MODES[:turn]:
                started = time.perf_counter()
                sweeps = sweep_prompts(
                    models,
                    chunk,
                    [0] * len(chunk),
                    configs[mode],
                    max_batch=args.batch,
                    stage_seconds=stages[mode],
                    engine=engines[mode],
                )
                seconds[mode] += time.perf_counter() - started
                taus[mode] += [sweep.tau for sweep in sweeps]
        same = sum(a == b == c for a, b, c in zip(taus["live"], taus["replay"], taus["static"], strict=True))
        rate = {mode: len(prompts) / seconds[mode] for mode in MODES}
        print(
            f"{str(candidates):<34} {rate['live']:>9.2f} {rate['replay']:>10.2f} {rate['static']:>11.2f} "
            f"{rate['replay'] / rate['live']:>5.2f}x {rate['static'] / rate['live']:>6.2f}x {same:>4}/{len(prompts)} "
            f"{seconds['live']:>7.2f} {stages['replay']['reference']:>6.2f} {stages['static']['reference']:>13.2f} "
            f"{stages['static']['tables']:>9.2f}"
        )


if __name__ == "__main__":
    main()
