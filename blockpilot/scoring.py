"""Scoring block-size choices on label rows: fixed b, per-row choices, the oracles; the report table.

Metrics of a set of label rows under per-row choices (each row's tau vector is read at the chosen b):

* `accuracy`: the chosen b is the row's B* (under the scoring objective);
* `tau_pred`, `tau_B` (the drafter's training B, when swept), `tau_best_fixed` (the single b with the best
  mean tau on the evaluated rows themselves: the strongest fixed baseline), `tau_oracle` (each row's best);
* `throughput_*`: the same choices priced with the cycle cost, committed tokens / total cost over the rows
  (tokens per second with a calibrated cost; tokens per cycle without one); `throughput_step_oracle` is the
  per-step oracle of the acceptance tables (b may change every cycle), where the labels carry tables;
* `gap_captured` = (pred - B) / (oracle - B), in tau, and `throughput_gap_captured` likewise;
* the same per source (`source/<name>/...`) and per temperature (`T<t>/...`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from blockpilot.blocks import best_block_size
from blockpilot.cost import CycleCost
from blockpilot.predictor.inputs import DENSE_COLUMN, INPUT_COLUMNS, PredictorInputs, input_arrays
from blockpilot.table import AcceptanceTable, tables_from_row

SCORES: tuple[str, ...] = ("tau", "throughput")


def score_matrix(tau: np.ndarray, candidates: tuple[int, ...], cost: CycleCost, score: str) -> np.ndarray:
    """(N, C) what choosing each candidate is worth for each row: its tau, or its tau / c(b) (`throughput`)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "tau":
        return tau.astype(np.float32)
    price = np.asarray([cost(b) for b in candidates], dtype=np.float64)
    return (tau / price[None, :]).astype(np.float32)


def best_indices(values: np.ndarray, candidates: tuple[int, ...]) -> np.ndarray:
    """(N,) index of each row's B*: the best value, ties to the smaller b."""
    return np.asarray(
        [candidates.index(best_block_size(candidates, row.tolist())) for row in values], dtype=np.int64
    )


@dataclass
class LabelArrays:
    """Label rows as arrays: the predictor's inputs, and what scores its choices."""

    prompt_ids: list[str]
    sources: list[str]
    inputs: dict[str, np.ndarray]  # `input_arrays` of the rows
    tau: np.ndarray  # (N, C) float32
    cycles: np.ndarray  # (N, C) cycles of each candidate's walks
    candidates: tuple[int, ...]
    train_block_size: int | None
    cost: CycleCost = field(default_factory=CycleCost.uniform)
    score: str = "tau"  # what B* maximizes: tau, or throughput (tau / c(b))
    tables: list[list[AcceptanceTable]] | None = None  # per row, where the labels carry acceptance tables

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def temperature(self) -> np.ndarray:
        return self.inputs["temperature"]

    @property
    def cycle_cost(self) -> np.ndarray:
        """(C,) the cost of one cycle at each candidate."""
        return np.asarray([self.cost(b) for b in self.candidates], dtype=np.float64)

    @property
    def scores(self) -> np.ndarray:
        """(N, C) what a row's choice is worth: tau, or tau / c(b)."""
        return score_matrix(self.tau, self.candidates, self.cost, self.score)

    @property
    def best_index(self) -> np.ndarray:
        """(N,) index of each row's B* under `score` (ties to the smaller b)."""
        return best_indices(self.scores, self.candidates)

    def batch(self, rows: slice | np.ndarray = slice(None)) -> PredictorInputs:
        return PredictorInputs.from_arrays({name: values[rows] for name, values in self.inputs.items()})


def label_columns(dense: bool = False) -> list[str]:
    """The label columns `label_arrays` reads."""
    scored = ["prompt_id", "source", "train_block_size", "candidates", "tau", "cycles", "max_new_tokens"]
    return [*scored, "table_commits", "table_anchors", *INPUT_COLUMNS, *([DENSE_COLUMN] if dense else [])]


