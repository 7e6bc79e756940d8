"""The speculative decoding engine: rows with their own prompt, block size, temperature, seed and stop rules
share one drafter call and one target verify per cycle. Batch 1 is the same code with one row.

prefill (one target pass for the rows that join) -> first token -> policy picks b -> repeat for the batch: draft every
row's block in one drafter call (padded to the widest block; a row attends to its own b slots only) -> a
policy that trims (`verify_count`, e.g. draft-then-trim) keeps a prefix of its drafts -> verify every block
in one target pass (packed: each row its own block) -> per row: accepted prefix + the target's own token ->
write the committed positions' context features into the drafter's cache -> the per-cycle policy hook picks
each row's next b (once per policy the rows share). Without a
drafter (or at b = 1) a cycle verifies just the last token: plain autoregressive decoding.

Caches keep one slot per absolute position (`cache.py`), so rejected drafts need no crop and rows of
different lengths need no compaction; rows join and leave between cycles (continuous batching). Every random
draw of a row comes from its own generator in a fixed order, so a row's output for a given seed does not
depend on the other rows. Terms (block, draft/accepted/bonus tokens, acceptance length) are defined in
`acceptance.py`; what this engine shares with the static one (a row, its queue and admission, the policies'
hooks) is in `rows.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from blockpilot.decoding.acceptance import (
    accept_greedy,
    accept_match,
    accept_rejection,
    sample_next,
    sample_tokens,
    temperature_probs,
)
from blockpilot.decoding.cache import SlotStore, TargetSlotCache
from blockpilot.decoding.request import GenerationConfig, GenerationRequest, GenerationResult
from blockpilot.decoding.rows import (
    NonFiniteLogits,
    Row,
    RowScheduler,
    RowUpdate,
    decide_block_sizes,
    new_record,
    prefill_groups,
    record_distributions,
    truncate_at_stop,
)
from blockpilot.decoding.width import AcceptanceRate, CyclePrice, priced_width
from blockpilot.models.attention import GROUPED_SDPA, RaggedTokens, masked_attention_kernels
from blockpilot.models.drafter import Blocks
from blockpilot.models.features import tapped
from blockpilot.models.loading import SpeculativeModels, cache_keyword, synchronize
from blockpilot.policies.base import BlockSizePolicy, PrefillState, draft_confidence

# How many drafts' worth of the engine's pooled acceptance rate a row's own rate starts from (`width.py`).
POOLED_PRIOR_DRAFTS = 4.0
# Slots past a row's last position that a cycle writes into: the drafter's block and the verify's block.
CACHE_SCRATCH = 64


def _finite(logits: torch.Tensor) -> list:
    """Whether each distribution of (..., V) logits is usable, as a nested list (...): its largest logit is
    finite. NaN propagates into the maximum and so does +inf, while a few tokens banned at -inf (a legitimate
    logit) leave it finite; one reduction over the logits, not an elementwise test of every one."""
    return torch.isfinite(logits.amax(dim=-1)).tolist()


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class SpeculativeEngine(RowScheduler):
    """Continuous-batching speculative decoding over one set of models.

    `submit` queues a request and returns its row id; each `step` admits queued rows (prefill) while the
    batch has room, then runs one draft/verify cycle for every active row and reports what each committed.
    `run` drains the engine as a generator of `RowUpdate`s; `cancel` ends a row before the next cycle.

    With a cycle `cost` curve, each cycle's verify width is priced (`width.py`): greedy rows whose blocks are
    wider than the batch's best width are capped at it for that cycle. Rows of unequal blocks run packed: the
    drafter's and the target's token-by-token layers (and both heads) see one sequence of every row's own block
    (`RaggedTokens`), not every row padded to the widest; only attention unpacks them, row by row.
    """

    def __init__(
        self,
        models: SpeculativeModels,
        *,
        max_batch: int = 1,
        cost: CyclePrice | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        super().__init__(models, max_batch, prefill_chunk)
        self._chunk_features: list[torch.Tensor] = []  # the long prompt's recorded features, chunk by chunk
        self.cost = cost
        # A packed verify reads each row's tokens back through the project's attention (`RaggedTokens`); a target
        # loaded with another attention verifies every row padded to the widest block.
        attention = getattr(models.target.config, "_attn_implementation", None)
        self.packed_verify = attention == GROUPED_SDPA
        self.acceptance = AcceptanceRate()  # every row's cycles, pooled: the prior of a row's own rate
        self.target, self.drafter = models.target, models.drafter
        self.cache_keyword = cache_keyword(self.target)
        num_layers = int(self.target.config.get_text_config().num_hidden_layers)
        self.target_cache = TargetSlotCache(num_layers)
        self.context = SlotStore(self.drafter.config.num_hidden_layers) if self.drafter is not None else None
        for store in (self.target_cache.store, self.context):
            if store is not None:
                store.row_limit = self.max_batch + 1  # the batch's rows and the long prompt's prefill row
        self.layer_ids = self.drafter.target_layer_ids if self.drafter is not None else None
        self.embed, self.head = self.target.get_input_embeddings(), self.target.get_output_embeddings()

    # ---------------------------------------------------------------- requests

    def submit(self, request: GenerationRequest) -> int:
        """Check and queue a request; returns its row id. Bad prompts fail here, naming the problem."""
        prompt = self._checked_prompt(request)
        policy = self._policy_of(request)
        if policy.tree_nodes is not None:
            raise ValueError(f"policy {policy.name!r} drafts trees: they run on the static engine (--engine static)")
        return self._queue(
            Row(
                id=next(self._ids),
                request=request,
                prompt=prompt.to(self.device),
                policy=policy,
                generator=make_generator(self.device, request.config.seed),
                record=new_record() if request.record else None,
            )
        )

    @torch.inference_mode()
    def step(self) -> list[RowUpdate]:
        updates: list[RowUpdate] = []
        self._drop_cancelled(updates)
        joining = self._joining()
        # Caches grow to what the rows can need (prompt, budget, the widest block's scratch), never doubled past it.
        pending = [*self.rows, *joining, *([self.prefilling] if self.prefilling else [])]
        needs = [row.prompt.numel() + row.config.max_new_tokens for row in pending]
        self.target_cache.position_limit = max(needs) + 2 * CACHE_SCRATCH if needs else None
        with masked_attention_kernels(self.device):
            if joining:
                self._admit(joining, updates)
            if self.prefilling is not None:
                self._prefill_chunk(updates)
            if self.rows:
                self._cycle(updates)
        if not self.busy:  # idle: hold no cache (the next request allocates what it needs)
            self.target_cache.store.release()
            if self.context is not None:
                self.context.release()
        return updates

    # ---------------------------------------------------------------- prefill

    def _admit(self, joining: list[Row], updates: list[RowUpdate]) -> None:
        """Prefill the joining rows, a few target passes of prompts of similar length (`prefill_groups`)."""
        batch_rows = len(self.rows) + len(joining)
        for group in prefill_groups([row.prompt.numel() for row in joining]):
            self._prefill([joining[index] for index in group], updates, batch_rows)

    def _prefill(self, joining: list[Row], updates: list[RowUpdate], batch_rows: int) -> None:
        """Prefill rows into the next free cache rows in one target pass; commit each one's first token.

        Prompts are right-padded to the longest: under causal attention a prompt's positions never see its
        padding, and the padded slots lie past the row's length, so they are rewritten before anything reads them.
        """
        started = time.perf_counter()
        first_slot, count = len(self.rows), len(joining)
        lengths = [row.prompt.numel() for row in joining]
        width = max(lengths)
        prompts = torch.zeros(count, width, dtype=torch.long, device=self.device)
        for index, row in enumerate(joining):
            prompts[index, : lengths[index]] = row.prompt
        positions = torch.arange(width, device=self.device)[None].expand(count, width)
        last = torch.tensor(lengths, device=self.device) - 1  # (k,)
        kept = torch.unique(last)  # (U,) the last positions, sorted: the only ones whose logits are needed
        slots = slice(first_slot, first_slot + count)
        self.target_cache.window(slots, positions, width)
        out, features = self._target(input_ids=prompts, position_ids=positions, logits_to_keep=kept)  # (k, width, F)
        logits = out.logits[torch.arange(count), torch.searchsorted(kept, last)].float()  # (k, V)
        if features is not None:
            self._write_context(slots, positions, features, torch.tensor(lengths, device=self.device), width)
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        recorded = [None if features is None else features[i, : lengths[i]] for i in range(count)]
        self._join(joining, logits, recorded, batch_rows, elapsed, updates)

    def _join(
        self,
        joining: list[Row],
        logits: torch.Tensor,  # (k, V) each row's next-token logits after its prompt
        features: list[torch.Tensor | None],  # each row's prompt features, for its record
        batch_rows: int,
        elapsed: float,
        updates: list[RowUpdate],
    ) -> None:
        """Rows whose prompts are in the next free cache rows join the batch: each one's first token, first b."""
        first_slot = len(self.rows)
        # Each first token is drawn before the first b is chosen: it is that block's first token, which a policy reads.
        finite = _finite(logits)
        firsts = [self._first_token(row, logits[i], finite[i]) for i, row in enumerate(joining)]
        for index, row in enumerate(joining):
            temperature = row.config.temperature
            row.prefill_state = PrefillState(
                logits[index], row.prompt, temperature, self.models.train_block_size, batch_rows, firsts[index]
            )
        decide_block_sizes([(row, row.prefill_state) for row in joining if row.failure is None], initial=True)
        finished = []
        for index, (row, first) in enumerate(zip(joining, firsts, strict=True)):
            row.tokens, row.length = [first], row.prompt.numel()
            if row.record is not None and features[index] is not None:
                row.record["features"].append(features[index])
                record_distributions(row, logits[index][None])
            row.prefill_time += elapsed
            self.rows.append(row)
            if row.failure is None:
                if first in row.config.stop_token_ids:
                    row.stop_reason = "stop"
                elif row.config.max_new_tokens == 1:
                    row.stop_reason = "length"
                updates.append(RowUpdate(row.id, [first]))
            if row.stop_reason is not None:
                finished.append(first_slot + index)
        for slot in reversed(finished):
            self._retire(slot, updates)

    def _start_chunked(self, row: Row) -> None:
        super()._start_chunked(row)
        self._chunk_features = []

    def _prefill_chunk(self, updates: list[RowUpdate]) -> None:
        """The next `prefill_chunk` tokens of the long prompt being prefilled, in its own cache row (`max_batch`,
        past every active row): the running rows cycle meanwhile, instead of waiting for one long prefill. After
        its last chunk the row moves to the next free cache row and joins the batch."""
        row, start, slot = self.prefilling, self._prefilled, self.max_batch
        if row.cancelled:
            self.prefilling = None
            updates.append(RowUpdate(row.id, [], row.result("cancelled")))
            return
        started = time.perf_counter()
        length = row.prompt.numel()
        stop = min(start + self.prefill_chunk, length)
        positions = torch.arange(start, stop, device=self.device)[None]  # (1, c)
        # A query at position q sees the slots <= q: the earlier chunks and this one up to itself.
        visible = torch.arange(stop, device=self.device)[None, None, :] <= positions[:, :, None]
        rows = slice(slot, slot + 1)
        self.target_cache.window(rows, positions, stop)
        out, features = self._target(  # features (1, c, F)
            input_ids=row.prompt[start:stop][None],
            position_ids=positions,
            attention_mask=visible[:, None],
            logits_to_keep=1,
        )
        if features is not None:
            self._write_context(rows, positions, features, torch.tensor([stop - start], device=self.device), stop)
            if row.record is not None:
                self._chunk_features.append(features[0])
        synchronize(self.device)
        row.prefill_time += time.perf_counter() - started
        self._prefilled = stop
        if stop < length:
            return
        destination = len(self.rows)
        self.target_cache.store.move_row(slot, destination, length)
        if self.context is not None:
            self.context.move_row(slot, destination, length)
        self.prefilling = None
        recorded = torch.cat(self._chunk_features) if self._chunk_features else None
        self._join([row], out.logits[:, -1].float(), [recorded], len(self.rows) + 1, 0.0, updates)

    # ---------------------------------------------------------------- one cycle for the whole batch

    def _cycle(self, updates: list[RowUpdate]) -> None:
        started = time.perf_counter()
        rows = self.rows
        sizes = [min(row.block_size, row.config.max_new_tokens - len(row.tokens)) for row in rows]
        sizes = self._priced_sizes(rows, sizes)
        width = max(sizes)
        lengths = torch.tensor([row.length for row in rows], device=self.device)
        last_tokens = torch.tensor([row.last_token for row in rows], device=self.device)
        drafts, draft_probs, draft_logits = self._draft(rows, lengths, last_tokens, sizes, width)
        sizes = self._trim(rows, sizes, draft_logits)
        width = max(sizes)
        block_ids = torch.cat([last_tokens[:, None], drafts[:, : width - 1]], dim=1)  # (n, W)
        logits, features = self._verify(block_ids, lengths, sizes)
        committed = self._accept(rows, sizes, drafts, draft_probs, logits)
        if features is not None:
            positions = lengths[:, None] + torch.arange(width, device=self.device)
            # A row's context grows by its first token and accepted drafts; its slots past them are rewritten
            # before they are read, so the rejected drafts' features are never encoded.
            counts = torch.tensor([accepted + 1 for _, accepted in committed], device=self.device)
            self._write_context(slice(0, len(rows)), positions, features, counts, int(lengths.max()) + width)
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        finished, going_on = [], []
        for index, (row, size, (new_tokens, accepted)) in enumerate(zip(rows, sizes, committed, strict=True)):
            if row.failure is not None:
                finished.append(index)
                continue
            self._commit(row, size, new_tokens, features, logits, index)
            row.acceptance.add(size, accepted)
            self.acceptance.add(size, accepted)
            row.decode_time += elapsed
            updates.append(RowUpdate(row.id, new_tokens))
            if row.stop_reason is None:
                going_on.append((row, len(new_tokens), logits[index, accepted]))
            else:
                finished.append(index)
        self._end_cycle(going_on, finished, updates)

    def _first_token(self, row: Row, logits: torch.Tensor, finite: bool) -> int:
        """The row's first token from its prefill distribution; 0 (unused) for a row that fails here."""
        try:
            if not finite:
                raise NonFiniteLogits("the target's next-token distribution after the prompt is not finite")
            return int(sample_next(logits, row.config.temperature, row.generator))
        except Exception as error:
            row.fail(error)
            return 0

    def _priced_sizes(self, rows: list[Row], sizes: list[int]) -> list[int]:
        """Greedy rows capped at the width the cost curve prices best for this batch; rows sampled at T > 0 keep
        their b (their output for a seed must not depend on the batch) and set the narrowest width allowed."""
        if self.cost is None or len(rows) < 2:
            return sizes
        sampled = [size for row, size in zip(rows, sizes, strict=True) if row.config.temperature > 0]
        pooled = self.acceptance.rate()
        rates = [row.acceptance.rate(prior=pooled, weight=POOLED_PRIOR_DRAFTS) for row in rows]
        width = priced_width(sizes, rates, self.cost, floor=max(sampled, default=1))
        return [size if row.config.temperature > 0 else min(size, width) for row, size in zip(rows, sizes, strict=True)]

    def _draft(
        self, rows: list[Row], lengths: torch.Tensor, last_tokens: torch.Tensor, sizes: list[int], width: int
    ) -> tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
        """Every row's drafts in one drafter call: (n, W - 1) tokens (padding past each row's b - 1), per row
        the drafter's probabilities where the `rejection` rule needs them, and the draft logits (n, W - 1, V)."""
        n = len(rows)
        if width == 1:
            return torch.empty(n, 0, dtype=torch.long, device=self.device), [None] * n, None
        span = int(lengths.max())
        # The slots past the longest row hold the blocks' keys and values while drafting: every row's context is
        # read in place, never copied. Each row's slots from its length on are rewritten before they are read.
        self.context.reserve(n, span + width, self.target_cache.position_limit)
        block_sizes = torch.tensor(sizes, device=self.device)
        packed = min(sizes) < width
        hidden = self.drafter.draft_in_rows(
            self.embed,
            self.context.read_all(slice(0, n), span + width),
            Blocks(last_tokens, lengths, block_sizes, width),
            self.models.mask_token_id,
            block_at=span,
            packed=packed,
        )
        if packed:  # (1, sum(sizes), hidden): the head runs on each row's drafted slots only
            drafted, slots = RaggedTokens.of(block_sizes, width).from_slot(1)
            draft_logits = slots.unpack(self.head(hidden[:, drafted]), n)  # (n, W - 1, V), zeros past a row's b
        else:
            draft_logits = self.head(hidden[:, 1:])  # (n, W - 1, V)
        drafts = draft_logits.argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * n
        for index, (row, size) in enumerate(zip(rows, sizes, strict=True)):
            if size > 1:
                row.drafter_passes += 1
                if row.config.temperature > 0 and row.config.verify == "rejection":
                    probs[index] = temperature_probs(draft_logits[index, : size - 1], row.config.temperature)
                    drafts[index, : size - 1] = sample_tokens(probs[index], row.generator)
        return drafts, probs, draft_logits

    def _trim(self, rows: list[Row], sizes: list[int], draft_logits: torch.Tensor | None) -> list[int]:
        """The block size each row verifies: its drafted b, or 1 + the drafts its policy's `verify_count`
        keeps, given the drafter's top probability in each drafted slot."""
        out = list(sizes)
        for index, (row, size) in enumerate(zip(rows, sizes, strict=True)):
            if not row.policy.trims or size < 2 or draft_logits is None:
                continue
            try:
                count = row.policy.verify_count(draft_confidence(draft_logits[index, : size - 1]))
                if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= size - 1:
                    raise ValueError(
                        f"policy {row.policy.name!r} kept {count!r} drafts; expected an integer in [0, {size - 1}]"
                    )
            except Exception as error:
                row.fail(error)
                continue
            out[index] = count + 1
        return out

    def _target(self, **inputs: Any) -> tuple[Any, torch.Tensor | None]:
        """One target pass over the window set on its cache (prefill, a prefill chunk, a verify): its output, and
        the context features of its tokens for the drafter (None without a drafter)."""
        with tapped(self.target, self.layer_ids) as tap:
            out = self.target(**inputs, **{self.cache_keyword: self.target_cache}, use_cache=True)
        return out, tap.features() if tap is not None else None

    def _verify(
        self, block_ids: torch.Tensor, lengths: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over every row's block: logits (n, W, V) and context features (n, W, F) or None (entries
        past a row's block are padding). Rows of unequal blocks run packed (`RaggedTokens`) where the target's
        attention allows it: its linear layers and head then see each row's own block, not the widest one."""
        n, width = block_ids.shape
        positions = lengths[:, None] + torch.arange(width, device=self.device)  # (n, W)
        span = int(lengths.max()) + width
        # A query at position q sees its own row's slots <= q: the committed context and the block up to itself.
        visible = torch.arange(span, device=self.device)[None, None, :] <= positions[:, :, None]
        ragged = None
        if self.packed_verify and min(sizes) < width:
            ragged = RaggedTokens.of(torch.tensor(sizes, device=self.device))
        if ragged is None:
            self.target_cache.window(slice(0, n), positions, span)
            inputs = {"input_ids": block_ids, "position_ids": positions}
        else:
            self.target_cache.window(slice(0, n), ragged.pack(positions), span, ragged.rows)
            inputs = {
                "input_ids": ragged.pack(block_ids),
                "position_ids": ragged.pack(positions),
                "ragged_tokens": ragged,
            }
        out, features = self._target(**inputs, attention_mask=visible[:, None])
        logits = out.logits
        if ragged is not None:
            logits = ragged.unpack(logits, n)
            features = ragged.unpack(features, n) if features is not None else None
        return logits, features

    def _accept(
        self,
        rows: list[Row],
        sizes: list[int],
        drafts: torch.Tensor,
        draft_probs: list[torch.Tensor | None],
        logits: torch.Tensor,
    ) -> list[tuple[list[int], int]]:
        """Per row: (committed tokens, number of accepted drafts) under the row's rule and generator."""
        # Two device-to-host reads for the whole batch, not two a row: at batch 64 on a GPU they were 128
        # synchronisations a cycle.
        draft_ids = drafts.tolist()  # (n, W - 1)
        greedy_ids = logits.argmax(dim=-1).tolist() if any(row.config.temperature == 0 for row in rows) else None
        finite = _finite(logits)  # (n, W): a row's NaN fails that row alone
        out = []
        for index, (row, size) in enumerate(zip(rows, sizes, strict=True)):
            config = row.config
            row_drafts = draft_ids[index][: size - 1]
            if row.failure is not None:  # failed earlier this cycle (its policy's verify count)
                out.append(([], 0))
                continue
            try:
                if not all(finite[index][:size]):
                    raise NonFiniteLogits("the target's distribution over this request's block is not finite")
                if config.temperature == 0:
                    accepted, bonus = accept_greedy(row_drafts, greedy_ids[index][:size])
                else:
                    target_probs = temperature_probs(logits[index, :size], config.temperature)
                    draft_tensor = drafts[index, : size - 1]
                    if draft_probs[index] is not None:
                        row_probs = draft_probs[index][: size - 1]
                        accepted, bonus = accept_rejection(draft_tensor, row_probs, target_probs, row.generator)
                    else:
                        accepted, bonus = accept_match(draft_tensor, target_probs, row.generator)
            except Exception as error:
                row.fail(error)
                out.append(([], 0))
                continue
            new_tokens = truncate_at_stop([*row_drafts[:accepted], bonus], config.stop_token_ids)
            out.append((new_tokens, accepted))
        return out

    def _commit(
        self,
        row: Row,
        size: int,
        new_tokens: list[int],
        features: torch.Tensor | None,
        logits: torch.Tensor,
        index: int,
    ) -> None:
        """The row's cache now holds the block positions before its new last token."""
        committed = len(new_tokens)
        if row.record is not None and features is not None:
            row.record["features"].append(features[index, :committed])
            record_distributions(row, logits[index, :committed])
        row.length += committed
        row.tokens.extend(new_tokens)
        row.block_sizes.append(size)
        row.acceptance_lengths.append(committed)
        if new_tokens[-1] in row.config.stop_token_ids:
            row.stop_reason = "stop"
        elif len(row.tokens) >= row.config.max_new_tokens:
            row.stop_reason = "length"

    def _write_context(
        self,
        rows: slice,
        positions: torch.Tensor,  # (n, S) absolute positions, all < span
        features: torch.Tensor,  # (n, S, F) target features at those positions
        counts: torch.Tensor,  # (n,) how many of each row's first entries to keep
        span: int,
    ) -> None:
        """Encode the first `counts[i]` features of every row into the drafter's context keys/values, packed:
        entries past a row's count (a shorter prompt's padding, rejected drafts) cost nothing."""
        self.context.reserve(rows.stop, span, self.target_cache.position_limit)
        kept = RaggedTokens.of(counts, positions.shape[1])
        kept_positions = kept.pack(positions)  # (1, T)
        for layer, (keys, values) in enumerate(self.drafter.encode_context(kept.pack(features), kept_positions)):
            self.context.write(layer, rows, kept_positions, keys, values, token_rows=kept.rows)

    # ---------------------------------------------------------------- leaving

    def _free_row(self, index: int, last: int) -> None:
        if index != last:
            # Slots up to the moved row's last verify may be read by nobody, but copying `length` is enough:
            # everything past it is rewritten before it is read.
            length = self.rows[last].length
            self.target_cache.store.move_row(last, index, length)
            if self.context is not None:
                self.context.move_row(last, index, length)


# ----------------------------------------------------------------------------- entry points


def generate_many(
    models: SpeculativeModels,
    requests: Sequence[GenerationRequest],
    *,
    max_batch: int | None = None,
    cost: CyclePrice | None = None,
    engine: Any | None = None,
) -> list[GenerationResult]:
    """Run `requests` through one engine (all at once by default; verify widths priced with `cost` when given)
    and return their results in order. `engine`: one already built (a `SpeculativeEngine`, or a `StaticEngine`
    whose compiled cycles are reused across calls) instead of a new eager one. A row that fails raises its error
    here (the engine itself goes on with the other rows: a server reads `RowUpdate.error`)."""
    engine = engine or SpeculativeEngine(models, max_batch=max_batch or max(1, len(requests)), cost=cost)
    ids = [engine.submit(request) for request in requests]
    results: dict[int, GenerationResult] = {}
    for update in engine.run():
        if update.error is not None:
            raise update.error
        if update.result is not None:
            results[update.row_id] = update.result
    return [results[i] for i in ids]


def generate(
    models: SpeculativeModels,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    policy: BlockSizePolicy | None = None,
    config: GenerationConfig | None = None,
    record: bool = False,
) -> GenerationResult:
    """Generate after `prompt_ids` (one row of the engine), to the end."""
    prompt = torch.as_tensor(prompt_ids).flatten().tolist()
    request = GenerationRequest(prompt, config or GenerationConfig(), policy, record)
    return generate_many(models, [request])[0]
