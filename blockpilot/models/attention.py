"""Attention for the masked passes (verify, prefill, drafting): which SDPA kernels they run on, and
grouped-query attention under a mask without copying keys and values once per query head."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

# The name under which `load_target` gives transformers the target's attention (`grouped_sdpa_forward`).
GROUPED_SDPA = "blockpilot_grouped_sdpa"


@contextlib.contextmanager
def masked_attention_kernels(device: torch.device) -> Iterator[None]:
    """Attention without the cuDNN backend on a GPU, around passes with an explicit mask.

    cuDNN attention builds an execution plan on the host for every new shape, and a decode meets each
    (rows, block, span) shape once: on an H100 (torch 2.11, Qwen3-4B's shape) that was 3.4 ms of CPU per
    attention call against 9 us on the GPU, 60% of a cycle. Memory-efficient attention takes the same masks
    and plans nothing. On the CPU this changes nothing.
    """
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


def grouped_query_attention(
    query: torch.Tensor,  # (n, H, q, d)
    key: torch.Tensor,  # (n, KV, k, d), H a multiple of KV
    value: torch.Tensor,  # (n, KV, k, d_v)
    mask: torch.Tensor | None,  # (n or 1, 1, q or 1, k): bool (True = attend) or additive
    *,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:  # (n, H, q, d_v)
    """Scaled dot-product attention where each key/value head serves H / KV query heads.

    The query heads of a group are stacked along the query axis, so attention runs on the KV heads as they
    are stored. transformers' SDPA path instead copies every key and value H / KV times when a mask is given
    (PyTorch's own `enable_gqa` drops to the math kernel under a mask on a GPU): at batch 32 on a CPU those
    copies were 40% of a verify pass. Each query still sees the same keys under the same mask, so the result is
    what per-head attention gives.
    """
    n, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads: expected a multiple")
    groups = heads // kv_heads
    if groups == 1 or (mask is not None and mask.shape[1] != 1):
        if groups > 1:  # a mask per head cannot follow the heads into the query axis
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    stacked = query.reshape(n, kv_heads, groups * q_len, query.shape[-1])
    if mask is not None:
        rows, kv_len = mask.shape[0], mask.shape[-1]
        mask = mask.expand(rows, 1, q_len, kv_len)[:, :, None].expand(rows, 1, groups, q_len, kv_len)
        mask = mask.reshape(rows, 1, groups * q_len, kv_len)
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.reshape(n, heads, q_len, value.shape[-1])


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: SDPA, with masked multi-token passes through
    `grouped_query_attention`; everything else (no mask, one query, biases, caches of their own) is transformers'
    SDPA path unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = attention_mask is None or query.shape[2] == 1 or any(
        kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap")
    )
    if plain or kwargs.get("output_attentions"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = grouped_query_attention(query, key, value, attention_mask, scale=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def register_grouped_sdpa() -> str:
    """Make `GROUPED_SDPA` an attention implementation transformers models can be loaded with (masks built
    as for SDPA); returns the name. Idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    return GROUPED_SDPA
