"""Block-size policies: what b to draft with, chosen once after prefill, and optionally revised before every cycle.

A policy is a small protocol with two hooks and a `name` (what every surface reports: the CLI's JSON, the
endpoint's `blockpilot` object, MLflow, benchmarks). `initial_block_size` sees the prefill state (the target's
next-token distribution at the last prompt position and the prompt ids) and picks b for the request;
`next_block_size` runs after every cycle and may change b. Per-request policies inherit the no-op per-cycle
hook from `PerRequestPolicy`. A policy may also define `verify_count(confidences) -> k`: after the draft, the
drafter's top probability in each of the b - 1 drafted slots, and it keeps the first k drafts for the verify
(draft-then-trim, `blockpilot.trim`). A policy that decides with a model may define the batched hooks
`initial_block_sizes(prefills)` and `next_block_sizes(cycles) -> list[int]`: over every row of a batch that shares
the policy, one model call as rows join and one per cycle instead of one per row (`initial_block_sizes` and
`next_block_sizes` below); the engine then calls them in place of the per-row hooks.
Policies are built from a spec by `blockpilot.decoding.resolve`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import torch

from blockpilot.checks import positive_int


def distribution_summary(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy (nats) and the top-k ids and probabilities of softmax(logits) at T = 1, for (..., V) logits:
    (...,), (..., k), (..., k), most likely first. The one summary of a target distribution that the prefill
    predictor, the per-step policies and the labels all read."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(dim=-1)
    top_probs, top_ids = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)
    return entropy, top_ids, top_probs


@dataclass(frozen=True)
class PrefillState:
    """What is known right after prefill, before the first draft."""

    next_token_logits: torch.Tensor  # (V,) fp32 logits at the last prompt position
    prompt_ids: torch.Tensor  # (P,)
    temperature: float
    train_block_size: int | None  # the drafter's training block size B, None without a drafter
    batch_rows: int = 1  # rows in the batch the request joins (itself included)
    first_token: int | None = None  # g_0, drawn from `next_token_logits`: the first block's first token
    # What policies derive from the prefill once per request and read again at later cycles (a per-request
    # predictor's output), by name; it lives as long as the request.
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def probs(self) -> torch.Tensor:
        """The next-token distribution at temperature 1, (V,) fp32."""
        return torch.softmax(self.next_token_logits.float(), dim=-1)

    @cached_property
    def entropy(self) -> float:
        """Entropy of `probs` in nats."""
        return float(distribution_summary(self.next_token_logits, 1)[0])

    def top_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely ids and their probabilities, most likely first: (k,), (k,)."""
        _, ids, probs = distribution_summary(self.next_token_logits, k)
        return ids, probs


@dataclass(frozen=True)
class CycleState:
    """What one draft/verify cycle did; the input of the per-cycle hook, which picks the next cycle's b."""

    cycle: int  # 0-based
    block_size: int  # the b this cycle was drafted with
    acceptance_length: int  # tokens it committed
    new_tokens: int  # generated so far, the prefill's token included
    max_new_tokens: int
    temperature: float
    # (V,) the target's logits that produced the next block's first token (the bonus): the distribution "at
    # the anchor" of the next cycle, already computed by this cycle's verify pass.
    anchor_logits: torch.Tensor | None = None
    first_block_size: int | None = None  # the b the request started with (its per-request choice)
    batch_rows: int = 1  # rows expected in the next cycle's batch: the ones going on, and waiting ones that fit
    recent_tokens: tuple[int, ...] = ()  # the last (up to) two generated tokens, the next block's first one last
    prefill: PrefillState | None = field(default=None, repr=False)  # the request's, as its first choice saw it


@runtime_checkable
class BlockSizePolicy(Protocol):
    name: str

    def initial_block_size(self, prefill: PrefillState) -> int: ...

    def next_block_size(self, cycle: CycleState) -> int: ...


def initial_block_sizes(policy: BlockSizePolicy, prefills: Sequence[PrefillState]) -> list[Any]:
    """The first-cycle hook of `policy` over the joining rows that share it: its batched `initial_block_sizes`
    when it has one, else `initial_block_size` row by row. The values are the policy's, unchecked."""
    return _asked(policy, "initial_block_size", prefills)


def next_block_sizes(policy: BlockSizePolicy, cycles: Sequence[CycleState]) -> list[Any]:
    """The per-cycle hook of `policy` over the rows that share it: its batched `next_block_sizes` when it has
    one, else `next_block_size` row by row. The values are the policy's, unchecked."""
    return _asked(policy, "next_block_size", cycles)


def _asked(policy: BlockSizePolicy, hook: str, states: Sequence[Any]) -> list[Any]:
    """`hook` of `policy` over `states`: in one call of its batched form (`hook` + "s") when it has one."""
    batched = getattr(policy, hook + "s", None)
    if batched is None:
        return [getattr(policy, hook)(state) for state in states]
    sizes = list(batched(states))
    if len(sizes) != len(states):
        raise ValueError(f"policy {policy.name!r} returned {len(sizes)} block sizes for {len(states)} rows")
    return sizes


class PerRequestPolicy:
    """Base of policies that decide once per request: the per-cycle hook keeps the block size."""

    name = "per-request"

    def initial_block_size(self, prefill: PrefillState) -> int:
        raise NotImplementedError

    def next_block_size(self, cycle: CycleState) -> int:
        return cycle.block_size


@dataclass(frozen=True)
class FixedBlockSize(PerRequestPolicy):
    """The same b for every request (what DFlash does, with b = B)."""

    block_size: int
    name: str = field(default="fixed", init=False)

    def __post_init__(self) -> None:
        positive_int(self.block_size, "block_size")

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.block_size


@dataclass(frozen=True)
class Autoregressive(PerRequestPolicy):
    """One token per target pass: what runs without a drafter."""

    name: str = field(default="autoregressive", init=False)

    def initial_block_size(self, prefill: PrefillState) -> int:
        return 1


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
        positive_int(self.min_block_size, "min_block_size")
        positive_int(self.max_block_size, "max_block_size")
        if self.min_block_size > self.max_block_size:
            raise ValueError(
                f"min_block_size ({self.min_block_size}) must not exceed max_block_size ({self.max_block_size})"
            )
        if not (self.high_entropy > 0 and math.isfinite(self.high_entropy)):
            raise ValueError(f"high_entropy must be a positive number of nats, got {self.high_entropy!r}")

    def initial_block_size(self, prefill: PrefillState) -> int:
        confidence = 1.0 - min(prefill.entropy / self.high_entropy, 1.0)
        span = self.max_block_size - self.min_block_size
        return self.min_block_size + int(round(span * confidence))
