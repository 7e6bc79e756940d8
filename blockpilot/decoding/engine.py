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
`acceptance.py`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from blockpilot.checks import check_fits_context, positive_int
from blockpilot.decoding.acceptance import (
    accept_greedy,
    accept_match,
    accept_rejection,
    sample_next,
    sample_tokens,
    temperature_probs,
)
from blockpilot.decoding.cache import SlotStore, TargetSlotCache
from blockpilot.decoding.request import (
    RECORD_TOP_K,
    GenerationConfig,
    GenerationRecord,
    GenerationRequest,
    GenerationResult,
    StopReason,
)
from blockpilot.decoding.width import AcceptanceRate, CyclePrice, priced_width
from blockpilot.models.attention import GROUPED_SDPA, RaggedTokens, masked_attention_kernels
from blockpilot.models.drafter import Blocks
from blockpilot.models.features import tapped
from blockpilot.models.loading import SpeculativeModels, cache_keyword, synchronize
from blockpilot.policies.base import (
    BlockSizePolicy,
    CycleState,
    PrefillState,
    distribution_summary,
    draft_confidence,
)
from blockpilot.policies.fixed import Autoregressive, FixedBlockSize

# Joining prompts share a prefill pass while its padding stays under half its real tokens. One padded pass
# for a burst of 32 prompts of 20 to 283 tokens computed 4x their tokens: 2.3 s of a 3.4 s batch on a CPU.
PREFILL_MAX_PADDING = 1.5
# How many drafts' worth of the engine's pooled acceptance rate a row's own rate starts from (`width.py`).
POOLED_PRIOR_DRAFTS = 4.0


@dataclass
class RowUpdate:
    """What one engine step did for one row: the tokens it committed, and the result once the row is done; `error`
    when the row failed (its policy raised or answered a bad value, its logits were not finite, its sampling
    raised): that row ends (stop reason "error") and the others go on."""

    row_id: int
    new_tokens: list[int]
    result: GenerationResult | None = None
    error: BaseException | None = None


# Slots past a row's last position that a cycle writes into: the drafter's block and the verify's block.
CACHE_SCRATCH = 64


# Failures of the device, not of one row: they poison the process (a CUDA device assert cannot be cleared), so they
# fail the engine (and the replica's health), never a row alone.
DEVICE_FAILURE_MARKERS = ("cuda error", "device-side assert", "cudnn", "nccl", "driver", "ecc error")


def is_device_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return (
        isinstance(error, RuntimeError)
        and "out of memory" not in text
        and any(m in text for m in DEVICE_FAILURE_MARKERS)
    )


def _finite(logits: torch.Tensor) -> list:
    """Whether each distribution of (..., V) logits is usable, as a nested list (...): its largest logit is
    finite. NaN propagates into the maximum and so does +inf, while a few tokens banned at -inf (a legitimate
    logit) leave it finite; one reduction over the logits, not an elementwise test of every one."""
    return torch.isfinite(logits.amax(dim=-1)).tolist()


class NonFiniteLogits(FloatingPointError):
    """The target's distribution for a row holds NaN or infinity."""


