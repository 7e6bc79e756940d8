"""Counter-based sampling on the device: the token at absolute position p of a row with seed s is drawn by an
exponential race over uniforms that are hashes of (s, p, token), so a draw needs no generator state (it compiles and
replays as a graph) and a row's output for a seed is a function of its prompt and seed alone. The `rejection` rule for
every row at once (`speculative_sampling`) draws from streams of its own."""

from __future__ import annotations

import torch

from blockpilot.decoding.acceptance import residual


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on the low 32 bits of int64 `x` (products wrap mod 2^64: the low bits stay exact)."""
    mask = 0xFFFFFFFF
    x = x & mask
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & mask
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & mask
    return x ^ (x >> 16)


# Independent uniforms for one row and position: the target's picks, the drafter's samples, and the acceptance test
# of the `rejection` rule.
TARGET_STREAM, DRAFT_STREAM, ACCEPT_STREAM = 0, 1, 2


def token_uniforms(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = TARGET_STREAM
) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per (seed, absolute position, token) of a stream: seeds (n,) int64,
    positions (n, S) -> (n, S, vocab). The same triple gives the same number on every device and in any batch."""
    key = _mix32(seeds[:, None] * 0x9E3779B1 + _mix32(positions) + stream * 0x632BE5AB)  # (n, S)
    bits = _mix32(_mix32(key[..., None] * 0x85EBCA77 + torch.arange(vocab, device=seeds.device)))
    return (bits.double() + 0.5) / 4294967296.0


def row_probs(
    logits: torch.Tensor,  # (n, S, V)
    temperatures: torch.Tensor,  # (n,)
    top_ks: torch.Tensor | None = None,  # (n,) int64, 0 = every token
    top_ps: torch.Tensor | None = None,  # (n,) in (0, 1], 1 = every token
) -> torch.Tensor:
    """softmax(logits / T) in float64 with each row's T, (n, S, V) -> (n, S, V) (rows at T = 0: at T = 1); with
    `top_ks` and `top_ps`, each row's distribution truncated (`truncate`)."""
    scale = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits.float() / scale[:, None, None], dim=-1).double()
    return probs if top_ks is None or top_ps is None else truncate(probs, top_ks, top_ps)


def truncate(
    probs: torch.Tensor,  # (n, S, V) float64, each distribution normalized
    top_ks: torch.Tensor,  # (n,) int64, 0 = every token
    top_ps: torch.Tensor,  # (n,) in (0, 1], 1 = every token
) -> torch.Tensor:
    """Each row's distributions cut to its top-k tokens, then to the smallest most-likely set whose mass reaches
    top-p of what is left, renormalized (transformers' TopK then TopP warpers, in that order: a token stays when
    it ranks below k and the tokens before it hold less than p of the top k's mass; the most likely always stays).
    Sampling, drafting and the acceptance tests all read the truncated distribution, so decoding stays exact for
    it. (n, S, V) -> (n, S, V)."""
    vocab = probs.shape[-1]
    ordered, order = probs.sort(dim=-1, descending=True)
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)[:, None, None]  # (n, 1, 1)
    ranks = torch.arange(vocab, device=probs.device)
    in_top_k = ranks < k
    ordered = torch.where(in_top_k, ordered, torch.zeros_like(ordered))
    before = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens ranked above each
    kept_mass = ordered.sum(dim=-1, keepdim=True)
    keep = in_top_k & ((before < top_ps.double()[:, None, None] * kept_mass) | (ranks == 0))
    kept = torch.zeros_like(probs).scatter(-1, order, torch.where(keep, ordered, torch.zeros_like(ordered)))
    return kept / kept.sum(dim=-1, keepdim=True)


def race(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A sample of each distribution (..., V) (unnormalized is fine) by an exponential race: argmax of p_i / E_i
    with E_i = -log(u_i), so token i wins with probability p_i / sum(p). Elementwise and a reduction: it fuses."""
    return (probs / -torch.log(uniforms)).argmax(dim=-1)


def pick_tokens(
    logits: torch.Tensor,  # (n, S, V) fp32
    temperatures: torch.Tensor,  # (n,) fp32, 0 = greedy
    seeds: torch.Tensor,  # (n,) int64
    positions: torch.Tensor,  # (n, S) the absolute position each picked token will sit at
    probs: torch.Tensor | None = None,  # (n, S, V) `row_probs(logits, temperatures)`, where the caller has them
) -> torch.Tensor:
    """(n, S) tokens: the argmax where the row's temperature is 0, else a sample of softmax(logits / T) raced over
    the uniforms of (seed, position)."""
    probs = probs if probs is not None else row_probs(logits, temperatures)
    sampled = race(probs, token_uniforms(seeds, positions, logits.shape[-1]))
    return torch.where(temperatures[:, None] > 0, sampled, logits.argmax(dim=-1))


def speculative_sampling(
    drafts: torch.Tensor,  # (n, W - 1) sampled from draft_probs
    draft_probs: torch.Tensor,  # (n, W - 1, V) the drafter's distributions at each row's temperature
    target_probs: torch.Tensor,  # (n, W, V) the target's, after each block entry
    sizes: torch.Tensor,  # (n,) each row's b
    seeds: torch.Tensor,  # (n,)
    positions: torch.Tensor,  # (n, W) the block entries' positions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rejection` rule (`acceptance.py`) for every row at once: (accepted drafts (n,), the committed tokens
    (n, W): the accepted drafts, then the bonus). Draft j is kept when u * q(d_j) < p(d_j) for the uniform of its
    position; the bonus at the first rejection comes from `residual`, after b - 1 acceptances from p."""
    _, width, vocab = target_probs.shape
    offsets = torch.arange(width, device=drafts.device)
    p = target_probs[:, :-1].gather(-1, drafts[..., None])[..., 0]
    q = draft_probs.gather(-1, drafts[..., None])[..., 0]
    u = token_uniforms(seeds, positions[:, 1:], 1, ACCEPT_STREAM)[..., 0]
    kept = (u * q < p) & (offsets[1:] < sizes[:, None])
    accepted = kept.long().cumprod(dim=1).sum(dim=1)
    at = accepted[:, None, None].expand(-1, 1, vocab)
    p_at = target_probs.gather(1, at)[:, 0]
    q_at = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1).gather(1, at)[:, 0]
    q_at = torch.where((accepted < sizes - 1)[:, None], q_at, torch.zeros_like(q_at))
    bonus_position = positions.gather(1, accepted[:, None]) + 1
    bonus = race(residual(p_at, q_at)[:, None], token_uniforms(seeds, bonus_position, vocab))[:, 0]
    out = torch.cat([drafts, drafts[:, :1]], dim=1)
    return accepted, torch.where(offsets == accepted[:, None], bonus[:, None], out)