def candidates_of(table: pa.Table) -> tuple[int, ...]:
    return tuple(int(b) for b in table["candidates"][0].as_py())


def label_arrays(
    table: pa.Table, dense: bool = False, cost: CycleCost | None = None, score: str = "tau", inputs: bool = True
) -> LabelArrays:
    """Checked label rows (`predictor.training.valid_rows`) as arrays; acceptance tables are kept where present.
    `inputs=False` skips the predictor's input columns (a summary of the labels needs none)."""
    candidates = candidates_of(table)
    tables = None
    if "table_commits" in table.column_names and table["table_commits"].null_count == 0:
        columns = table.select(["candidates", "table_commits", "table_anchors", "max_new_tokens"]).to_pylist()
        tables = [tables_from_row(row) for row in columns]
    return LabelArrays(
        prompt_ids=table["prompt_id"].to_pylist(),
        sources=table["source"].to_pylist(),
        inputs=(
            input_arrays(table.select([*INPUT_COLUMNS, *([DENSE_COLUMN] if dense else [])]).to_pydict(), dense)
            if inputs
            else {"temperature": np.asarray(table["temperature"].to_pylist(), dtype=np.float32)}
        ),
        tau=np.asarray(table["tau"].to_pylist(), dtype=np.float32),
        cycles=np.asarray(table["cycles"].to_pylist(), dtype=np.float64),
        candidates=candidates,
        train_block_size=table["train_block_size"][0].as_py(),
        cost=cost or CycleCost.uniform(),
        score=score,
        tables=tables,
    )


def step_oracle_costs(arrays: LabelArrays) -> tuple[np.ndarray, np.ndarray] | None:
    """Per row (all its tables): the fewest cycles any per-step walk needs, and the lowest cost under
    `arrays.cost`; None where the labels carry no tables."""
    if arrays.tables is None:
        return None
    unit = CycleCost.uniform()
    cycles = np.asarray([sum(t.cost_to_go(unit)[0][1] for t in tables) for tables in arrays.tables])
    if arrays.cost.is_uniform:
        return cycles, cycles
    costs = np.asarray([sum(t.cost_to_go(arrays.cost)[0][1] for t in tables) for tables in arrays.tables])
    return cycles, costs


def _scores(
    choice: np.ndarray, arrays: LabelArrays, rows: np.ndarray, oracle: tuple[np.ndarray, np.ndarray] | None
) -> dict:
    tau, cycles, price = arrays.tau[rows], arrays.cycles[rows], arrays.cycle_cost
    picked = (np.arange(len(rows)), choice[rows])
    tokens = tau * cycles  # (n, C) committed tokens of each candidate's walks
    spent = cycles * price[None, :]

    def throughput(index: np.ndarray) -> float:
        chosen = (np.arange(len(rows)), index)
        return float(tokens[chosen].sum() / spent[chosen].sum()) if spent[chosen].sum() > 0 else math.nan

    candidates = arrays.candidates
    mean_by_b = tau.mean(axis=0)
    fixed_throughput = [throughput(np.full(len(rows), k)) for k in range(len(candidates))]
    train = candidates.index(arrays.train_block_size) if arrays.train_block_size in candidates else None
    per_row_best = np.argmax(tokens / np.maximum(spent, 1e-12) - 1e-9 * np.arange(len(candidates))[None, :], axis=1)
    metrics = {
        "rows": float(len(rows)),
        "accuracy": float((choice[rows] == arrays.best_index[rows]).mean()),
        "tau_pred": float(tau[picked].mean()),
        "tau_B": float(mean_by_b[train]) if train is not None else math.nan,
        "tau_best_fixed": float(mean_by_b.max()),
        "best_fixed_b": float(candidates[int(mean_by_b.argmax())]),
        "tau_oracle": float(tau.max(axis=1).mean()),
        "throughput_pred": throughput(choice[rows]),
        "throughput_B": fixed_throughput[train] if train is not None else math.nan,
        "throughput_best_fixed": max(fixed_throughput),
        "throughput_best_fixed_b": float(candidates[int(np.argmax(fixed_throughput))]),
        "throughput_oracle": throughput(per_row_best),
    }
    if oracle is not None:
        # Replayed walks all commit the same tokens (the sequences'), whatever b they use.
        metrics["tau_step_oracle"] = float(tokens[:, 0].sum() / oracle[0][rows].sum())
        metrics["throughput_step_oracle"] = float(tokens[:, 0].sum() / oracle[1][rows].sum())
    metrics["gap_captured"] = _gap(metrics["tau_pred"], metrics["tau_B"], metrics["tau_oracle"])
    metrics["throughput_gap_captured"] = _gap(
        metrics["throughput_pred"], metrics["throughput_B"], metrics["throughput_oracle"]
    )
    return metrics


