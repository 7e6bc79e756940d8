"""The drafter's context features: hidden states of a few target layers, captured during the target's own pass.

DFlash reads `output_hidden_states[i + 1]` for each target layer id i: the output of decoder layer i, except
for the last layer, whose entry is the final-normed state. Asking the target for every hidden state would
hold all of them (for a long prompt on a real target, gigabytes); forward hooks keep only those read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def decoder_layers(target: Any) -> tuple[Sequence[nn.Module], nn.Module]:
    """(decoder layers, final norm) of a Qwen3/Llama-style causal LM."""
    body = getattr(target, "model", None)
    layers, norm = getattr(body, "layers", None), getattr(body, "norm", None)
    if layers is None or norm is None:
        raise ValueError(
            f"cannot find the decoder layers of {type(target).__name__}: expected `model.layers` and `model.norm` "
            "(Qwen3 and Llama style targets)"
        )
    return layers, norm


class FeatureTap:
    """Captures the context features of one forward pass: `with tap: target(...)`, then `tap.features()`.

    `features()` is (batch, seq, len(layer_ids) * hidden), the concatenation DFlash's drafter reads.
    """

    def __init__(self, target: Any, layer_ids: Sequence[int]) -> None:
        layers, norm = decoder_layers(target)
        last = len(layers) - 1
        self._modules = [norm if i == last else layers[i] for i in layer_ids]
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> FeatureTap:
        self._captured.clear()
        for slot, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._hook(slot)))
        return self

    def _hook(self, slot: int):
        def capture(module: nn.Module, inputs: Any, output: Any) -> None:
            self._captured[slot] = output[0] if isinstance(output, tuple) else output

        return capture

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def features(self) -> torch.Tensor:
        if len(self._captured) != len(self._modules):
            raise RuntimeError("no forward pass ran inside the tap")
        return torch.cat([self._captured[slot] for slot in range(len(self._modules))], dim=-1)


