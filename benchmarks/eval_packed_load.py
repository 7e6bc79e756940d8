"""What packed rows could gain under load on a device, modeled from held-out labels and the device's cost curve.

    python benchmarks/eval_packed_load.py --labels DIR --cost cost.json [--concurrency 1,4,16,32] [--batches 400]
    # cost.json from `blockpilot calibrate --batch-sizes 1,4,16,32 --block-sizes 1,2,4,8` on the device

A batch of n rows, each a held-out prompt drawn at random (its label's tau(b): mean tokens a cycle at b), decodes
at sum(tau) / cycle cost. Priced from the measured c(n, W) (n rows, all at width W, so n x W tokens a pass):

- autoregressive: every row b = 1, c(n, 1);
- fixed b: every row b, c(n, b);
- padded oracle (the engine today: every row computes the widest row's width, batch pricing chooses the width):
  the best width W for the batch, each row at its best b <= W, c(n, W);
- packed oracle (issue 59's packed rows: a pass costs what its tokens cost): each row its own b_i, the pass run at
  the smallest measured n x W tokens that holds sum(b_i) and priced c(n, W) (total-token buckets at the measured
  widths, and the padded pass's attention: what a packed pass of those buckets would cost at best), the b_i the
  best for the batch (a knapsack per bucket, exact).
- two widths: the packed oracle with each row at b = 1 or at one b shared by the rows that draft (a pass of an
  autoregressive group and a drafting group, the first step toward packed rows).

Prints, per temperature and concurrency, tokens a second of each and the packed oracle against the best of the
others. Where that ratio stays near 1, no per-row choice in a packed pass pays on the device under that load.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Collection, Sequence

import numpy as np

from blockpilot.cost import CycleCost
from blockpilot.data.labels import read_labels


def tau_tables(labels: str) -> dict[float, list[dict[int, float]]]:
    """Per temperature, each labeled prompt's tau by b, b = 1 (tau 1) included."""
    table = read_labels(labels, columns=["temperature", "candidates", "tau", "error"]).to_pylist()
    by_temperature: dict[float, list[dict[int, float]]] = {}
    for row in table:
        if row["error"] is None:
            taus = {1: 1.0} | dict(zip(row["candidates"], row["tau"], strict=True))
            by_temperature.setdefault(round(row["temperature"], 3), []).append(taus)
    return by_temperature


def packed_choice(
    taus: Sequence[dict[int, float]], curve: dict[int, float], sizes: Collection[int] | None = None
) -> tuple[float, float, int]:
    """The best packed pass for a batch: (its tokens, its seconds, its rows at b = 1). A pass of n rows runs at the
    smallest measured n x W total tokens that holds sum(b_i), at c(n, W); at each such bucket, the b_i (of `sizes`,
    default any of a row's) maximizing sum(tau_i(b_i)) within it (a knapsack over the rows, exact)."""
    rows = len(taus)
    best = (0.0, 1.0, rows)
    for width, seconds in sorted(curve.items()):
        budget = rows * width
        most = np.zeros(budget + 1)  # the most tokens the rows so far commit within k slots
        picks = []  # per row, its b at each k
        for t in taus:
            options = [(b, tau) for b, tau in t.items() if b <= budget and (sizes is None or b == 1 or b in sizes)]
            gains = np.full((len(options), budget + 1), -np.inf)
            for j, (b, tau) in enumerate(options):
                gains[j, b:] = most[: budget + 1 - b] + tau
            picks.append([options[j][0] for j in gains.argmax(axis=0)])
            most = gains.max(axis=0)
        if most[budget] / seconds > best[0] / best[1]:
            k, ones = budget, 0
            for pick in reversed(picks):
                ones += pick[k] == 1
                k -= pick[k]
            best = (float(most[budget]), seconds, ones)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", required=True, help="held-out labels (blockpilot label)")
    parser.add_argument("--cost", required=True, help="cost curve with several batch sizes (blockpilot calibrate)")
    parser.add_argument("--concurrency", default="1,4,16,32", help="rows decoding at once, comma-separated")
    parser.add_argument("--batches", type=int, default=400, help="random batches drawn per concurrency")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cost = CycleCost.load(args.cost)
    rng = random.Random(args.seed)
    print(f"cost: {cost.describe()}")
    for temperature, prompts in sorted(tau_tables(args.labels).items()):
        widths = sorted(set.intersection(*(set(t) for t in prompts)))
        print(f"\nT = {temperature:g}: {len(prompts)} prompts, b in {widths}")
        print(
            f"{'rows':>5} {'AR':>9} {'best fixed':>15} {'padded':>9} {'two widths':>10} {'packed':>9} "
            f"{'packed x best':>13} b=1 rows"
        )
        for rows in [int(n) for n in args.concurrency.split(",")]:
            if rows not in cost.seconds:
                parser.error(f"concurrency {rows} is not a batch size of {args.cost} ({sorted(cost.seconds)})")
            measured = sorted(b for b in cost.seconds[rows] if b in widths)
            c = cost.seconds[rows]
            tokens = {"padded": 0.0, "two widths": 0.0, "packed": 0.0} | dict.fromkeys(measured, 0.0)
            seconds = dict.fromkeys(tokens, 0.0)
            autoregressive_rows = 0
            for _ in range(args.batches):
                batch = [rng.choice(prompts) for _ in range(rows)]
                for b in measured:
                    tokens[b] += sum(t[b] for t in batch)
                    seconds[b] += c[b]
                padded = max(
                    (sum(max(t[b] for b in t if b <= width) for t in batch) / c[width], width) for width in measured
                )
                tokens["padded"] += padded[0] * c[padded[1]]
                seconds["padded"] += c[padded[1]]
                two = max((packed_choice(batch, c, {b}) for b in widths if b > 1), key=lambda p: p[0] / p[1])
                tokens["two widths"] += two[0]
                seconds["two widths"] += two[1]
                packed_tokens, packed_seconds, ones = packed_choice(batch, c)
                tokens["packed"] += packed_tokens
                seconds["packed"] += packed_seconds
                autoregressive_rows += ones
            speed = {key: tokens[key] / seconds[key] for key in tokens}
            fixed = max((b for b in measured if b > 1), key=speed.get)
            best_other = max(speed[1], speed[fixed], speed["padded"])
            print(
                f"{rows:>5} {speed[1]:>9.1f} {speed[fixed]:>9.1f} (b={fixed}) {speed['padded']:>9.1f} "
                f"{speed['two widths']:>10.1f} {speed['packed']:>9.1f} {speed['packed'] / best_other:>13.3f} "
                f"{autoregressive_rows / (rows * args.batches):>8.0%}"
            )


if __name__ == "__main__":
    main()
