"""Label rows as arrays for the per-request predictor (its inputs, each candidate's tau and cycles, B* under a
score), and the metrics of per-row choices on them, named as `blockpilot.walks` defines them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from blockpilot.cost import CycleCost
from blockpilot.predictor.inputs import DENSE_COLUMN, INPUT_COLUMNS, PredictorInputs, input_arrays
from blockpilot.table import AcceptanceTable, tables_from_row
from blockpilot.walks import (
    POLICY_COLUMNS,
    FixedWalks,
    TreeWalks,
    policy_table,
    step_oracle,
    temperature_groups,
    walk_metrics,
)

SCORES: tuple[str, ...] = ("tau", "throughput")


def shape_prices(candidates: tuple[int, ...], tree_budgets: tuple[int, ...], cost: CycleCost) -> np.ndarray:
    """(S,) the cost of one cycle of each shape: c(b) for each candidate, then the tree cycle's for each budget."""
    return np.asarray([cost(b) for b in candidates] + [cost.tree(n) for n in tree_budgets], dtype=np.float64)


def per_choice(chains: np.ndarray, trees: np.ndarray | None) -> np.ndarray:
    """(N, S) a quantity of every choice (tau, cycles): the candidates' columns (N, C), then the tree budgets' (N, T)
    where the choices are shapes (None: b alone)."""
    return chains if trees is None else np.concatenate([chains, trees], axis=1)


def score_matrix(tau: np.ndarray, prices: np.ndarray, score: str) -> np.ndarray:
    """(N, S) what choosing each shape is worth for each row: its tau, or its tau / its cycle's price
    (`throughput`); tau (N, S), prices (S,) (`shape_prices`)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "tau":
        return tau.astype(np.float32)
    return (tau / prices[None, :]).astype(np.float32)


def best_indices(values: np.ndarray) -> np.ndarray:
    """(N,) index of each row's best shape (B* among block sizes): the best value, ties to the first (the smaller
    b; chains before trees); NaN never wins."""
    return np.argmax(np.where(np.isnan(values), -np.inf, values), axis=1).astype(np.int64)


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
    # Where the rows carry draft trees: their budgets and each budget's tau and cycles, (N, T).
    tree_budgets: tuple[int, ...] = ()
    tree_tau: np.ndarray | None = None
    tree_cycles: np.ndarray | None = None
    over_shapes: bool = False  # the choices are shapes (the candidates, then the tree budgets), not b alone

    def __post_init__(self) -> None:
        if self.over_shapes and not self.tree_budgets:
            raise ValueError("these labels carry no draft trees to choose: label them with --tree-budgets")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def temperature(self) -> np.ndarray:
        return self.inputs["temperature"]

    @property
    def shapes(self) -> int:
        """How many choices a row has: the candidates, and the tree budgets `over_shapes`."""
        return len(self.candidates) + (len(self.tree_budgets) if self.over_shapes else 0)

    @property
    def choice_tau(self) -> np.ndarray:
        """(N, S) tau of every choice."""
        return per_choice(self.tau, self.tree_tau if self.over_shapes else None)

    @property
    def choice_cycles(self) -> np.ndarray:
        """(N, S) cycles of every choice's walks."""
        return per_choice(self.cycles, self.tree_cycles if self.over_shapes else None)

    @property
    def cycle_cost(self) -> np.ndarray:
        """(S,) the cost of one cycle of each choice."""
        return shape_prices(self.candidates, self.tree_budgets if self.over_shapes else (), self.cost)

    @property
    def scores(self) -> np.ndarray:
        """(N, S) what a row's choice is worth: tau, or tau / its cycle's cost."""
        return score_matrix(self.choice_tau, self.cycle_cost, self.score)

    @property
    def best_index(self) -> np.ndarray:
        """(N,) index of each row's best choice under `score` (ties to the first)."""
        return best_indices(self.scores)

    def batch(self, rows: slice | np.ndarray = slice(None)) -> PredictorInputs:
        return PredictorInputs.from_arrays({name: values[rows] for name, values in self.inputs.items()})


def label_columns(dense: bool = False) -> list[str]:
    """The label columns `label_arrays` reads."""
    scored = ["prompt_id", "source", "train_block_size", "candidates", "tau", "cycles", "max_new_tokens"]
    tables = ["table_commits", "table_anchors", "tree_budgets", "table_tree_commits", "tree_tau", "tree_cycles"]
    return [*scored, *tables, *INPUT_COLUMNS, *([DENSE_COLUMN] if dense else [])]


def candidates_of(table: pa.Table) -> tuple[int, ...]:
    return tuple(int(b) for b in table["candidates"][0].as_py())


def label_arrays(
    table: pa.Table,
    dense: bool = False,
    cost: CycleCost | None = None,
    score: str = "tau",
    inputs: bool = True,
    over_shapes: bool = False,
) -> LabelArrays:
    """Checked label rows (`predictor.training.valid_rows`) as arrays; acceptance tables and draft trees are kept
    where present. `inputs=False` skips the predictor's input columns (a summary of the labels needs none);
    `over_shapes`: the choices are the candidates and the tree budgets."""
    candidates = candidates_of(table)
    tables = None
    if "table_commits" in table.column_names and table["table_commits"].null_count == 0:
        wanted = [
            "candidates",
            "table_commits",
            "table_anchors",
            "max_new_tokens",
            "tree_budgets",
            "table_tree_commits",
        ]
        columns = table.select([name for name in wanted if name in table.column_names]).to_pylist()
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
        **tree_columns(table),
        over_shapes=over_shapes,
    )


