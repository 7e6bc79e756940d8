"""Sampling and the acceptance rules of one draft/verify cycle.

Terms, used the same way everywhere in this package:

* **block**: `[last committed token, d_1, ..., d_k]`, k = b - 1, verified by the target in one pass.
* **draft tokens** `d_1..d_k`: the drafter's proposals for the k positions after the block's first token.
* **target distributions** `p_0..p_k`: the target's next-token distributions at the block's k + 1
  positions; `p_i` is conditioned on the committed text followed by `d_1..d_i`.
* **accepted tokens**: the longest prefix `d_1..d_a` (0 <= a <= k) that the rule keeps.
* **bonus token**: the one token the target adds after the accepted prefix, drawn from `p_a` (or from
  the residual of `p_a` and the drafter's distribution, under `rejection`). It corrects the first rejected
  draft, or extends the block when all k drafts are accepted.
* **acceptance length** tau = a + 1: the tokens one cycle commits, between 1 and b.

Rules. At temperature 0 every rule is `greedy`: accept while `d_i == argmax p_{i-1}`; the output is then
exactly the target's greedy decoding. At temperature T > 0 both rules are exact in distribution (every
committed token is a sample of the target at T given what precedes it):

* `match` (DFlash): drafts are the drafter's argmax; sample `s_i ~ p_i` at every position; accept
  while `d_{i+1} == s_i`; the bonus is `s_a`.
* `rejection` (speculative sampling): drafts are sampled from the drafter's own distributions `q_i`;
  accept `d_i` with probability `min(1, p(d_i) / q(d_i))`; on the first rejection the bonus comes from
  `normalize(max(0, p - q))`, and after k acceptances from `p_k`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

VerifyRule = Literal["match", "rejection"]
VERIFY_RULES: tuple[str, ...] = ("match", "rejection")


def temperature_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of logits / T in fp32, (..., V) -> (..., V). T must be > 0."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` (..., V) -> (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def sample_next(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Argmax at T = 0, else a sample at T; logits (..., V) -> (...)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_tokens(temperature_probs(logits, temperature), generator)


def _prefix_length(matches: torch.Tensor) -> int:
    """Length of the leading run of True in a 1-D bool tensor."""
    return int(matches.to(torch.int64).cumprod(dim=0).sum().item())


def accept_greedy(
    draft_tokens: Sequence[int],  # (k,)
    target_tokens: Sequence[int],  # (k + 1,) the argmax of the target's logits at the block's positions
) -> tuple[int, int]:
    """Temperature 0: (number of accepted drafts, bonus token), from token ids on the host (a batch reads
    its argmax in one transfer, not one a row)."""
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, int(target_tokens[accepted])


def accept_match(
    draft_tokens: torch.Tensor,  # (k,) the drafter's argmax
    target_probs: torch.Tensor,  # (k + 1, V) at temperature T
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """DFlash's rule at T > 0: (number of accepted drafts, bonus token)."""
    samples = sample_tokens(target_probs, generator)
    accepted = _prefix_length(draft_tokens == samples[:-1])
    return accepted, int(samples[accepted].item())


def accept_rejection(
    draft_tokens: torch.Tensor,  # (k,) sampled from draft_probs
    draft_probs: torch.Tensor,  # (k, V) the drafter's distributions at temperature T
    target_probs: torch.Tensor,  # (k + 1, V) at temperature T
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling: (number of accepted drafts, bonus token)."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=draft_tokens.device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    uniform = torch.rand(k, generator=generator, device=draft_tokens.device)
    accepted = _prefix_length(uniform * q < p)
    if accepted == k:
        return k, int(sample_tokens(target_probs[k], generator).item())
    distribution = residual(target_probs[accepted], draft_probs[accepted])
    return accepted, int(sample_tokens(distribution / distribution.sum(), generator).item())


def residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """What the bonus token is drawn from after a rejection: max(0, p - q) (unnormalized), or p where that is all
    zero (p == q, where a rejection has probability 0: rounding). (..., V), (..., V) -> (..., V)."""
    left = (target - draft).clamp_min(0)
    return torch.where(left.sum(dim=-1, keepdim=True) > 0, left, target)