@dataclass
class Row:
    """A request inside the engine."""

    id: int
    request: GenerationRequest
    prompt: torch.Tensor  # (P,)
    policy: BlockSizePolicy
    generator: torch.Generator | None  # the eager engine's draws (the static engine's are keyed on the seed)
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # positions in the caches == position of the last committed token
    block_size: int = 1  # the policy's current choice
    chosen_block_size: int = 1  # its choice after prefill
    block_sizes: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    tree_nodes: list[int] = field(default_factory=list)  # per cycle, where trees ran (the static engine)
    tree_budget: int | None = None  # the nodes of its trees, chosen after prefill (None: chains of its b)
    acceptance: AcceptanceRate = field(default_factory=AcceptanceRate)
    drafter_passes: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_state: PrefillState | None = None
    stop_reason: StopReason | None = None
    cancelled: bool = False
    failure: BaseException | None = None  # why the row ended with stop reason "error"
    record: dict[str, list[torch.Tensor]] | None = None

    def fail(self, error: BaseException) -> None:
        """End this row with `error`; a failure of the device is raised instead (`is_device_failure`)."""
        if is_device_failure(error):
            raise error
        self.failure, self.stop_reason = error, "error"

    def result(self, stop_reason: StopReason) -> GenerationResult:
        """What the caller gets of this row once it ended."""
        record = None
        if self.record is not None and self.record["features"]:
            record = GenerationRecord(
                context_features=torch.cat(self.record["features"], dim=0),
                entropy=torch.cat(self.record["entropy"], dim=0),
                top_ids=torch.cat(self.record["top_ids"], dim=0),
                top_probs=torch.cat(self.record["top_probs"], dim=0),
            )
        return GenerationResult(
            token_ids=list(self.tokens),
            prompt_length=self.prompt.numel(),
            policy=self.policy.name,
            block_size=self.chosen_block_size,
            block_sizes=list(self.block_sizes),
            acceptance_lengths=list(self.acceptance_lengths),
            tree_nodes=list(self.tree_nodes),
            stop_reason=stop_reason,
            prefill_time_s=self.prefill_time,
            decode_time_s=self.decode_time,
            target_forward_passes=(1 if self.tokens else 0) + len(self.block_sizes),
            drafter_forward_passes=self.drafter_passes,
            prefill=self.prefill_state,
            record=record,
        )

    @property
    def config(self) -> GenerationConfig:
        return self.request.config

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def prefill_groups(lengths: Sequence[int], max_padding: float = PREFILL_MAX_PADDING) -> list[list[int]]:
    """Indices of the joining prompts, grouped into prefill passes: by length, shortest first, a group growing
    while its padded size (rows x longest prompt) stays within `max_padding` x its real tokens."""
    if max_padding < 1:
        raise ValueError(f"max_padding must be >= 1 (padded tokens per real token), got {max_padding!r}")
    groups: list[list[int]] = []
    real = 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[index] <= max_padding * (real + lengths[index]):
            groups[-1].append(index)
            real += lengths[index]
        else:
            groups.append([index])
            real = lengths[index]
    return groups


def truncate_at_stop(tokens: list[int], stop_token_ids: Sequence[int]) -> list[int]:
    """Tokens up to and including the first stop token."""
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: index + 1]
    return tokens


def _checked_sizes(policy: BlockSizePolicy, sizes: Any, rows: int) -> list[int]:
    """A batched hook's answer for `rows` rows, each an integer block size >= 1."""
    sizes = list(sizes)
    if len(sizes) != rows:
        raise ValueError(f"policy {policy.name!r} returned {len(sizes)} block sizes for {rows} rows")
    return [_checked(size, policy) for size in sizes]


def _checked_budgets(policy: BlockSizePolicy, budgets: Any, rows: int) -> list[int | None]:
    """A batched `initial_tree_budgets` answer for `rows` rows, each a tree's nodes in [1, policy.tree_nodes] or None
    (a chain)."""
    budgets = list(budgets)
    if len(budgets) != rows:
        raise ValueError(f"policy {policy.name!r} returned {len(budgets)} tree budgets for {rows} rows")
    for nodes in budgets:
        good = isinstance(nodes, int) and not isinstance(nodes, bool) and 1 <= nodes <= (policy.tree_nodes or 0)
        if nodes is not None and not good:
            raise ValueError(
                f"policy {policy.name!r} returned tree budget {nodes!r}; expected None or an integer in "
                f"[1, {policy.tree_nodes}]"
            )
    return budgets


def _checked(block_size: Any, policy: BlockSizePolicy) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"policy {policy.name!r} returned block size {block_size!r}; expected an integer >= 1")
    return block_size


def cycle_state(row: Row, committed: int, anchor_logits: torch.Tensor, batch_rows: int) -> CycleState:
    """What the per-cycle hook sees of a row's last cycle, which committed `committed` tokens."""
    return CycleState(
        cycle=len(row.block_sizes) - 1,
        block_size=row.block_size,
        acceptance_length=committed,
        new_tokens=len(row.tokens),
        max_new_tokens=row.config.max_new_tokens,
        temperature=row.config.temperature,
        anchor_logits=anchor_logits,
        first_block_size=row.chosen_block_size,
        prefill=row.prefill_state,
        batch_rows=batch_rows,
        recent_tokens=tuple(row.tokens[-2:]),
    )


