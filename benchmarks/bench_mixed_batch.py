"""What a cycle of a batch whose rows draft unequal blocks costs, against batches all at one b.

    python benchmarks/bench_mixed_batch.py --target $ZOO/target --drafter $ZOO/drafter
        [--prompts zoo:$ZOO:heldout] [--batch 32] [--low 6] [--high 8] [--shares 0,0.15,0.5,1]
        [--rounds 5] [--held]

A per-step policy under load makes the rows of a batch draft blocks of unequal sizes. The engine packs them
(`RaggedTokens`), so a row's token-by-token work follows its own b, but attention and the caches span the widest
block. Modeled throughput prices each row at c(b, batch) of its own b; this measures whether a mixed batch costs that.

Each row drafts --high with probability `share` and --low otherwise, drawn again before every cycle (seeded), greedy
and without stop tokens, so every row decodes --max-new-tokens and the batch stays full. Prints the median time of a
cycle (engine time per cycle of each row, median over rows, then over --rounds rounds that interleave the shares),
the mean b drafted, what a per-row price interpolates between the two pure batches for the same mean b, and the
share of the step from that price to the pure --high batch that the mixed batch pays (0: its rows' own prices; 1: the
widest block for every row). Every round runs each share, starting one share later each round, so the shares are
compared within a run: this machine's speed drifts by more than the difference between runs taken minutes apart.

With --held, each mix is held still instead: round(share x batch) rows (drawn per round) at --high and the rest at
--low through --cycles cycles after one untimed cycle (`blockpilot.decoding.calibration.seconds_per_cycle`, the calibration's
timer), so no row finishes, no row changes b and no cache grows inside the timed cycles.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from blockpilot.data.sources import prompt_texts
from blockpilot.decoding import GenerationConfig, GenerationRequest, SpeculativeEngine
from blockpilot.decoding.calibration import seconds_per_cycle
from blockpilot.models import load_models
from blockpilot.policies.base import CycleState, PrefillState


class RandomMix:
    """b = `high` with probability `share`, else `low`, drawn before every cycle (a stand-in for a per-step policy
    whose choices differ across rows). Counts what it drafted."""

    name = "mix"

    def __init__(self, low: int, high: int, share: float, seed: int) -> None:
        self.low, self.high, self.share = low, high, share
        self.random = random.Random(seed)
        self.drafted: list[int] = []

    def _draw(self) -> int:
        size = self.high if self.random.random() < self.share else self.low
        self.drafted.append(size)
        return size

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self._draw()

    def next_block_size(self, cycle: CycleState) -> int:
        return self._draw()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", default=None, help="prompt sources, e.g. zoo:DIR:heldout (default: one prompt)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--low", type=int, default=None, help="default: the drafter's training block size B")
    parser.add_argument("--high", type=int, default=None, help="default: B + 2")
    parser.add_argument("--shares", default="0,0.15,0.5,1", help="shares of rows at --high, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--held", action="store_true", help="hold each mix still (see above) instead of redrawing it")
    parser.add_argument("--cycles", type=int, default=12, help="with --held: timed cycles per measurement")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.target, args.drafter, device=args.device)
    train = models.train_block_size or 4
    low, high = args.low or train, args.high or train + 2
    shares = [float(s) for s in args.shares.split(",")]
    if not low < high or any(not 0.0 <= s <= 1.0 for s in shares):
        parser.error(f"expected --low < --high and shares within [0, 1]; got {low}, {high} and {shares}")
    if args.prompts is not None:
        texts = prompt_texts(args.prompts)
    else:
        texts = ["Write the numbers from 1 to 40, separated by commas."]
    prompts = [models.encode_prompt(texts[i % len(texts)]) for i in range(args.batch)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_token_ids=())

    def run(share: float, seed: int) -> tuple[float, float]:
        """(median seconds per cycle over the rows, mean b drafted) of one full batch."""
        if args.held:
            wide = round(share * args.batch)
            sizes = [high] * wide + [low] * (args.batch - wide)
            random.Random(seed).shuffle(sizes)
            seconds = seconds_per_cycle(models, prompts, sizes, args.cycles)
            return seconds, statistics.fmean(sizes)
        policy = RandomMix(low, high, share, seed)
        engine = SpeculativeEngine(models, max_batch=args.batch)
        for prompt in prompts:
            engine.submit(GenerationRequest(prompt, config, policy))
        results = [update.result for update in engine.run() if update.result is not None]
        per_cycle = statistics.median(r.decode_time_s / r.cycles for r in results if r.cycles)
        return per_cycle, statistics.fmean(policy.drafted)

    run(0.5, 0)  # warm-up
    cycles: dict[float, list[float]] = {share: [] for share in shares}
    drafted: dict[float, list[float]] = {share: [] for share in shares}
    for round_index in range(args.rounds):
        start = round_index % len(shares)
        for share in shares[start:] + shares[:start]:
            seconds, mean_b = run(share, round_index)
            cycles[share].append(seconds)
            drafted[share].append(mean_b)
    print(
        f"device={models.device} threads={torch.get_num_threads()} batch={args.batch} b={low}/{high} "
        f"max_new_tokens={args.max_new_tokens} rounds={args.rounds} "
        f"mixes={f'held, {args.cycles} cycles' if args.held else 'drawn every cycle'}"
    )
    print(f"{'share at b=' + str(high):>14} {'mean b':>7} {'ms/cycle':>9} {'per-row price':>14} {'widest share':>13}")
    pure = {share: statistics.median(cycles[share]) for share in (0.0, 1.0) if share in shares}
    for share in shares:
        mean_b = statistics.fmean(drafted[share])
        median = statistics.median(cycles[share])
        priced = widest = ""
        if len(pure) == 2:  # c(b, n) per row, linear between the two pure batches, at this mix's mean b
            price = pure[0.0] + (pure[1.0] - pure[0.0]) * (mean_b - low) / (high - low)
            priced = f"{1e3 * price:>14.2f}"
            if 0.0 < share < 1.0 and pure[1.0] > price:
                widest = f"{(median - price) / (pure[1.0] - price):>13.2f}"
        print(f"{share:>14.2f} {mean_b:>7.2f} {1e3 * median:>9.2f} {priced} {widest}")


if __name__ == "__main__":
    main()
