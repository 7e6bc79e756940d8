"""What per-step choice can gain in a full batch whose rows draft unequal blocks, modeled on acceptance tables.

    python benchmarks/eval_mixed_batch_headroom.py --labels DIR --cost cost.json [--batch 32]
        [--widest-shares 0,0.25,0.4] [--step-model M]

Modeled throughput prices a row's cycle at c(b, n) of its own b. A batch of rows at unequal b costs more: its
attention and caches span the widest block, so it pays a share s of the step from its rows' own prices to the
widest block for every row (`bench_mixed_batch.py` prints s, "widest share", for the engine on this device). Where
rows choose apart, some row drafts the largest candidate D in nearly every cycle of a full batch, so a row's cycle
at b costs about

    (1 - s) c(b, n) + s c(D, n).

This prints, per temperature, the best fixed b (a uniform batch pays c(b, n)), and the per-step oracle, and with
--step-model that model's walk, priced so at every share given: s = 0 is the per-row price `train-step` reports.
The per-step oracle is the most any per-step policy can reach in hindsight; where it falls under a bar at the
measured share, no policy that chooses per row reaches that bar in a full batch on that device.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from blockpilot.cost import load_cost
from blockpilot.data.labels import read_labels
from blockpilot.predictor.step import StepModel, StepRow, load_step_model, step_rows, walk_step_model


def mixed_price(cost: Callable[[int], float], share: float, widest: int) -> Callable[[int], float]:
    """A row's cycle at b in a batch whose widest block is `widest`, paying `share` of the step to it."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a widest share lies within [0, 1], got {share}")
    return lambda b: (1.0 - share) * cost(b) + share * cost(widest)


def headroom(
    rows: list[StepRow], cost: Callable[[int], float], shares: list[float], model: StepModel | None, batch: int
) -> str:
    candidates = rows[0].tables[0].candidates
    tables = [(row, t, anchors) for row in rows for t, anchors in zip(row.tables, row.anchors, strict=True)]
    tokens = sum(t.n - 1 for _, t, _ in tables)
    fixed = {b: tokens / sum(t.walk_cost([b] * len(t.walk(b)), cost=cost) for _, t, _ in tables) for b in candidates}
    best = max(fixed, key=fixed.get)
    lines = [f"  best fixed b = {best}: {fixed[best]:.1f} (uniform batches, c(b))"]
    walks = {"per-step oracle": None} | ({"step model": model} if model is not None else {})
    for name, walker in walks.items():
        for share in shares:
            price = mixed_price(cost, share, max(candidates))
            spent = widest = cycles = 0.0
            for row, t, anchors in tables:
                if walker is None:
                    sizes, _ = t.oracle_walk(price)
                else:
                    sizes, _ = walk_step_model(walker, t, anchors, batch_rows=batch)
                spent += t.walk_cost(sizes, cost=price)
                widest += sum(size == max(candidates) for size in sizes)
                cycles += len(sizes)
            value = tokens / spent
            lines.append(
                f"  {name:<15} share {share:4.2f}: {value:7.1f} = {value / fixed[best]:.3f}x best fixed "
                f"(b = {max(candidates)} in {widest / cycles:.0%} of cycles)"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", required=True, help="labels with acceptance tables (e.g. held-out ones)")
    parser.add_argument("--cost", required=True, help="cost curve (blockpilot calibrate)")
    parser.add_argument("--batch", type=int, default=32, help="price cycles at this batch size (the nearest measured)")
    parser.add_argument("--widest-shares", default="0,0.25,0.4", help="shares s of the widest block, comma-separated")
    parser.add_argument("--step-model", default=None, help="also walk this step model (one with no per-request prior)")
    args = parser.parse_args()

    shares = [float(s) for s in args.widest_shares.split(",") if s.strip()]
    cost = load_cost(args.cost, args.batch)
    model = load_step_model(args.step_model) if args.step_model else None
    if model is not None and model.config.uses_prior:
        parser.error(f"{args.step_model} reads a per-request prior; give a step model without one")
    rows = step_rows(read_labels(args.labels))
    for temperature in sorted({row.temperature for row in rows}):
        group = [row for row in rows if row.temperature == temperature]
        print(f"T = {temperature:g}, batch {args.batch}, {len(group)} label rows")
        print(headroom(group, cost, shares, model, args.batch))


if __name__ == "__main__":
    main()
