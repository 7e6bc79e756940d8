"""The engine's model forwards, the project's own over the loaded models' weights (the same tensors, not copies), in
gpt-fast's manner: decoder layers on a KV cache of `capacity` slots per row, written at absolute slots and read through
a boolean mask. What the target forward computes exactly is declared once (`check_exact_target`); anything else is
refused as an engine is built."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from blockpilot.models.drafter import apply_rotary, default_inverse_frequencies, rms_norm, rotary_cos_sin
from blockpilot.models.features import decoder_layers

# In a compiled step on a CPU where MKL's GEMM of a few rows is slow (`measure_few_rows`), projections of at most
# this many rows (a cycle's tokens at batch 1) are the fused reduction of `linear`.
FEW_ROWS = 4
SLOW_GEMM = 1.5  # MKL's GEMM of FEW_ROWS rows over its GEMV of one row, past which `linear` fuses
few_rows: int | None = None  # this process's measured choice: FEW_ROWS, or 0 (F.linear everywhere); None: not yet


def measure_few_rows(weight: torch.Tensor) -> int:
    """Whether `linear` fuses few-row products on this CPU: MKL's GEMM of FEW_ROWS rows against its GEMV of one, on
    `weight` (a projection of the model), eager, once per process (a few milliseconds). Where the GEMM costs more
    than SLOW_GEMM times the GEMV (2.9x on the 2-core AMD EPYC: 4 rows 36.8 us, 1 row 12.8 us, 1152 x 192), the
    GEMM does not read its weight once for all its rows, and the fused loop does. Sets and returns `few_rows`."""
    global few_rows
    if few_rows is not None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return few_rows or 0
    one, several = torch.randn(1, weight.shape[1]), torch.randn(FEW_ROWS, weight.shape[1])

    def seconds(x: torch.Tensor) -> float:
        F.linear(x, weight)  # warm
        rounds = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(20):
                F.linear(x, weight)
            rounds.append(time.perf_counter() - started)
        return sorted(rounds)[2]

    with torch.inference_mode():
        few_rows = FEW_ROWS if seconds(several) > SLOW_GEMM * seconds(one) else 0
    return few_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; in a compiled step on a CPU whose MKL is slow at few rows (`few_rows`), for at
    most that many rows of fp32 (static: a cycle's tokens), the product as a reduction that inductor fuses into one
    vectorized loop over each row's outputs. On the 2-core AMD EPYC, a cycle at batch 1 (mini zoo, compiled,
    interleaved): autoregressive 0.252 -> 0.199 ms, b = 4 0.942 -> 0.683 ms, the tokens the same; 8 rows fused
    were slower there (b = 8 0.976 -> 1.068 ms), hence FEW_ROWS (docs/log.md). Eager the reduction would
    materialize its products: there, and for prompts (dynamic shapes), F.linear."""
    if not few_rows or x.device.type != "cpu" or x.dtype != torch.float32 or not torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    dims = x.shape[:-1]
    rows = math.prod(dims)
    # Asked without a guard: a prompt's length is symbolic, and `rows > few_rows` would guard the compiled prefill to
    # prompts of at most few_rows tokens (every longer one ran eagerly). Dynamo calls a symbolic size an int.
    if not statically_known_true(rows <= few_rows):
        return F.linear(x, weight, bias)
    # Rows outer, the reduced dimension inner and contiguous: the layout inductor vectorizes (the weight-outer form
    # left the next projection reading a transposed input, one parallel region per output: 30x slower).
    out = (x.reshape(rows, 1, x.shape[-1]) * weight).sum(dim=-1)
    if bias is not None:
        out = out + bias
    return out.reshape(*dims, weight.shape[0])


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
class Packing:
    """The entries of a block of n rows x W slots that a packed pass computes: a row's first b slots (its own block
    size), then padding up to a static token count T. Projections, MLPs and heads run over the T packed entries, in a
    (T, C) layout; attention runs over the block padded, each row reading its own cache, so a row pays for its own
    slots, not for the widest row's. `index` (T,): positions in the flattened (n * W) block, every used entry first
    (a permutation's prefix: no entry twice, so a padded entry computes something unread)."""

    index: torch.Tensor  # (T,)
    rows: int
    width: int

    @staticmethod
    def of(sizes: torch.Tensor, width: int, tokens: int) -> Packing:
        """The packing of blocks whose rows use their first `sizes` (n,) slots of `width`, in `tokens` entries
        (at least sizes' sum: the caller's bucket)."""
        used = torch.arange(width, device=sizes.device) < sizes[:, None]  # (n, W)
        index = torch.argsort((~used).flatten().int(), stable=True)[:tokens]
        return Packing(index, sizes.shape[0], width)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """(n, W, ...) -> (T, ...)."""
        return t.reshape(self.rows * self.width, *t.shape[2:])[self.index]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (n, W, ...), zeros where nothing was computed."""
        flat = t.new_zeros(self.rows * self.width, *t.shape[1:]).index_copy(0, self.index, t)
        return flat.reshape(self.rows, self.width, *t.shape[1:])


@dataclass(frozen=True)
class _Attention:
    """One layer's attention weights (views of the model's own parameters); what a family lacks is None."""

    qkv: torch.Tensor  # the query, key and value projections stacked (`stacked`)
    o: torch.Tensor
    qkv_bias: torch.Tensor | None  # Qwen2's q/k/v biases, Llama's and Qwen3's with attention_bias (concatenated)
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm of queries and keys, before the rotation
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class _Experts:
    """A Qwen3-MoE sparse block's weights (the model's own tensors): each token's `top_k` experts by the router's
    softmax, their weights renormalized to sum to 1 where `normalize` (`norm_topk_prob`), each expert a SiLU-gated
    MLP.

    Two exact forms, chosen by the step's static token count T: with fewer routes than experts (T * top_k <
    experts: an autoregressive or narrow step) each token gathers its chosen experts' matrices and multiplies them,
    so the step reads the chosen experts, not all; with as many or more (a verify block: 17 tokens x 8 routes
    against Qwen3-30B-A3B's 128 experts), every expert runs over every token with a routing weight of 0 where it
    was not chosen, reading each expert once."""

    router: torch.Tensor  # (experts, hidden)
    gate_up: torch.Tensor  # (experts, 2 * intermediate, hidden): each expert's gate and up projections stacked
    down: torch.Tensor  # (experts, hidden, intermediate)
    top_k: int
    normalize: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, S, hidden) -> the block's output (n, S, hidden)."""
        shape, flat = x.shape, x.reshape(-1, x.shape[-1])
        probabilities = F.linear(flat, self.router).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)  # (T, k)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        experts = self.router.shape[0]
        # Asked without a guard, as in `linear`: a prompt's length is symbolic, and a prompt runs every expert.
        if statically_known_true(flat.shape[0] * self.top_k < experts):
            gate, up = (self.gate_up[chosen] @ flat[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)  # (T, k, I)
            out = (self.down[chosen] @ (F.silu(gate) * up)[..., None]).squeeze(-1)  # (T, k, hidden)
            return (out * weights[..., None]).sum(dim=1).reshape(shape)
        routing = torch.zeros(flat.shape[0], experts, dtype=x.dtype, device=x.device).scatter(1, chosen, weights)
        gate, up = torch.einsum("th,eih->eti", flat, self.gate_up).chunk(2, dim=-1)  # (E, T, I)
        out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.down)  # (E, T, hidden)
        return torch.einsum("eth,te->th", out, routing).reshape(shape)


