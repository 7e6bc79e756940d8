"""What a generation is asked to do (`GenerationConfig`, `GenerationRequest`) and what it returns (`GenerationResult`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from blockpilot.checks import non_negative_number, positive_int
from blockpilot.decoding.acceptance import VERIFY_RULES, VerifyRule

if TYPE_CHECKING:
    import torch

    from blockpilot.policies.base import BlockSizePolicy, PrefillState

StopReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class GenerationConfig:
    """How one row decodes. At T > 0 its target distributions are cut to the `top_k` most likely tokens (0: all),
    then to the fewest most likely whose mass reaches `top_p` (1: all), as transformers' warpers do; drafting and
    acceptance read the cut distributions, so the output is an exact sample of them. At T = 0 both change
    nothing (the argmax is always kept)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    verify: VerifyRule = "match"
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        positive_int(self.max_new_tokens, "max_new_tokens")
        non_negative_number(self.temperature, "temperature")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: every token), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1: every token), got {self.top_p!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def truncates(self) -> bool:
        """Whether this row's sampled distributions are cut (T > 0 with a top-k or a top-p)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)


@dataclass(frozen=True)
class GenerationRequest:
    """One row of the engine: a prompt, how to generate, and which block-size policy drives it.

    `record` keeps, for the acceptance table, the target's context features of every processed position and
    a summary of the target distribution that produced each generated token.
    """

    prompt_ids: Sequence[int]
    config: GenerationConfig = field(default_factory=GenerationConfig)
    policy: BlockSizePolicy | None = None  # None: the drafter's training block size (autoregressive without one)
    record: bool = False


RECORD_TOP_K = 8  # the top probabilities a record keeps of each distribution


@dataclass
class GenerationRecord:
    """What a `record`ed generation keeps for the acceptance table."""

    # (P + n - 1, F): the target's context features of every position it processed, on the CPU.
    context_features: torch.Tensor
    # Per generated token g_j, the target distribution (T = 1) it was drawn from: entropy (n,), top-k ids and
    # probabilities (n, k). Entry 0 is the prefill's distribution.
    entropy: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor


@dataclass
class GenerationResult:
    """Tokens and statistics of one generation.

    End-of-generation accounting: tokens past the first stop token or past `max_new_tokens` never reach
    `token_ids`, and `acceptance_lengths` count only tokens that do. So, always,
    `sum(acceptance_lengths) == len(token_ids) - 1` (the first token comes from the prefill, not from a
    cycle) and `1 <= acceptance_lengths[i] <= block_sizes[i]`. A stop token, when hit, is the last entry
    of `token_ids`.
    """

    token_ids: list[int]
    prompt_length: int
    policy: str  # the policy's name, as every surface reports it
    block_size: int  # chosen after prefill; 1 without a drafter
    block_sizes: list[int]  # per cycle (the last may be cut to fit max_new_tokens)
    acceptance_lengths: list[int]  # per cycle, tokens committed (accepted drafts + bonus)
    stop_reason: StopReason
    prefill_time_s: float
    decode_time_s: float  # engine time of the cycles this generation took part in, nothing else
    target_forward_passes: int
    drafter_forward_passes: int
    # Per cycle, the drafted nodes its tree verified (a chain of b counts b - 1); empty where no trees ran.
    tree_nodes: list[int] = field(default_factory=list)
    prefill: PrefillState | None = field(default=None, repr=False)
    record: GenerationRecord | None = field(default=None, repr=False)

    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length; NaN when no cycle ran (the prefill's token was the last)."""
        return sum(self.acceptance_lengths) / self.cycles if self.cycles else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.token_ids) - 1) / self.decode_time_s if self.decode_time_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, `tau` and `cycles`; NaN becomes None."""
        out = {k: v for k, v in asdict(self).items() if k not in ("prefill", "record")}
        out["cycles"] = self.cycles
        out["tau"] = None if math.isnan(self.tau) else self.tau
        return out

    def format_stats(self) -> str:
        """The statistics as aligned text lines (what `blockpilot generate` and the demo print)."""
        tau = "n/a" if math.isnan(self.tau) else f"{self.tau:.2f}"
        lines = [
            f"policy:              {self.policy}",
            f"block size:          {self.block_size}",
            f"block sizes:         {self.block_sizes}",
            f"acceptance lengths:  {self.acceptance_lengths}",
            *([f"tree nodes:          {self.tree_nodes}"] if self.tree_nodes else []),
            f"new tokens:          {len(self.token_ids)} ({self.stop_reason})",
            f"cycles:              {self.cycles}",
            f"mean tau:            {tau}",
            f"target passes:       {self.target_forward_passes}",
            f"prefill:             {self.prefill_time_s * 1000:.1f} ms",
            f"decode:              {self.decode_time_s * 1000:.1f} ms ({self.decode_tokens_per_s:.1f} tokens/s)",
        ]
        return "\n".join(lines)
