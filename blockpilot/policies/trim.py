"""Draft-then-trim: draft the largest block, then verify only the prefix worth its priced cost.

Before each verify, the drafter's confidence in every drafted slot (its top probability) becomes a survival
probability through a calibration measured on acceptance tables: s(c) = P(a slot's draft is right | every
earlier draft of its block was right, its confidence is c). Verifying k drafts is then expected to commit
1 + sum_{j<=k} prod_{i<=j} s(c_i) tokens (the target's own token included) at the price c(k + 1) of a cycle
that verifies k + 1 positions; the policy verifies the k with the most expected tokens per unit cost. Any
prefix of the drafts verifies losslessly, so the output is exactly that of the acceptance rule.

This is vLLM's confidence-scheduled adaptive verification on a DFlash drafter, with the calibration taken
from the acceptance table instead of a profiling run. `TrimCalibration` is a small JSON file
(`blockpilot calibrate-trim`, `blockpilot.sweep.calibrate_trim`); its cost curve is the one given when it was made (uniform without one, which
never trims: more verified drafts never commit fewer tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blockpilot.checks import positive_int
from blockpilot.cost import CycleCost
from blockpilot.files import write_text_atomic
from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState
from blockpilot.table import AcceptanceTable

CONFIDENCE_BINS = 10


def confidence_bin(confidence: torch.Tensor, bins: int) -> torch.Tensor:
    """The bin of each confidence among `bins` equal-width bins over [0, 1] (a confidence of 1 in the last)."""
    return torch.clamp((confidence * bins).long(), 0, bins - 1)


@dataclass(frozen=True)
class TrimCalibration:
    """Survival probability per confidence bin (bins of equal width over [0, 1]) for drafts of `block_size`."""

    block_size: int
    survival: tuple[float, ...]  # (CONFIDENCE_BINS,)
    counts: tuple[int, ...]  # drafts reached per bin (the evidence behind each survival value)
    cost: CycleCost = field(default_factory=CycleCost.uniform)

    def __post_init__(self) -> None:
        positive_int(self.block_size, "the trim block size")
        if len(self.survival) != len(self.counts) or not self.survival:
            raise ValueError(f"{len(self.survival)} survival values for {len(self.counts)} counts")
        if not all(0.0 <= s <= 1.0 for s in self.survival):
            raise ValueError(f"survival probabilities must lie in [0, 1], got {list(self.survival)}")
        if self.cost.drafted not in (None, self.block_size):
            raise ValueError(
                f"a cost of cycles that draft {self.cost.drafted} cannot price trim's, which draft {self.block_size}"
            )

    @classmethod
    def from_hits(cls, block_size: int, hits: np.ndarray, cost: CycleCost | None = None) -> TrimCalibration:
        """From (bins, 2) [right, reached] counts; a bin without evidence takes the pooled rate."""
        right, reached = hits[:, 0].astype(float), hits[:, 1].astype(float)
        pooled = right.sum() / reached.sum() if reached.sum() else 0.0
        survival = np.where(reached > 0, right / np.maximum(reached, 1), pooled)
        return cls(block_size, tuple(float(s) for s in survival), tuple(int(n) for n in reached), cost or CycleCost.uniform())

    @classmethod
    def from_tables(cls, tables: Sequence[AcceptanceTable], cost: CycleCost | None = None) -> TrimCalibration:
        """From the largest candidate's drafts in acceptance tables (`survival_hits`)."""
        if not tables:
            raise ValueError("no acceptance table to calibrate on")
        drafted = max(tables[0].candidates)
        hits = np.zeros((CONFIDENCE_BINS, 2), dtype=np.int64)
        for table in tables:
            if max(table.candidates) != drafted:
                raise ValueError(f"tables of largest candidates {drafted} and {max(table.candidates)}: calibrate apart")
            hits += survival_hits(table)
        if hits[:, 1].sum() == 0:
            raise ValueError("no draft was verified on these tables: nothing to calibrate (longer generations?)")
        return cls.from_hits(drafted, hits, cost)

    def survival_of(self, confidence: torch.Tensor) -> torch.Tensor:
        bins = confidence_bin(confidence, len(self.survival))
        return torch.as_tensor(self.survival, dtype=torch.float32)[bins.cpu()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "survival": list(self.survival),
            "counts": list(self.counts),
            "cost": self.cost.to_dict(),
        }

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TrimCalibration:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"trim calibration {str(path)!r} does not exist (make one with `blockpilot calibrate-trim`)")
        raw = json.loads(path.read_text())
        return cls(
            int(raw["block_size"]),
            tuple(float(s) for s in raw["survival"]),
            tuple(int(n) for n in raw["counts"]),
            CycleCost.from_dict(raw["cost"]),
        )


