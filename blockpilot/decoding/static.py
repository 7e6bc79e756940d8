"""A draft/verify cycle over preallocated caches, every tensor of a fixed shape per (rows, width): the form that
`torch.compile` compiles whole and a CUDA graph replays, with no host round-trip inside a cycle.

The target's and the drafter's forwards (`forwards.py`) run over a KV cache of `capacity` slots per row, written at
absolute slots and read through a boolean mask, so nothing is cropped, concatenated or reallocated between cycles;
how a step is compiled and replayed is `compiled.py`, which steps are built and when is `steps.py`.

One cycle for `rows` rows of width W (each row its own block size b <= W; slots past b are padding):

    draft:   block [last token, MASK x (W - 1)] at positions length .. length + W - 1; it sees the drafter's context
             before `length` and its own first b slots; drafts = argmax of the target's head on slots 1 .. W - 1
    verify:  the target over [last token, drafts] at the same positions, writing its keys and values there
    pick:    the target's token for every slot: its argmax at T = 0, else its sample (below)
    accept:  a = the leading drafts equal to the target's pick (at most b - 1): DFlash's `match` rule; commit the
             picks at slots 0 .. a (the a accepted drafts and the target's own token). Rows that verify by
             `rejection` at T > 0 draft samples of the drafter instead and keep them by speculative sampling's test
             (`speculative_sampling`)
    context: the drafter's keys and values of the W verified positions, from the target's features there
    state:   length += a + 1, last token = the pick at slot a

Sampling is counter-based (`sampling.py`): the token at absolute position p of a row with seed s is drawn by an
exponential race over uniforms that are hashes of (s, p, token). It needs no generator state, so it compiles and
replays as a graph, and a row's output for a seed is a function of its prompt and seed alone: the same at any block
size, in any batch, and equal to autoregressive sampling with that seed (which samples the target's distribution
exactly, so the speculative output does too). Under `rejection` a row's output for a seed depends on its block
sizes, not on the other rows: every committed token is decided by the uniforms of its own position alone (drafts,
the test and the bonus each from a stream of their own), which no earlier committed token depended on, so it is
exact in distribution too.

A tree cycle (`_tree_cycle`: `_grow` every row's best-first tree on the device, then `_verify_tree`) is the same
with the verify's block a tree: see `tree.py` (`best_first_tree`, and `grow_trees` on the device).

Stale entries (a rejected draft's slot, a short prompt's padding) always lie at or past `length`, are invisible to
every query that could read them, and are rewritten before `length` passes them. `width == 1` is autoregressive
decoding: no drafter, one verify slot. Its context step has three forms (`CONTEXT_MODES`): `encode` as above;
`skip` for rows that never draft again; `defer` for rows that may: the target's features of the committed position
are kept (up to `PENDING_CONTEXT` a row) and `_flush_context` encodes them in one pass before the row drafts again,
so the draft sees the context it would have seen had the row drafted all along.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from blockpilot.blocks import PENDING_CONTEXT
from blockpilot.decoding.compiled import compile_mode, inductor_options
from blockpilot.decoding.forwards import (
    Packing,
    StaticDrafter,
    StaticTarget,
    check_exact_target,
    linear,
    measure_few_rows,
)
from blockpilot.decoding.request import RECORD_TOP_K
from blockpilot.decoding.sampling import (
    DRAFT_STREAM,
    pick_tokens,
    race,
    row_probs,
    speculative_sampling,
    token_uniforms,
)
from blockpilot.decoding.steps import Steps
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.base import distribution_summary, top_probability
from blockpilot.tree import TOP_K, grow_trees

CONTEXT_MODES = ("encode", "defer", "skip")
CONFIDENCE_UNITS = 1 << 24  # an anchor's top-1 probability rides `report` as an integer of these (float32's precision)


MIN_SPAN = 256


def span_bucket(needed: int, capacity: int) -> int:
    """The cache slots a cycle reads: `needed` rounded up to a power of two (at least `MIN_SPAN`), at most the
    capacity. Attention reads every slot of its span, masked, so a short context must not pay for the capacity (at
    4,096 slots a row the CPU cycle took 4.7 ms against 1.2 at 256); a few spans bound the compiled variants."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, capacity)


def largest_packing(n: int, width: int) -> int:
    """The largest token bucket a chain cycle of `n` rows at `width` packs into (`StaticDecoder.packed_tokens`): the
    largest power of two below n x width."""
    return 1 << ((n * width - 1).bit_length() - 1)


