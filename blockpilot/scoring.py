"""Label rows as arrays for the per-request predictor (its inputs, each candidate's tau and cycles, B* under a
score), and the metrics of per-row choices on them, named as `blockpilot.walks` defines them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from blockpilot.cost import CycleCost
from blockpilot.predictor.inputs import DENSE_COLUMN, INPUT_COLUMNS, PredictorInputs, input_arrays
from blockpilot.table import AcceptanceTable, tables_from_row
from blockpilot.walks import (
    POLICY_COLUMNS,
    TREE,
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


def beyond_cycles(
    candidates: tuple[int, ...],
    tree_budgets: tuple[int, ...],
    prompt_tokens: Sequence[int | None],  # (N,)
    requests: Sequence[float | None],  # (N,) the generations each row's walks sum (its samples)
    cost: CycleCost,
) -> np.ndarray:
    """(N, S) what each row's requests pay beyond their cycles under each shape (`shape_prices`'s order;
    `CycleCost.request`): their start, and their prompts' drafter context where the shape drafts (a tree always
    does, autoregression never)."""
    shapes = [(b,) for b in candidates] + [TREE for _ in tree_budgets]
    out = np.zeros((len(prompt_tokens), len(shapes)))
    for i, (prompt, count) in enumerate(zip(prompt_tokens, requests, strict=True)):
        if prompt is not None:  # labels without a prompt's length price nothing beyond their cycles
            out[i] = [(1 if count is None else count) * cost.request(shape, int(prompt)) for shape in shapes]
    return out


def score_matrix(
    tau: np.ndarray,
    prices: np.ndarray,
    score: str,
    cycles: np.ndarray | None = None,
    beyond: np.ndarray | None = None,
) -> np.ndarray:
    """(N, S) what choosing each shape is worth for each row: its tau, or its walks' committed tokens / their cost
    (`throughput`): tau / (its cycle's price + what its requests pay `beyond` their `cycles`, a cycle's share); tau,
    cycles and beyond (N, S), prices (S,) (`shape_prices`)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "tau":
        return tau.astype(np.float32)
    per_cycle = np.broadcast_to(prices[None, :], tau.shape).astype(np.float64)
    if beyond is not None and cycles is not None:
        per_cycle = per_cycle + np.divide(beyond, cycles, out=np.zeros(tau.shape), where=cycles > 0)
    return (tau / per_cycle).astype(np.float32)


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
    prompt_tokens: np.ndarray | None = None  # (N,) each row's prompt length (None: labels without it)
    requests: np.ndarray | None = None  # (N,) the generations each row's walks sum (its samples)

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

    def beyond_cycles(self, over_shapes: bool | None = None) -> np.ndarray:
        """(N, S) what each row's requests pay beyond their cycles under each choice (`beyond_cycles`), the tree
        budgets' columns too where `over_shapes` (default: this arrays' choices); zero without prompt lengths."""
        shapes = self.over_shapes if over_shapes is None else over_shapes
        budgets = self.tree_budgets if shapes else ()
        if self.prompt_tokens is None:
            return np.zeros((len(self), len(self.candidates) + len(budgets)))
        requests = self.requests if self.requests is not None else np.ones(len(self))
        return beyond_cycles(self.candidates, budgets, self.prompt_tokens, requests, self.cost)

    @property
    def scores(self) -> np.ndarray:
        """(N, S) what a row's choice is worth: tau, or its walks' tokens / their cost (`score_matrix`)."""
        return score_matrix(self.choice_tau, self.cycle_cost, self.score, self.choice_cycles, self.beyond_cycles())

    @property
    def best_index(self) -> np.ndarray:
        """(N,) index of each row's best choice under `score` (ties to the first)."""
        return best_indices(self.scores)

    def batch(self, rows: slice | np.ndarray = slice(None)) -> PredictorInputs:
        return PredictorInputs.from_arrays({name: values[rows] for name, values in self.inputs.items()})


def label_columns(dense: bool = False) -> list[str]:
    """The label columns `label_arrays` reads."""
    scored = ["prompt_id", "source", "train_block_size", "candidates", "tau", "cycles", "max_new_tokens"]
    scored += ["prompt_tokens", "samples"]
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
        **request_columns(table),
    )


def request_columns(table: pa.Table) -> dict[str, Any]:
    """`prompt_tokens` and `requests` (the generations each row's walks sum) of label rows, where they carry both."""
    if any(name not in table.column_names or table[name].null_count for name in ("prompt_tokens", "samples")):
        return {}
    return {
        "prompt_tokens": np.asarray(table["prompt_tokens"].to_pylist(), dtype=np.int64),
        "requests": np.asarray(table["samples"].to_pylist(), dtype=np.float64),
    }


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
    """Each candidate's walks over each row, from the rows' tau and cycles (tables or not), with what their requests
    pay beyond their cycles (`LabelArrays.beyond_cycles`)."""
    price = shape_prices(arrays.candidates, (), arrays.cost)
    spent = arrays.cycles * price[None, :] + arrays.beyond_cycles(over_shapes=False)
    return FixedWalks(arrays.tau * arrays.cycles, arrays.cycles, spent)


def step_oracles(arrays: LabelArrays) -> np.ndarray | None:
    """(N, 3) each row's per-step oracle (tokens, cycles, cost) over its tables; None without tables."""
    if arrays.tables is None:
        return None
    prompts = arrays.prompt_tokens if arrays.prompt_tokens is not None else np.zeros(len(arrays), dtype=np.int64)
    return np.asarray(
        [step_oracle(tables, arrays.cost, int(p)) for tables, p in zip(arrays.tables, prompts, strict=True)]
    )


def choice_walks(arrays: LabelArrays) -> FixedWalks:
    """Each choice's walks over each row (the candidates, and the tree budgets `over_shapes`)."""
    cycles = arrays.choice_cycles
    spent = cycles * arrays.cycle_cost[None, :] + arrays.beyond_cycles()
    return FixedWalks(arrays.choice_tau * cycles, cycles, spent)


def tree_walks(arrays: LabelArrays) -> TreeWalks | None:
    """The tree budgets' walks over the rows (None where the rows carry no trees), priced where the curve can."""
    if arrays.tree_tau is None:
        return None
    cycles = arrays.tree_cycles
    beyond = arrays.beyond_cycles(over_shapes=True)[:, len(arrays.candidates)]  # every tree drafts alike
    return TreeWalks.priced_by(arrays.tree_tau * cycles, cycles, arrays.tree_budgets, arrays.cost, beyond)


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