def tree_columns(table: pa.Table) -> dict[str, Any]:
    """`tree_budgets`, `tree_tau` and `tree_cycles` of label rows that all carry the same draft trees (else none)."""
    if "tree_tau" not in table.column_names or table["tree_tau"].null_count or table.num_rows == 0:
        return {}
    budgets = {tuple(b) for b in table["tree_budgets"].to_pylist()}
    if len(budgets) != 1:
        raise ValueError(f"label rows of different tree budgets: {sorted(budgets)}")
    return {
        "tree_budgets": budgets.pop(),
        "tree_tau": np.asarray(table["tree_tau"].to_pylist(), dtype=np.float32),
        "tree_cycles": np.asarray(table["tree_cycles"].to_pylist(), dtype=np.float64),
    }


def fixed_walks(arrays: LabelArrays) -> FixedWalks:
    """Each candidate's walks over each row, from the rows' tau and cycles (tables or not)."""
    price = shape_prices(arrays.candidates, (), arrays.cost)
    return FixedWalks(arrays.tau * arrays.cycles, arrays.cycles, arrays.cycles * price[None, :])


def step_oracles(arrays: LabelArrays) -> np.ndarray | None:
    """(N, 3) each row's per-step oracle (tokens, cycles, cost) over its tables; None without tables."""
    if arrays.tables is None:
        return None
    return np.asarray([step_oracle(tables, arrays.cost) for tables in arrays.tables])


def choice_walks(arrays: LabelArrays) -> FixedWalks:
    """Each choice's walks over each row (the candidates, and the tree budgets `over_shapes`)."""
    cycles = arrays.choice_cycles
    return FixedWalks(arrays.choice_tau * cycles, cycles, cycles * arrays.cycle_cost[None, :])


def tree_walks(arrays: LabelArrays) -> TreeWalks | None:
    """The tree budgets' walks over the rows (None where the rows carry no trees), priced where the curve can."""
    if arrays.tree_tau is None:
        return None
    cycles = arrays.tree_cycles
    return TreeWalks.priced_by(arrays.tree_tau * cycles, cycles, arrays.tree_budgets, arrays.cost)


def evaluate_choices(choice_index: np.ndarray, arrays: LabelArrays) -> dict[str, float]:
    """The metrics (`blockpilot.walks`) of choosing `candidates[choice_index[i]]` for row i as `pred`, beside fixed B,
    the best fixed b and the oracles; with `accuracy` (the choice is the row's best), `gap_captured` = (pred - B) /
    (oracle - B) in tau (the shape oracle's for choices over shapes) and `throughput_gap_captured` likewise, and `rows`. Over all rows, per temperature and per
    source."""
    choice = np.asarray(choice_index, dtype=np.int64)
    walks, chosen = fixed_walks(arrays), choice_walks(arrays)
    oracles = step_oracles(arrays)
    groups = temperature_groups(arrays.temperature.tolist())
    sources = np.asarray(arrays.sources, dtype=object)
    groups |= {f"source/{s}/": np.flatnonzero(sources == s) for s in sorted(set(arrays.sources))}
    metrics = walk_metrics(
        walks,
        groups,
        arrays.candidates,
        arrays.train_block_size,
        policies={"pred": lambda rows: chosen.rows(rows).chosen(choice[rows])},
        step_oracles=oracles,
        trees=tree_walks(arrays),
    )
    best = arrays.best_index
    for prefix, rows in groups.items():
        if len(rows) == 0:
            continue
        metrics[f"{prefix}rows"] = float(len(rows))
        metrics[f"{prefix}accuracy"] = float((choice[rows] == best[rows]).mean())
        for measure, gap in (("tau", "gap_captured"), ("throughput", "throughput_gap_captured")):
            keys = ("pred", "B", "shape_oracle" if arrays.over_shapes else "oracle")
            pred, base, oracle = (metrics.get(f"{prefix}{measure}_{k}", math.nan) for k in keys)
            metrics[f"{prefix}{gap}"] = float((pred - base) / (oracle - base)) if oracle - base > 1e-9 else math.nan
    return metrics


def headroom(arrays: LabelArrays) -> dict[str, float]:
    """What the labels leave to gain: fixed B, the best fixed b, the static oracle and the per-step oracle."""
    walks = fixed_walks(arrays)
    oracles = step_oracles(arrays)
    groups = temperature_groups(arrays.temperature.tolist())
    return walk_metrics(
        walks, groups, arrays.candidates, arrays.train_block_size, step_oracles=oracles, trees=tree_walks(arrays)
    )


def format_metrics(title: str, metrics: dict[str, float], prediction: bool = True) -> str:
    """The report: per group (all, each temperature), tau and modeled throughput of fixed B, the best fixed b,
    the choices under test (`prediction`), the static oracle and the per-step oracle."""
    if prediction:
        title += f": accuracy {metrics['accuracy']:.3f}, gap captured {metrics['gap_captured']:.2f} (tau), "
        title += f"{metrics['throughput_gap_captured']:.2f} (throughput)"
    return policy_table(title, metrics, POLICY_COLUMNS)