def survival_hits(table: AcceptanceTable) -> np.ndarray:
    """(CONFIDENCE_BINS, 2) [right, reached] counts of the largest candidate's drafts in `table`, per bin of their
    confidence: a slot is reached when every earlier draft of its block was right. A block that commits up to
    the end of the sequence says nothing of its draft of the last token (a(i, b) is capped there), so that slot
    and the slots past it count as neither (a block cut to the generation budget ends before them)."""
    if table.confidences is None:
        raise ValueError("this table has no draft confidences (labels from before them): relabel to calibrate trim")
    drafted = max(table.candidates)
    cursors = np.arange(1, table.n)[:, None]
    slots = np.arange(1, drafted)[None, :]  # slot j drafts g_{i + j - 1}
    commits = table.row(drafted).astype(np.int64)[:, None]
    reached = (slots <= commits) & (slots < table.n - cursors)
    right = reached & (slots < commits)
    bins = confidence_bin(torch.from_numpy(table.confidences[reached]), CONFIDENCE_BINS).numpy()
    hits = np.zeros((CONFIDENCE_BINS, 2), dtype=np.int64)
    np.add.at(hits[:, 0], bins[right[reached]], 1)
    np.add.at(hits[:, 1], bins, 1)
    return hits


def walk_trim(calibration: TrimCalibration, table: AcceptanceTable) -> tuple[list[int], list[int]]:
    """(verified block sizes, acceptance lengths) of `DraftThenTrim(calibration)` walked on `table`
    (`AcceptanceTable.walk_trim`): it verifies what the live policy verifies from the same confidences."""
    if calibration.block_size != max(table.candidates):
        raise ValueError(
            f"trim drafts b = {calibration.block_size}; the table keeps the confidences of b = {max(table.candidates)}"
        )
    return table.walk_trim(lambda confidences: verify_count(calibration, torch.from_numpy(confidences)))


def verify_count(calibration: TrimCalibration, confidences: torch.Tensor) -> int:
    """How many of the drafts (confidences (b - 1,), in slot order) to verify: the k in 0 .. b - 1 with the
    most expected committed tokens per unit of cycle cost (ties to the larger k)."""
    survival = torch.cumprod(calibration.survival_of(confidences.float()), dim=0)
    expected = 1.0 + torch.cat([torch.zeros(1), torch.cumsum(survival, dim=0)])  # (b,): k = 0 .. b - 1
    rate = [float(expected[k]) / calibration.cost(k + 1) for k in range(len(expected))]
    return max(range(len(rate)), key=lambda k: (rate[k], k))


class DraftThenTrim(BlockSizePolicy):
    """Draft `calibration.block_size` slots every cycle; verify the prefix `verify_count` picks."""

    name = "trim"
    trims = True

    def __init__(self, calibration: TrimCalibration) -> None:
        self.calibration = calibration

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.calibration.block_size

    def next_block_size(self, cycle: CycleState) -> int:
        return self.calibration.block_size

    def verify_count(self, confidences: torch.Tensor) -> int:
        return verify_count(self.calibration, confidences)
