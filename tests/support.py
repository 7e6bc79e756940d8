"""Test doubles and references shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache

from blockpilot.models.loading import SpeculativeModels


@torch.inference_mode()
def greedy_reference(
    target: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> list[int]:
    """The target's own greedy decoding: a plain loop, one token a step, with its KV cache.

    Deliberately independent of `blockpilot.decoding` (no padding, no shared helpers), so it can judge it.
    """
    device = next(target.parameters()).device
    cache = {"cache": DynamicCache()}  # transformers' own keyword (the project's installed version)
    out = target(torch.tensor([list(prompt_ids)], device=device), **cache, use_cache=True)
    tokens: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in stop_token_ids or len(tokens) == max_new_tokens:
            return tokens
        out = target(torch.tensor([[token]], device=device), **cache, use_cache=True)


def oracle_drafts(
    monkeypatch,
    target: nn.Module,
    reference: Sequence[int],
    wrong_positions: Sequence[int] = (),
    sharpness: float = 1.0,
) -> None:
    """Make the engine's drafter propose the target's own distributions along a reference continuation.

    The drafted slot at absolute position t gets the target's logits at t - 1 on `reference` (prompt + continuation):
    at T = 0 every draft along the greedy path is accepted. `wrong_positions` lists absolute positions whose draft is
    replaced by another position's (a different greedy token), to force rejections where wanted; `sharpness` scales
    the drafted logits (a drafter close to the target but not equal to it). The drafter's own pass still runs (its
    context too): only the logits it hands the cycle are replaced, in the cycle's `_draft_logits`."""
    import blockpilot.decoding.static as static

    device = next(target.parameters()).device
    with torch.no_grad():
        logits = target(torch.tensor([list(reference)], device=device)).logits[0].float().clone()  # (len, V)
    for position in wrong_positions:
        wanted = int(logits[position - 1].argmax())
        other = next(i for i in range(len(reference) - 1) if int(logits[i].argmax()) != wanted)
        logits[position - 1] = logits[other]
    logits = logits * sharpness

    def draft_logits(self, n: int, span: int, width: int, packing=None) -> torch.Tensor:
        positions = self.length[:n, None] + self.offsets[1:width]  # the drafted slots' positions
        return logits[(positions - 1).clamp(0, len(reference) - 1)]

    monkeypatch.setattr(static.StaticDecoder, "_draft_logits", draft_logits)


def with_drafter(models: SpeculativeModels, drafter: nn.Module) -> SpeculativeModels:
    return SpeculativeModels(
        target=models.target, tokenizer=models.tokenizer, drafter=drafter, mask_token_id=models.mask_token_id or 0
    )


def check_stats_invariants(result, max_new_tokens: int) -> None:
    assert sum(result.acceptance_lengths) == len(result.token_ids) - 1
    assert len(result.acceptance_lengths) == len(result.block_sizes) == result.cycles
    for tau, size in zip(result.acceptance_lengths, result.block_sizes, strict=True):
        assert 1 <= tau <= size
    assert result.target_forward_passes == result.cycles + 1
    assert len(result.token_ids) <= max_new_tokens


def context_writes(engine) -> list[int]:
    """The positions each write of the drafter's context covers on `engine` from now on (its decoder's drafter
    `encode` calls, recorded as they happen): empty while no row keeps a drafter context."""
    drafter, written = engine.decoder.drafter, []
    write = drafter.encode

    def encode(features, positions, slots, rows, packing=None):
        written.append(features.shape[1])
        write(features, positions, slots, rows, packing)

    drafter.encode = encode
    return written
