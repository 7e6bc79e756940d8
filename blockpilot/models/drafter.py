"""The DFlash drafter, in plain torch modules, reading and writing the z-lab checkpoint layout.

A DFlash drafter drafts a whole block of B tokens in one forward pass:

* Context: hidden states of a few target layers (`target_layer_ids`) at every committed position,
  concatenated, projected by `fc` (no bias) and normalised by `hidden_norm`. Every drafter layer projects
  this same context into its own keys and values; the context is never transformed between layers, so
  its keys and values depend on the target's features alone and can be computed once and cached.
* Block: `[last committed token, MASK x (B-1)]`, embedded with the target's input embeddings. Queries
  come from the block only; keys/values are `[context ; block]`, with no causal mask inside the block.
* Output: the final `norm` of the block's hidden states; the target's `lm_head` turns them into logits.
  The drafter owns no embedding and no head.

Checkpoints follow z-lab's published layout (`z-lab/Qwen3-4B-DFlash-b16`): a Qwen3-style `config.json`
plus `block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`, and
safetensors weights named `layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`,
`mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`, `norm`, `fc`, `hidden_norm`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.files import CONFIG_NAME, WEIGHTS_NAME
from blockpilot.models.attention import grouped_query_attention, masked_attention_kernels

WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# One (keys, values) pair per drafter layer, each (batch, kv_heads, length, head_dim).
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]

# Blocks over one shared context (the acceptance table) are packed side by side into rows of about this many
# slots. Attending row by row copies the context's keys and values once per row instead of once per block
# (those copies were 22% of a table on the small zoo), for a few masked-out keys more per query.
PACKED_SLOTS = 64


def dflash_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """DFlash's rule: `num_ids` layers spread evenly over [1, num_target_layers - 3].

    A 36-layer target with 5 ids gives [1, 9, 17, 25, 33]. Targets too shallow for that rule to give
    distinct ids (a few layers, as in the zoo) get ids spread evenly over [0, num_target_layers - 2].
    """
    if num_ids < 1:
        raise ValueError(f"num_ids must be >= 1, got {num_ids}")
    if num_ids > num_target_layers:
        raise ValueError(f"cannot pick {num_ids} distinct layers of a {num_target_layers}-layer target")
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + i * (end - start) / (num_ids - 1))) for i in range(num_ids)]
    if len(set(ids)) == num_ids and min(ids) >= 0:
        return ids
    end = max(num_target_layers - 2, num_ids - 1)
    return [int(round(i * end / (num_ids - 1))) for i in range(num_ids)]


# The fields of a z-lab `dflash_config` this drafter computes; a drafter with any other is refused.
DFLASH_FIELDS = frozenset({"mask_token_id", "target_layer_ids", "block_size", "num_target_layers"})
# Fields that change a layer's arithmetic in newer drafters and other families; refused when set (1 or null: unset).
IGNORED_COMPUTATION = (
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "embedding_multiplier",
    "logits_scaling",
    "residual_multiplier",
    "attention_multiplier",
)


@dataclass
class DFlashConfig:
    """What a DFlash drafter's `config.json` says, in typed fields; other keys (transformers' bookkeeping: ids,
    dtype, initializer) ride along in `extra`. What would change the drafter's arithmetic is refused."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "block_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise ValueError("drafter config: dflash_config.target_layer_ids is empty")
        if any(not isinstance(i, int) or i < 0 for i in self.target_layer_ids):
            raise ValueError(
                f"drafter config: target_layer_ids must be non-negative integers, got {self.target_layer_ids}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Parse a z-lab style config dict; fields may sit at the top level or under `dflash_config`."""
        raw = dict(raw)
        dflash = dict(raw.pop("dflash_config", None) or {})

        def pick(name: str, default: Any = None) -> Any:
            return dflash.get(name, raw.get(name, default))

        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if name not in raw:
                raise ValueError(f"drafter config: missing required field {name!r}")
        if pick("block_size") is None:
            raise ValueError("drafter config: missing required field 'block_size'")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"drafter config: hidden_act must be 'silu' (Qwen3), got {hidden_act!r}")
        layer_types = raw.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types) or raw.get("use_sliding_window"):
            raise ValueError(
                f"drafter config: only full-attention drafters are supported, got layer_types={layer_types}"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"drafter config: rope_type must be 'default', got {rope_type!r}")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))

        unknown = sorted(set(dflash) - DFLASH_FIELDS)
        if unknown:
            raise ValueError(
                f"drafter config: dflash_config.{unknown[0]} = {dflash[unknown[0]]!r} is not computed by this engine "
                f"(it knows {sorted(DFLASH_FIELDS)}); refused rather than drafted wrong"
            )
        for name in IGNORED_COMPUTATION:
            if raw.get(name) not in (None, 1, 1.0):
                raise ValueError(
                    f"drafter config: {name} = {raw[name]!r} is not computed by this engine; refused rather than "
                    "drafted wrong"
                )
        num_target_layers = pick("num_target_layers")
        target_layer_ids = pick("target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ValueError(
                    "drafter config: needs dflash_config.target_layer_ids or num_target_layers to derive them"
                )
            target_layer_ids = dflash_target_layer_ids(int(num_target_layers), int(raw["num_hidden_layers"]))

        known = {f.name for f in dataclasses.fields(cls)} | {
            "dflash_config",
            "hidden_act",
            "layer_types",
            "rope_parameters",
            "rope_scaling",
            "rope_theta",
            "architectures",
            "model_type",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "attention_dropout",
            "dtype",
        }
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
            vocab_size=int(raw["vocab_size"]),
            block_size=int(pick("block_size")),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            mask_token_id=None if pick("mask_token_id") is None else int(pick("mask_token_id")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            attention_bias=bool(raw.get("attention_bias", False)),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The z-lab layout: Qwen3 fields, `block_size`, `num_target_layers` and `dflash_config`."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids},
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "vocab_size": self.vocab_size,
        }
        return {**self.extra, **out}

    @property
    def context_feature_size(self) -> int:
        """Width of the concatenated target hidden states the drafter reads."""
        return len(self.target_layer_ids) * self.hidden_size


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm: normalised in fp32 (so bf16 checkpoints behave as they were trained), scaled in x's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def default_inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """The default RoPE's inverse frequencies (head_dim // 2,), in fp32."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponent)


def rotary_cos_sin(
    positions: torch.Tensor, inverse_frequencies: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for `positions` (..., S) -> cos, sin (..., S, head_dim), from a RoPE's inverse frequencies
    (head_dim // 2,) and its attention scaling (YaRN's; 1 for the others), as transformers' rotary modules apply them.

    Computed in fp32 on every call (cheap) rather than kept in a buffer that a `.to(bf16)` would round.
    """
    freqs = positions.float()[..., None] * inverse_frequencies.float()
    angles = torch.cat([freqs, freqs], dim=-1)
    if scaling != 1.0:
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, S, d); cos/sin: (N or 1, S, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """context: (N, C, hidden) projected target features -> keys, values (N, kv_heads, C, head_dim)."""
        return self._keys_values(context, cos, sin)

    def attend(
        self,
        x: torch.Tensor,  # (N, S, hidden), already normalised
        cos: torch.Tensor,  # (N or 1, S, head_dim) at the block positions
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],  # (N or 1, kv_heads, C, head_dim) each
        attention_mask: torch.Tensor | None,  # bool (N or 1, 1, S, C + S), True = may attend; packed: see below
        blocks_per_row: int = 1,  # > 1: N / G rows of G blocks side by side, mask (N / G, 1, G * S, C + G * S)
    ) -> torch.Tensor:
        """The attention's output before `o_proj`, (N, S, heads * head_dim): the layer projects it token by token
        (`DrafterLayer.finish`)."""
        n, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, s, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k_block, v_block = self._keys_values(x, cos, sin)
        k_ctx, v_ctx = context_kv
        q, k_block, v_block = (_pack(t, blocks_per_row) for t in (q, k_block, v_block))
        rows = q.shape[0]
        k = torch.cat([k_ctx.expand(rows, -1, -1, -1), k_block], dim=2)
        v = torch.cat([v_ctx.expand(rows, -1, -1, -1), v_block], dim=2)
        out = _unpack(grouped_query_attention(q, k, v, attention_mask), blocks_per_row)
        return out.transpose(1, 2).reshape(n, s, self.num_heads * self.head_dim)


def _block_mask(sees_context: torch.Tensor, sees_block: torch.Tensor, blocks_per_row: int) -> torch.Tensor:
    """Per block, (N, C) context and (N, S) slot visibility -> the mask of rows of G blocks side by side,
    (N / G, 1, G * S, C + G * S): each block's queries see its context and its own slots, nothing of the others
    (G = 1: one block a row)."""
    n, width = sees_block.shape
    rows = n // blocks_per_row
    own = torch.eye(blocks_per_row, dtype=torch.bool, device=sees_block.device)  # (query block, key block)
    block_keys = own[None, :, :, None] & sees_block.view(rows, 1, blocks_per_row, width)
    block_keys = block_keys.reshape(rows, blocks_per_row, -1)
    keys = torch.cat([sees_context.view(rows, blocks_per_row, -1), block_keys], dim=-1)
    return keys[:, :, None, :].expand(-1, -1, width, -1).reshape(rows, 1, blocks_per_row * width, keys.shape[-1])


def _pack(x: torch.Tensor, blocks_per_row: int) -> torch.Tensor:
    """(N, heads, S, d) -> (N / G, heads, G * S, d): G consecutive blocks side by side on the sequence axis."""
    if blocks_per_row == 1:
        return x
    n, heads, s, d = x.shape
    packed = x.view(n // blocks_per_row, blocks_per_row, heads, s, d).transpose(1, 2)
    return packed.reshape(-1, heads, blocks_per_row * s, d)


def _unpack(x: torch.Tensor, blocks_per_row: int) -> torch.Tensor:
    """The inverse of `_pack`."""
    if blocks_per_row == 1:
        return x
    rows, heads, packed, d = x.shape
    s = packed // blocks_per_row
    return x.view(rows, heads, blocks_per_row, s, d).transpose(1, 2).reshape(rows * blocks_per_row, heads, s, d)


class DrafterMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        blocks_per_row: int = 1,
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attended = self.self_attn.attend(normed, cos, sin, context_kv, attention_mask, blocks_per_row)
        return self.finish(x, attended)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention, token by token: (..., hidden) input and (..., heads * head_dim)
        attention output -> (..., hidden)."""
        x = x + self.self_attn.o_proj(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DeferredSlots:
    """Blocks drafted up to the last layer's attention. What is left (the rest of that layer, the final norm) is
    token by token, so `hidden` computes it for chosen slots of chosen blocks only: the acceptance table asks
    only for the slots a block reaches, up to its first wrong draft."""

    residual: torch.Tensor  # (N, W, hidden) the last layer's input
    attended: torch.Tensor  # (N, W, heads * head_dim) its attention output before o_proj
    layer: DrafterLayer
    norm: RMSNorm

    def hidden(self, blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """(len(blocks), stop - start, hidden): slots [start, stop) of `blocks` (indices), the same entries as the
        primitive's full output."""
        return self.norm(self.layer.finish(self.residual[blocks, start:stop], self.attended[blocks, start:stop]))


@dataclass(frozen=True)
class Blocks:
    """N blocks to draft: block n is `[first_tokens[n], MASK, ...]` at positions anchors[n] .. anchors[n] + W - 1,
    its first `sizes[n]` slots real and the rest of the width W padding."""

    first_tokens: torch.Tensor  # (N,) each block's first token (the last committed one)
    anchors: torch.Tensor  # (N,) absolute position of each block's first token
    sizes: torch.Tensor  # (N,) slots of each block
    width: int  # W >= max(sizes)


class DFlashDrafter(nn.Module):
    """DFlash block drafter. See the module docstring for the data flow."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.context_feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> DFlashDrafter:
        """Qwen-style initialisation for training from scratch: N(0, std) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        return self

    @property
    def block_size(self) -> int:
        """The block size the drafter was trained at."""
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inverse = default_inverse_frequencies(self.config.head_dim, self.config.rope_theta, positions.device)
        return rotary_cos_sin(positions, inverse, self.dtype)

    def encode_context(
        self,
        features: torch.Tensor,  # (N, C, len(target_layer_ids) * hidden) raw target hidden states
        positions: torch.Tensor,  # (N or 1, C) absolute positions of those states
    ) -> ContextKV:
        """Keys and values of the context for every layer: the part of the drafter that can be cached."""
        context = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self._rotary(positions)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,  # (N, S, hidden) target embeddings of [last token, MASK...]
        block_positions: torch.Tensor,  # (N or 1, S)
        context_kv: ContextKV,  # from encode_context, batch N or 1
        attention_mask: torch.Tensor | None = None,  # bool (N or 1, 1, S, C + S); None = see everything
        blocks_per_row: int = 1,  # see `_draft`
        defer_last_layer: bool = False,
    ) -> torch.Tensor | DeferredSlots:
        """Hidden states of the block after the final norm, (N, S, hidden); feed them to the target's head. With
        `defer_last_layer`, a `DeferredSlots` that computes them slot by slot on demand."""
        cos, sin = self._rotary(block_positions)
        x = block_embeds.to(self.dtype)
        if len(context_kv) != len(self.layers):
            raise ValueError(f"context_kv has {len(context_kv)} layers; the drafter has {len(self.layers)}")
        for layer, kv in zip(self.layers[:-1], context_kv[:-1], strict=True):
            x = layer(x, cos, sin, kv, attention_mask, blocks_per_row)
        last = self.layers[-1]
        normed = last.input_layernorm(x)
        attended = last.self_attn.attend(normed, cos, sin, context_kv[-1], attention_mask, blocks_per_row)
        if defer_last_layer:
            return DeferredSlots(x, attended, last, self.norm)
        return self.norm(last.finish(x, attended))

    def draft_over_one_context(
        self,
        embed: nn.Module,
        context_kv: ContextKV,  # per layer (1, kv_heads, C, head_dim): one sequence's context features
        blocks: Blocks,
        mask_token_id: int,
        defer_last_layer: bool = False,  # a `DeferredSlots` instead: the last layer's per-token part on demand
    ) -> torch.Tensor | DeferredSlots:
        """The acceptance table's drafting: many blocks over one shared context (every anchor of a sequence),
        attended `PACKED_SLOTS // W` at a time side by side in one row. Hidden states (N, W, hidden)."""
        return self._draft(embed, context_kv, blocks, mask_token_id, defer_last_layer=defer_last_layer)

    def draft_over_contexts(
        self,
        embed: nn.Module,
        context_kv: ContextKV,  # per layer (M, kv_heads, C, head_dim): M sequences' context features
        blocks: Blocks,
        mask_token_id: int,
        context_rows: torch.Tensor,  # (N,) the sequence each block reads
    ) -> torch.Tensor:
        """Training's drafting: blocks at random anchors of many sequences, block n over sequence
        `context_rows[n]`. Hidden states (N, W, hidden)."""
        return self._draft(embed, context_kv, blocks, mask_token_id, context_rows=context_rows)

    def _draft(
        self,
        embed: nn.Module,
        context_kv: ContextKV,  # per layer (M, kv_heads, C, head_dim): context position p at index p
        blocks: Blocks,
        mask_token_id: int,
        context_rows: torch.Tensor | None = None,
        defer_last_layer: bool = False,
    ) -> torch.Tensor | DeferredSlots:
        """The one drafting core under the two entry points above: hidden states of N blocks in one call.

        Block n is `[first_tokens[n], MASK, ...]` at positions anchors[n] .. anchors[n] + W - 1. It sees the
        context strictly before its anchor (index < anchor; later entries may be stale or belong to other
        blocks) and, inside the block, its own `sizes[n]` slots in both directions, never the padding.
        `target head(hidden[:, 1:])` gives the logits of the W - 1 drafted tokens.
        """
        first_tokens, anchors, block_sizes, width = blocks.first_tokens, blocks.anchors, blocks.sizes, blocks.width
        device = first_tokens.device
        n = first_tokens.shape[0]
        shared = context_rows is None and bool(context_kv) and context_kv[0][0].shape[0] == 1
        per_row = min(n, max(1, PACKED_SLOTS // width)) if shared else 1
        padding = -n % per_row
        if padding:  # the last row is filled up with copies of the last block, dropped at the end
            first_tokens, anchors, block_sizes = (
                torch.cat([t, t[-1:].expand(padding)]) for t in (first_tokens, anchors, block_sizes)
            )
        block_ids = torch.full((n + padding, width), mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = first_tokens
        slots = torch.arange(width, device=device)
        positions = anchors[:, None] + slots
        context_length = context_kv[0][0].shape[2] if context_kv else 0
        sees_context = torch.arange(context_length, device=device)[None, :] < anchors[:, None]
        sees_block = slots[None, :] < block_sizes[:, None]
        mask = _block_mask(sees_context, sees_block, per_row)
        if context_rows is not None:
            context_kv = [(k.index_select(0, context_rows), v.index_select(0, context_rows)) for k, v in context_kv]
        with masked_attention_kernels(device):
            hidden = self(embed(block_ids), positions, context_kv, mask, per_row, defer_last_layer)
        if isinstance(hidden, DeferredSlots):
            return dataclasses.replace(hidden, residual=hidden.residual[:n], attended=hidden.attended[:n])
        return hidden[:n]

    # ---------------------------------------------------------------- checkpoints (z-lab layout)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write `config.json` and `model.safetensors` in the z-lab layout."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["dtype"] = str(self.dtype).removeprefix("torch.")
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
        return directory

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """Load a drafter from a local folder or a hub id (e.g. `z-lab/Qwen3-4B-DFlash-b16`)."""
        from blockpilot.models.hub import DRAFTER_FILES, resolve_model_dir

        directory = resolve_model_dir(path_or_id, allow_patterns=DRAFTER_FILES)
        config_path = directory / CONFIG_NAME
        if not config_path.is_file():
            raise FileNotFoundError(f"drafter {str(path_or_id)!r}: no {CONFIG_NAME} in {directory}")
        config = DFlashConfig.from_dict(json.loads(config_path.read_text()))
        state = _read_safetensors(directory)
        if dtype is None:
            dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
        with torch.device("meta"):
            model = cls(config)
        # Older exports carry the rotary table as a tensor; the rotary here is computed, not stored.
        state = {k: v.to(dtype) for k, v in state.items() if "rotary_emb" not in k}
        missing, unexpected = _key_mismatch(model, state)
        if missing or unexpected:
            raise ValueError(
                f"drafter {str(path_or_id)!r}: weights do not match the DFlash layout; "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )
        model.load_state_dict(state, strict=True, assign=True)
        return model.to(device or "cpu").eval()


def _key_mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    expected = set(model.state_dict())
    return sorted(expected - set(state)), sorted(set(state) - expected)


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = directory / WEIGHTS_NAME
    if single.is_file():
        return load_file(single)
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(directory / shard))
        return state
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {directory}")
