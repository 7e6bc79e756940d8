"""Predictor size on disk and CPU latency per prediction, dense vs sparse.

    python benchmarks/bench_predictor.py --predictor DIR_OR_URI [--predictor ...]
    python benchmarks/bench_predictor.py --vocab 151936 --hidden 2048      # untrained, at Qwen3's vocabulary

A prediction is what the engine pays once per request after prefill: softmax and top-k of the last
position's logits (dense: the full distribution), then the MLP. Timed at batch 1 on the CPU, median of
--repeats calls after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockpilot.files import WEIGHTS_NAME
from blockpilot.policies.base import PrefillState
from blockpilot.policies.learned import LearnedPolicy
from blockpilot.predictor import BlockSizePredictor, PredictorConfig, resolve_predictor_dir


def time_prediction(predictor: BlockSizePredictor, repeats: int, seed: int = 0) -> float:
    """Median milliseconds of one `LearnedPolicy.initial_block_size` call on random logits."""
    generator = torch.Generator().manual_seed(seed)
    policy = LearnedPolicy(predictor)
    states = [
        PrefillState(
            torch.randn(predictor.config.vocab_size, generator=generator) * 4,
            torch.arange(16),
            temperature=0.0,
            train_block_size=predictor.config.train_block_size,
        )
        for _ in range(repeats + 5)
    ]
    for state in states[:5]:
        policy.initial_block_size(state)
    times = []
    for state in states[5:]:
        started = time.perf_counter()
        policy.initial_block_size(state)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictor", action="append", default=[], help="a predictor folder or models:/ URI")
    parser.add_argument("--vocab", type=int, default=None, help="also time untrained predictors of this vocabulary")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.predictor and args.vocab is None:
        parser.error("give --predictor and/or --vocab")

    rows = []
    for source in args.predictor:
        directory = resolve_predictor_dir(source)
        predictor = BlockSizePredictor.load(directory)
        rows.append((source, predictor, (directory / WEIGHTS_NAME).stat().st_size))
    if args.vocab is not None:
        scratch = Path(tempfile.mkdtemp(prefix="bench-predictor-"))
        for kind in ("dense", "sparse"):
            config = PredictorConfig(kind, (6, 7, 8, 9, 10), args.vocab, top_k=args.top_k, hidden_size=args.hidden)
            predictor = BlockSizePredictor(config)
            directory = predictor.save(scratch / kind)
            rows.append((f"untrained {kind} V={args.vocab}", predictor, (directory / WEIGHTS_NAME).stat().st_size))

    print(f"torch threads: {torch.get_num_threads()}, repeats: {args.repeats}")
    print(f"{'predictor':<48} {'kind':>6} {'k':>4} {'hidden':>6} {'params':>11} {'MB':>8} {'ms/pred':>8}")
    for name, predictor, size in rows:
        config = predictor.config
        params = sum(p.numel() for p in predictor.parameters())
        ms = time_prediction(predictor, args.repeats)
        print(
            f"{name[-48:]:<48} {config.kind:>6} {config.top_k:>4} {config.hidden_size:>6} {params:>11,} "
            f"{size / 2**20:>8.2f} {ms:>8.3f}"
        )


if __name__ == "__main__":
    main()
