"""Block-size policies: what b to draft with, chosen once after prefill, optionally revised per cycle.

A policy is a small protocol with two hooks. `initial_block_size` sees the prefill state (the target's
next-token distribution at the last prompt position and the prompt ids) and picks b for the request;
`next_block_size` runs after every cycle and may change b. Per-request policies (everything here, and
the learned predictor) inherit the no-op per-cycle hook from `PerRequestPolicy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class PrefillState:
    """What is known right after prefill, before the first draft."""

    next_token_logits: torch.Tensor  # (V,) fp32 logits at the last prompt position
    prompt_ids: torch.Tensor  # (P,)
    temperature: float
    train_block_size: int | None  # the drafter's training block size B, None without a drafter

    @cached_property
    def probs(self) -> torch.Tensor:
        """The next-token distribution at temperature 1, (V,) fp32."""
        return torch.softmax(self.next_token_logits.float(), dim=-1)

    @cached_property
    def entropy(self) -> float:
        """Entropy of `probs` in nats."""
        log_probs = torch.log_softmax(self.next_token_logits.float(), dim=-1)
        return float(-(self.probs * log_probs).sum().item())

    def top_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely ids and their probabilities, most likely first: (k,), (k,)."""
        probs, ids = torch.topk(self.probs, min(k, self.probs.shape[-1]))
        return ids, probs


@dataclass(frozen=True)
class CycleState:
    """What one draft/verify cycle did; the input of the per-cycle hook."""

    cycle: int  # 0-based
    block_size: int
    acceptance_length: int
    new_tokens: int  # generated so far, the prefill's token included


@runtime_checkable
class BlockSizePolicy(Protocol):
    name: str

    def initial_block_size(self, prefill: PrefillState) -> int: ...

    def next_block_size(self, cycle: CycleState) -> int: ...


class PerRequestPolicy:
    """Base of policies that decide once per request: the per-cycle hook keeps the block size."""

    name = "per-request"

    def initial_block_size(self, prefill: PrefillState) -> int:
        raise NotImplementedError

    def next_block_size(self, cycle: CycleState) -> int:
        return cycle.block_size


def _check_block_size(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class FixedBlockSize(PerRequestPolicy):
    """The same b for every request (what DFlash does, with b = B)."""

    block_size: int
    name: str = field(default="fixed", init=False)

    def __post_init__(self) -> None:
        _check_block_size(self.block_size, "block_size")

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.block_size


@dataclass(frozen=True)
class EntropyHeuristic(PerRequestPolicy):
    """A training-free baseline: the more confident the first next-token distribution, the longer the block.

    b = round(max_block_size - (max_block_size - min_block_size) * min(H / high_entropy, 1)), with H the
    entropy (nats) of the prefill distribution: H = 0 drafts `max_block_size`, H >= `high_entropy` drafts
    `min_block_size`.
    """

    min_block_size: int
    max_block_size: int
    high_entropy: float = 3.0
    name: str = field(default="entropy", init=False)

    def __post_init__(self) -> None:
        _check_block_size(self.min_block_size, "min_block_size")
        _check_block_size(self.max_block_size, "max_block_size")
        if self.min_block_size > self.max_block_size:
            raise ValueError(
                f"min_block_size ({self.min_block_size}) must not exceed max_block_size ({self.max_block_size})"
            )
        if not (self.high_entropy > 0 and math.isfinite(self.high_entropy)):
            raise ValueError(f"high_entropy must be a positive number of nats, got {self.high_entropy!r}")

    @classmethod
    def around(cls, train_block_size: int, spread: int = 2) -> EntropyHeuristic:
        """Candidates B - spread .. B + spread around the drafter's training block size B."""
        return cls(max(1, train_block_size - spread), train_block_size + spread)

    def initial_block_size(self, prefill: PrefillState) -> int:
        confidence = 1.0 - min(prefill.entropy / self.high_entropy, 1.0)
        span = self.max_block_size - self.min_block_size
        return self.min_block_size + int(round(span * confidence))
