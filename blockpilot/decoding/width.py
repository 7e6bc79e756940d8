"""The verify width of a batched cycle, priced: how wide the padded draft/verify pass is, given what each row asks for.

A batched cycle drafts every row to the widest block (the verify packs the rows' own blocks, but the drafter pads),
so one row's long block is paid in part by all of them, and how much that costs depends on the batch: flat in the
width on a GPU at small batches, growing with it on a CPU or under load. With a cycle cost c(W, n)
(`blockpilot.cost`) the engine prices each candidate width W (one of the rows' block sizes) as the tokens the
batch is expected to commit over the cycle's cost,

    sum_i E(a_i, min(b_i, W)) / c(W, n),

and caps the rows that may be capped at the best W. E(a, b) = 1 + a + ... + a^(b-1) is the expected commit of a
block of b under independent per-draft acceptance a (the accepted drafts plus the bonus), and a_i is the row's
acceptance rate so far, pooled with the engine's (`AcceptanceRate`). Capping a row's b for one cycle is a per-step
block-size change, so it is as lossless as any policy's; rows sampled at T > 0 are never capped, so that their
output for a seed does not depend on the other rows in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class CyclePrice(Protocol):
    """What prices a cycle: c(block_size, batch), in any unit. `blockpilot.cost.CycleCost` is one (it times the
    engine, so the engine reads it through this protocol, not by importing it)."""

    def __call__(self, block_size: int, batch: int = 1) -> float: ...


def expected_commit(rate: float, block_size: int) -> float:
    """Expected tokens a cycle of block size b commits when each draft is accepted with probability `rate`,
    independently, up to the first rejection: 1 + rate + ... + rate^(b-1)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {rate!r}")
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size!r}")
    return float(block_size) if rate == 1.0 else (1.0 - rate**block_size) / (1.0 - rate)


@dataclass
class AcceptanceRate:
    """Per-draft acceptance counts: `accepted` drafts and `rejected` ones (at most one per cycle: the first wrong
    draft ends the block). `rate(prior, weight)` is the posterior mean with `weight` pseudo-drafts at `prior`."""

    accepted: int = 0
    rejected: int = 0

    def add(self, block_size: int, accepted: int) -> None:
        """One cycle that verified `block_size - 1` drafts and accepted the first `accepted` of them."""
        if not 0 <= accepted <= block_size - 1:
            raise ValueError(f"accepted {accepted!r} drafts of a block of {block_size}; expected 0..{block_size - 1}")
        self.accepted += accepted
        self.rejected += int(accepted < block_size - 1)

    def rate(self, prior: float = 0.5, weight: float = 2.0) -> float:
        trials = self.accepted + self.rejected
        return (self.accepted + prior * weight) / (trials + weight)


def priced_width(
    block_sizes: Sequence[int],
    rates: Sequence[float],
    cost: CyclePrice,
    *,
    floor: int = 1,
) -> int:
    """The verify width W that maximizes sum_i E(rates[i], min(block_sizes[i], W)) / cost(W, n), n the rows.

    Candidates are the rows' block sizes no smaller than `floor` (the widest row that may not be capped); ties go
    to the narrower width. With one row that is its own block: nothing to trade.
    """
    if len(block_sizes) != len(rates) or not block_sizes:
        raise ValueError(f"expected one acceptance rate per row, got {len(rates)} for {len(block_sizes)} rows")
    widest = max(block_sizes)
    if floor > widest:
        raise ValueError(f"floor {floor} exceeds the widest block {widest}")
    rows = len(block_sizes)
    if rows == 1:
        return widest
    best, best_value = widest, -1.0
    for width in sorted({b for b in block_sizes if b >= floor}):
        committed = sum(expected_commit(rate, min(b, width)) for b, rate in zip(block_sizes, rates, strict=True))
        value = committed / cost(width, rows)
        if value > best_value * (1 + 1e-12):
            best, best_value = width, value
    return best