def rows_by_policy(rows: Sequence[Row]) -> list[list[int]]:
    """The indices of `rows` grouped by the policy object they share, so that a policy with a model is asked
    once for all its rows."""
    groups: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(id(row.policy), []).append(index)
    return list(groups.values())


def new_record() -> dict[str, list[torch.Tensor]]:
    """A recording row's record, filled as it decodes (`Row.result` makes it a `GenerationRecord`)."""
    return {"features": [], "entropy": [], "top_ids": [], "top_probs": []}


def record_distributions(row: Row, logits: torch.Tensor) -> None:
    """Keep the summaries of the distributions (m, V) that drew the row's next m tokens."""
    entropy, top_ids, top_probs = distribution_summary(logits, RECORD_TOP_K)
    row.record["entropy"].append(entropy)
    row.record["top_ids"].append(top_ids)
    row.record["top_probs"].append(top_probs)


def decide_block_sizes(pairs: list[tuple[Row, Any]], initial: bool) -> None:
    """Each row's b from its policy: the first one from the prefill state (`initial`), with its tree budget for a
    tree policy, else the next one from its cycle state; one batched call per policy the rows share. A policy that
    raises or answers a bad value for the group is asked row by row, so that only the rows it fails on fail, with
    its error."""
    for group in rows_by_policy([row for row, _ in pairs]):
        rows, states = [pairs[i][0] for i in group], [pairs[i][1] for i in group]
        policy = rows[0].policy
        hook = policy.initial_block_sizes if initial else policy.next_block_sizes
        sizes = _per_row(hook, states, rows, lambda answer, n: _checked_sizes(policy, answer, n))
        budgets: list[int | None] = [None] * len(group)
        if initial and policy.tree_nodes is not None:
            budgets = _per_row(
                policy.initial_tree_budgets, states, rows, lambda answer, n: _checked_budgets(policy, answer, n)
            )
        for row, size, budget in zip(rows, sizes, budgets, strict=True):
            if size is None or row.failure is not None:  # a hook failed on it
                continue
            row.block_size = size
            if initial:
                row.chosen_block_size, row.tree_budget = size, budget


def _per_row(hook: Callable[[list], Any], states: list, rows: list[Row], check: Callable[[Any, int], list]) -> list:
    """`check(hook(states), n)` for n rows at once; if that raises, row by row, failing the rows it raises on (their
    answer None)."""
    try:
        return check(hook(states), len(states))
    except Exception:
        answers = []
        for row, state in zip(rows, states, strict=True):
            try:
                answers.append(check(hook([state]), 1)[0])
            except Exception as error:
                row.fail(error)
                answers.append(None)
        return answers


