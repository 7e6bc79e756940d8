"""Training the block-size predictor on label rows, Ray-free: label checks, the split, objectives, epochs.

`pipelines/train_predictor.py` runs `fit_epochs` on Ray Train workers over the labels' `training_columns`;
the checks, the split and the objectives live here, the metrics in `evaluation.py`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

from blockpilot.checks import positive_int
from blockpilot.cost import CycleCost
from blockpilot.predictor.inputs import INPUT_COLUMNS, PredictorInputs, input_arrays
from blockpilot.scoring import (
    LabelArrays,
    best_indices,
    beyond_cycles,
    candidates_of,
    per_choice,
    score_matrix,
    shape_prices,
)

Objective = Literal["ce", "expected-tau", "normalized-gain"]
OBJECTIVES: tuple[str, ...] = ("ce", "expected-tau", "normalized-gain")
REQUIRED_COLUMNS = ("prompt_id", "source", "train_block_size", "candidates", "tau", "cycles", "error", *INPUT_COLUMNS)


def valid_rows(table: pa.Table, *, what: str = "labels") -> pa.Table:
    """The rows usable for training, after checking the columns; errors name what is wrong."""
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{what}: missing columns {missing} (label files must follow blockpilot.data.labels)")
    usable = table.filter(pc.and_(pc.is_null(table["error"]), pc.is_valid(table["tau"])))
    keep = [i for i, tau in enumerate(usable["tau"].to_pylist()) if not any(math.isnan(v) for v in tau)]
    usable = usable.take(keep) if len(keep) < usable.num_rows else usable
    if usable.num_rows == 0:
        errors = [e for e in table["error"].to_pylist() if e][:3]
        raise ValueError(f"{what}: zero valid rows among {table.num_rows} (errors such as {errors})")
    candidate_sets = {tuple(c) for c in usable["candidates"].to_pylist()}
    if len(candidate_sets) != 1:
        raise ValueError(f"{what}: mismatched candidates across rows: {sorted(candidate_sets)}")
    widths = {len(ids) for ids in usable["topk_ids"].to_pylist()}
    if len(widths) != 1:
        raise ValueError(f"{what}: top-k lists of different lengths {sorted(widths)}")
    return usable


def check_same_candidates(train: pa.Table, other: pa.Table, what: str) -> None:
    if candidates_of(train) != candidates_of(other):
        raise ValueError(
            f"mismatched candidates: training labels sweep {list(candidates_of(train))}, {what} sweeps "
            f"{list(candidates_of(other))}"
        )


def prompt_group(prompt_id: str) -> str:
    """Turns of one conversation stay together: `mt:7#t1` belongs to `mt:7`."""
    return prompt_id.split("#", 1)[0]


def is_validation(prompt_id: str, share: float, seed: int) -> bool:
    """Deterministic split by prompt: the same prompt (every temperature, every turn) lands on one side."""
    digest = hashlib.sha256(f"{seed}:{prompt_group(prompt_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def split_by_prompt(table: pa.Table, share: float, seed: int) -> tuple[pa.Table, pa.Table]:
    if not 0.0 < share < 1.0:
        raise ValueError(f"validation share must be in (0, 1), got {share}")
    mask = pa.array([is_validation(p, share, seed) for p in table["prompt_id"].to_pylist()])
    train, val = table.filter(pc.invert(mask)), table.filter(mask)
    if train.num_rows == 0 or val.num_rows == 0:
        raise ValueError(f"a {share:.0%} split of {table.num_rows} rows leaves one side empty; label more prompts")
    return train, val


def predictor_loss(
    logits: torch.Tensor,  # (N, C)
    tau: torch.Tensor,  # (N, C) each row's score vector: tau, or tau / c(b)
    best_index: torch.Tensor,  # (N,)
    objective: Objective,
    temperature: torch.Tensor | None = None,  # (N,), needed by normalized-gain
) -> torch.Tensor:
    """`ce`: cross-entropy on B* (the paper). `expected-tau`: minus the score expected under the predicted
    distribution, which uses the whole score vector (a near-tie costs little, a bad b costs a lot).
    `normalized-gain`: the same, as the gain over the row's mean score, divided by the mean spread
    (max - min over b) of the batch's rows at the same temperature. At T = 1 the tau vectors of a row
    differ by hundredths, at T = 0 by whole tokens; unnormalized, the T > 0 rows hardly move the weights."""
    if objective == "ce":
        return F.cross_entropy(logits, best_index)
    expected = torch.softmax(logits, dim=-1) * tau
    if objective == "expected-tau":
        return -expected.sum(dim=-1).mean()
    if objective == "normalized-gain":
        if temperature is None:
            raise ValueError("the normalized-gain objective needs the rows' temperatures")
        gain = torch.softmax(logits, dim=-1) * (tau - tau.mean(dim=-1, keepdim=True))
        spread = tau.max(dim=-1).values - tau.min(dim=-1).values
        scale = torch.empty_like(spread)
        for value in temperature.unique():
            rows = temperature == value
            scale[rows] = spread[rows].mean().clamp_min(1e-3)
        return -(gain.sum(dim=-1) / scale).mean()
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def training_columns(
    batch: dict[str, Any],
    dense: bool = False,
    cost: CycleCost | None = None,
    score: str = "tau",
    over_shapes: bool = False,
) -> dict[str, np.ndarray]:
    """Label rows (columns of lists, or of numpy arrays) -> the fixed-shape arrays a training batch
    holds: the predictor's inputs, each row's `score` vector and the index of its best choice (B*; with
    `over_shapes`, the choices are the candidates, then the tree budgets)."""
    candidates = tuple(int(b) for b in batch["candidates"][0])
    budgets = tuple(int(n) for n in batch["tree_budgets"][0]) if over_shapes else ()

    def matrix(column: str) -> np.ndarray:
        return np.stack([np.asarray(x, dtype=np.float32) for x in batch[column]])

    cost = cost or CycleCost.uniform()
    tau = per_choice(matrix("tau"), matrix("tree_tau") if over_shapes else None)
    cycles = per_choice(matrix("cycles"), matrix("tree_cycles") if over_shapes else None)
    beyond = None
    if "prompt_tokens" in batch and "samples" in batch:  # what a drafting request pays beyond its cycles
        beyond = beyond_cycles(candidates, budgets, list(batch["prompt_tokens"]), list(batch["samples"]), cost)
    values = score_matrix(tau, shape_prices(candidates, budgets, cost), score, cycles, beyond)
    return {**input_arrays(batch, dense), "score": values, "best_index": best_indices(values)}


@dataclass(frozen=True)
class PredictorTrainConfig:
    epochs: int = 30
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-4
    objective: Objective = "ce"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        positive_int(self.epochs, "epochs")
        positive_int(self.batch_size, "batch_size")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")


def make_optimizer(model: torch.nn.Module, config: PredictorTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def fit_epochs(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    epochs: Iterable[int],
    batches: Callable[[int], Iterator[dict[str, Any]]],
    config: PredictorTrainConfig,
    on_epoch: Callable[[int, float], None],
) -> None:
    """Run `epochs` (possibly resuming mid-way); `batches(epoch)` yields training batches (`training_columns`
    arrays); `on_epoch(epoch, mean training loss)` validates and checkpoints. A non-finite loss stops the run."""
    device = next(model.parameters()).device
    for epoch in epochs:
        model.train()
        total, count = 0.0, 0
        for batch in batches(epoch):
            logits = model(PredictorInputs.from_arrays(batch).to(device))
            # torch.tensor copies: Ray's object store hands out read-only arrays, which torch warns about.
            loss = predictor_loss(
                logits,
                torch.tensor(batch["score"], dtype=torch.float32, device=device),
                torch.tensor(batch["best_index"], dtype=torch.long, device=device),
                config.objective,
                torch.tensor(batch["temperature"], dtype=torch.float32, device=device),
            )
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"the predictor's loss became {loss.item()} in epoch {epoch}; lower --lr (now {config.lr})"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch["score"])
            count += len(batch["score"])
        on_epoch(epoch, total / max(count, 1))


def shuffled_batches(
    columns: dict[str, np.ndarray], batch_size: int, seed: int
) -> Callable[[int], Iterator[dict[str, Any]]]:
    """`batches(epoch)` over in-memory training columns (`training_columns`' arrays), shuffled anew each epoch."""
    count = len(columns["score"])

    def batches(epoch: int) -> Iterator[dict[str, Any]]:
        order = np.random.default_rng(seed + epoch).permutation(count)
        for start in range(0, count, batch_size):
            rows = order[start : start + batch_size]
            yield {name: column[rows] for name, column in columns.items()}

    return batches


def local_batches(arrays: LabelArrays, batch_size: int, seed: int) -> Callable[[int], Iterator[dict[str, Any]]]:
    """`batches(epoch)` over label arrays, shuffled per epoch (what runs without Ray)."""
    columns = {**arrays.inputs, "score": arrays.scores, "best_index": arrays.best_index}
    return shuffled_batches(columns, batch_size, seed)
