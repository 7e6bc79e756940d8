"""Training and evaluating the block-size predictor on label rows, Ray-free.

`pipelines/train_predictor.py` runs `fit_epochs` on Ray Train workers over a Ray Dataset of the labels;
the validation, the metrics and the objectives live here.

Metrics of a set of label rows under a predictor (each row's tau vector is read at the chosen b):

* `accuracy`: the chosen b is the row's B*;
* `tau_pred`, `tau_B` (the drafter's training B, when swept), `tau_best_fixed` (the single b with the best
  mean tau on the evaluated rows themselves: the strongest fixed baseline), `tau_oracle` (each row's best);
* `gap_captured` = (tau_pred - tau_B) / (tau_oracle - tau_B);
* the same per source (`source/<name>/...`) and per temperature (`T<t>/...`).
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

from blockpilot.predictor import BlockSizePredictor, PredictorInputs

Objective = Literal["ce", "expected-tau", "normalized-gain"]
OBJECTIVES: tuple[str, ...] = ("ce", "expected-tau", "normalized-gain")
REQUIRED_COLUMNS = (
    "prompt_id",
    "source",
    "temperature",
    "train_block_size",
    "candidates",
    "tau",
    "best_block_size",
    "topk_ids",
    "topk_probs",
    "entropy",
    "error",
)


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


def candidates_of(table: pa.Table) -> tuple[int, ...]:
    return tuple(table["candidates"][0].as_py())


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


@dataclass
class LabelArrays:
    """Label rows as arrays: the predictor's inputs and what scores its choices."""

    prompt_ids: list[str]
    sources: list[str]
    temperature: np.ndarray  # (N,) float32
    topk_ids: np.ndarray  # (N, k) int64
    topk_probs: np.ndarray  # (N, k) float32
    entropy: np.ndarray  # (N,) float32
    tau: np.ndarray  # (N, C) float32
    best_index: np.ndarray  # (N,) int64, index of B* among the candidates
    candidates: tuple[int, ...]
    train_block_size: int | None
    probs: np.ndarray | None = None  # (N, V) float16, dense labels only

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def inputs(self, rows: slice | np.ndarray = slice(None)) -> PredictorInputs:
        return PredictorInputs(
            topk_ids=torch.from_numpy(self.topk_ids[rows]),
            topk_probs=torch.from_numpy(self.topk_probs[rows]),
            entropy=torch.from_numpy(self.entropy[rows]),
            temperature=torch.from_numpy(self.temperature[rows]),
            probs=None if self.probs is None else torch.from_numpy(self.probs[rows].astype(np.float32)),
        )


def label_arrays(table: pa.Table, dense: bool = False) -> LabelArrays:
    candidates = candidates_of(table)
    best = table["best_block_size"].to_pylist()
    probs = None
    if dense and "probs_fp16" in table.column_names and table["probs_fp16"].null_count == 0:
        probs = np.stack([np.asarray(p, dtype=np.float16) for p in table["probs_fp16"].to_pylist()])
    return LabelArrays(
        prompt_ids=table["prompt_id"].to_pylist(),
        sources=table["source"].to_pylist(),
        temperature=np.asarray(table["temperature"].to_pylist(), dtype=np.float32),
        topk_ids=np.asarray(table["topk_ids"].to_pylist(), dtype=np.int64),
        topk_probs=np.asarray(table["topk_probs"].to_pylist(), dtype=np.float32),
        entropy=np.asarray(table["entropy"].to_pylist(), dtype=np.float32),
        tau=np.asarray(table["tau"].to_pylist(), dtype=np.float32),
        best_index=np.asarray([candidates.index(b) for b in best], dtype=np.int64),
        candidates=candidates,
        train_block_size=table["train_block_size"][0].as_py(),
        probs=probs,
    )


