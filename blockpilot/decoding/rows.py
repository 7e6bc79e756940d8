"""A request's row and its life in the engine (`engine.Engine`) (`Row`, `RowUpdate`, `RowScheduler`: the queue, admission into
the batch, cancel, the end of a cycle and of a row), the policies' hooks asked once per policy the rows share
(`decide_block_sizes`), and how rows fail alone (`NonFiniteLogits`, a hook's bad answer) or fail the engine
(`is_device_failure`)."""

from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from blockpilot.blocks import AUTOREGRESSIVE
from blockpilot.checks import check_fits_context, positive_int
from blockpilot.decoding.batch_pricing import DraftSavings, OptionPrice, SlotAcceptance
from blockpilot.decoding.request import (
    RECORD_TOP_K,
    GenerationConfig,
    GenerationRecord,
    GenerationRequest,
    GenerationResult,
    StopReason,
)
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState, distribution_summary
from blockpilot.policies.fixed import Autoregressive, FixedBlockSize

# Joining prompts share a prefill pass while its padding stays under half its real tokens. One padded pass
# for a burst of 32 prompts of 20 to 283 tokens computed 4x their tokens: 2.3 s of a 3.4 s batch on a CPU.
PREFILL_MAX_PADDING = 1.5


@dataclass
class RowUpdate:
    """What one engine step did for one row: the tokens it committed, and the result once the row is done; `error`
    when the row failed (its policy raised or answered a bad value, its logits were not finite, its sampling
    raised): that row ends (stop reason "error") and the others go on."""

    row_id: int
    new_tokens: list[int]
    result: GenerationResult | None = None
    error: BaseException | None = None


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


class NonFiniteLogits(FloatingPointError):
    """The target's distribution for a row holds NaN or infinity."""


@dataclass
class Row:
    """A request inside the engine."""

    id: int
    request: GenerationRequest
    prompt: torch.Tensor  # (P,)
    policy: BlockSizePolicy
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # positions in the caches == position of the last committed token
    block_size: int = 1  # the policy's current choice
    chosen_block_size: int = 1  # its choice after prefill
    block_sizes: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    tree_nodes: list[int] = field(default_factory=list)  # per cycle, where trees ran
    tree_budget: int | None = None  # the nodes of its trees, chosen after prefill (None: chains of its b)
    drafter_passes: int = 0
    # Whether the drafter's context is kept for it: False once its policy chose b = 1 for good
    # (`BlockSizePolicy.autoregressive_for_good`); such a row's per-cycle hook is not asked either.
    drafter_context: bool = True
    pending_context: int = 0  # its positions whose drafter context waits in the decoder (`defer` cycles)
    acceptance: SlotAcceptance = field(default_factory=SlotAcceptance)  # its drafted slots kept, for batch pricing
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_state: PrefillState | None = None
    keeps_block_size: bool = False  # its policy keeps its first b to the end (`keeps_block_size_of`), set at join
    decision_placed: bool = False  # the cycle's decision has its request's inputs (`Engine._place_decision_inputs`)
    probing: int = 0  # autoregressive cycles left before it drafts its chain again (`Engine._price_lone_chain`)
    stop_reason: StopReason | None = None
    cancelled: bool = False
    failure: BaseException | None = None  # why the row ended with stop reason "error"
    record: dict[str, list[torch.Tensor]] | None = None

    @property
    def batch_chooses(self) -> bool:
        """Whether, in a cycle of several rows, the batch chooses this row's b (`Engine._batch_width`): its policy
        adapts (a fixed b is the request's own) and it keeps the drafter's context to draft from."""
        return self.policy.adapts and self.drafter_context

    def stop_drafting(self) -> None:
        """Decode autoregressive for good from the next cycle: b = 1, and no drafter context kept for later."""
        self.block_size, self.drafter_context = AUTOREGRESSIVE, False

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


