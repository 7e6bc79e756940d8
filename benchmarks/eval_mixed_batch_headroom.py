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

from blockpilot.cost import CycleCost, load_cost
from blockpilot.data.labels import read_labels
from blockpilot.predictor.step_data import StepRow, evaluate_step_model, step_rows
from blockpilot.predictor.step_model import StepModel, load_step_model


def mixed_price(cost: CycleCost, share: float, widest: int) -> CycleCost:
    """A row's cycle at b in a batch whose widest block is `widest`, paying `share` of the step to it: the curve of
    `cost` (at one load) at every b up to `widest`."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a widest share lies within [0, 1], got {share}")
    (batch,) = cost.seconds
    return CycleCost({batch: {b: (1.0 - share) * cost(b) + share * cost(widest) for b in range(1, widest + 1)}})


def headroom(rows: list[StepRow], cost: CycleCost, shares: list[float], model: StepModel | None) -> str:
    widest = max(rows[0].tables[0].candidates)
    plain = evaluate_step_model(None, rows, cost)
    best = plain["throughput_best_fixed"]
    lines = [f"  best fixed b = {plain['best_fixed_b']:g}: {best:.1f} (uniform batches, c(b))"]
    priced = {share: evaluate_step_model(model, rows, mixed_price(cost, share, widest)) for share in shares}
    for name, key in (("per-step oracle", "step_oracle"), ("step model", "step")):
        for share, metrics in priced.items():
            if f"throughput_{key}" in metrics:
                value = metrics[f"throughput_{key}"]
                lines.append(f"  {name:<15} share {share:4.2f}: {value:7.1f} = {value / best:.3f}x best fixed")
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
    if model is not None and model.config.prior:
        parser.error(f"{args.step_model} reads a per-request prior; give a step model without one")
    rows = step_rows(read_labels(args.labels))
    for temperature in sorted({row.temperature for row in rows}):
        group = [row for row in rows if row.temperature == temperature]
        print(f"T = {temperature:g}, batch {args.batch}, {len(group)} label rows")
        print(headroom(group, cost, shares, model))


if __name__ == "__main__":
    main()
