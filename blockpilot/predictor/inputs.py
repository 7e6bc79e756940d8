"""The predictor's inputs, written once: which columns, and how a row of them becomes tensors.

A label row, a Ray Data batch, the MLflow pyfunc's DataFrame and a live prefill all carry the same columns
(`INPUT_COLUMNS`, plus `probs_fp16` for the dense kind); `input_arrays` turns any of them into fixed-shape
arrays and `PredictorInputs.from_arrays` into tensors. A new input feature is one entry in each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blockpilot.policies.base import PrefillState, distribution_summary

INPUT_COLUMNS = ("topk_ids", "topk_probs", "entropy", "temperature")
DENSE_COLUMN = "probs_fp16"  # the whole prefill distribution, only the dense kind reads it


def prefill_columns(prefill: PrefillState, top_k: int, dense: bool) -> dict[str, Any]:
    """The input columns of one prefill (numpy arrays and numbers; a label row stores them as lists)."""
    entropy, ids, probs = distribution_summary(prefill.next_token_logits, top_k)  # one pass for all three
    return {
        "topk_ids": ids.cpu().numpy(),
        "topk_probs": probs.cpu().numpy(),
        "entropy": float(entropy),
        "temperature": float(prefill.temperature),
        DENSE_COLUMN: prefill.probs.half().cpu().numpy() if dense else None,
    }


def input_arrays(columns: Mapping[str, Any], dense: bool) -> dict[str, np.ndarray]:
    """Columns of N rows (lists per row, or arrays) -> fixed-shape arrays: ids (N, k) int64, probabilities
    (N, k), entropy and temperature (N,) float32, and for `dense` the distribution (N, V) float16."""

    def stacked(name: str, dtype: Any) -> np.ndarray:
        return np.stack([np.asarray(v, dtype=dtype) for v in columns[name]])

    out = {
        "topk_ids": stacked("topk_ids", np.int64),
        "topk_probs": stacked("topk_probs", np.float32),
        "entropy": np.asarray(columns["entropy"], dtype=np.float32),
        "temperature": np.asarray(columns["temperature"], dtype=np.float32),
    }
    if dense:
        out["probs"] = stacked(DENSE_COLUMN, np.float16)
    return out


def nearest_labeled(temperature: torch.Tensor, labeled: Sequence[float]) -> torch.Tensor:
    """(N,) long: the index in `labeled` (the labels' temperatures, ascending) of the one nearest each request's
    `temperature` (N,), the lower of two as near: how a model that decides per labeled temperature reads a request
    at another. In torch ops alone: a compiled cycle traces it."""
    grid = torch.tensor(list(labeled), dtype=temperature.dtype, device=temperature.device)
    return (temperature[:, None] - grid).abs().argmin(dim=1)


@dataclass
class PredictorInputs:
    """A batch of predictor inputs; `probs` is only needed by the dense kind."""

    topk_ids: torch.Tensor  # (N, k) int64
    topk_probs: torch.Tensor  # (N, k) float
    entropy: torch.Tensor  # (N,)
    temperature: torch.Tensor  # (N,)
    probs: torch.Tensor | None = None  # (N, V) float

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> PredictorInputs:
        """From `input_arrays` output (numpy or torch), rows as they are."""

        def tensor(name: str, dtype: torch.dtype) -> torch.Tensor:
            value = arrays[name]
            # Ray Data hands out read-only numpy views; torch warns on those, and a batch is small to copy.
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()
            return torch.as_tensor(value).to(dtype)

        return cls(
            topk_ids=tensor("topk_ids", torch.long),
            topk_probs=tensor("topk_probs", torch.float32),
            entropy=tensor("entropy", torch.float32),
            temperature=tensor("temperature", torch.float32),
            probs=tensor("probs", torch.float32) if arrays.get("probs") is not None else None,
        )

    @classmethod
    def from_prefills(cls, prefills: Sequence[PrefillState], top_k: int, dense: bool) -> PredictorInputs:
        """One row per prefill, the same numbers as `prefill_columns` gives a label row, in torch alone: a live
        request's decision went through numpy in 0.12 ms of its 0.53 ms on a CPU."""
        logits = torch.stack([prefill.next_token_logits for prefill in prefills])  # (N, V)
        entropy, ids, probs = distribution_summary(logits, top_k)
        temperatures = [float(prefill.temperature) for prefill in prefills]
        return cls(
            topk_ids=ids.cpu(),
            topk_probs=probs.float().cpu(),
            entropy=entropy.float().cpu(),
            temperature=torch.tensor(temperatures, dtype=torch.float32),
            probs=torch.softmax(logits.float(), dim=-1).half().float().cpu() if dense else None,
        )

    def to(self, device: torch.device | str) -> PredictorInputs:
        return PredictorInputs(
            self.topk_ids.to(device),
            self.topk_probs.to(device),
            self.entropy.to(device),
            self.temperature.to(device),
            None if self.probs is None else self.probs.to(device),
        )
