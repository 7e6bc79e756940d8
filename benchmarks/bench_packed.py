"""What packing saves a chain cycle of rows of unequal b: each row's own slots computed (`_packed_cycle`) against
every row computing the widest row's (`_cycle`), both compiled, in interleaved rounds.

    python benchmarks/bench_packed.py --zoo $ZOO [--rows 4,16] [--rounds 7] [--cycles 50] \
        [--prompts 32 --max-batch 16 --max-new-tokens 64 --temperature 0 [--frozen [--spans 1]]]

For each row count and mix of b (every row at the width; a quarter of the rows drafting the width and the others
autoregressive; half of them; b cycling through 1, 2, 4 and the width), one decoder runs --cycles cycles of those
rows packed, then padded, then every row at the width of the packed entries over the rows, padded (what the engine
prices a packed cycle at: `batch_pricing.packed_block_sizes`), in each round (the rows' lengths reset before each
cycle: the same span). Prints the median cycle of each, the entries each computes (packed: the rows' b summed,
rounded up to a power of two; padded: rows x width) and packed over padded. The first round builds the steps and is
not counted.

With --prompts N, then the zoo's first N held-out prompts, queued at once, through two engines of --max-batch rows
(row buckets as a replica declares them), compiled, one packing its rows and one not, in interleaved rounds (the first
two build the steps and are not counted), under autoregression and the drafter's fixed B (no row of a
different b: references, and the rounds' noise), and policies that mix b: the entropy heuristic (an adaptive policy
whose b the batch chooses, `Engine._batch_sizes`) and fixed b of 1, 2, 4 and the width in turn. Prints each one's
median tokens/s packed and padded. With --frozen, each engine first builds the shapes a replica declares (`Engine.
declared_shapes` over autoregression and the width, --spans spans; the packing one with its packed cycles, as `serve
--compile-packed` builds them) and freezes, as a replica does: nothing compiles in the rounds, and a packed batch runs
on the declared step that holds it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from blockpilot.data.sources import zoo_prompts
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.decoding.engine import Engine
from blockpilot.decoding.static import StaticDecoder, span_bucket
from blockpilot.models import load_models
from blockpilot.policies.fixed import FixedBlockSize
from blockpilot.policies.resolve import resolve_policy

LENGTH = 64  # each row's prompt, and where its length is reset before every cycle


def mixes(rows: int, width: int) -> dict[str, list[int]]:
    """Named b per row: the padded cycle's own case, and mixes of autoregressive and drafting rows."""
    quarter, half = max(1, rows // 4), max(1, rows // 2)
    return {
        f"all {width}": [width] * rows,
        f"{quarter} at {width}, others 1": [width] * quarter + [1] * (rows - quarter),
        f"{half} at {width}, others 1": [width] * half + [1] * (rows - half),
        f"1, 2, 4, {width} cycling": [(1, 2, 4, width)[i % 4] for i in range(rows)],
    }


def timed_cycles(decoder: StaticDecoder, rows: int, width: int, cycles: int) -> float:
    """Median seconds of `cycles` cycles of rows 0 .. rows - 1 at `width` (lengths reset before each)."""
    span, times = span_bucket(LENGTH + decoder.width, decoder.capacity), []
    for _ in range(cycles):
        decoder.length[:rows] = LENGTH
        started = time.perf_counter()
        decoder.cycle(rows, span, width)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True, help="a zoo folder (target/ and drafter/)")
    parser.add_argument("--rows", default="4,16", help="row counts, comma-separated ('': the load test alone)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=0, help="held-out prompts through the engine (0: none)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--frozen", action="store_true", help="the engines build a replica's declared shapes, frozen")
    parser.add_argument("--spans", type=int, default=1, help="with --frozen: spans of cache declared")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.zoo / "target", args.zoo / "drafter")
    width = models.train_block_size + 2
    width = 1 << (width - 1).bit_length()  # the engine's width bucket of its widest b
    row_counts = [int(r) for r in args.rows.split(",") if r]
    if not row_counts:  # the engines under load alone
        return load(models, args)
    decoder = StaticDecoder(models, rows=max(row_counts), width=width, capacity=512, compile="compile")
    vocab = models.target.get_input_embeddings().weight.shape[0]
    prompts = [torch.randint(0, vocab, (LENGTH,)) for _ in range(max(row_counts))]
    for row, prompt in enumerate(prompts):
        decoder.prefill(row, [prompt])
        decoder.place(row, length=LENGTH, last_token=int(prompt[-1]), temperature=0.0, seed=row)
    cases = []
    for rows in row_counts:
        for name, sizes in mixes(rows, width).items():
            decoder.set_block_sizes(sizes)
            cases.append((rows, name, sizes, decoder.packed_tokens(rows, width) or rows * width))
    medians: dict[tuple, list[float]] = {}
    for round_ in range(args.rounds + 1):
        for rows, name, sizes, entries in cases:
            # packed, padded, and every row at the width of as many entries, padded: what the engine prices it at
            runs = [(True, sizes, width), (False, sizes, width), (False, [entries // rows] * rows, entries // rows)]
            for kind, (packed, block_sizes, cycle_width) in zip(("packed", "padded", "priced"), runs, strict=True):
                decoder.set_block_sizes(block_sizes)
                decoder.pack_rows = packed
                seconds = timed_cycles(decoder, rows, cycle_width, args.cycles)
                if round_:
                    medians.setdefault((rows, name, kind), []).append(seconds)
    print(f"{models.target_id}: width {width}, {args.rounds} interleaved rounds of {args.cycles} cycles (medians)")
    print(
        f"{'rows':>4}  {'mix of b':<24} {'entries':>9}  {'padded ms':>9}  {'packed ms':>9}  packed/padded  "
        "priced as (ms: every row at entries / rows, padded)"
    )
    for rows, name, _, entries in cases:
        padded, packed, priced = (statistics.median(medians[(rows, name, k)]) for k in ("padded", "packed", "priced"))
        print(
            f"{rows:>4}  {name:<24} {entries:>4}/{rows * width:<4}  {padded * 1e3:>9.3f}  {packed * 1e3:>9.3f}  "
            f"{packed / padded:>13.3f}  b = {entries // rows}: {priced * 1e3:.3f}"
        )
    if args.prompts:
        load(models, args)


def load(models, args: argparse.Namespace) -> None:
    """The held-out prompts queued at once through an engine that packs and one that does not (module docstring)."""
    prompts = [models.encode_prompt(r.turns[0]) for r in zoo_prompts(args.zoo, "heldout")[: args.prompts]]
    buckets = Engine(models, max_batch=args.max_batch).declared_row_buckets()
    engines = {}
    for packed in (True, False):
        engines[packed] = Engine(
            models, max_batch=args.max_batch, compile="compile", row_buckets=buckets, pack_rows=packed
        )
    widest = engines[True].width
    if args.frozen:
        for packed, engine in engines.items():
            engine.compile_shapes(engine.declared_shapes((1, widest), spans=args.spans, packed=packed))
    mixes = {
        "autoregressive": lambda i: resolve_policy("autoregressive", models),
        f"fixed {models.train_block_size}": lambda i: resolve_policy("fixed", models),
        "entropy": lambda i: resolve_policy("entropy", models),
        f"fixed 1, 2, 4, {widest}": lambda i: FixedBlockSize((1, 2, 4, widest)[i % 4]),
    }
    stop = tuple(models.stop_token_ids())
    rates: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(args.rounds + 2):
        for name, policy in mixes.items():
            for packed, engine in engines.items():
                config = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=stop)
                requests = [
                    GenerationRequest(p, GenerationConfig(**config, seed=i), policy(i)) for i, p in enumerate(prompts)
                ]
                started = time.perf_counter()
                tokens = sum(len(r.token_ids) for r in generate_many(models, requests, engine=engine))
                if round_ >= 2:
                    rates.setdefault((name, packed), []).append(tokens / (time.perf_counter() - started))
    print(
        f"{len(prompts)} held-out prompts at once, {args.max_batch} rows{', frozen' * args.frozen}, "
        f"T = {args.temperature}, "
        f"{args.rounds} interleaved rounds (medians, tokens/s)"
    )
    for name in mixes:
        packed, padded = (statistics.median(rates[(name, p)]) for p in (True, False))
        print(f"  {name:<20} padded {padded:8.1f}  packed {packed:8.1f}  packed/padded {packed / padded:.3f}")


if __name__ == "__main__":
    main()