def _gap(pred: float, base: float, best: float) -> float:
    """The share of the oracle's gain over the base that `pred` captures."""
    return float((pred - base) / (best - base)) if best - base > 1e-9 else math.nan


def evaluate_choices(choice_index: np.ndarray, arrays: LabelArrays) -> dict[str, float]:
    """Metrics (see the module docstring) of choosing `candidates[choice_index[i]]` for row i."""
    oracle = step_oracle_costs(arrays)
    everything = np.arange(len(arrays))
    metrics = _scores(choice_index, arrays, everything, oracle)
    groups = {f"source/{s}": [i for i, x in enumerate(arrays.sources) if x == s] for s in sorted(set(arrays.sources))}
    groups |= {
        f"T{t:g}": [i for i, x in enumerate(arrays.temperature) if x == t]
        for t in sorted(set(arrays.temperature.tolist()))
    }
    for name, rows in groups.items():
        for key, value in _scores(choice_index, arrays, np.asarray(rows), oracle).items():
            metrics[f"{name}/{key}"] = value
    return metrics


def headroom(arrays: LabelArrays) -> dict[str, float]:
    """What the labels leave to gain: the metrics of always choosing B (the drafter's training block size), so
    that fixed B, the best fixed b, the static oracle and the per-step oracle are all in it, per temperature."""
    candidates = arrays.candidates
    index = candidates.index(arrays.train_block_size) if arrays.train_block_size in candidates else 0
    return evaluate_choices(np.full(len(arrays), index), arrays)


def format_metrics(title: str, metrics: dict[str, float], prediction: bool = True) -> str:
    """The report: per group (all, each temperature), tau and modeled throughput of fixed B, the best fixed b,
    the choices under test (`prediction`), the static oracle and the per-step oracle."""
    columns = [("fixed B", "B"), ("best b", "best_fixed"), ("oracle", "oracle"), ("step", "step_oracle")]
    if prediction:
        columns.insert(2, ("chosen", "pred"))
        title += f": accuracy {metrics['accuracy']:.3f}, gap captured {metrics['gap_captured']:.2f} (tau), "
        title += f"{metrics['throughput_gap_captured']:.2f} (throughput)"
    return format_table(title, metrics, columns)


def format_table(title: str, metrics: dict[str, float], columns: Sequence[tuple[str, str]]) -> str:
    """`metrics` as a table: a line per group (all, each temperature) and measure (tau, throughput), a column
    per (header, metric key) of `columns`; missing values print as nan."""
    lines = [title, f"  {'group':<6} {'':>10} " + " ".join(f"{header:>8}" for header, _ in columns)]
    groups = [""] + sorted({k.split("/", 1)[0] + "/" for k in metrics if k.startswith("T")})
    for group in groups:
        for measure in ("tau", "throughput"):
            values = [metrics.get(f"{group}{measure}_{key}", math.nan) for _, key in columns]
            name = group.rstrip("/") or "all"
            lines.append(f"  {name:<6} {measure:>10} " + " ".join(f"{value:>8.3f}" for value in values))
    return "\n".join(lines)
