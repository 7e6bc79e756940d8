"""Held-out tau and modeled throughput of saved predictors on any label set, per temperature.

    python benchmarks/eval_predictor.py --labels labels/heldout --predictor DIR_OR_URI [--predictor ...] \
        [--cost FILE [--cost-batch N]]

For each predictor: per temperature, tau and modeled throughput (tau / c(b), with the cost curve of
`blockpilot calibrate`; uniform without --cost) of the fixed training B, of the best single fixed b, of the
predictor's choices, of the per-prompt oracle and of the per-step oracle (where the labels hold acceptance
tables), with the share of the oracle gap the predictor captures. Useful to score one predictor on several
label sets, e.g. held-out labels relabeled with more pooled samples at T > 0 (`blockpilot label ... --samples 16`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from blockpilot.cost import load_cost
from blockpilot.data.labels import read_labels
from blockpilot.options import positive_int_arg
from blockpilot.predictor import load_predictor
from blockpilot.predictor.evaluation import evaluate_predictor
from blockpilot.predictor.training import valid_rows
from blockpilot.scoring import format_metrics, label_arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, required=True, help="label Parquet file or folder")
    parser.add_argument("--predictor", action="append", required=True, help="a predictor folder or models:/ URI")
    parser.add_argument("--cost", type=Path, default=None, help="a cost curve (blockpilot calibrate)")
    parser.add_argument("--cost-batch", type=positive_int_arg, default=1, help="price cycles at this batch size")
    args = parser.parse_args()

    table = valid_rows(read_labels(args.labels))
    cost = load_cost(args.cost, args.cost_batch)
    print(f"labels: {args.labels} ({table.num_rows} rows); cost {cost.describe()}")
    for source in args.predictor:
        predictor = load_predictor(source)
        arrays = label_arrays(table, dense=predictor.config.kind == "dense", cost=cost)
        print(format_metrics(source, evaluate_predictor(predictor, arrays)))


if __name__ == "__main__":
    main()
