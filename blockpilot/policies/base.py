"""The contract of a block-size policy, and the state its hooks see.

A policy chooses the block size b a row drafts: once after prefill (`initial_block_size`, from the target's
next-token distribution at the last prompt position), and again after every cycle (`next_block_size`; a policy that
decides once per request keeps b). The batched forms `initial_block_sizes` / `next_block_sizes` are what the engine
calls, once for every row of a batch that shares the policy; by default they loop over the per-row hooks, and a
policy with a model overrides them to decide for every row in one call.

A policy's `name` is what every surface reports (the CLI's JSON, the endpoint's `blockpilot` object, MLflow, the
benchmarks). Every policy is lossless: it changes how many tokens a cycle drafts and verifies, never the output's
distribution. The families are the modules beside this one; `resolve.py` builds one from a spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from blockpilot.blocks import AUTOREGRESSIVE


def distribution_summary(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy (nats) and the top-k ids and probabilities of softmax(logits) at T = 1, for (..., V) logits:
    (...,), (..., k), (..., k), most likely first. The one summary of a target distribution that the prefill
    predictor, the per-step policies and the labels all read."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(dim=-1)
    top_probs, top_ids = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)
    return entropy, top_ids, top_probs


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits)'s largest entry at T = 1, (..., V) -> (...): 1 / sum(exp(logits - max)), two reductions and no
    softmax. A cycle computes it at every anchor (`StaticDecoder.anchor_confidence`), what the confidence rule and the
    step model read."""
    logits = logits.float()
    return (logits - logits.amax(dim=-1, keepdim=True)).exp().sum(dim=-1).reciprocal()


def draft_confidence(draft_logits: torch.Tensor) -> torch.Tensor:
    """The drafter's top probability at T = 1 in each drafted slot, (..., V) -> (...): the labels' table keeps it."""
    return torch.softmax(draft_logits.float(), dim=-1).amax(dim=-1)


@dataclass(frozen=True)
class PrefillState:
    """What is known right after prefill, before the first draft."""

    next_token_logits: torch.Tensor  # (V,) fp32 logits at the last prompt position
    prompt_ids: torch.Tensor  # (P,)
    temperature: float
    train_block_size: int | None  # the drafter's training block size B, None without a drafter
    batch_rows: int = 1  # rows in the batch the request joins (itself included)
    first_token: int | None = None  # g_0, drawn from `next_token_logits`: the first block's first token
    # b -> seconds of a cycle drafting b at the batch the request joins, as the engine measured them (None or a
    # missing b: not measured yet); the same mapping every row of that batch sees, updated in place.
    prices: Mapping[int, float] | None = field(default=None, compare=False, repr=False)
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
    # The top-1 probability of `anchor_logits` at T = 1, computed inside the cycle (`StaticDecoder`).
    anchor_confidence: float | None = None
    prices: Mapping[int, float] | None = field(default=None, compare=False, repr=False)  # as `PrefillState.prices`


class BlockSizePolicy:
    """The base of every policy: b chosen after prefill and kept (override `next_block_size` to change it per
    cycle), the batched hooks looping over the rows."""

    name = "policy"
    # The drafted nodes of a row's draft tree (`blockpilot.tree`), b levels deep; None: a chain of b (a
    # tree of b - 1 nodes, one a level). A policy that chooses a tree per request
    # (`initial_tree_budgets`) names its largest, and the depth of its trees (`tree_depth`).
    tree_nodes: int | None = None
    tree_depth: int | None = None
    # Whether the policy chooses b itself (from the prompt or the cycles), so that in a cycle of several rows the
    # batch chooses its row's b, the cycle's width or autoregression (`decoding.batch_pricing`), and its per-cycle
    # hook is asked only before the cycles its row runs alone; a fixed b is the request's own choice.
    adapts = True

    @property
    def block_size_choices(self) -> tuple[int, ...] | None:
        """The block sizes this policy may choose (None: any), what an engine builds its cycles for up front."""
        return None

    @property
    def keeps_block_size(self) -> bool:
        """Whether a row keeps its first b to the end (no per-cycle hook): a row that starts autoregressive then
        never drafts, and the engine spends nothing on its drafter context."""
        kind = type(self)
        return (
            kind.next_block_size is BlockSizePolicy.next_block_size
            and kind.next_block_sizes is BlockSizePolicy.next_block_sizes
        )

    def keeps_block_size_of(self, prefill: PrefillState) -> bool:
        """Whether this request keeps its first b to the end (`keeps_block_size`, or this policy's own rule for the
        request): the engine then asks no per-cycle hook for it, and its lone cycles compute no choice."""
        return self.keeps_block_size

    def autoregressive_for_good(
        self, prefill: PrefillState, block_size: int, option_price: float = 0.0, saves: float | None = None
    ) -> bool:
        """Whether a row that starts at `block_size` never drafts: the engine then writes no drafter context for it
        and asks its per-cycle hook nothing. `option_price`: what keeping the option to draft later would cost, a
        share of the row's autoregressive time; `saves`: what this policy's drafts saved the rows that kept it, a
        share of the same time (None: not measured); both as the engine measured them
        (`batch_pricing.OptionPrice`, `batch_pricing.DraftSavings`). By default, a row starting autoregressive
        that keeps b (`keeps_block_size_of`), or whose policy's drafts were measured to save no more than the option
        costs."""
        if block_size != AUTOREGRESSIVE:
            return False
        return self.keeps_block_size_of(prefill) or (saves is not None and saves <= option_price)

    def initial_block_size(self, prefill: PrefillState) -> int:
        raise NotImplementedError(f"{type(self).__name__} must choose the first block size")

    def next_block_size(self, cycle: CycleState) -> int:
        return cycle.block_size

    def initial_block_sizes(self, prefills: Sequence[PrefillState]) -> list[int]:
        """The first b of every joining row that shares this policy."""
        return [self.initial_block_size(prefill) for prefill in prefills]

    def initial_tree_budgets(self, prefills: Sequence[PrefillState]) -> list[int | None]:
        """Each joining row's tree budget, kept for the request (None: chains of its b); asked after its first b."""
        return [self.tree_nodes] * len(prefills)

    def next_block_sizes(self, cycles: Sequence[CycleState]) -> list[int]:
        """The next b of every going row that shares this policy."""
        return [self.next_block_size(cycle) for cycle in cycles]