class StaticDecoder:
    """Cache rows of `capacity` slots each (`rows` of them), each row's decoding state on the device, and the
    draft/verify cycle at width `width` (each row its own b <= width) over the first n rows, run per `compile`
    (`COMPILE_MODES`):

    - `off`: eager, the reference;
    - `compile`: `torch.compile(fullgraph=True)` of the whole cycle (inductor, CPU or GPU); on a CPU each compiled
      step is then replayed (`compiled_replay`), unless `steps.replay` is set False before it is built;
    - `graph` (CUDA): the eager cycle captured once as a CUDA graph and replayed;
    - `compile+graph` (CUDA): the compiled cycle, captured and replayed.

    Each (rows, span) pair the cycle runs at is compiled or captured once (`compile_seconds` adds them up). With
    `sampling`, rows may decode at T > 0 (each with its own temperature and seed); without it the cycle takes
    argmaxes only and skips the sampler's work.

    The caller (`engine.py`) keeps its rows in cache rows 0 .. n - 1: `prefill` writes prompts into given
    rows, `place` starts a row decoding, `move` compacts, `free` stops one. After `cycle(n, span)`, `outputs(n)`
    gives device views, overwritten by the next cycle: tokens (n, W), counts (n,) (row i committed
    tokens[i, :counts[i]]), finite (n,) (whether the row's target distributions over its block were finite); and
    `report` (rows, W + 4) the same in one integer tensor, what the engine copies to the host once a cycle: each
    row's tokens, count, finite, its anchor's top-1 probability in `CONFIDENCE_UNITS` and the b the cycle's decision
    chose (0: none). `anchor_logits` (rows, V) holds each row's logits at its new last token: the next block's
    anchor, for per-step policies, and `anchor_confidence` (rows,) their top-1 probability at T = 1.
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
        tree_nodes: int | None = None,
        top_k: int = TOP_K,
        record: bool = False,
    ) -> None:
        compile = compile_mode(compile, models.device)
        check_exact_target(models.target.config)
        if "graph" in compile and models.device.type != "cuda":
            raise ValueError(f"compile={compile!r} replays CUDA graphs: it needs a CUDA device, got {models.device}")
        if width > 1 and models.drafter is None:
            raise ValueError(f"width {width} drafts: it needs a drafter (width 1 decodes autoregressively)")
        if tree_nodes is not None and (width < 2 or tree_nodes < 1 or top_k < 1):
            raise ValueError(f"a tree of {tree_nodes} nodes (top {top_k}) needs a drafter and width >= 2, got {width}")
        self.tree_slots = tree_nodes + 1 if tree_nodes is not None else None  # the root and the drafted nodes
        if capacity < max(width, self.tree_slots or 0) + 1:
            raise ValueError(f"capacity {capacity} must exceed the width {width} and the tree's slots")
        self.models, self.rows, self.width, self.capacity = models, rows, width, capacity
        self.sampling = sampling  # rows may have T > 0 (else the cycle only takes argmaxes)
        self.device = models.device
        drafting = width > 1
        layer_ids = models.drafter.target_layer_ids if drafting else None
        self.target = StaticTarget(models.target, rows, capacity, layer_ids)
        self.drafter = StaticDrafter(models.drafter, rows, capacity) if drafting else None
        if "compile" in compile:  # what a compiled step's few-row projections are on this CPU (`forwards.linear`)
            measure_few_rows(self.target.body.attention[0].qkv)
        long = dict(dtype=torch.long, device=self.device)
        self.length = torch.zeros(rows, **long)  # position (== slot) of each row's last committed token
        self.last_token = torch.zeros(rows, **long)
        self.block_sizes = torch.ones(rows, **long)
        self._host_block_sizes = [1] * rows  # what `block_sizes` holds, kept on the host: unchanged b, no copy
        self.seeds = torch.zeros(rows, **long)
        self.temperatures = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=self.device)  # a free row stays at length 0
        self.rejection = torch.zeros(rows, dtype=torch.bool, device=self.device)  # verifies by `rejection` at T > 0
        self.top_ks = torch.zeros(rows, **long)  # each row's top-k at T > 0 (0: every token), read by `truncate` steps
        self.top_ps = torch.ones(rows, dtype=torch.float32, device=self.device)  # and its top-p (1: every token)
        self.tokens = torch.zeros(rows, width, **long)  # the last cycle's output
        self.counts = torch.zeros(rows, **long)
        self.finite = torch.ones(rows, dtype=torch.bool, device=self.device)
        self.anchor_logits = torch.zeros(rows, self.target.head.shape[0], dtype=torch.float32, device=self.device)
        self.anchor_confidence = torch.zeros(rows, dtype=torch.float32, device=self.device)  # its top-1 probability
        # A per-step policy's choice of the next b, inside the cycle of a lone row (`set_decision`): the row's
        # per-request inputs and the slot before its first generated token (its cursor is length - origin); the b it
        # chose goes in `report` (0 after a cycle that did not choose).
        self.decision: Callable[..., torch.Tensor] | None = None
        self.decision_inputs = torch.zeros(rows, 0, dtype=torch.float32, device=self.device)
        self.origins = torch.zeros(rows, **long)
        # What a cycle tells the host, written inside it (`_commit`): one copy instead of an eager slice, cast,
        # product and concatenation after every compiled cycle (about 60 us of a mini zoo's 0.45 ms autoregressive
        # cycle on a 2-core CPU, docs/log.md)
        self.report = torch.zeros(rows, width + 4, **long)
        if drafting:  # autoregressive cycles' features, kept for the drafter's context (`defer`)
            feature_size = models.target.config.get_text_config().hidden_size * len(layer_ids)
            dtype = self.target.embed.dtype
            self.pending_features = torch.zeros(rows, PENDING_CONTEXT, feature_size, dtype=dtype, device=self.device)
            self.pending_positions = torch.zeros(rows, PENDING_CONTEXT, **long)
            self.pending_count = torch.zeros(rows, **long)
        self.offsets = torch.arange(width, device=self.device)
        self.slot_range = torch.arange(capacity, device=self.device)
        self.mask_token_id = models.mask_token_id if drafting else 0
        if self.tree_slots is not None:  # each row's tree shape (host -> device), then its tree, grown on the device
            self.top_k = min(top_k, self.target.head.shape[0])
            self.tree_budgets = torch.zeros(rows, **long)  # nodes a row's tree keeps
            self.tree_widths = torch.ones(rows, **long)  # tokens of each slot it may branch into (1: a chain)
            self.tree_probabilities = torch.zeros(rows, self.tree_slots, dtype=torch.float32, device=self.device)
            self.tree_tokens = torch.zeros(rows, self.tree_slots, **long)
            self.tree_depths = torch.zeros(rows, self.tree_slots, **long)
            self.tree_parents = torch.full((rows, self.tree_slots), -1, **long)
            self.tree_ancestors = torch.zeros(
                rows, self.tree_slots, self.tree_slots, dtype=torch.bool, device=self.device
            )
        self.recording = record and drafting  # every cycle keeps its committed positions' features and distributions
        if self.recording:
            features = models.target.config.get_text_config().hidden_size * len(layer_ids)
            self.record_features = torch.zeros(rows, width, features, dtype=torch.float32, device=self.device)
            self.record_entropy = torch.zeros(rows, width, dtype=torch.float32, device=self.device)
            self.record_top_ids = torch.zeros(rows, width, RECORD_TOP_K, **long)
            self.record_top_probs = torch.zeros(rows, width, RECORD_TOP_K, dtype=torch.float32, device=self.device)
        # A chain cycle of rows of unequal b computes each row's own slots (`_packed_cycle`), not the widest row's.
        self.pack_rows = True
        self.packed = 0  # the entries the last cycle packed its rows' blocks into (0: it ran padded)
        self.steps = Steps(self, compile, self.device, self._moved_by_a_build)
        # Whole prompts' prefill compiled too, by `compile_prefill` (a long-lived engine's start), on a CPU.
        self._prefill_compiled: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._context_compiled: Callable[..., None] | None = None  # the drafter's context of whole prompts

    # ------------------------------------------------------------------ how steps run (`steps.Steps`)

    def _moved_by_a_build(self) -> tuple[torch.Tensor, ...]:
        """What a build's warm-up moves and `Steps` restores: each row's length, last token and kept context."""
        return (self.length, self.last_token) + ((self.pending_count,) if self.drafter is not None else ())

    @property
    def mode(self) -> str:
        """`COMPILE_MODES`, "auto" resolved: how the steps run."""
        return self.steps.mode

    @property
    def frozen(self) -> bool:
        """Once frozen (a serving engine, after it built its declared shapes), nothing compiles: a step of a shape
        not built runs eagerly (logged once), and a prefill that would recompile runs eagerly."""
        return self.steps.frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self.steps.frozen = value

    @property
    def compile_seconds(self) -> float | None:
        return self.steps.compile_seconds

    @property
    def built_shapes(self) -> list[tuple]:
        return list(self.steps.built)

    def build(self, name: str, *shape: object) -> None:
        """Compile (or load from the on-disk cache) and capture step `name` at `shape` now (`cycle`'s names and
        shapes: `Steps.build`)."""
        self.steps.build(name, *shape)

    def set_decision(self, decision: Callable[..., torch.Tensor], inputs: int) -> None:
        """Every chain cycle of one row that may draft again computes `decision` (`StepPolicy.cycle_decision`: the
        row's next b from what the cycle holds, (1,) long) into `report`'s last column, which the engine reads with
        the cycle's tokens; `inputs`: the per-request numbers it reads (`place`). Set before any step is built: a built
        step replays what it traced."""
        if self.steps.built:
            raise ValueError(f"set the cycle's decision before building steps; {len(self.steps.built)} are built")
        self.decision = decision
        self.decision_inputs = torch.zeros(self.rows, inputs, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ the cycle, on device buffers only

    def _cycle(
        self,
        n: int,
        span: int,
        width: int,
        rejection: bool = False,
        truncate: bool = False,
        context: str = "encode",
        tokens: int = 0,
        decide: bool = True,
    ) -> None:
        length, last, sizes = self.length[:n], self.last_token[:n], self.block_sizes[:n]
        packing = Packing.of(sizes, width, tokens) if tokens else None  # each row's own b slots, not the width's
        rows, window, offsets = slice(0, n), self.slot_range[:span], self.offsets[:width]
        temperatures, seeds = self.temperatures[:n], self.seeds[:n]
        cut = (self.top_ks[:n], self.top_ps[:n]) if truncate else ()  # each row's top-k and top-p, where asked
        positions = length[:, None] + offsets  # (n, W)
        ids = last[:, None].expand(-1, width)
        if width > 1:
            draft_logits = self._draft_logits(n, span, width, packing)  # (n, W - 1, V)
            drafts = draft_logits.argmax(dim=-1)
            if rejection:  # rows that verify by `rejection` draft samples of the drafter at their temperature
                rejecting = self.rejection[:n] & (temperatures > 0)
                draft_probs = row_probs(draft_logits, temperatures, *cut)
                sampled = race(
                    draft_probs, token_uniforms(seeds, positions[:, 1:], draft_logits.shape[-1], DRAFT_STREAM)
                )
                drafts = torch.where(rejecting[:, None], sampled, drafts)
            ids = torch.cat([ids[:, :1], drafts], dim=1)
        mask = (window[None, None, :] <= positions[:, :, None])[:, None]  # (n, 1, W, span)
        logits, features = self.target(ids, positions, positions, mask, rows, packing=packing)
        # the picks' and the test's distributions
        target_probs = row_probs(logits, temperatures, *cut) if rejection or truncate else None
        out = self._pick(logits, positions + 1, rows, target_probs)  # (n, W)
        if width > 1:
            right = (ids[:, 1:] == out[:, :-1]) & (offsets[1:] < sizes[:, None])
            accepted = right.long().cumprod(dim=1).sum(dim=1)  # (n,)
            if rejection:
                kept, committed = speculative_sampling(drafts, draft_probs, target_probs, sizes, seeds, positions)
                accepted = torch.where(rejecting, kept, accepted)
                out = torch.where(rejecting[:, None], committed, out)
        else:
            accepted = torch.zeros_like(length)
        if self.drafter is not None and context == "encode":  # the drafter's context grows at every width
            self.drafter.encode(features, positions, positions, rows, packing)
        elif self.drafter is not None and context == "defer":  # width 1: one position a row, kept for later
            self._defer_context(n, features[:, 0], positions[:, 0])
        self._record(n, logits, features, offsets.expand(n, -1))
        self._commit(n, logits, out, accepted, accepted, offsets >= sizes[:, None], decide=decide and context != "skip")

    def _packed_cycle(
        self, n: int, span: int, width: int, tokens: int, rejection: bool = False, truncate: bool = False
    ) -> None:
        """A chain cycle whose projections, MLPs and heads compute each row's own b slots, packed into `tokens`
        entries (at least the rows' b summed, free rows' 1 included), not n x width: a narrow row beside a wide
        one pays for its own draft (`forwards.Packing`). The same tokens as `_cycle`'s."""
        self._cycle(n, span, width, rejection, truncate, "encode", tokens)

    def _kept_cycle(self, n: int, span: int, width: int, rejection: bool = False, truncate: bool = False) -> None:
        """`_cycle` for a lone row that keeps its b (a fixed b, a prior kept to the end): the cycle's decision
        (`set_decision`) is not computed, which on the mini zoo's CPU cost a drafting cycle 7-16%."""
        self._cycle(n, span, width, rejection, truncate, decide=False)

    def _plain_cycle(self, n: int, span: int, truncate: bool = False) -> None:
        """An autoregressive cycle for rows that never draft again: no drafter context kept."""
        self._cycle(n, span, 1, False, truncate, "skip")

    def _deferred_cycle(self, n: int, span: int, truncate: bool = False) -> None:
        """An autoregressive cycle for rows that may draft again: their features kept, encoded later."""
        self._cycle(n, span, 1, False, truncate, "defer")

    def _defer_context(self, n: int, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep rows 0 .. n - 1's features (n, F) at `positions` (n,) for `_flush_context` (the caller flushes a
        full row first; free rows count nothing)."""
        count, rows = self.pending_count[:n], torch.arange(n, device=self.device)
        slot = count.clamp(max=PENDING_CONTEXT - 1)  # never past the buffer (the caller flushes before)
        self.pending_features[rows, slot] = features.to(self.pending_features.dtype)
        self.pending_positions[rows, slot] = positions
        count.add_(self.active[:n].long())

    def _flush_context(self, n: int) -> None:
        """The drafter's context of every position rows 0 .. n - 1 kept (`_defer_context`), in one pass; the
        entries past a row's count are written to its last cache slot, which no row's context reaches."""
        count, positions = self.pending_count[:n], self.pending_positions[:n]
        kept = torch.arange(PENDING_CONTEXT, device=self.device) < count[:, None]
        slots = torch.where(kept, positions, torch.full_like(positions, self.capacity - 1))
        self.drafter.encode(self.pending_features[:n], positions, slots, slice(0, n))
        count.zero_()

    def _draft_logits(self, n: int, span: int, width: int, packing: Packing | None = None) -> torch.Tensor:
        """The drafter over rows 0 .. n - 1's blocks [last token, MASK x (width - 1)] at their next positions, each
        seeing its context and its own first b slots: the target head's logits of the drafted slots (n, W - 1, V)
        (with `packing`, of each row's first b - 1; the others' are 0)."""
        length, sizes, offsets = self.length[:n], self.block_sizes[:n], self.offsets[:width]
        ids = self.last_token[:n, None].expand(-1, width)
        block = torch.where(offsets == 0, ids, torch.full_like(ids, self.mask_token_id))
        sees = (self.slot_range[:span] < (length + sizes)[:, None])[:, None, None, :]  # (n, 1, 1, span)
        embeds = F.embedding(block if packing is None else packing.pack(block), self.target.embed)
        hidden = self.drafter(embeds, length[:, None] + offsets, sees, slice(0, n), packing)
        if packing is None:
            return linear(hidden[:, 1:], self.target.head)
        return packing.unpack(linear(hidden, self.target.head))[:, 1:]

    def _record(
        self,
        n: int,
        logits: torch.Tensor,  # (n, S, V) the verify's
        features: torch.Tensor | None,  # (n, S, F)
        committed: torch.Tensor,  # (n, W') each row's verified entries in committed order (a tree: its path)
    ) -> None:
        """When recording: the features and the distribution summaries (`distribution_summary`) of each row's
        entries in committed order; the caller keeps the first `counts` of each."""
        if not self.recording:
            return
        width = committed.shape[1]
        along = lambda values: values.gather(1, committed[..., None].expand(-1, -1, values.shape[-1]))  # noqa: E731
        entropy, top_ids, top_probs = distribution_summary(along(logits), RECORD_TOP_K)
        self.record_features[:n, :width].copy_(along(features))
        self.record_entropy[:n, :width].copy_(entropy)
        self.record_top_ids[:n, :width].copy_(top_ids)
        self.record_top_probs[:n, :width].copy_(top_probs)

    def _commit(
        self,
        n: int,
        logits: torch.Tensor,  # (n, S, V) the verify's
        out: torch.Tensor,  # (n, W') the committed tokens, slot by slot (the first accepted + 1 count)
        accepted: torch.Tensor,  # (n,) accepted drafts
        last_index: torch.Tensor,  # (n,) where in `logits` the new last token was picked
        unused: torch.Tensor,  # (n, S) bool: entries of `logits` that verify nothing (padding)
        decide: bool = False,  # a chain cycle of rows that may draft again: `decision` too, where set, for one row
    ) -> None:
        """What every cycle ends with: the rows' outputs, their new last tokens and lengths (free rows stay at 0).
        A row's block is usable when every distribution it verifies has a finite largest logit (NaN and +inf
        propagate into the maximum; a token banned at -inf does not)."""
        finite = (torch.isfinite(logits.amax(dim=-1)) | unused).all(dim=1)
        self.finite[:n].copy_(finite)
        self.tokens[:n, : out.shape[1]].copy_(out)
        self.counts[:n].copy_(accepted + 1)
        anchor = logits.gather(1, last_index[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        confidence = self._keep_anchor(n, anchor)
        last = out.gather(1, accepted[:, None])[:, 0]
        grown = torch.where(self.active[:n], accepted + 1, torch.zeros_like(accepted))  # free rows stay at 0
        if decide and n == 1 and self.decision is not None:
            # the token before the new last one: the last accepted draft, else the block's first token
            last_draft = out.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
            before = torch.where(accepted > 0, last_draft, self.last_token[:n])
            cursor = self.length[:n] + grown - self.origins[:n]  # the tokens generated, the prefill's one included
            # a copy of its own, not stacked with the other columns: stacked, inductor fused the choice into the
            # report's writes and the width-1 cycle with it varied by -1 to +10% between compiles (docs/log.md)
            self.report[:n, -1].copy_(
                self.decision(
                    confidence,
                    torch.stack([last, before], dim=1),
                    self.temperatures[:n],
                    cursor,
                    accepted + 1,
                    self.block_sizes[:n],
                    self.decision_inputs[:n],
                )
            )
        else:  # 0: this cycle did not choose
            self.report[:n, -1].zero_()
        self.last_token[:n].copy_(last)
        self.length[:n].add_(grown)
        # From the values computed here, not read back from the buffers just written
        quantized = (confidence * CONFIDENCE_UNITS).round().long()
        self.report[:n, : out.shape[1]].copy_(out)
        self.report[:n, -4:-1].copy_(torch.stack([accepted + 1, finite.long(), quantized], dim=1))

    def _keep_anchor(self, n: int, anchor: torch.Tensor) -> torch.Tensor:
        """Rows 0 .. n - 1's logits at their new last token (n, V), and their top-1 probability (`top_probability`,
        what per-step policies read, with no pass of their own), which it returns (n,)."""
        anchor = anchor.float()
        confidence = top_probability(anchor)
        self.anchor_logits[:n].copy_(anchor)
        self.anchor_confidence[:n].copy_(confidence)
        return confidence

    def _grow(self, n: int, span: int, slots_n: int) -> None:
        """The drafter over every row's block of depth b (its block size), then each row's best-first tree of its
        budget over its slots' top `tree_widths` tokens (`grow_trees`), cut to `slots_n` slots, into the tree
        buffers. Nothing grows past a row's depth."""
        logprobs = torch.log_softmax(self._draft_logits(n, span, self.width).float(), dim=-1)  # (n, W - 1, V)
        top_logprobs, top_ids = logprobs.topk(self.top_k, dim=-1)
        deep = (self.offsets[1:] >= self.block_sizes[:n, None])[..., None]  # (n, W - 1, 1): slots past the row's b
        narrow = torch.arange(self.top_k, device=self.device) >= self.tree_widths[:n, None, None]  # (n, 1, k)
        grown = grow_trees(top_logprobs.masked_fill(deep | narrow, -torch.inf), top_ids, self.tree_budgets[:n], slots_n)
        tokens, depths, parents, ancestors, probabilities = grown
        self.tree_tokens[:n, :slots_n].copy_(tokens)
        self.tree_depths[:n, :slots_n].copy_(depths)
        self.tree_parents[:n, :slots_n].copy_(parents)
        self.tree_probabilities[:n, :slots_n].copy_(probabilities)
        self.tree_ancestors[:n, :slots_n, :slots_n].copy_(ancestors)

    def _draft_tree(self, n: int, span: int) -> None:
        """Grow every row's whole tree (its nodes' probabilities then tell how many nodes a verify pays for)."""
        self._grow(n, span, self.tree_slots)

    def _tree_cycle(self, n: int, span: int, slots_n: int, truncate: bool = False) -> None:
        """A whole tree cycle, on the device: grow every row's tree cut to `slots_n` slots, verify and commit it."""
        self._grow(n, span, slots_n)
        self._verify_tree(n, span, slots_n, truncate)

    def _verify_tree(self, n: int, span: int, slots_n: int, truncate: bool = False) -> None:
        """The target over every row's tree in one pass (each node at position length + depth, in scratch slot
        length + node, seeing the committed context and its ancestors), then the walk: from the root, follow the
        child whose token is the target's pick at the current node; commit the path's tokens and the pick at its
        end, move the path's keys and values to their positions and encode its features for the drafter. The trees
        are their first `slots_n` nodes (a parent comes before its children, so any prefix is a tree)."""
        length, last = self.length[:n], self.last_token[:n]
        rows, window = slice(0, n), self.slot_range[:span]
        parents, depths = self.tree_parents[:n, :slots_n], self.tree_depths[:n, :slots_n]
        nodes = torch.arange(slots_n, device=self.device)
        # (n, S): the root is the last token
        tokens = torch.where(nodes == 0, last[:, None], self.tree_tokens[:n, :slots_n])
        positions = length[:, None] + depths
        slots = length[:, None] + nodes
        ancestors = self.tree_ancestors[:n, :slots_n, :slots_n]  # (n, S, S): node j is node i or one of its ancestors
        offset = window[None, :] - length[:, None]  # (n, span): a slot's node, where it lies in the tree's slots
        in_tree = (offset >= 0) & (offset < slots_n)
        sees_tree = ancestors.gather(2, offset.clamp(0, slots_n - 1)[:, None, :].expand(-1, slots_n, -1))
        mask = ((window[None, None, :] < length[:, None, None]) | (sees_tree & in_tree[:, None, :]))[:, None]
        logits, features = self.target(tokens, positions, slots, mask, rows)  # (n, S, V), (n, S, F)
        picks = self._pick(logits, positions + 1, rows, truncate=truncate)  # (n, S): the target's token after each node
        # The walk down the tree, at once: a node is on the accepted path when its token is the target's pick after
        # its parent, and so is every ancestor's (siblings hold distinct tokens, so those nodes form one path).
        live = (parents >= 0) | (nodes == 0)
        good = ((tokens == picks.gather(1, parents.clamp(min=0))) & (parents >= 0)) | (nodes == 0)
        on_path = ~(ancestors & ~good[:, None, :]).any(dim=-1) & live  # (n, S)
        at_depth = on_path[:, None, :] & (depths[:, None, :] == self.offsets[None, :, None])  # (n, W, S)
        reached = at_depth.any(dim=-1)  # (n, W): the path reaches depth d
        accepted = reached.long().sum(dim=1) - 1
        current = at_depth.long().argmax(dim=-1).gather(1, accepted[:, None])[:, 0]  # the path's last node
        path_nodes = torch.where(reached, at_depth.long().argmax(dim=-1), current[:, None])  # (n, W)
        bonus = picks.gather(1, current[:, None])[:, 0]
        path_tokens = tokens.gather(1, path_nodes)  # (n, W): the root's token first
        out = torch.cat([path_tokens[:, 1:], bonus[:, None]], dim=1)
        out = torch.where(self.offsets == accepted[:, None], bonus[:, None], out)
        # The path's keys and values from their scratch slots to their positions (gathered first: they overlap).
        row_ids = torch.arange(n, device=self.device)[:, None]
        source, destination = length[:, None] + path_nodes, length[:, None] + self.offsets
        for buffer in self.target.body.buffers():
            buffer.index_put_((row_ids, destination), buffer[row_ids, source])
        path_features = features.gather(1, path_nodes[..., None].expand(-1, -1, features.shape[-1]))
        self.drafter.encode(path_features, destination, destination, rows)
        self._record(n, logits, features, path_nodes)
        self._commit(n, logits, out, accepted, current, ~live)

    def _pick(
        self,
        logits: torch.Tensor,
        positions: torch.Tensor,
        rows: slice,
        probs: torch.Tensor | None = None,
        truncate: bool = False,
    ) -> torch.Tensor:
        if not self.sampling:
            return logits.argmax(dim=-1)
        if probs is None and truncate:
            probs = row_probs(logits, self.temperatures[rows], self.top_ks[rows], self.top_ps[rows])
        return pick_tokens(logits, self.temperatures[rows], self.seeds[rows], positions, probs)

    @torch.inference_mode()
    def cycle(
        self,
        n: int,
        span: int | None = None,
        width: int | None = None,
        rejection: bool = False,
        context: str = "encode",
        truncate: bool = False,
        decide: bool = True,
    ) -> None:
        """One draft/verify cycle for rows 0 .. n - 1 at `width` (default the decoder's; every row's b at most it)
        reading `span` cache slots (default: what the longest active row needs, `span_bucket`); its outputs in
        `outputs` and `report`. With `rejection`, rows placed to verify by `rejection` do (a
        variant of the step of its own: the drafter's sampling and the test cost the others nothing); with
        `truncate`, rows sample their distributions cut to their top-k and top-p (`place`; a variant too, run only
        where a row cuts: a batch without one pays no sort). `context` (`CONTEXT_MODES`) is how a cycle of width 1
        keeps the drafter's context (on a frozen decoder, where that step was built; else it encodes); a wider cycle
        encodes, packed where its rows' b summed need fewer entries than n x width (`packed_tokens`; on a frozen
        decoder, where such a step was built). Without `decide` (a lone row that keeps its b), a decoder with a
        decision runs the chain cycle that skips it (`_kept_cycle`; on a frozen decoder, where it was built)."""
        width = width or self.width
        if not 1 <= width <= self.width:
            raise ValueError(f"a cycle of width {width}: expected 1 .. {self.width}")
        if (rejection or truncate) and not self.sampling:
            raise ValueError("the rejection rule and truncation sample: they need a decoder built with sampling=True")
        if span is None:
            span = span_bucket(int(self.length[:n].max()) + self.width, self.capacity)
        if context not in CONTEXT_MODES:
            raise ValueError(f"context must be one of {CONTEXT_MODES}, got {context!r}")
        self.packed = 0
        step = ("_plain_cycle" if context == "skip" else "_deferred_cycle", n, span, truncate)
        packed = ("_packed_cycle", n, span, width, self.packed_tokens(n, width), rejection, truncate)
        if width == 1 and context != "encode" and self.drafter is not None and self.steps.can_run(step):
            self.steps.run(*step)
        elif packed[4] and self.steps.can_run(packed):
            self.steps.run(*packed)
            self.packed = packed[4]
        else:
            kept = ("_kept_cycle", n, span, width, rejection, truncate)
            if decide or n > 1 or self.decision is None or not self.steps.can_run(kept):
                kept = ("_cycle", *kept[1:])
            self.steps.run(*kept)

    def outputs(self, n: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device views of the last cycle's rows 0 .. n - 1: tokens (n, width; default every slot), counts (n,),
        finite (n,)."""
        return self.tokens[:n, : width or self.width], self.counts[:n], self.finite[:n]

    def packed_tokens(self, n: int, width: int) -> int:
        """The token bucket a chain cycle of rows 0 .. n - 1 at `width` packs their blocks into (`_packed_cycle`):
        the power of two that holds their b summed (a free row's 1 included), or 0 where that is no fewer than
        n x width (the padded cycle) or `pack_rows` is off."""
        if not self.pack_rows or width == 1 or n == 1:
            return 0
        needed, tokens = sum(self._host_block_sizes[:n]), 1
        while tokens < needed:
            tokens *= 2
        return tokens if tokens < n * width else 0

    @torch.inference_mode()
    def flush_context(self, n: int) -> None:
        """Encode the drafter's context of every position rows 0 .. n - 1 kept by `defer` cycles (before a row
        drafts again, or before one keeps more than `PENDING_CONTEXT`)."""
        self.steps.run("_flush_context", n)

    def set_tree_shapes(self, budgets: Sequence[int], widths: Sequence[int]) -> None:
        """Rows 0 .. len(budgets) - 1 grow trees of these many nodes over their slots' top `widths` tokens next
        (a chain of b: b - 1 nodes of width 1)."""
        if any(not 1 <= w <= self.top_k for w in widths) or any(b < 0 for b in budgets):
            raise ValueError(f"tree budgets >= 0 and widths in [1, {self.top_k}], got {list(budgets)}, {list(widths)}")
        self.tree_budgets[: len(budgets)].copy_(torch.tensor(list(budgets), device=self.device))
        self.tree_widths[: len(widths)].copy_(torch.tensor(list(widths), device=self.device))

    @torch.inference_mode()
    def draft_tree(self, n: int, span: int) -> torch.Tensor:
        """Grow rows 0 .. n - 1's whole trees: a device view of their nodes' probabilities (n, S), root first, to
        choose how many a verify checks (`verify_tree`)."""
        self.steps.run("_draft_tree", n, span)
        return self.tree_probabilities[:n]

    @torch.inference_mode()
    def verify_tree(self, n: int, span: int, slots: int) -> None:
        """Verify and commit the first `slots` nodes of rows 0 .. n - 1's grown trees; outputs as `cycle`'s."""
        self._check_tree_slots(slots)
        self.steps.run("_verify_tree", n, span, slots)

    @torch.inference_mode()
    def tree_cycle(self, n: int, span: int, slots: int, truncate: bool = False) -> None:
        """Grow, verify and commit rows 0 .. n - 1's trees cut to `slots` slots in one step; outputs as `cycle`'s."""
        self._check_tree_slots(slots)
        self.packed = 0
        self.steps.run("_tree_cycle", n, span, slots, truncate)

    def _check_tree_slots(self, slots: int) -> None:
        if self.tree_slots is None or not 1 <= slots <= self.tree_slots:
            raise ValueError(f"a verify of {slots} tree slots: expected 1 .. {self.tree_slots}")

    # ------------------------------------------------------------------ rows: prefill, place, move, free

    @torch.inference_mode()
    def prefill(
        self, first: int, prompts: Sequence[torch.Tensor], start: int = 0, context: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts (token tensors, right-padded to the longest) into cache rows first .. first + k - 1, their tokens
        at positions start .. (a long prompt's chunk after `start` tokens already there), with the drafter's
        context unless `context` is False (`keep_context` writes it later, for rows that draft): one target pass
        (compiled for whole prompts without context once `compile_prefill` ran). Returns each prompt's
        next-token logits after its last token, (k, V) fp32, and its positions' target features (k, P, F) (None
        without a drafter)."""
        k, lengths = len(prompts), [len(p) for p in prompts]
        if start + max(lengths) + self.width > self.capacity:
            raise ValueError(f"{start + max(lengths)} tokens leave no room for a block in {self.capacity} slots")
        ids = torch.zeros(k, max(lengths), dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(prompt, device=self.device)
        last = torch.tensor(lengths, device=self.device) - 1
        positions = start + torch.arange(max(lengths), device=self.device)[None].expand(k, -1)
        mask = None  # whole prompts attend to themselves, without reading the cache back
        if start > 0:  # a chunk reads its prompt's earlier chunks there
            mask = (self.slot_range[: start + max(lengths)][None, None, :] <= positions[:, :, None])[:, None]
        if mask is not None or context or not self._fits_compiled_prefill(ids) or self._prefill_compiled is None:
            return self._prefill_pass(ids, positions, mask, slice(first, first + k), last, context)
        # The rows as a tensor of ids: dynamo specializes a slice's bounds, so a slice would hold the compiled pass to
        # the cache row it was first called at (every prompt joining at another row ran eagerly).
        rows = torch.arange(first, first + k, device=self.device)
        for tensor in (ids, positions):  # the prompt's length: the one size the compiled pass does not fix
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        compiled, eager = self._prefill_compiled, self._prefill_pass
        return self.steps.compiled_or_eager(compiled, eager, ids, positions, None, rows, last)

    @torch.inference_mode()
    def keep_context(self, first: int, features: torch.Tensor) -> None:
        """The drafter's context of whole prompts prefilled without it: target features (k, P, F) (`prefill`'s) at
        positions 0 .. P - 1 of cache rows first .. first + k - 1."""
        if self.drafter is None:
            return
        rows = torch.arange(first, first + features.shape[0], device=self.device)  # as the prefill's, a tensor
        compiled = self._context_compiled
        if compiled is None or not self._fits_compiled_prefill(features):
            self._context_pass(features, rows)
        else:
            torch._dynamo.maybe_mark_dynamic(features, 1)
            self.steps.compiled_or_eager(compiled, self._context_pass, features, rows)

    def compile_prefill(self) -> None:
        """Compile the whole-prompt prefill and drafter-context passes of one prompt (any length past 1, at any cache
        row), on a CPU in a mode that compiles, and warm them up (cache row 0 is left free and clean). Eager, their few
        hundred small operations cost one mini-zoo prompt 1.55 ms against 0.96-1.17 compiled (docs/log.md); several
        prompts in one pass share that cost and run eagerly (each prompt count would be a compile of its own, about
        20 s cold on the tiny zoo). A long-lived engine pays it as it starts, a one-off generation not. (On a GPU the
        prefill stays eager: not measured there.)"""
        if "compile" not in self.mode or self.device.type != "cpu" or self._prefill_compiled is not None:
            return
        started = time.perf_counter()
        options = inductor_options(self.device)
        # Static but for the prompt's length, which `prefill` and `keep_context` mark dynamic: the weights' sizes stay
        # constants (dynamic=True made them symbols too, and its floats, then restarted the analysis to fix those).
        self._prefill_compiled = torch.compile(self._prefill_pass, fullgraph=True, dynamic=False, options=options)
        if self.drafter is not None:
            self._context_compiled = torch.compile(self._context_pass, fullgraph=True, dynamic=False, options=options)
        _, features = self.prefill(0, [torch.arange(1, 3)], context=False)  # a length past 1: not specialized
        self.keep_context(0, features)
        self.free(0, clear=True)
        self.steps.add_seconds(time.perf_counter() - started)

    @staticmethod
    def _fits_compiled_prefill(batch: torch.Tensor) -> bool:
        """Whether the compiled prefill and context passes (`compile_prefill`: one prompt of at least 2 tokens) take
        `batch` (k, P, ...) as it is. Others run eagerly at once: called compiled, they would first fail its guards
        (about 2 ms of a mini-zoo join)."""
        return batch.shape[0] == 1 and batch.shape[1] > 1

    def _prefill_pass(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        rows: slice | torch.Tensor,  # the prompts' cache rows: a slice, or their ids (k,)
        last: torch.Tensor,
        context: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, features = self.target(ids, positions, positions, mask, rows, logits_at=last)
        if self.drafter is not None and context:
            self.drafter.encode(features, positions, positions, rows)
        return logits[:, 0], features

    def _context_pass(self, features: torch.Tensor, rows: torch.Tensor) -> None:
        k, length = features.shape[:2]
        positions = torch.arange(length, device=self.device)[None].expand(k, -1)
        self.drafter.encode(features, positions, positions, rows)

    def pick(
        self,
        logits: torch.Tensor,
        positions: Sequence[int],
        temperatures: Sequence[float],
        seeds: Sequence[int],
        top_ks: Sequence[int] | None = None,
        top_ps: Sequence[float] | None = None,
    ) -> list[int]:
        """Tokens from next-token logits (k, V) for rows at temperatures and seeds (and top-k and top-p, where
        given), to sit at `positions`: the same draw (`pick_tokens`) as every token the cycle commits."""
        if any(t > 0 for t in temperatures) and not self.sampling:
            raise ValueError("rows at temperature > 0 need a decoder built with sampling=True")
        if not any(t > 0 for t in temperatures):  # pick_tokens' argmax, without its draw (0.15 ms a join on a CPU)
            return logits.argmax(dim=-1).tolist()
        device = self.device
        temperatures_ = torch.tensor(list(temperatures), dtype=torch.float32, device=device)
        probs = None
        if top_ks is not None and top_ps is not None:
            ks = torch.tensor(list(top_ks), dtype=torch.long, device=device)
            ps = torch.tensor(list(top_ps), dtype=torch.float32, device=device)
            probs = row_probs(logits[:, None], temperatures_, ks, ps)
        tokens = pick_tokens(
            logits[:, None],
            temperatures_,
            torch.tensor(list(seeds), dtype=torch.long, device=device),
            torch.tensor(list(positions), device=device)[:, None],
            probs,
        )
        return tokens[:, 0].tolist()

    def place(
        self,
        row: int,
        *,
        length: int,
        last_token: int,
        temperature: float,
        seed: int,
        rejection: bool = False,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> None:
        """Row `row`, whose cache holds `length` positions, decodes from `last_token` (at position `length`),
        verifying by `rejection` (at T > 0, in cycles run with `rejection=True`) or by matching, and sampling its
        distributions cut to `top_k` tokens (0: all) and `top_p` of their mass in cycles run with `truncate=True`."""
        if temperature > 0 and not self.sampling:
            raise ValueError("rows at temperature > 0 need a decoder built with sampling=True")
        self.origins[row] = length - 1  # `last_token` is the first generated token
        self.length[row], self.last_token[row] = length, last_token
        self.temperatures[row], self.seeds[row], self.rejection[row] = temperature, seed, rejection
        self.top_ks[row], self.top_ps[row] = top_k, top_p
        self.block_sizes[row], self.active[row] = 1, True
        self._host_block_sizes[row] = 1
        if self.drafter is not None:
            self.pending_count[row] = 0

    def set_decision_inputs(self, row: int, inputs: Sequence[float]) -> None:
        """The request's numbers the cycle's decision reads for row `row` (`set_decision`), before its first cycle
        that decides (a placed row's are another request's until then)."""
        if len(inputs) != self.decision_inputs.shape[1]:
            expected = self.decision_inputs.shape[1]
            raise ValueError(f"the cycle's decision reads {expected} inputs, got {list(inputs)}")
        self.decision_inputs[row] = torch.as_tensor(list(inputs), dtype=torch.float32)

    def set_block_sizes(self, sizes: Sequence[int]) -> None:
        """The b of rows 0 .. len(sizes) - 1 for the next cycle, each in [1, width]."""
        sizes = list(sizes)
        if sizes == self._host_block_sizes[: len(sizes)]:
            return
        if any(not 1 <= b <= self.width for b in sizes):
            raise ValueError(f"expected block sizes in [1, {self.width}], got {sizes}")
        self.block_sizes[: len(sizes)].copy_(torch.tensor(sizes, device=self.device))
        self._host_block_sizes[: len(sizes)] = sizes

    def move(self, source: int, destination: int, length: int) -> None:
        """Row `source`'s first `length` cache slots and state into row `destination` (compaction: the engine's
        rows stay in rows 0 .. n - 1); the source row is freed."""
        for body in (self.target.body, *([self.drafter.body] if self.drafter is not None else [])):
            for buffer in body.buffers():
                buffer[destination, :length].copy_(buffer[source, :length])
        states = (
            self.length,
            self.last_token,
            self.block_sizes,
            self.seeds,
            self.temperatures,
            self.active,
            self.rejection,
            self.top_ks,
            self.top_ps,
            self.origins,
            self.decision_inputs,
        )
        if self.drafter is not None:
            states += (self.pending_features, self.pending_positions, self.pending_count)
        for state in states:
            state[destination] = state[source]
        self._host_block_sizes[destination] = self._host_block_sizes[source]
        self.free(source)

    def free(self, row: int, clear: bool = False) -> None:
        """Row `row` decodes nothing: it stays at length 0 (its cycles write its own first slots only). With `clear`,
        its cache slots are zeroed too (a failed row's may hold NaN, which a masked read still spreads)."""
        self.active[row], self.length[row], self.block_sizes[row], self.rejection[row] = False, 0, 1, False
        self._host_block_sizes[row] = 1
        if self.drafter is not None:
            self.pending_count[row] = 0
        if clear:
            for body in (self.target.body, *([self.drafter.body] if self.drafter is not None else [])):
                for buffer in body.buffers():
                    buffer[row].zero_()