def cycle_state(
    row: Row,
    committed: int,
    anchor_logits: torch.Tensor,
    confidence: float | None,
    batch_rows: int,
    prices: Mapping[int, float] | None = None,
) -> CycleState:
    """What the per-cycle hook sees of a row's last cycle, which committed `committed` tokens."""
    return CycleState(
        cycle=len(row.block_sizes) - 1,
        block_size=row.block_sizes[-1],
        acceptance_length=committed,
        new_tokens=len(row.tokens),
        max_new_tokens=row.config.max_new_tokens,
        temperature=row.config.temperature,
        anchor_logits=anchor_logits,
        first_block_size=row.chosen_block_size,
        prefill=row.prefill_state,
        batch_rows=batch_rows,
        recent_tokens=tuple(row.tokens[-2:]),
        anchor_confidence=confidence,
        prices=prices,
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
    """The engine's rows: the queue of requests, their checks, cancel, admission into at most `max_batch`
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
        self.option_price = OptionPrice()  # what a row's option to draft later costs here (`batch_pricing`)
        self._draft_savings: weakref.WeakKeyDictionary[BlockSizePolicy, DraftSavings] = weakref.WeakKeyDictionary()

    def draft_savings(self, policy: BlockSizePolicy) -> DraftSavings | None:
        """What `policy`'s drafts saved its rows that kept the option to draft here (None: a policy that cannot be
        told apart from another, unhashable)."""
        try:
            return self._draft_savings.setdefault(policy, DraftSavings())
        except TypeError:
            return None

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
        self,
        going_on: list[tuple[Row, int, int, float, int | None]],
        finished: list[int],
        updates: list[RowUpdate],
    ) -> None:
        """After a cycle: the next b of every row going on (row, tokens it committed, its index in the batch, whose
        anchor's logits `_anchor_logits` gives a hook that asks, their top-1 probability, and the b its policy chose
        inside the cycle, if it did), priced at the batch the next cycle runs (those rows and the waiting ones that
        will join them); then the finished rows and any row that failed meanwhile (its policy's hook) leave."""
        next_batch = min(self.max_batch, len(going_on) + len(self.waiting))
        # A policy that keeps b has no per-cycle hook to ask, nor a row autoregressive for good, nor a row whose next
        # b the batch chooses; a lone row's policy that chose inside the cycle (for a batch of one) has answered.
        deciding = []
        for row, committed, index, confidence, decided in going_on:
            if row.keeps_block_size or not row.drafter_context or self._chosen_by_batch(row, next_batch):
                continue
            if decided is not None and next_batch == 1:
                row.block_size = decided
                self.option_price.observe("hook", 0.0)
            else:
                deciding.append((row, committed, self._anchor_logits(index), confidence))
        if deciding:
            started, prices = time.perf_counter(), self._policy_prices(next_batch)
            decide_block_sizes([(row, cycle_state(row, *done, next_batch, prices)) for row, *done in deciding], False)
            self.option_price.observe("hook", (time.perf_counter() - started) / len(deciding))
        failed = {index for index, row in enumerate(self.rows) if row.failure is not None}
        for index in sorted(set(finished) | failed, reverse=True):
            self._retire(index, updates)

    def _retire(self, index: int, updates: list[RowUpdate]) -> None:
        """Finish row `index`: the last active row takes over its cache row; its result joins this step's update."""
        row = self.rows[index]
        if row.stop_reason in ("stop", "length"):
            self.option_price.finished(len(row.tokens))
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

    def _policy_prices(self, batch_rows: int) -> Mapping[int, float] | None:
        """b -> measured seconds of a cycle at `batch_rows` rows, as a policy reads them (None: none measured)."""
        return None

    def _anchor_logits(self, index: int) -> torch.Tensor:
        """(V,) the logits at the new last token of the row at `index` of the last cycle's batch."""
        raise NotImplementedError

    def _chosen_by_batch(self, row: Row, batch_rows: int) -> bool:
        """Whether the batch, not the row's policy, chooses the row's b in a cycle of `batch_rows` rows (then its
        per-cycle hook is not asked before it)."""
        return False

    def _free_row(self, index: int, last: int) -> None:
        """Cache row `index` is left: move cache row `last` (an active row's) into it, or free it if it is last."""
        raise NotImplementedError
