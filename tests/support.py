"""Test doubles and references shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache

from blockpilot.models.attention import RaggedTokens
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


class OracleDrafter(nn.Module):
    """A drafter double that proposes the target's own distributions along a reference continuation.

    For the block slot at absolute position t it returns the target's final (normed) hidden state at
    t - 1 on `reference` (prompt + continuation), so the target's head turns it into exactly the target's
    logits there: at T = 0 every draft along the greedy path is accepted. `wrong_positions` lists
    absolute positions whose draft is replaced by a different token, to force rejections where wanted;
    `sharpness` scales the drafted logits (a drafter close to the target but not equal to it).
    It speaks the drafter interface the engine uses (`encode_context`, `draft_in_rows`, `block_size`,
    `target_layer_ids`, `config.num_hidden_layers`).
    """

    def __init__(
        self,
        target: nn.Module,
        reference: Sequence[int],
        block_size: int,
        wrong_positions: Sequence[int] = (),
        sharpness: float = 1.0,
    ) -> None:
        super().__init__()
        self.target = target
        self.block_size = block_size
        self.target_layer_ids = [0]
        self.mask_token_id = 0
        self.config = SimpleNamespace(num_hidden_layers=0)
        device = next(target.parameters()).device
        with torch.inference_mode():
            out = target.model(torch.tensor([list(reference)], device=device))
        hidden = out.last_hidden_state[0].clone()  # (len, H), already normed: lm_head(hidden) == logits
        for position in wrong_positions:
            # The hidden state of a position whose greedy token differs makes a wrong draft.
            wanted = int(target.lm_head(hidden[position - 1]).argmax())
            other = next(i for i in range(len(reference) - 1) if int(target.lm_head(hidden[i]).argmax()) != wanted)
            hidden[position - 1] = hidden[other]
        self.register_buffer("hidden", hidden * sharpness, persistent=False)

    def encode_context(self, features: torch.Tensor, positions: torch.Tensor) -> list:
        return []

    def draft_in_rows(self, embed, context_kv, blocks, mask_token_id, block_at, packed=False):
        positions = blocks.anchors[:, None] + torch.arange(blocks.width, device=blocks.anchors.device)
        hidden = self.hidden[(positions - 1).clamp(0, self.hidden.shape[0] - 1)]
        return RaggedTokens.of(blocks.sizes, blocks.width).pack(hidden) if packed else hidden


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
