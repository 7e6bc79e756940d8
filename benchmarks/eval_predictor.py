"""Held-out tau of saved predictors on any label set, per temperature.

    python benchmarks/eval_predictor.py --labels labels/heldout --predictor DIR_OR_URI [--predictor ...]

For each temperature in the labels: tau of the fixed training B, of the best single fixed b, of the
per-prompt oracle, and of each predictor's choices, with the share of the oracle gap it captures
((pred - B) / (oracle - B)). Useful to score one predictor on several label sets, e.g. held-out labels
relabeled with more pooled samples at T > 0 (`blockpilot label ... --samples 16`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from blockpilot.data.labels import read_labels
from blockpilot.predictor import load_predictor
from blockpilot.predictor_training import evaluate_predictor, label_arrays, valid_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, required=True, help="label Parquet file or folder")
    parser.add_argument("--predictor", action="append", required=True, help="a predictor folder or models:/ URI")
    args = parser.parse_args()

    table = valid_rows(read_labels(args.labels))
    predictors = [(source, load_predictor(source)) for source in args.predictor]
    arrays = {kind: label_arrays(table, dense=kind == "dense") for kind in {p.config.kind for _, p in predictors}}
    scores = [(source, evaluate_predictor(p, arrays[p.config.kind])) for source, p in predictors]
    groups = sorted({key.split("/")[0] for key in scores[0][1] if key.startswith("T") and "/" in key})
    print(f"labels: {args.labels} ({table.num_rows} rows)")
    for group in groups:
        first = scores[0][1]
        print(
            f"{group}: fixed B {first[f'{group}/tau_B']:.4f}, best fixed b={first[f'{group}/best_fixed_b']:g} "
            f"{first[f'{group}/tau_best_fixed']:.4f}, oracle {first[f'{group}/tau_oracle']:.4f}"
        )
        for source, metrics in scores:
            print(
                f"  {source[-60:]:<60} tau {metrics[f'{group}/tau_pred']:.4f}  "
                f"gap captured {metrics[f'{group}/gap_captured']:.3f}"
            )


if __name__ == "__main__":
    main()
