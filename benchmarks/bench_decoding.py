"""Decode speed of policies, at batch 1 and batched: same prompts, same models, one engine.

    python benchmarks/bench_decoding.py [--target DIR --drafter DIR] [--device cpu] [--max-new-tokens 128]
    python benchmarks/bench_decoding.py --target $ZOO/target --drafter $ZOO/drafter \\
        --prompts $ZOO/prompts/heldout.jsonl --policies autoregressive,fixed:4,fixed:8,entropy --batches 1,8

Without --target/--drafter it writes and uses the random tiny zoo (tau near 1 by construction, so what
this shows there is the cost of a cycle, not a speedup). Each policy spec goes through the one resolver
(`blockpilot.decoding.resolve`), so the names printed are the names every surface reports. Prints generated
tokens per second of wall time over all prompts (batch 1: one after another; batch N: N rows in one engine),
mean tau, and the speedup over the first policy at the same batch (the median of its ratios within a round),
after one warm-up pass.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from blockpilot.data.sources import prompt_texts
from blockpilot.decoding import GenerationConfig
from blockpilot.decoding.speed import measure_speed
from blockpilot.models import load_models
from blockpilot.policies.resolve import resolve_policy

PROMPTS = [
    "Count from one to twenty.",
    "Write a Python function that reverses a list.",
    "Explain what a hash map is.",
    "List the first ten prime numbers.",
]


def measure(models, prompts_ids, spec: str, config: GenerationConfig, batch: int) -> tuple[str, float, float]:
    """(policy name, generated tokens per wall second, mean tau) of `prompts_ids` at `batch` rows at a time."""
    speed = measure_speed(models, prompts_ids, resolve_policy(spec, models), config, max_batch=batch)
    return speed.policy, speed.tokens_per_s, speed.tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--policies",
        default="autoregressive,fixed:2,fixed:4,fixed:8,fixed:16,entropy",
        help="policy specs, comma-separated (';'-separated when a spec holds a comma, as learned+step:P,S does)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the policies (interleaved); median tokens/s")
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes, e.g. 1,8")
    parser.add_argument("--prompts", type=Path, default=None, help="a prompts .jsonl (e.g. a zoo's heldout.jsonl)")
    parser.add_argument("--limit", type=int, default=16, help="prompts taken from --prompts")
    parser.add_argument("--predictor", default=None, help="also time learned:PREDICTOR (folder or models:/ URI)")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    if args.target is None:
        from blockpilot.zoo.random_models import write_random_zoo

        paths = write_random_zoo(Path(tempfile.mkdtemp()) / "zoo")
        args.target, args.drafter = paths["target"], paths["drafter"]
    models = load_models(args.target, args.drafter, device=args.device)
    if args.prompts is None:
        prompts = PROMPTS
        # No stop tokens: every run decodes exactly max_new_tokens, so the runs are comparable.
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    else:
        prompts = prompt_texts(f"jsonl:{args.prompts}", limit=args.limit)
        # Real answers end at a stop token: at T = 0 every policy produces the same tokens. Sampled, each policy
        # draws its own answers, of other lengths, and a batch of shorter ones spends more of its time in prefill
        # and with few rows; so at T > 0 every row decodes exactly max_new_tokens, the same work for every policy.
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=0,
            stop_token_ids=tuple(models.stop_token_ids()) if args.temperature == 0 else (),
        )
    prompts_ids = [models.encode_prompt(p) for p in prompts]
    specs = args.policies.split(";" if ";" in args.policies else ",") + ([f"learned:{args.predictor}"] if args.predictor else [])
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"device={models.device} dtype={models.target.dtype} threads={torch.get_num_threads()} "
        f"prompts={len(prompts)} max_new_tokens={args.max_new_tokens} T={args.temperature:g} rounds={args.rounds}"
        f" ends={'at a stop token' if config.stop_token_ids else 'at max_new_tokens'}"
    )
    measure(models, prompts_ids[:2], "fixed:2", config, 2)  # warm-up
    print(f"{'batch':>5} {'policy':<22} {'tokens/s':>10} {'tau':>6} {'speedup':>8}")
    for batch in batches:
        rates: dict[str, list[float]] = {spec: [] for spec in specs}
        seen: dict[str, tuple[str, float]] = {}
        # Policies interleaved, each round starting one policy later, so that neither drift in the machine's
        # speed nor a place in the round favours one; the speedup is the median of the ratios within a round.
        for round_index in range(args.rounds):
            shift = round_index % len(specs)
            for spec in specs[shift:] + specs[:shift]:
                name, rate, tau = measure(models, prompts_ids, spec, config, batch)
                rates[spec].append(rate)
                seen[spec] = (name, tau)
        first = rates[specs[0]]
        for spec in specs:
            (name, tau), rate = seen[spec], statistics.median(rates[spec])
            speedup = statistics.median(r / f for r, f in zip(rates[spec], first, strict=True))
            label = spec if spec.startswith(name) else f"{spec} ({name})"
            print(f"{batch:>5} {label:<22} {rate:>10.1f} {tau:>6.2f} {speedup:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