def _biases(*projections: nn.Module) -> torch.Tensor | None:
    """The projections' biases concatenated, or None when they have none (all or none: a family's rule)."""
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("the engine computes q/k/v projections that all have biases or none do")
    return torch.cat([b.detach() for b in biases])


def head_dim_of(config: Any) -> int:
    """A layer's head size: `head_dim` where the config names one (Qwen3, Llama 3), else width over heads (Qwen2)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _Layers(nn.Module):
    """Decoder layers (a target's or the drafter's) as plain functions of their weights, with a KV cache per layer of
    `rows` x `capacity` slots: pre-norm attention and a SiLU-gated MLP, plus what a family's layer has beyond them,
    read from the layers themselves (q/k norms, projection biases). `config` names the layers' shape as the families'
    and DFlash's configs do (`num_attention_heads`, `num_key_value_heads`, `rms_norm_eps`, and `head_dim` or
    `hidden_size`)."""

    def __init__(self, layers: Sequence[nn.Module], config: Any, rows: int, capacity: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.eps = head_dim_of(config), config.rms_norm_eps
        self.attention = []
        for a in (layer.self_attn for layer in layers):
            q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            self.attention.append(
                _Attention(
                    stacked([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    a.o_proj.weight,
                    _biases(a.q_proj, a.k_proj, a.v_proj),
                    a.o_proj.bias.detach() if a.o_proj.bias is not None else None,
                    q_norm.weight if q_norm is not None else None,
                    k_norm.weight if k_norm is not None else None,
                )
            )
        self.mlp: list[tuple[torch.Tensor, torch.Tensor] | _Experts] = []
        for m in (layer.mlp for layer in layers):
            if hasattr(m, "experts"):  # Qwen3-MoE's sparse block (its dense layers have a plain MLP)
                router, experts = m.gate, m.experts
                weights = (router.weight, experts.gate_up_proj, experts.down_proj)
                self.mlp.append(_Experts(*weights, router.top_k, router.norm_topk_prob))
                continue
            if any(p.bias is not None for p in (m.gate_proj, m.up_proj, m.down_proj)):
                raise ValueError("the engine computes MLPs without biases (mlp_bias = False)")
            self.mlp.append((stacked([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight))
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
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        queries: bool = True,
        packing: Packing | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x (n, S, hidden), or (T, hidden) packed by `packing` -> queries (n, heads, S, d) (None without `queries`:
        the drafter's context) and keys (n, kv_heads, S, d), both normed (where the family norms them) and rotated,
        and values (n, kv_heads, S, d): one matmul."""
        a = self.attention[index]
        query_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if queries:
            projected = linear(x, a.qkv, a.qkv_bias)
        else:
            bias = a.qkv_bias[query_size:] if a.qkv_bias is not None else None
            projected = linear(x, a.qkv[query_size:], bias)
        if packing is not None:
            projected = packing.unpack(projected)
        n, s, _ = projected.shape
        if queries:
            q, k, v = projected.split([query_size, kv_size, kv_size], dim=-1)
        else:
            q, (k, v) = None, projected.split([kv_size, kv_size], dim=-1)

        def rotated(t: torch.Tensor, heads: int, norm: torch.Tensor | None) -> torch.Tensor:
            t = t.reshape(n, s, heads, self.head_dim)
            if norm is not None:
                t = rms_norm(t, norm, self.eps)
            return apply_rotary(t.transpose(1, 2), cos, sin)

        q = rotated(q, self.heads, a.q_norm) if q is not None else None
        return q, rotated(k, self.kv_heads, a.k_norm), v.reshape(n, s, self.kv_heads, self.head_dim).transpose(1, 2)

    def write(
        self, index: int, rows: slice | torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Keys and values (n, kv_heads, S, d) into the cache rows `rows` (n of them: a slice, or their ids (n,)) at
        `slots` (n, S)."""
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=slots.device)
        row_ids = rows[:, None]
        getattr(self, f"keys_{index}").index_put_((row_ids, slots), k.transpose(1, 2))
        getattr(self, f"values_{index}").index_put_((row_ids, slots), v.transpose(1, 2))

    def cached(self, index: int, rows: slice, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, span) of cache rows `rows` of layer `index`, as attention reads them: keys, values
        (n, kv_heads, span, d), views (nothing copied)."""
        keys, values = getattr(self, f"keys_{index}"), getattr(self, f"values_{index}")
        return keys[rows, :span].transpose(1, 2), values[rows, :span].transpose(1, 2)

    def layer(
        self,
        index: int,
        x: torch.Tensor,
        cos,
        sin,
        rows: slice | torch.Tensor,
        slots,
        mask,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """One whole decoder layer: its block's keys and values written at `slots`, then attention over the
        cache's first `span` slots (mask (n, 1, S, span), True = seen) and the MLP. With no mask the block is a
        whole prompt from slot 0: it attends to itself causally, without reading the cache back. With `packing`, x
        is (T, hidden) packed, and so is the output; attention runs padded (what padding writes lies past each
        row's block, where no query reads)."""
        first, second = self.norms[index]
        q, keys, values = self.project(index, rms_norm(x, first, self.eps), cos, sin, packing=packing)
        n, s = keys.shape[0], keys.shape[2]
        self.write(index, rows, slots, keys, values)
        gqa = self.heads != self.kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        else:
            keys, values = self.cached(index, rows, mask.shape[-1])
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        attention = self.attention[index]
        out = out.transpose(1, 2).reshape(n, s, self.heads * self.head_dim)
        if packing is not None:
            out = packing.pack(out)
        x = x + linear(out, attention.o, attention.o_bias)
        mlp, h = self.mlp[index], rms_norm(x, second, self.eps)
        if isinstance(mlp, _Experts):
            return x + mlp(h)
        gate_up, down = mlp
        gate, up = linear(h, gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, down)


def target_rope(target: nn.Module) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim // 2,) in fp32, attention scaling) of the target's RoPE, as transformers' own
    rope initialization computed them for its `rope_type` (the values the model's rotary module holds), so that the
    engine cannot drift from the model it loads. A dynamic RoPE's are its starting ones, which hold while positions
    stay within the context the engine admits (`check_fits_context`)."""
    rotary = getattr(getattr(target, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "inv_freq", None) is None:
        raise ValueError(f"cannot find the rotary embedding of {type(target).__name__} at `model.rotary_emb`")
    inverse = getattr(rotary, "original_inv_freq", None)
    inverse = inverse if inverse is not None else rotary.inv_freq
    return inverse.detach().float().clone(), float(getattr(rotary, "attention_scaling", 1.0))


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
        self.inverse_frequencies, self.rope_scaling = target_rope(target)
        self.layer_ids = list(layer_ids) if layer_ids is not None else []
        self.last = len(layers) - 1

    def forward(
        self,
        ids: torch.Tensor,  # (n, S) token ids
        positions: torch.Tensor,  # (n, S) rotary positions
        slots: torch.Tensor,  # (n, S) cache slots the tokens' keys and values go to (== positions for a chain)
        mask: torch.Tensor | None,  # (n, 1, S, span) bool: which of the first `span` slots each token sees (itself
        # too); None: the tokens are whole prompts from slot 0, each seeing the ones before it
        rows: slice | torch.Tensor | None = None,  # the n cache rows, or their ids (n,) with no mask (default: the
        # first n)
        logits_at: torch.Tensor | None = None,  # (n,) the one entry of each row whose logits are wanted
        packing: Packing | None = None,  # computes only the packed entries (the others' logits and features are 0)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (n, S, V) in fp32, or (n, 1, V) at `logits_at`, and features (n, S, len(layer_ids) * hidden) or
        None."""
        rows = rows if rows is not None else slice(0, ids.shape[0])
        cos, sin = rotary_cos_sin(positions, self.inverse_frequencies, self.embed.dtype, self.rope_scaling)
        x = F.embedding(ids if packing is None else packing.pack(ids), self.embed)
        taps = {}
        for index in range(len(self.body.attention)):
            x = self.body.layer(index, x, cos, sin, rows, slots, mask, packing)
            if index in self.layer_ids and index != self.last:
                taps[index] = x
        x = rms_norm(x, self.norm, self.eps)
        if self.last in self.layer_ids:
            taps[self.last] = x
        features = torch.cat([taps[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at][:, None]
        logits = linear(x, self.head).float()
        if packing is not None:
            logits, features = packing.unpack(logits), packing.unpack(features) if features is not None else None
        return logits, features


class StaticDrafter(nn.Module):
    """The DFlash drafter's forward over a preallocated context cache: `encode` writes the context's keys and
    values at their slots; `forward` writes the block's own at the block's slots (scratch: the context past the
    anchor is not read, and is rewritten by the next `encode`) and attends over the cache in place."""

    def __init__(self, drafter: nn.Module, rows: int, capacity: int) -> None:
        super().__init__()
        config = drafter.config
        self.body = _Layers(drafter.layers, config, rows, capacity)
        self.fc, self.hidden_norm, self.norm = drafter.fc.weight, drafter.hidden_norm.weight, drafter.norm.weight
        self.eps = config.rms_norm_eps
        self.inverse_frequencies = default_inverse_frequencies(config.head_dim, config.rope_theta, self.fc.device)

    def encode(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: slice,
        packing: Packing | None = None,
    ) -> None:
        """The context keys and values of target features (n, S, F) at `positions`, written at `slots` (n, S) of
        cache rows `rows` (with `packing`, of its entries only: the others' are written as zeros)."""
        features = features if packing is None else packing.pack(features)
        context = rms_norm(linear(features.to(self.fc.dtype), self.fc), self.hidden_norm, self.eps)
        cos, sin = rotary_cos_sin(positions, self.inverse_frequencies, self.fc.dtype)
        for index in range(len(self.body.attention)):
            _, keys, values = self.body.project(index, context, cos, sin, queries=False, packing=packing)
            self.body.write(index, rows, slots, keys, values)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        rows: slice,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """Hidden states (n, W, hidden) of blocks (embeds (n, W, hidden)) at `positions` (n, W), written at those
        slots of cache rows `rows`; mask (n, 1, 1 or W, span) True = seen (the context before the anchor and the
        block's own slots). With `packing`, embeds and hidden states are its entries' (T, hidden)."""
        cos, sin = rotary_cos_sin(positions, self.inverse_frequencies, self.fc.dtype)
        x = embeds.to(self.fc.dtype)
        for index in range(len(self.body.attention)):
            x = self.body.layer(index, x, cos, sin, rows, positions, mask, packing)
        return rms_norm(x, self.norm, self.eps)


# The target families the forward computes exactly (transformers' `model_type`), and what each one's decoder layer
# has beyond pre-norm attention with full causal attention and a SiLU-gated MLP (read from the layers themselves).
TARGET_FAMILIES = {
    "qwen3": "q/k RMSNorm per head, q/k/v/o biases with attention_bias",
    "llama": "q/k/v/o biases with attention_bias (Llama 3.x)",
    "qwen2": "q/k/v biases (Qwen2, Qwen2.5)",
    "qwen3_moe": "Qwen3's attention; sparse blocks of top-k routed SiLU experts (`_Experts`), dense MLPs elsewhere",
}
# The RoPE types whose tables are static over the positions the engine admits (`target_rope`).
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# Config fields of features the forward does not compute: refused whenever set.
UNSUPPORTED_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window_pattern")
EXACT_TARGET = (
    f"{', '.join(TARGET_FAMILIES)} targets with full attention in every layer and a RoPE of type "
    f"{', '.join(EXACT_ROPE_TYPES)}"
)


def check_exact_target(config: Any) -> None:
    """Refuse, naming the field and its value, a target whose forward this engine would not compute exactly."""
    text = config.get_text_config()

    def refuse(field: str, value: Any) -> None:
        raise ValueError(
            f"target {field} = {value!r}: the engine computes {EXACT_TARGET} exactly; this target is refused rather "
            "than decoded wrong"
        )

    model_type = getattr(text, "model_type", None)
    if model_type not in TARGET_FAMILIES:
        refuse("model_type", model_type)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in EXACT_ROPE_TYPES:
        refuse("rope_type", rope_type)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None and getattr(text, "use_sliding_window", False):
        refuse("use_sliding_window", True)
    if any(kind != "full_attention" for kind in layer_types or []):
        refuse("layer_types", sorted(set(layer_types)))
    if getattr(text, "hidden_act", "silu") != "silu":
        refuse("hidden_act", text.hidden_act)
    if getattr(text, "mlp_bias", False):
        refuse("mlp_bias", True)
    for field in UNSUPPORTED_FIELDS:
        if getattr(text, field, None) is not None:
            refuse(field, getattr(text, field))
