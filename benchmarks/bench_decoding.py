"""Decode speed: autoregressive vs fixed block sizes (and the entropy policy), same prompts, same models.

    python benchmarks/bench_decoding.py [--target DIR --drafter DIR] [--device cpu] [--max-new-tokens 128]
    python benchmarks/bench_decoding.py --target $ZOO/target --drafter $ZOO/drafter \
        --prompts $ZOO/prompts/heldout.jsonl --block-sizes 4,6,8 [--predictor DIR_OR_URI]

Without --target/--drafter it writes and uses the random tiny zoo (tau near 1 by construction, so what
this shows there is the cost of a cycle, not a speedup). Prints decode tokens/s, mean tau, and the
speedup over autoregressive decoding, averaged over the prompts after one warm-up pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from blockpilot.decoding import EntropyHeuristic, FixedBlockSize, GenerationConfig, generate
from blockpilot.models import load_models

PROMPTS = [
    "Count from one to twenty.",
    "Write a Python function that reverses a list.",
    "Explain what a hash map is.",
    "List the first ten prime numbers.",
]


def measure(models, prompts_ids, policy, config) -> tuple[float, float]:
    tokens = seconds = 0.0
    taus = []
    for ids in prompts_ids:
        result = generate(models, ids, policy=policy, config=config)
        tokens += len(result.token_ids) - 1
        seconds += result.decode_time_s
        if result.cycles:
            taus.append(result.tau)
    return tokens / seconds, statistics.fmean(taus) if taus else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-sizes", default="2,4,8,16")
    parser.add_argument("--prompts", type=Path, default=None, help="a prompts .jsonl (e.g. a zoo's heldout.jsonl)")
    parser.add_argument("--limit", type=int, default=16, help="prompts taken from --prompts")
    parser.add_argument("--predictor", default=None, help="also time the learned policy (folder or models:/ URI)")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    if args.target is None:
        from blockpilot.zoo.random_models import write_random_zoo

        paths = write_random_zoo(Path(tempfile.mkdtemp()) / "zoo")
        args.target, args.drafter = paths["target"], paths["drafter"]
    models = load_models(args.target, args.drafter, device=args.device)
    autoregressive = replace(models, drafter=None, mask_token_id=None)
    if args.prompts is None:
        prompts = PROMPTS
        # No stop tokens: every run decodes exactly max_new_tokens, so the runs are comparable.
        config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    else:
        rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
        prompts = [row["prompt"] for row in rows[: args.limit]]
        # Real answers end at a stop token; at T = 0 every policy produces the same tokens anyway.
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(models.stop_token_ids()))
    prompts_ids = [models.encode_prompt(p) for p in prompts]
    print(
        f"device={models.device} dtype={models.target.dtype} threads={torch.get_num_threads()} "
        f"prompts={len(prompts)} max_new_tokens={args.max_new_tokens} T=0"
    )

    runs = [("autoregressive", autoregressive, None)]
    runs += [(f"fixed b={b}", models, FixedBlockSize(int(b))) for b in args.block_sizes.split(",")]
    runs += [("entropy policy", models, EntropyHeuristic.around(models.train_block_size))]
    if args.predictor:
        from blockpilot.predictor import LearnedPolicy, load_predictor

        runs += [("learned policy", models, LearnedPolicy(load_predictor(args.predictor)))]
    measure(models, prompts_ids[:1], FixedBlockSize(2), config)  # warm-up
    baseline = None
    print(f"{'policy':<16} {'tokens/s':>10} {'tau':>6} {'speedup':>8}")
    for name, run_models, policy in runs:
        rate, tau = measure(run_models, prompts_ids, policy, config)
        baseline = baseline or rate
        print(f"{name:<16} {rate:>10.1f} {tau:>6.2f} {rate / baseline:>7.2f}x")


if __name__ == "__main__":
    main()
