"""Which scaled-dot-product attention kernels the masked passes (verify, prefill, drafting) run on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
