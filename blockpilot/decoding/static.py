"""A draft/verify cycle over preallocated caches, every tensor of a fixed shape per (rows, width): the form that
`torch.compile` compiles whole and a CUDA graph replays, with no host round-trip inside a cycle.

The target's and the drafter's forwards here are the project's own, over the loaded models' weights (the same
tensors, not copies), in gpt-fast's manner: Qwen3 layers on a KV cache of `capacity` slots per row, written at
absolute slots and read through a boolean mask, so nothing is cropped, concatenated or reallocated between cycles.

One cycle for `rows` rows of width W (each row its own block size b <= W; slots past b are padding):

    draft:   block [last token, MASK x (W - 1)] at positions length .. length + W - 1; it sees the drafter's context
             before `length` and its own first b slots; drafts = argmax of the target's head on slots 1 .. W - 1
    verify:  the target over [last token, drafts] at the same positions, writing its keys and values there
    pick:    the target's token for every slot: its argmax at T = 0, else its sample (below)
    accept:  a = the leading drafts equal to the target's pick (at most b - 1): DFlash's `match` rule; commit the
             picks at slots 0 .. a (the a accepted drafts and the target's own token)
    context: the drafter's keys and values of the W verified positions, from the target's features there
    state:   length += a + 1, last token = the pick at slot a

Sampling is counter-based: the token at absolute position p of a row with seed s is drawn by an exponential race
over uniforms that are hashes of (s, p, token). It needs no generator state, so it compiles and replays as a graph,
and a row's output for a seed is a function of its prompt and seed alone: the same at any block size, in any batch,
and equal to autoregressive sampling with that seed (which samples the target's distribution exactly, so the speculative
output does too).

Stale entries (a rejected draft's slot, a short prompt's padding) always lie at or past `length`, are invisible to
every query that could read them, and are rewritten before `length` passes them. `width == 1` is autoregressive
decoding: no drafter, one verify slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.models.drafter import apply_rotary, rms_norm, rotary_cos_sin
from blockpilot.models.features import decoder_layers
from blockpilot.models.loading import SpeculativeModels, synchronize

COMPILE_MODES = ("off", "compile", "graph", "compile+graph")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on the low 32 bits of int64 `x` (products wrap mod 2^64: the low bits stay exact)."""
    mask = 0xFFFFFFFF
    x = x & mask
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & mask
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & mask
    return x ^ (x >> 16)


