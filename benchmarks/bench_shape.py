"""The engine at a real model's shape with random weights: cycle cost c(b, batch), rows of mixed b, batched decoding.

    python benchmarks/bench_shape.py [--drafter-config tests/fixtures/zlab_qwen3_4b_dflash_b16_config.json] \\
        [--block-sizes 1,2,4,8,12,16,20,24,32] [--batches 1,8,32,64] [--out DIR] [--tau 8:5.02,16:6.51]

Builds a Qwen3 target and a DFlash drafter at the sizes the drafter config names (by default z-lab's b16
drafter of Qwen3-4B: a 36-layer, 2560-wide target with a 151936-token vocabulary), random weights, bf16 on
a GPU. A cycle's cost does not depend on weight values; acceptance does, so nothing here is a speedup:

1. cost: `blockpilot.cost.calibrate` at every (batch, b), written to DIR/cost.json (use it as --cost).
2. mixed b: one cycle of N rows whose block sizes spread over --mixed (each row its own b) against all N
   rows at the smallest and at the largest of them. The batch verifies the widest block for every row.
3. decoding: generated tokens/s of N rows decoding together against one at a time, per policy (random
   weights accept almost no draft, so this is rows x cycles/s; the policies' tau is printed beside).
With --tau B:TAU,... (a tau curve measured elsewhere, e.g. a real drafter's sweep), also the modeled
throughput batch x tau(b) / c(b, batch) in tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from blockpilot.decoding import GenerationConfig
from blockpilot.decoding.calibration import calibrate, random_prompts, seconds_per_cycle
from blockpilot.decoding.speed import measure_speed
from blockpilot.models.drafter import DFlashConfig
from blockpilot.options import block_size_list
from blockpilot.policies.resolve import resolve_policy
from blockpilot.zoo.random_models import random_models_like

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "zlab_qwen3_4b_dflash_b16_config.json"


def tau_curve(text: str) -> dict[int, float]:
    pairs = [part.split(":") for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected B:TAU pairs separated by commas, got {text!r}")
    return {int(b): float(tau) for b, tau in pairs}


def print_cost(seconds: dict[int, dict[int, float]]) -> None:
    batches = sorted(seconds)
    print("cycle cost, ms (rows: b; columns: batch)")
    print("b     " + "".join(f"{batch:>10}" for batch in batches))
    for b in sorted(seconds[batches[0]]):
        print(f"{b:<6}" + "".join(f"{seconds[batch][b] * 1000:>10.2f}" for batch in batches))


def mixed_block_sizes(models, batches: list[int], spread: list[int], cycles: int, repeats: int) -> list[dict]:
    """Seconds per cycle at each batch: every row at min(spread), every row at max(spread), rows cycling
    through `spread`. Repeats interleave the three so that drift hits each alike; medians reported."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for batch in batches:
        prompts = random_prompts(models, batch, 64, generator)
        layouts = {
            "smallest": [min(spread)] * batch,
            "mixed": [spread[i % len(spread)] for i in range(batch)],
            "largest": [max(spread)] * batch,
        }
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(repeats):
            for name, sizes in layouts.items():
                times[name].append(seconds_per_cycle(models, prompts, sizes, cycles))
        rows.append({"batch": batch, **{name: statistics.median(values) for name, values in times.items()}})
    return rows


def decoding_speed(models, batches: list[int], policies: list[str], requests: int, max_new_tokens: int) -> list[dict]:
    """Tokens/s of `requests` prompts per (policy, batch); batch 1 decodes 4 of them one after another (a
    longer sequential run adds minutes, not information)."""
    generator = torch.Generator().manual_seed(2)
    prompts = random_prompts(models, requests, 64, generator)
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    rows = []
    for spec in policies:
        policy = resolve_policy(spec, models)
        measure_speed(models, prompts[:2], policy, config, max_batch=2)  # warm-up: kernels, allocator
        for batch in batches:
            subset = prompts[: max(batch, 4)] if batch == 1 else prompts
            speed = measure_speed(models, subset, policy, config, max_batch=batch)
            rows.append({"policy": spec, "batch": batch, "tokens_per_s": speed.tokens_per_s, "tau": speed.tau})
            line = f"  {spec:<14} batch {batch:>3}: {speed.tokens_per_s:9.1f} tokens/s  (tau {speed.tau:.2f})"
            print(line, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter-config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--block-sizes", type=block_size_list, default=(1, 2, 4, 8, 12, 16, 20, 24, 32))
    parser.add_argument("--batches", type=block_size_list, default=(1, 8, 32, 64))
    parser.add_argument("--cycles", type=int, default=8, help="timed cycles per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per point (median)")
    parser.add_argument("--mixed", type=block_size_list, default=(4, 8, 12, 16), help="the mixed rows' b, in turn")
    parser.add_argument("--policies", default="autoregressive,fixed:8,fixed:16")
    parser.add_argument("--requests", type=int, default=64, help="prompts per batched decoding run")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tau", type=tau_curve, default=None, help="B:TAU,... for the modeled throughput")
    parser.add_argument("--out", type=Path, default=None, help="folder for cost.json and results.json")
    args = parser.parse_args()

    config = DFlashConfig.from_dict(json.loads(args.drafter_config.read_text()))
    started = time.perf_counter()
    models = random_models_like(config, device=args.device, dtype=args.dtype)
    parameters = sum(p.numel() for p in models.target.parameters()) / 1e9
    print(f"{models.target_id}: {parameters:.2f}B target parameters, {models.drafter_id}, "
          f"{models.target.dtype} on {models.device} (built in {time.perf_counter() - started:.0f} s)", flush=True)

    cost = calibrate(models, args.block_sizes, args.batches, cycles=args.cycles, repeats=args.repeats, warmup=1)
    print(f"device: {cost.device}; versions: {cost.versions}")
    print_cost(cost.seconds)
    if args.tau:
        print("modeled throughput, tokens/s = batch x tau(b) / c(b, batch)")
        for b, tau in sorted(args.tau.items()):
            cells = "".join(f"{batch * tau / cost(b, batch):>10.0f}" for batch in args.batches)
            print(f"b={b:<3} tau {tau:<5}" + cells)

    print(f"mixed block sizes {args.mixed}: seconds of one cycle, ms")
    mixed = mixed_block_sizes(models, [b for b in args.batches if b > 1], args.mixed, args.cycles, args.repeats)
    for row in mixed:
        print(f"  batch {row['batch']:>3}: all b={min(args.mixed)} {row['smallest'] * 1000:.2f}, "
              f"mixed {row['mixed'] * 1000:.2f}, all b={max(args.mixed)} {row['largest'] * 1000:.2f}", flush=True)

    print(f"decoding, {args.max_new_tokens} new tokens a request (T = 0)")
    speeds = decoding_speed(models, args.batches, args.policies.split(","), args.requests, args.max_new_tokens)

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        cost.save(args.out / "cost.json")
        results = {"models": models.target_id, "mixed": mixed, "decoding": speeds, "cost": cost.to_dict()}
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"-> {args.out / 'cost.json'}, {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
