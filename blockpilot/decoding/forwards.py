"""The engine's model forwards, the project's own over the loaded models' weights (the same tensors, not copies), in
gpt-fast's manner: decoder layers on a KV cache of `capacity` slots per row, written at absolute slots and read through
a boolean mask. What the target forward computes exactly is declared once (`check_exact_target`); anything else is
refused as an engine is built."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.models.drafter import apply_rotary, rms_norm, rotary_cos_sin
from blockpilot.models.features import decoder_layers


def stacked(weights: Sequence[nn.Parameter]) -> torch.Tensor:
    """The (rows_1 + ... + rows_k, in) stack of weights (rows_i, in), for one matmul in place of k (fewer, larger
    calls: a cycle 6-7% faster on the CPU). Each parameter becomes a view of the stack, so it costs no memory;
    parameters stacked so already (a second decoder over the same models) give their stack back."""
    first, rows = weights[0], sum(w.shape[0] for w in weights)
    storage = first.untyped_storage().data_ptr()
    offsets = [first.storage_offset() + sum(w.numel() for w in weights[:i]) for i in range(len(weights))]
    if all(
        w.untyped_storage().data_ptr() == storage and w.storage_offset() == at and w.is_contiguous()
        for w, at in zip(weights, offsets, strict=True)
    ):
        return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1), offsets[0])
    with torch.no_grad():
        stack = torch.cat([w.detach() for w in weights])
        at = 0
        for w in weights:
            w.data = stack[at : at + w.shape[0]]
            at += w.shape[0]
    return stack


@dataclass(frozen=True)
class _Attention:
    """One layer's attention weights (views of the model's own parameters)."""

    qkv: torch.Tensor  # the query, key and value projections stacked (`stacked`)
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


class _Layers(nn.Module):
    """Qwen3 decoder layers (target or drafter) as plain functions of their weights, with a KV cache per layer of
    `rows` x `capacity` slots. `config` names the layers' shape as both Qwen3's and DFlash's configs do
    (`num_attention_heads`, `num_key_value_heads`, `head_dim`, `rms_norm_eps`)."""

    def __init__(self, layers: Sequence[nn.Module], config: Any, rows: int, capacity: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.eps = config.head_dim, config.rms_norm_eps
        self.attention = [
            _Attention(
                stacked([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                a.o_proj.weight,
                a.q_norm.weight,
                a.k_norm.weight,
            )
            for a in (layer.self_attn for layer in layers)
        ]
        self.mlp = [
            (stacked([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight)
            for m in (layer.mlp for layer in layers)
        ]
        self.norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
        # One buffer per layer, slots before heads: a cycle's writes are one in-place `index_put_` on the two leading
        # dimensions, which inductor keeps in place (written through a view of one stacked cache, it copied the whole
        # cache every cycle: 32 ms against 4.7 eager at 8 rows of 4,096 slots on a CPU).
        weight = self.attention[0].qkv
        shape = (rows, capacity, self.kv_heads, self.head_dim)
        for index in range(len(layers)):
            for kind in ("keys", "values"):
                cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
                self.register_buffer(f"{kind}_{index}", cache, persistent=False)

    def project(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, queries: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x (n, S, hidden) -> queries (n, heads, S, d) (None without `queries`: the drafter's context) and keys
        (n, kv_heads, S, d), both normed and rotated, and values (n, kv_heads, S, d): one matmul."""
        a = self.attention[index]
        n, s, _ = x.shape
        query_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if queries:
            q, k, v = F.linear(x, a.qkv).split([query_size, kv_size, kv_size], dim=-1)
        else:
            q, (k, v) = None, F.linear(x, a.qkv[query_size:]).split([kv_size, kv_size], dim=-1)

        def rotated(t: torch.Tensor, heads: int, norm: torch.Tensor) -> torch.Tensor:
            return apply_rotary(
                rms_norm(t.reshape(n, s, heads, self.head_dim), norm, self.eps).transpose(1, 2), cos, sin
            )

        q = rotated(q, self.heads, a.q_norm) if q is not None else None
        return q, rotated(k, self.kv_heads, a.k_norm), v.reshape(n, s, self.kv_heads, self.head_dim).transpose(1, 2)

    def write(self, index: int, rows: slice, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (n, kv_heads, S, d) into the cache rows `rows` (n of them) at `slots` (n, S)."""
        row_ids = torch.arange(rows.start, rows.stop, device=slots.device)[:, None]
        getattr(self, f"keys_{index}").index_put_((row_ids, slots), k.transpose(1, 2))
        getattr(self, f"values_{index}").index_put_((row_ids, slots), v.transpose(1, 2))

    def cached(self, index: int, rows: slice, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, span) of cache rows `rows` of layer `index`, as attention reads them: keys, values
        (n, kv_heads, span, d), views (nothing copied)."""
        keys, values = getattr(self, f"keys_{index}"), getattr(self, f"values_{index}")
        return keys[rows, :span].transpose(1, 2), values[rows, :span].transpose(1, 2)

    def layer(self, index: int, x: torch.Tensor, cos, sin, rows: slice, slots, mask) -> torch.Tensor:
        """One whole decoder layer: its block's keys and values written at `slots`, then attention over the
        cache's first `span` slots (mask (n, 1, S, span), True = seen) and the MLP. With no mask the block is a
        whole prompt from slot 0: it attends to itself causally, without reading the cache back."""
        first, second = self.norms[index]
        n, s, _ = x.shape
        q, keys, values = self.project(index, rms_norm(x, first, self.eps), cos, sin)
        self.write(index, rows, slots, keys, values)
        gqa = self.heads != self.kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        else:
            keys, values = self.cached(index, rows, mask.shape[-1])
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        x = x + F.linear(out.transpose(1, 2).reshape(n, s, self.heads * self.head_dim), self.attention[index].o)
        gate_up, down = self.mlp[index]
        gate, up = F.linear(rms_norm(x, second, self.eps), gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, down)


class StaticTarget(nn.Module):
    """The target's forward over a preallocated cache; also returns the drafter's context features (the outputs
    of the layers at `layer_ids`, the last one final-normed, as `features.py` taps them)."""

    def __init__(self, target: nn.Module, rows: int, capacity: int, layer_ids: Sequence[int] | None) -> None:
        super().__init__()
        config = target.config.get_text_config()
        layers, norm = decoder_layers(target)
        self.body = _Layers(layers, config, rows, capacity)
        self.embed = target.get_input_embeddings().weight
        self.head = target.get_output_embeddings().weight
        self.norm, self.eps = norm.weight, config.rms_norm_eps
        self.theta, self.head_dim = float(config.rope_parameters["rope_theta"]), config.head_dim
        self.layer_ids = list(layer_ids) if layer_ids is not None else []
        self.last = len(layers) - 1

    def forward(
        self,
        ids: torch.Tensor,  # (n, S) token ids
        positions: torch.Tensor,  # (n, S) rotary positions
        slots: torch.Tensor,  # (n, S) cache slots the tokens' keys and values go to (== positions for a chain)
        mask: torch.Tensor | None,  # (n, 1, S, span) bool: which of the first `span` slots each token sees (itself
        # too); None: the tokens are whole prompts from slot 0, each seeing the ones before it
        rows: slice | None = None,  # the n cache rows (default: the first n)
        logits_at: torch.Tensor | None = None,  # (n,) the one entry of each row whose logits are wanted
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (n, S, V) in fp32, or (n, 1, V) at `logits_at`, and features (n, S, len(layer_ids) * hidden) or
        None."""
        rows = rows if rows is not None else slice(0, ids.shape[0])
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.theta, self.embed.dtype)
        x = F.embedding(ids, self.embed)
        taps = {}
        for index in range(len(self.body.attention)):
            x = self.body.layer(index, x, cos, sin, rows, slots, mask)
            if index in self.layer_ids and index != self.last:
                taps[index] = x
        x = rms_norm(x, self.norm, self.eps)
        if self.last in self.layer_ids:
            taps[self.last] = x
        features = torch.cat([taps[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at][:, None]
        return F.linear(x, self.head).float(), features


class StaticDrafter(nn.Module):
    """The DFlash drafter's forward over a preallocated context cache: `encode` writes the context's keys and
    values at their slots; `forward` writes the block's own at the block's slots (scratch: the context past the
    anchor is not read, and is rewritten by the next `encode`) and attends over the cache in place."""

    def __init__(self, drafter: nn.Module, rows: int, capacity: int) -> None:
        super().__init__()
        config = drafter.config
        self.body = _Layers(drafter.layers, config, rows, capacity)
        self.fc, self.hidden_norm, self.norm = drafter.fc.weight, drafter.hidden_norm.weight, drafter.norm.weight
        self.eps, self.theta, self.head_dim = config.rms_norm_eps, config.rope_theta, config.head_dim

    def encode(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: slice) -> None:
        """The context keys and values of target features (n, S, F) at `positions`, written at `slots` (n, S) of
        cache rows `rows`."""
        context = rms_norm(F.linear(features.to(self.fc.dtype), self.fc), self.hidden_norm, self.eps)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.theta, self.fc.dtype)
        for index in range(len(self.body.attention)):
            _, keys, values = self.body.project(index, context, cos, sin, queries=False)
            self.body.write(index, rows, slots, keys, values)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: slice) -> torch.Tensor:
        """Hidden states (n, W, hidden) of blocks (embeds (n, W, hidden)) at `positions` (n, W), written at those
        slots of cache rows `rows`; mask (n, 1, 1 or W, span) True = seen (the context before the anchor and the
        block's own slots)."""
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.theta, self.fc.dtype)
        x = embeds.to(self.fc.dtype)
        for index in range(len(self.body.attention)):
            x = self.body.layer(index, x, cos, sin, rows, positions, mask)
        return rms_norm(x, self.norm, self.eps)


# What the target forward here computes: Qwen3 dense layers (q/k norms, no biases, SiLU gated MLP), default RoPE,
# full attention in every layer. A target with anything else would decode wrong tokens without an error.
EXACT_TARGET = "Qwen3 dense targets with the default RoPE and full attention in every layer"


def check_exact_target(config: Any) -> None:
    """Refuse, naming the field and its value, a target whose forward this engine would not compute exactly."""
    text = config.get_text_config()

    def refuse(field: str, value: Any) -> None:
        raise ValueError(
            f"target {field} = {value!r}: the engine computes {EXACT_TARGET} exactly; this target is refused rather "
            "than decoded wrong"
        )

    model_type = getattr(text, "model_type", None)
    if model_type != "qwen3":
        refuse("model_type", model_type)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        refuse("rope_type", rope_type)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None and getattr(text, "use_sliding_window", False):
        refuse("use_sliding_window", True)
    if any(kind != "full_attention" for kind in layer_types or []):
        refuse("layer_types", sorted(set(layer_types)))
    if getattr(text, "attention_bias", False):
        refuse("attention_bias", True)
    if getattr(text, "hidden_act", "silu") != "silu":
        refuse("hidden_act", text.hidden_act)