def token_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per (seed, absolute position, token): seeds (n,) int64, positions (n, S) ->
    (n, S, vocab). The same triple gives the same number on every device and in any batch."""
    key = _mix32(seeds[:, None] * 0x9E3779B1 + _mix32(positions))  # (n, S)
    bits = _mix32(_mix32(key[..., None] * 0x85EBCA77 + torch.arange(vocab, device=seeds.device)))
    return (bits.double() + 0.5) / 4294967296.0


def pick_tokens(
    logits: torch.Tensor,  # (n, S, V) fp32
    temperatures: torch.Tensor,  # (n,) fp32, 0 = greedy
    seeds: torch.Tensor,  # (n,) int64
    positions: torch.Tensor,  # (n, S) the absolute position each picked token will sit at
) -> torch.Tensor:
    """(n, S) tokens: the argmax where the row's temperature is 0, else a sample of softmax(logits / T) by an
    exponential race, argmax of p_i / E_i with E_i = -log(u_i) exponential at the uniforms of (seed, position, i):
    token i wins with probability p_i. Every step is elementwise or a reduction, so a compiler fuses it whole."""
    greedy = logits.argmax(dim=-1)
    scale = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / scale[:, None, None], dim=-1).double()
    race = probs / -torch.log(token_uniforms(seeds, positions, logits.shape[-1]))
    return torch.where(temperatures[:, None] > 0, race.argmax(dim=-1), greedy)


@dataclass(frozen=True)
class _Attention:
    """One layer's attention weights (views of the model's own parameters)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
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
                a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, a.q_norm.weight, a.k_norm.weight
            )
            for a in (layer.self_attn for layer in layers)
        ]
        self.mlp = [(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight) for m in (layer.mlp for layer in layers)]
        self.norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
        # One buffer per layer, slots before heads: a cycle's writes are one in-place `index_put_` on the two leading
        # dimensions, which inductor keeps in place (written through a view of one stacked cache, it copied the whole
        # cache every cycle: 32 ms against 4.7 eager at 8 rows of 4,096 slots on a CPU).
        weight = self.attention[0].k
        shape = (rows, capacity, self.kv_heads, self.head_dim)
        for index in range(len(layers)):
            for kind in ("keys", "values"):
                cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
                self.register_buffer(f"{kind}_{index}", cache, persistent=False)

    def project_kv(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (n, S, hidden) -> keys (n, kv_heads, S, d) with rotary applied, values (n, kv_heads, S, d)."""
        a = self.attention[index]
        n, s, _ = x.shape
        k = rms_norm(F.linear(x, a.k).view(n, s, self.kv_heads, self.head_dim), a.k_norm, self.eps).transpose(1, 2)
        v = F.linear(x, a.v).view(n, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def write(self, index: int, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (n, kv_heads, S, d) into the cache at `slots` (n, S) of `rows` (n, 1)."""
        getattr(self, f"keys_{index}").index_put_((rows, slots), k.transpose(1, 2))
        getattr(self, f"values_{index}").index_put_((rows, slots), v.transpose(1, 2))

    def cached(self, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n rows of layer `index`'s cache, as attention reads them: keys, values (n, kv_heads, slots, d)."""
        return getattr(self, f"keys_{index}")[:n].transpose(1, 2), getattr(self, f"values_{index}")[:n].transpose(1, 2)

    def attend(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Queries of x (n, S, hidden) over the first n rows of the cache; mask (n, 1, S, capacity), True = seen."""
        a = self.attention[index]
        n, s, _ = x.shape
        q = rms_norm(F.linear(x, a.q).view(n, s, self.heads, self.head_dim), a.q_norm, self.eps).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        out = F.scaled_dot_product_attention(
            q, *self.cached(index, n), attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return F.linear(out.transpose(1, 2).reshape(n, s, self.heads * self.head_dim), a.o)

    def layer(self, index: int, x: torch.Tensor, cos, sin, rows, slots, mask) -> torch.Tensor:
        """One whole decoder layer: its block's keys and values written at `slots`, then attention and MLP."""
        first, second = self.norms[index]
        normed = rms_norm(x, first, self.eps)
        self.write(index, rows, slots, *self.project_kv(index, normed, cos, sin))
        x = x + self.attend(index, normed, cos, sin, mask)
        gate, up, down = self.mlp[index]
        normed = rms_norm(x, second, self.eps)
        return x + F.linear(F.silu(F.linear(normed, gate)) * F.linear(normed, up), down)


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
        mask: torch.Tensor,  # (n, 1, S, capacity) bool: which slots each token sees (its own included)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (n, S, V) in fp32 and features (n, S, len(layer_ids) * hidden) or None."""
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
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

    def encode(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The context keys and values of target features (n, S, F) at `positions`, written at `slots` (n, S)."""
        context = rms_norm(F.linear(features.to(self.fc.dtype), self.fc), self.hidden_norm, self.eps)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.theta, self.fc.dtype)
        rows = torch.arange(features.shape[0], device=features.device)[:, None]
        for index in range(len(self.body.attention)):
            self.body.write(index, rows, slots, *self.body.project_kv(index, context, cos, sin))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, W, hidden) of blocks (embeds (n, W, hidden)) at `positions` (n, W), written at those
        slots; mask (n, 1, 1 or W, capacity) True = seen (the context before the anchor and the block's own slots)."""
        rows = torch.arange(embeds.shape[0], device=embeds.device)[:, None]
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.theta, self.fc.dtype)
        x = embeds.to(self.fc.dtype)
        for index in range(len(self.body.attention)):
            x = self.body.layer(index, x, cos, sin, rows, positions, mask)
        return rms_norm(x, self.norm, self.eps)


class StaticDecoder:
    """Speculative decoding of `rows` rows at width `width` (each row its own b <= width) over
    `capacity` cache slots a row, its cycle compiled or replayed per `compile` (`COMPILE_MODES`):

    - `off`: eager, the reference;
    - `compile`: `torch.compile(fullgraph=True)` of the whole cycle (inductor, CPU or GPU);
    - `graph` (CUDA): the eager cycle captured once as a CUDA graph and replayed;
    - `compile+graph` (CUDA): the compiled cycle, captured and replayed.

    With `sampling`, rows may decode at T > 0 (each with its own temperature and seed); without it the cycle
    takes argmaxes only and skips the sampler's work.

    `start` prefills a batch (eager, its own shapes); `cycle` runs one cycle for every row on device buffers and
    returns (tokens (rows, W), counts (rows,)): row i committed tokens[i, :counts[i]].
    """

    def __init__(
        self,
        models: SpeculativeModels,
        *,
        rows: int,
        width: int,
        capacity: int,
        compile: str = "off",
        sampling: bool = False,
    ) -> None:
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        if "graph" in compile and models.device.type != "cuda":
            raise ValueError(f"compile={compile!r} replays CUDA graphs: it needs a CUDA device, got {models.device}")
        if width > 1 and models.drafter is None:
            raise ValueError(f"width {width} drafts: it needs a drafter (width 1 decodes autoregressively)")
        self.models, self.rows, self.width, self.capacity, self.mode = models, rows, width, capacity, compile
        self.sampling = sampling  # rows may have T > 0 (else the cycle only takes argmaxes)
        self.device = models.device
        drafting = width > 1
        layer_ids = models.drafter.target_layer_ids if drafting else None
        self.target = StaticTarget(models.target, rows, capacity, layer_ids)
        self.drafter = StaticDrafter(models.drafter, rows, capacity) if drafting else None
        long = dict(dtype=torch.long, device=self.device)
        self.length = torch.zeros(rows, **long)  # position (== slot) of each row's last committed token
        self.last_token = torch.zeros(rows, **long)
        self.block_sizes = torch.ones(rows, **long)
        self.seeds = torch.zeros(rows, **long)
        self.temperatures = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.tokens = torch.zeros(rows, width, **long)  # the last cycle's output
        self.counts = torch.zeros(rows, **long)
        self.offsets = torch.arange(width, device=self.device)
        self.capacity_range = torch.arange(capacity, device=self.device)
        self.mask_token_id = models.mask_token_id if drafting else 0
        self.compile_seconds: float | None = None
        self._step: Callable[[], None] = self._cycle
        self._graph: torch.cuda.CUDAGraph | None = None

    # ------------------------------------------------------------------ the cycle, on device buffers only

    def _cycle(self) -> None:
        positions = self.length[:, None] + self.offsets  # (n, W)
        ids = self.last_token[:, None].expand(-1, self.width)
        if self.drafter is not None:
            block = torch.where(self.offsets == 0, ids, torch.full_like(ids, self.mask_token_id))
            sees = (self.capacity_range < (self.length + self.block_sizes)[:, None])[:, None, None, :]  # (n,1,1,C)
            hidden = self.drafter(F.embedding(block, self.target.embed), positions, sees)
            drafts = F.linear(hidden[:, 1:], self.target.head).argmax(dim=-1)  # (n, W - 1)
            ids = torch.cat([ids[:, :1], drafts], dim=1)
        logits, features = self.target(ids, positions, positions, self._causal(positions))
        picks = self._pick(logits, positions + 1)  # (n, W)
        if self.drafter is not None:
            right = (ids[:, 1:] == picks[:, :-1]) & (self.offsets[1:] < self.block_sizes[:, None])
            accepted = right.long().cumprod(dim=1).sum(dim=1)  # (n,)
            self.drafter.encode(features, positions, positions)
        else:
            accepted = torch.zeros_like(self.length)
        self.tokens.copy_(picks)
        self.counts.copy_(accepted + 1)
        self.last_token.copy_(picks.gather(1, accepted[:, None])[:, 0])
        self.length.add_(accepted + 1)

    def _causal(self, positions: torch.Tensor) -> torch.Tensor:
        """(n, 1, S, capacity): a token at position p sees the slots up to p (a chain's slot is its position)."""
        return (self.capacity_range[None, None, :] <= positions[:, :, None])[:, None]

    def _pick(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.sampling:
            return pick_tokens(logits, self.temperatures, self.seeds, positions)
        return logits.argmax(dim=-1)

    def _build(self) -> None:
        """Compile and/or capture the cycle once, on the state `start` left (its outputs are then recomputed)."""
        started = time.perf_counter()
        step: Callable[[], None] = self._cycle
        state = [t.clone() for t in (self.length, self.last_token)]
        if "compile" in self.mode:
            step = torch.compile(self._cycle, fullgraph=True, dynamic=False)
        if "graph" in self.mode:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compilation, allocator, kernels' first launch
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                step()
            step = self._graph.replay
        else:
            step()  # compiles
        self.length.copy_(state[0])
        self.last_token.copy_(state[1])
        synchronize(self.device)
        self._step = step
        self.compile_seconds = time.perf_counter() - started

    @torch.inference_mode()
    def cycle(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft/verify cycle for every row: (tokens (rows, W), counts (rows,)), device tensors (overwritten by
        the next cycle)."""
        if self.mode != "off" and self.compile_seconds is None:
            self._build()
        self._step()
        return self.tokens, self.counts

    # ------------------------------------------------------------------ prefill and the host loop

    @torch.inference_mode()
    def start(
        self,
        prompts: Sequence[Sequence[int]],
        block_sizes: Sequence[int] | None = None,
        temperatures: Sequence[float] | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[int]:
        """Prefill `rows` prompts (one target pass, right-padded) and commit each one's first token. Per row: its
        block size (default: the width), temperature (default 0) and seed (default 0)."""
        if len(prompts) != self.rows:
            raise ValueError(f"this decoder runs {self.rows} rows; got {len(prompts)} prompts")
        sizes = list(block_sizes) if block_sizes is not None else [self.width] * self.rows
        if len(sizes) != self.rows or any(not 1 <= b <= self.width for b in sizes):
            raise ValueError(f"expected {self.rows} block sizes in [1, {self.width}], got {sizes}")
        temperatures = list(temperatures) if temperatures is not None else [0.0] * self.rows
        if len(temperatures) != self.rows or any(not t >= 0 for t in temperatures):
            raise ValueError(f"expected {self.rows} temperatures >= 0, got {temperatures}")
        if any(t > 0 for t in temperatures) and not self.sampling:
            raise ValueError("rows at temperature > 0 need a decoder built with sampling=True")
        seeds = list(seeds) if seeds is not None else [0] * self.rows
        if len(seeds) != self.rows:
            raise ValueError(f"expected {self.rows} seeds, got {seeds}")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) + self.width > self.capacity:
            raise ValueError(f"prompts of {min(lengths)}..{max(lengths)} tokens do not fit {self.capacity} slots")
        span = max(lengths)
        ids = torch.zeros(self.rows, span, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(list(prompt), device=self.device)
        positions = torch.arange(span, device=self.device)[None].expand(self.rows, -1)
        logits, features = self.target(ids, positions, positions, self._causal(positions))
        self.block_sizes.copy_(torch.tensor(sizes, device=self.device))
        self.temperatures.copy_(torch.tensor(temperatures, dtype=torch.float32, device=self.device))
        self.seeds.copy_(torch.tensor(seeds, device=self.device))
        last = torch.tensor(lengths, device=self.device) - 1
        last_logits = logits[torch.arange(self.rows, device=self.device), last][:, None]  # (n, 1, V)
        firsts = self._pick(last_logits, last[:, None] + 1)[:, 0]
        if self.drafter is not None:
            self.drafter.encode(features, positions, positions)
        self.length.copy_(last + 1)
        self.last_token.copy_(firsts)
        return firsts.tolist()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        block_sizes: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] = (),
        temperatures: Sequence[float] | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Decode every prompt to `max_new_tokens` or a stop token. A row that finishes keeps cycling in place (its
        length held where it ended, its tokens dropped) until every row has. One device-to-host copy per cycle."""
        if max(len(p) for p in prompts) + max_new_tokens + self.width > self.capacity:
            raise ValueError(f"{max_new_tokens} new tokens after these prompts do not fit {self.capacity} slots")
        outputs = [[token] for token in self.start(prompts, block_sizes, temperatures, seeds)]
        done = [out[-1] in stop_token_ids or len(out) >= max_new_tokens for out in outputs]
        held, finished = self.length.clone(), torch.tensor(done, device=self.device)
        while not all(done):
            tokens, counts = self.cycle()
            if any(done):
                self.length.copy_(torch.where(finished, held, self.length))
            host_tokens, host_counts = tokens.tolist(), counts.tolist()
            for row, out in enumerate(outputs):
                if done[row]:
                    continue
                for token in host_tokens[row][: host_counts[row]]:
                    out.append(token)
                    if token in stop_token_ids or len(out) >= max_new_tokens:
                        done[row] = True
                        break
            if sum(done) > int(finished.sum()):  # rows that finished this cycle are held from the next one on
                finished = torch.tensor(done, device=self.device)
                held = torch.where(finished, self.length, held)
        return outputs