def predictor_loss(
    logits: torch.Tensor,  # (N, C)
    tau: torch.Tensor,  # (N, C)
    best_index: torch.Tensor,  # (N,)
    objective: Objective,
    temperature: torch.Tensor | None = None,  # (N,), needed by normalized-gain
) -> torch.Tensor:
    """`ce`: cross-entropy on B* (the paper). `expected-tau`: minus the tau expected under the predicted
    distribution, which uses the whole tau vector (a near-tie costs little, a bad b costs a lot).
    `normalized-gain`: the same, as the gain over the row's mean tau, divided by the mean spread
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


def _scores(choice: np.ndarray, arrays: LabelArrays, rows: np.ndarray) -> dict[str, float]:
    tau = arrays.tau[rows]
    chosen = tau[np.arange(len(rows)), choice[rows]]
    mean_by_b = tau.mean(axis=0)
    oracle = tau.max(axis=1).mean()
    candidates = arrays.candidates
    tau_b = (
        float(mean_by_b[candidates.index(arrays.train_block_size)])
        if arrays.train_block_size in candidates
        else math.nan
    )
    gap = oracle - tau_b
    return {
        "rows": float(len(rows)),
        "accuracy": float((choice[rows] == arrays.best_index[rows]).mean()),
        "tau_pred": float(chosen.mean()),
        "tau_B": tau_b,
        "tau_best_fixed": float(mean_by_b.max()),
        "best_fixed_b": float(candidates[int(mean_by_b.argmax())]),
        "tau_oracle": float(oracle),
        "gap_captured": float((chosen.mean() - tau_b) / gap) if gap > 1e-9 else math.nan,
    }


def evaluate_choices(choice_index: np.ndarray, arrays: LabelArrays) -> dict[str, float]:
    """Metrics (see the module docstring) of choosing `candidates[choice_index[i]]` for row i."""
    everything = np.arange(len(arrays))
    metrics = _scores(choice_index, arrays, everything)
    groups = {f"source/{s}": [i for i, x in enumerate(arrays.sources) if x == s] for s in sorted(set(arrays.sources))}
    groups |= {
        f"T{t:g}": [i for i, x in enumerate(arrays.temperature) if x == t]
        for t in sorted(set(arrays.temperature.tolist()))
    }
    for name, rows in groups.items():
        for key, value in _scores(choice_index, arrays, np.asarray(rows)).items():
            metrics[f"{name}/{key}"] = value
    return metrics


@torch.no_grad()
def predict_indices(model: BlockSizePredictor, arrays: LabelArrays, batch_size: int = 512) -> np.ndarray:
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(arrays), batch_size):
        rows = slice(start, start + batch_size)
        out.append(model(arrays.inputs(rows).to(device)).argmax(dim=-1).cpu())
    return torch.cat(out).numpy()


def evaluate_predictor(model: BlockSizePredictor, arrays: LabelArrays) -> dict[str, float]:
    return evaluate_choices(predict_indices(model, arrays), arrays)


def batch_to_inputs(batch: dict[str, torch.Tensor]) -> PredictorInputs:
    return PredictorInputs(
        topk_ids=batch["topk_ids"].long(),
        topk_probs=batch["topk_probs"].float(),
        entropy=batch["entropy"].float(),
        temperature=batch["temperature"].float(),
        probs=batch["probs"].float() if "probs" in batch else None,
    )


def training_columns(batch: dict[str, Any], dense: bool = False) -> dict[str, np.ndarray]:
    """Label rows (a numpy batch from Ray Data or pyarrow) -> fixed-shape arrays `fit_epochs` batches read."""
    candidates = [tuple(c) for c in batch["candidates"]]
    out = {
        "topk_ids": np.stack([np.asarray(x, dtype=np.int64) for x in batch["topk_ids"]]),
        "topk_probs": np.stack([np.asarray(x, dtype=np.float32) for x in batch["topk_probs"]]),
        "entropy": np.asarray(batch["entropy"], dtype=np.float32),
        "temperature": np.asarray(batch["temperature"], dtype=np.float32),
        "tau": np.stack([np.asarray(x, dtype=np.float32) for x in batch["tau"]]),
        "best_index": np.asarray(
            [c.index(b) for c, b in zip(candidates, batch["best_block_size"], strict=True)], dtype=np.int64
        ),
    }
    if dense:
        out["probs"] = np.stack([np.asarray(x, dtype=np.float16) for x in batch["probs_fp16"]])
    return out


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
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"epochs and batch_size must be >= 1 and lr > 0, got {self}")


def make_optimizer(model: torch.nn.Module, config: PredictorTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def fit_epochs(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    epochs: Iterable[int],
    batches: Callable[[int], Iterator[dict[str, torch.Tensor]]],
    config: PredictorTrainConfig,
    on_epoch: Callable[[int, float], None],
) -> None:
    """Run `epochs` (possibly resuming mid-way); `batches(epoch)` yields training batches; `on_epoch(epoch,
    mean training loss)` validates and checkpoints."""
    device = next(model.parameters()).device
    for epoch in epochs:
        model.train()
        total, count = 0.0, 0
        for batch in batches(epoch):
            logits = model(batch_to_inputs(batch).to(device))
            loss = predictor_loss(
                logits,
                batch["tau"].to(device),
                batch["best_index"].to(device),
                config.objective,
                batch["temperature"].to(device),
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch["tau"])
            count += len(batch["tau"])
        on_epoch(epoch, total / max(count, 1))


def local_batches(
    arrays: LabelArrays, batch_size: int, seed: int
) -> Callable[[int], Iterator[dict[str, torch.Tensor]]]:
    """`batches(epoch)` over in-memory arrays, shuffled per epoch (what runs without Ray)."""

    def batches(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        order = np.random.default_rng(seed + epoch).permutation(len(arrays))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            inputs = arrays.inputs(rows)
            batch = {
                "topk_ids": inputs.topk_ids,
                "topk_probs": inputs.topk_probs,
                "entropy": inputs.entropy,
                "temperature": inputs.temperature,
                "tau": torch.from_numpy(arrays.tau[rows]),
                "best_index": torch.from_numpy(arrays.best_index[rows]),
            }
            if inputs.probs is not None:
                batch["probs"] = inputs.probs
            yield batch

    return batches