class RowScheduler:
    """What both engines share: the queue of requests, their checks, cancel, admission into at most `max_batch`
    rows (a long prompt prefilled a chunk a step in a spare row), and the end of a row. An engine adds the caches,
    the prefill and the cycle (`step`), and how a leaving row's cache row is freed (`_free_row`)."""

    def __init__(self, models: SpeculativeModels, max_batch: int, prefill_chunk: int | None) -> None:
        self.models = models
        self.max_batch = positive_int(max_batch, "max_batch")
        # Prompts longer than this are prefilled a chunk a step, beside the running rows' cycles (None: whole).
        self.prefill_chunk = None if prefill_chunk is None else positive_int(prefill_chunk, "prefill_chunk")
        self.device = models.device
        text_config = models.target.config.get_text_config()
        self.context_limit = getattr(text_config, "max_position_embeddings", None)
        self.vocab_size = int(models.target.get_input_embeddings().weight.shape[0])
        self.rows: list[Row] = []  # active rows; row i occupies cache row i
        self.waiting: deque[Row] = deque()
        self.prefilling: Row | None = None  # the one long prompt being prefilled, in cache row `max_batch`
        self._prefilled = 0  # its prompt tokens already in the caches
        self._ids = itertools.count()

    def _checked_prompt(self, request: GenerationRequest) -> torch.Tensor:
        """The request's prompt as a tensor, or ValueError naming what is wrong with it."""
        prompt = torch.as_tensor(list(request.prompt_ids), dtype=torch.long).flatten()
        if prompt.numel() == 0:
            raise ValueError("prompt is empty: expected at least one token id")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size:
            raise ValueError(
                f"prompt token ids must lie in [0, {self.vocab_size}), got min {int(prompt.min())}, "
                f"max {int(prompt.max())}"
            )
        check_fits_context(prompt.numel(), request.config.max_new_tokens, self.context_limit)
        return prompt

    def _policy_of(self, request: GenerationRequest) -> BlockSizePolicy:
        if self.models.drafter is None:
            return Autoregressive()
        return request.policy or FixedBlockSize(self.models.drafter.block_size)

    def _queue(self, row: Row) -> int:
        self.waiting.append(row)
        return row.id

    def cancel(self, row_id: int) -> None:
        """End a row before its next cycle (stop reason "cancelled"); unknown or finished ids are ignored."""
        for row in itertools.chain(self.rows, self.waiting, [self.prefilling] if self.prefilling else []):
            if row.id == row_id:
                row.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.prefilling)

    def run(self) -> Iterator[RowUpdate]:
        """Step until every submitted row is done, yielding each step's updates."""
        while self.busy:
            yield from self.step()

    def step(self) -> list[RowUpdate]:
        raise NotImplementedError

    def _joining(self) -> list[Row]:
        """Waiting rows that join the batch this step, in order; a long prompt starts its chunked prefill instead
        (one at a time; the short ones behind it need not wait for it)."""
        joining, passed = [], deque()
        while self.waiting and len(self.rows) + len(joining) + (self.prefilling is not None) < self.max_batch:
            row = self.waiting.popleft()
            if self.prefill_chunk is None or row.prompt.numel() <= self.prefill_chunk:
                joining.append(row)
            elif self.prefilling is None:
                self._start_chunked(row)
            else:
                passed.append(row)
        self.waiting.extendleft(reversed(passed))
        return joining

    def _start_chunked(self, row: Row) -> None:
        self.prefilling, self._prefilled = row, 0

    def _drop_cancelled(self, updates: list[RowUpdate]) -> None:
        for row in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(row)
            updates.append(RowUpdate(row.id, [], row.result("cancelled")))
        for index in reversed([i for i, r in enumerate(self.rows) if r.cancelled]):
            self.rows[index].stop_reason = "cancelled"
            self._retire(index, updates)

    def _end_cycle(
        self, going_on: list[tuple[Row, int, torch.Tensor]], finished: list[int], updates: list[RowUpdate]
    ) -> None:
        """After a cycle: the next b of every row going on (row, tokens it committed, its anchor's logits), priced at
        the batch the next cycle runs (those rows and the waiting ones that will join them); then the finished rows
        and any row that failed meanwhile (its policy's hook) leave."""
        next_batch = min(self.max_batch, len(going_on) + len(self.waiting))
        decide_block_sizes([(row, cycle_state(row, *done, next_batch)) for row, *done in going_on], initial=False)
        failed = {index for index, row in enumerate(self.rows) if row.failure is not None}
        for index in sorted(set(finished) | failed, reverse=True):
            self._retire(index, updates)

    def _retire(self, index: int, updates: list[RowUpdate]) -> None:
        """Finish row `index`: the last active row takes over its cache row; its result joins this step's update."""
        row = self.rows[index]
        self._free_row(index, len(self.rows) - 1)
        if index != len(self.rows) - 1:
            self.rows[index] = self.rows[-1]
        self.rows.pop()
        result = row.result(row.stop_reason)
        mine = next((u for u in reversed(updates) if u.row_id == row.id), None)
        if mine is None:
            updates.append(RowUpdate(row.id, [], result, row.failure))
        else:
            mine.result, mine.error = result, row.failure

    def _free_row(self, index: int, last: int) -> None:
        """Cache row `index` is left: move cache row `last` (an active row's) into it, or free it if it is last."""
        raise NotImplementedError


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
