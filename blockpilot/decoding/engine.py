"""The engine: continuous batching on the static cycle (`static.py`). Every command decodes here: `generate`,
`serve`, `label`, `calibrate`, the demo and the benchmarks. `compile="off"` runs the same cycle eagerly (debugging,
and the reference in exactness tests); it is not a second engine.

Rows live in cache rows 0 .. n - 1 of a `StaticDecoder` built for `max_batch` rows (and one more, where a long
prompt is prefilled a chunk a step beside the running rows). A step: drop cancelled rows -> prefill joining rows
into the next free cache rows (a few passes of prompts of similar length) -> one cycle for the n rows at the
smallest compiled row count >= n, the span of cache their contexts need and the width bucket of the widest b ->
one device-to-host copy of what the rows committed -> stop tokens, budgets, per-step policies on the host ->
finished rows leave, the last row moving into the hole.

- a chain cycle runs at the width bucket of its widest b (a row's b <= width is where its acceptance stops), so a
  policy's b is capped at the engine's width; rows of unequal b run packed where that computes fewer entries, each
  row its own slots (`StaticDecoder._packed_cycle`), else every row computes the width; in a cycle of several rows
  an adaptive row drafts the whole width (`Engine._widened`);
- sampling is counter-based (`sampling.pick_tokens`): a row's output for a seed is a function of its prompt and seed
  alone (any b, any batch);
- rows at T > 0 with a top-k or top-p sample their cut distributions (`sampling.truncate`) in a cycle variant of
  its own, run only when a row of the batch truncates (a batch without one pays no sort);
- `rejection` rows draft samples of the drafter (`sampling.speculative_sampling`), in a cycle variant compiled when
  one runs; a tree engine verifies by matching only;
- feature records (`GenerationRequest.record`, labeling's reference generations) need an engine built with
  `record=True`: its compiled cycle then also keeps every committed position's features and distribution summary;
- draft trees (`tree.py`, policy `tree:N`): an engine built with `tree_nodes` drafts, grows every row's tree on the
  device (`tree.grow_trees`) and verifies the batch's trees in one target pass, one step a cycle.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from blockpilot.blocks import AUTOREGRESSIVE, flushes
from blockpilot.checks import positive_int
from blockpilot.decoding.batch_pricing import (
    LONE_PRIOR_SLOTS,
    LONE_PROBE,
    Exploration,
    LonePeriods,
    MeasuredPrices,
    RecentLoad,
    SlotAcceptance,
    batch_width,
    expected_commits,
    temperature_key,
)
from blockpilot.decoding.compiled import compile_mode
from blockpilot.decoding.request import GenerationConfig, GenerationRequest, GenerationResult
from blockpilot.decoding.rows import (
    PREFILL_MAX_PADDING,
    NonFiniteLogits,
    Row,
    RowScheduler,
    RowUpdate,
    decide_block_sizes,
    is_device_failure,
    new_record,
    prefill_groups,
    record_distributions,
    truncate_at_stop,
)
from blockpilot.decoding.static import CONFIDENCE_UNITS, StaticDecoder, largest_packing, span_bucket
from blockpilot.home import blockpilot_home
from blockpilot.models.loading import SpeculativeModels, synchronize
from blockpilot.policies.base import BlockSizePolicy, PrefillState
from blockpilot.policies.fixed import Autoregressive, FixedBlockSize
from blockpilot.tree import TOP_K

COMPILE_HELP = (
    "auto (default): what pays on the device (compile on a CPU, compile+graph on CUDA); off: the same cycle eagerly "
    "(debugging); compile, graph, compile+graph: torch.compile the cycle, replay it as a CUDA graph, or both"
)
# Cache slots a row holds by default: its prompt, its budget and one block must fit.
DEFAULT_CAPACITY = 2048


def keep_compiled_kernels() -> None:
    """Inductor's compiled kernels go under $BLOCKPILOT_HOME/inductor, with everything else the project writes (a
    second run of the same shapes loads them instead of compiling), unless TORCHINDUCTOR_CACHE_DIR says otherwise.
    Inductor writes its default folder into that variable the first time it looks (an import may), so the default
    is replaced too; call before anything compiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(blockpilot_home() / "inductor")


def shape_for(policy: BlockSizePolicy) -> tuple[int | None, int | None]:
    """(width, tree nodes) a static engine needs for rows of `policy` alone: a fixed b's own width, a tree's depth and
    (largest) budget; (None, None) (the defaults) for a policy that chooses b."""
    if policy.tree_nodes is not None:
        return policy.tree_depth, policy.tree_nodes
    if isinstance(policy, (FixedBlockSize, Autoregressive)):
        return policy.initial_block_size(None), None
    return None, None


def power_buckets(limit: int, smallest: int = 1) -> list[int]:
    """The sizes a shape is compiled at, up to `limit`: powers of two from `smallest` below it, and `limit` (row
    counts, chain widths)."""
    return sorted({*(1 << i for i in range(limit.bit_length()) if smallest <= 1 << i < limit), limit})


def tree_buckets(tree_nodes: int) -> list[int]:
    """The tree sizes, in nodes, a verify is compiled at, up to `tree_nodes`: those whose slots (the root too) are
    powers of two from 4, and `tree_nodes`. A verify's cost is a staircase in its slots, with steps past multiples of
    8 on the CPUs measured (one slot past 8, 16 or 32 costs 9-17% more), so a bucket of 2^k - 1 nodes is the largest
    tree at its price."""
    return [slots - 1 for slots in power_buckets(tree_nodes + 1, smallest=4)]


class Engine(RowScheduler):
    """Continuous-batching speculative decoding: `submit` a request (its row id back), `step` (admission, then one
    cycle for every row; each row's `RowUpdate`s), `run` (step until idle, as a generator), `cancel`.

    `width`: the widest block a row drafts (default: the drafter's training block size B + 2, the widest candidate
    the project's sweeps label; 1 without a drafter). `capacity`: cache slots a row holds (prompt, budget and one
    block; default 2,048, at most the context). `compile`: `compiled.COMPILE_MODES`, "auto" resolved by
    `compile_mode` (the class's default is "off": a one-off generation does not repay a compile; the commands
    default to "auto"). `sampling`: whether rows may
    decode at T > 0 (off, the cycle skips the sampler). `prefill_chunk`: prompts longer than this are prefilled a
    chunk a step, beside the running rows' cycles. `tree_nodes`: every cycle verifies draft trees of up to this
    many nodes (`tree.py`; a row without a tree policy as the chain of its b), branching into each slot's `top_k`
    tokens (at least the engine's widest chain: a chain of b is the tree of b - 1 nodes). `row_buckets`: the row
    counts a cycle runs at (default: powers of two up to `max_batch`; a cycle of fewer rows runs at the next, its
    free rows committing nothing), so many compiled shapes a span. `batch_pricing`: a cycle of several rows where no
    fixed b drafts runs the measured width (autoregression included) of the most expected tokens a second, every
    adaptive row drafting all of it (`batch_pricing.py`; off: every row runs its policy's b, as when measuring a
    policy's own choices). `pack_rows`: chain cycles of rows of unequal b compute each row's own slots
    (`StaticDecoder._packed_cycle`; a step of each token bucket compiles the first time a batch meets it).
    """

    def __init__(
        self,
        models: SpeculativeModels,
        *,
        max_batch: int = 1,
        width: int | None = None,
        capacity: int | None = None,
        compile: str = "off",
        sampling: bool = True,
        prefill_chunk: int | None = None,
        tree_nodes: int | None = None,
        top_k: int = TOP_K,
        record: bool = False,
        row_buckets: Sequence[int] | None = None,
        batch_pricing: bool = True,
        pack_rows: bool = True,
    ) -> None:
        super().__init__(models, max_batch, prefill_chunk)
        if width is None:
            width = models.train_block_size + 2 if models.drafter is not None else 1
        self.width = positive_int(width, "width")
        capacity = capacity or min(DEFAULT_CAPACITY, self.context_limit or DEFAULT_CAPACITY)
        if tree_nodes is not None:  # the largest tree bucket holds every chain a row may draft
            tree_nodes = max(positive_int(tree_nodes, "tree_nodes"), self.width - 1)
        self.decoder = StaticDecoder(
            models,
            rows=self.max_batch + 1,
            width=self.width,
            capacity=capacity,
            compile=compile,
            sampling=sampling,
            tree_nodes=tree_nodes,
            top_k=top_k,
            record=record,
        )
        self.decoder.pack_rows = pack_rows
        self.tree_nodes = tree_nodes  # the largest tree a cycle verifies, in nodes past the root (None: chains)
        self.tree_sizes = tree_buckets(tree_nodes) if tree_nodes is not None else []
        self.verified_nodes: Counter[int] = Counter()  # cycles by the tree size they verified
        self.reach = max(self.width, (tree_nodes or 0) + 1)  # slots a cycle writes past a row's length
        self.buckets = sorted(set(row_buckets)) if row_buckets else power_buckets(self.max_batch)
        if self.buckets[-1] != self.max_batch or self.buckets[0] < 1:
            raise ValueError(
                f"row_buckets must lie in 1 .. {self.max_batch} and hold max_batch {self.max_batch}, got {row_buckets}"
            )
        self.widths = power_buckets(self.width)  # the widths a chain cycle is compiled at
        self._seeds: dict[int, int] = {}  # row id -> the seed its draws are keyed on
        self.prices = MeasuredPrices(self.widths)  # what its chain cycles cost here and now
        self.batch_pricing = batch_pricing
        self._cycle_policy: BlockSizePolicy | None = None  # the policy whose choice its lone cycles compute
        self.lone_periods = LonePeriods(self.widths)  # what a lone row's cycle costs at each width, all in
        self.forget_requests()  # what the requests tell: nothing yet
        # the last lone cycle where nothing came after it: when it started, its width, whether it followed its width
        self._last_lone: tuple[float, int, bool] | None = None
        self._last_shape: tuple[int, int] | None = None  # the last chain cycle's (bucket, width), nothing after it

    @property
    def capacity(self) -> int:
        return self.decoder.capacity

    @property
    def spans(self) -> list[int]:
        """The spans of cache a cycle reads, in the order rows reach them (`span_bucket`)."""
        spans = [span_bucket(1, self.capacity)]
        while spans[-1] < self.capacity:
            spans.append(span_bucket(spans[-1] + 1, self.capacity))
        return spans

    def decide_in_cycle(self, policy: BlockSizePolicy) -> bool:
        """Whether `policy`'s per-step choice is computed inside the compiled cycle of a lone row (no hook on the host
        between its cycles): set up now where the policy has such a form (`cycle_decision`) and no step is built yet
        (a built step replays what it traced; `serve` sets it before it builds its shapes). One policy an engine; the
        others' rows, and this one's in cycles of several rows, ask their hooks."""
        if self._cycle_policy is not None or self.decoder.steps.built:
            return self._cycle_policy is policy
        make = getattr(policy, "cycle_decision", None)
        decision = make(self.device) if make is not None and self.decoder.drafter is not None else None
        if decision is None:
            return False
        self.decoder.set_decision(decision, decision.inputs)
        self._cycle_policy = policy
        return True

    def declared_shapes(
        self,
        widths: Sequence[int] | None = None,
        spans: int = 2,
        keeps_block_size: bool = True,
        truncate: bool = False,
        packed: bool = False,
    ) -> list[tuple]:
        """The engine's shape set: its declared row buckets (`declared_row_buckets`: the smallest, the largest and one
        every factor of 4 between) x the width bucket that holds the widest of `widths` (default: the engine's width)
        x the first `spans` spans of cache, as chain cycles, and those row buckets at width 1 where `widths` holds
        autoregression (without the drafter's context, for rows autoregressive for good; also keeping it for rows
        that may draft again, with the step that writes what was kept, where the policy does not `keeps_block_size`
        and at the buckets of several rows, where a batch may run autoregressive); with trees, those row buckets x
        every tree size; where the cycle computes a per-step policy's choice (`decide_in_cycle`), the smallest
        bucket's chain cycles also without it, for a lone row that keeps its b (`_kept_cycle`). With `truncate`
        (rows that sample with a top-k or top-p, as a served model's defaults may ask), each cycle also in its
        truncating variant. With `packed`, each bucket of several rows' chain cycles also packed into the largest
        token bucket below its rows x width (`StaticDecoder.packed_tokens`), so that rows of unequal b (fixed b's a
        request forces, a budget's last block) compute their own slots there too: one step a bucket and span, which
        holds every batch of that bucket whose blocks fit it.
        Once frozen, a cycle runs on the smallest built step that holds it (more rows, a wider block or a longer span
        compute the same tokens), so a few steps serve every batch."""
        widest = min(max(widths), self.width) if widths else self.width
        width = next(w for w in self.widths if w >= widest)
        rows_set = self.declared_row_buckets()
        shapes = [("_cycle", rows, span, width, False, False) for rows in rows_set for span in self.spans[:spans]]
        if widths and min(widths) == AUTOREGRESSIVE and width > 1:
            # Rows autoregressive for good (all of a policy that keeps b) keep no drafter context; rows that may
            # draft again keep it for later: under a per-step policy, and in a batch of several rows that drafting
            # does not pay for (`batch_pricing`), so at the buckets of several rows whatever the policy.
            keeping = [rows for rows in rows_set if not keeps_block_size or rows > 1]
            autoregressive = [
                (kind, rows, span, False)
                for rows in rows_set
                for kind in ("_plain_cycle", "_deferred_cycle")
                if kind == "_plain_cycle" or rows in keeping
                for span in self.spans[:spans]
            ]
            shapes = autoregressive + shapes + [("_flush_context", rows) for rows in keeping]
        if self.decoder.decision is not None and width > 1:  # a lone row that keeps its b skips the choice
            shapes += [("_kept_cycle", rows_set[0], span, width, False, False) for span in self.spans[:spans]]
        if self.tree_nodes is not None:
            shapes += [
                ("_tree_cycle", rows, span, size + 1, False)
                for rows in rows_set
                for span in self.spans[:spans]
                for size in self.tree_sizes
            ]
        if packed and width > 1:
            shapes += [
                ("_packed_cycle", rows, span, width, largest_packing(rows, width), False, False)
                for rows in rows_set
                if rows > 1
                for span in self.spans[:spans]
            ]
        if truncate:  # the same cycles, sampling cut distributions (the flag is each cycle step's last argument)
            shapes += [(*shape[:-1], True) for shape in shapes if shape[0] != "_flush_context"]
        return shapes

    def declared_row_buckets(self) -> list[int]:
        """The row buckets a declared shape set builds: the smallest, the largest, and between them one every factor
        of 4 down from the largest, so that a batch runs on a step of at most about 4x its rows (a batch of 4 on a
        replica of 16 rows ran the 16-row step: slower than a batch of 1, docs/log.md)."""
        smallest, rows = self.buckets[0], [self.buckets[-1]]
        while rows[-1] // 4 > 2 * smallest:
            rows.append(next(b for b in self.buckets if b >= rows[-1] // 4))
        return sorted({smallest, *rows})

    @torch.inference_mode()
    def compile_shapes(self, shapes: Sequence[tuple]) -> float:
        """Build `shapes` (`declared_shapes`) and whole-prompt prefill now, then freeze: from here on nothing compiles
        (a cycle runs on the smallest built step that holds it, else eagerly, logged once). Returns the seconds it
        took. The engine must be idle."""
        if self.busy:
            raise ValueError("compile_shapes needs an idle engine")
        started = time.perf_counter()
        decoder = self.decoder
        decoder.compile_prefill()
        for shape in shapes:
            decoder.build(*shape)
        decoder.frozen = True
        return time.perf_counter() - started

    @property
    def compile_seconds(self) -> float | None:
        return self.decoder.compile_seconds

    def forget_requests(self) -> None:
        """Forget what the requests decoded so far told of requests (how often their drafts were kept, what drafts
        saved, how long rows ran, how many ran at once, the explorations' counts), keeping what the device's cycles
        and passes cost. For after a warm-up, whose prompt is no sample of the requests: a replica warmed up on
        "Hello" kept 1 of its 6 drafted slots, the prior of every lone row's chain, and so ran every request
        autoregressive at T = 0 on the small zoo, where its chain commits 5.1 tokens a cycle (docs/log.md)."""
        if self.busy:
            raise ValueError("forget_requests needs an idle engine")
        self.acceptance = SlotAcceptance()  # every row's drafted slots kept: the prior of a row's own rate
        self.acceptance_at: dict[float, SlotAcceptance] = {}  # the same, per `temperature_key`
        self.recent_load = RecentLoad()  # the rows a joining row can expect to run beside
        self.exploration_under_load = Exploration()  # rows joining under load sent autoregressive for good
        self.exploration_alone = Exploration()  # lone rows whose chain loses before it drafts (`_chain_loses_unrun`)
        self._draft_savings.clear()
        self.option_price.tokens = None

    # ---------------------------------------------------------------- requests

    def submit(self, request: GenerationRequest) -> int:
        """Check and queue a request; returns its row id. What this engine cannot decode fails here, naming it."""
        prompt = self._checked_prompt(request)
        config = request.config
        need = prompt.numel() + config.max_new_tokens + self.reach
        if need > self.capacity:
            raise ValueError(
                f"a prompt of {prompt.numel()} tokens and max_new_tokens {config.max_new_tokens} need {need} cache "
                f"slots with a block of {self.width}; this engine holds {self.capacity} a row"
            )
        if config.temperature > 0 and config.verify == "rejection" and self.tree_nodes is not None:
            raise ValueError("a tree engine verifies by matching the target's samples; verify='rejection' needs chains")
        if config.temperature > 0 and not self.decoder.sampling:
            raise ValueError(f"temperature {config.temperature} needs an engine built with sampling=True")
        if request.record and not self.decoder.recording:
            raise ValueError("a recorded request needs an engine built with record=True (and a drafter)")
        policy = self._policy_of(request)
        if policy.tree_nodes is not None and self.tree_nodes is None:
            raise ValueError(f"policy {policy.name!r} drafts trees: build the engine with tree_nodes")
        row = Row(
            id=next(self._ids),
            request=request,
            prompt=prompt.to(self.device),
            policy=policy,
            record=new_record() if request.record else None,
        )
        self._seeds[row.id] = config.seed if config.seed is not None else random.getrandbits(62)
        return self._queue(row)

    @torch.inference_mode()
    def step(self) -> list[RowUpdate]:
        updates: list[RowUpdate] = []
        self._drop_cancelled(updates)
        joining = self._joining()
        if joining or self.prefilling is not None:  # a prefill comes between this step's cycle and the last
            self._last_lone = self._last_shape = None
        batch_rows = len(self.rows) + len(joining)
        for group in prefill_groups([row.prompt.numel() for row in joining], PREFILL_MAX_PADDING):
            rows = [joining[i] for i in group]
            with self._failing_alone(rows, updates):
                self._prefill(rows, batch_rows, updates)
        if self.prefilling is not None:
            with self._failing_alone([self.prefilling], updates):
                self._prefill_chunk(updates)
        if self.rows:
            with self._failing_alone(list(self.rows), updates):
                self._cycle(updates)
        return updates

    @contextmanager
    def _failing_alone(self, rows: list[Row], updates: list[RowUpdate]) -> Iterator[None]:
        """A model pass that raises (out of memory included) fails the rows it ran for, not the engine: they end with
        its error, their cache rows cleared, and the engine serves on. A failure of the device itself
        (`is_device_failure`) is raised: the process cannot go on."""
        try:
            yield
        except Exception as error:
            if is_device_failure(error):
                raise
            for row in rows:
                row.fail(error)
            if self.prefilling is not None and self.prefilling.failure is not None:
                self.prefilling = None
                self.decoder.free(self.max_batch, clear=True)
            for index in reversed([i for i, row in enumerate(self.rows) if row.failure is not None]):
                self._retire(index, updates)
            for row in rows:  # rows that failed before they took a cache row (the long prompt's prefill too)
                if all(update.row_id != row.id or update.result is None for update in updates):
                    updates.append(RowUpdate(row.id, [], row.result("error"), error))
                    self._seeds.pop(row.id, None)

    # ---------------------------------------------------------------- prefill

    def _prefill(self, joining: list[Row], batch_rows: int, updates: list[RowUpdate]) -> None:
        """Prefill rows into the next free cache rows in one target pass; each one joins with its first token."""
        started = time.perf_counter()
        first = len(self.rows)
        logits, features = self.decoder.prefill(first, [row.prompt for row in joining], context=False)
        synchronize(self.device)
        for index, row in enumerate(joining):
            row.prefill_time += time.perf_counter() - started
            if row.record is not None:
                row.record["features"].append(features[index, : row.prompt.numel()].cpu())
        self._join(joining, logits, batch_rows, updates, features)

    def _prefill_chunk(self, updates: list[RowUpdate]) -> None:
        """The next chunk of the long prompt, in cache row `max_batch`; after its last chunk the row moves to the
        next free cache row and joins."""
        row, start = self.prefilling, self._prefilled
        if row.cancelled:
            self.prefilling = None
            updates.append(RowUpdate(row.id, [], row.result("cancelled")))
            return
        started = time.perf_counter()
        stop = min(start + self.prefill_chunk, row.prompt.numel())
        logits, features = self.decoder.prefill(self.max_batch, [row.prompt[start:stop]], start=start)
        synchronize(self.device)
        if row.record is not None:
            row.record["features"].append(features[0].cpu())
        row.prefill_time += time.perf_counter() - started
        self._prefilled = stop
        if stop < row.prompt.numel():
            return
        self.prefilling = None
        self.decoder.move(self.max_batch, len(self.rows), stop)
        self._join([row], logits, len(self.rows) + 1, updates)

    def _join(
        self,
        joining: list[Row],
        logits: torch.Tensor,
        batch_rows: int,
        updates: list[RowUpdate],
        features: torch.Tensor | None = None,
    ) -> None:
        """Rows whose prompts are in cache rows len(rows) .. join: first token, first b, placed in the decoder. With
        their prompts' target `features` (prefilled without the drafter's context), the context is written now
        unless every joining row starts autoregressive for good."""
        first_row = len(self.rows)
        finite = torch.isfinite(logits.amax(dim=-1)).tolist()
        seeds = [self._seeds[row.id] for row in joining]
        temperatures = [row.config.temperature for row in joining]
        positions = [row.prompt.numel() for row in joining]
        truncate = any(row.config.truncates for row in joining)  # as a cycle: the sort only where a row cuts
        cuts = ([row.config.top_k for row in joining], [row.config.top_p for row in joining]) if truncate else ()
        firsts = self.decoder.pick(logits, positions, temperatures, seeds, *cuts)
        for index, row in enumerate(joining):
            if not finite[index]:
                row.fail(NonFiniteLogits("the target's next-token distribution after the prompt is not finite"))
            if row.record is not None:
                record_distributions(row, logits[index][None])
            row.prefill_state = PrefillState(
                logits[index],
                row.prompt,
                row.config.temperature,
                self.models.train_block_size,
                batch_rows,
                firsts[index],
                prices=self._policy_prices(batch_rows),
            )
        decide_block_sizes([(row, row.prefill_state) for row in joining if row.failure is None], initial=True)
        for row in joining:
            row.keeps_block_size = row.policy.keeps_block_size_of(row.prefill_state)
            if not row.policy.keeps_block_size:
                self.decide_in_cycle(row.policy)
        load = self.recent_load.rows(batch_rows)  # its option to draft is priced at the load it can expect
        autoregressive_price = (self._prices(load) or {}).get(AUTOREGRESSIVE)
        batch_drafts = self._batch_drafts(load, joining)
        for row in joining:
            asks_hook = not self._chosen_by_batch(row, load)  # under load the batch chooses, unasked
            option = self.option_price.share(
                row.prompt.numel(), row.config.max_new_tokens, load, autoregressive_price, asks_hook
            )
            row.drafter_context = not self._autoregressive_for_good(row, option, load, batch_drafts)
            if load == 1 and self.batch_pricing and self._chain_loses_unrun(row):
                row.stop_drafting()
        if features is not None and any(row.drafter_context for row in joining):
            started = time.perf_counter()
            self.decoder.keep_context(first_row, features)
            synchronize(self.device)
            seconds = time.perf_counter() - started
            self.option_price.observe("context", seconds / sum(row.prompt.numel() for row in joining))
            for row in joining:
                row.prefill_time += seconds
        finished = []
        for index, row in enumerate(joining):
            slot = first_row + index
            row.tokens, row.length = [firsts[index]], row.prompt.numel()
            self.rows.append(row)
            self.decoder.place(
                slot,
                length=row.length,
                last_token=firsts[index],
                temperature=row.config.temperature,
                seed=self._seeds[row.id],
                rejection=row.config.verify == "rejection",
                top_k=row.config.top_k,
                top_p=row.config.top_p,
            )
            if row.failure is None:
                if firsts[index] in row.config.stop_token_ids:
                    row.stop_reason = "stop"
                elif row.config.max_new_tokens == 1:
                    row.stop_reason = "length"
                updates.append(RowUpdate(row.id, [firsts[index]]))
            if row.stop_reason is not None:
                finished.append(slot)
        for slot in reversed(finished):
            self._retire(slot, updates)

    def _cycle_decides(self, row: Row) -> bool:
        """Whether the cycle computes this row's next b: its policy is the one the cycle decides for, and the row does
        not keep its b (a kept row runs the cycle without the choice and reads none)."""
        return row.policy is self._cycle_policy and not row.keeps_block_size

    def _place_decision_inputs(self, row: Row) -> None:
        """What the cycle's decision reads of the lone row's request, placed before its first cycle that decides for
        it (`_cycle_decides`): the cycle decides for one row only, and a request's inputs may cost a predictor pass
        (the prior's probabilities), which a row that never runs alone, or keeps its b, never pays (2% of the
        engine's time at 4 clients on the mini zoo: docs/log.md, "the load a joining row expects")."""
        row.decision_placed = True
        if self._cycle_decides(row) and row.drafter_context and self.decoder.decision_inputs.shape[1]:
            inputs = self.decoder.decision.row_inputs(row.prefill_state, row.chosen_block_size)
            self.decoder.set_decision_inputs(0, inputs)

    def _autoregressive_for_good(self, row: Row, option: float, load: int, batch_drafts: bool | None) -> bool:
        """The row's policy's answer (`autoregressive_for_good`), given what its drafts saved the rows that kept the
        option in lone cycles where the row can expect to run alone (`load`: `RecentLoad`; `DraftSavings`); now and
        then a row that only the measured saving sends autoregressive keeps the option (`Exploration`). Under load the
        batch chooses the row's width: where at this load it would not draft were every row able to
        (`_batch_drafts`), the option buys nothing while the load lasts, and the row starts autoregressive for good
        (its drafter context and flushes cost 12% of autoregression at 16 rows on the mini zoo's CPU: docs/log.md),
        but now and then (`Exploration`)."""
        policy, state = row.policy, row.prefill_state
        if self._chosen_by_batch(row, load):
            if batch_drafts is False and not self.exploration_under_load.explores():
                row.block_size = AUTOREGRESSIVE
                return True
            if batch_drafts:
                self.exploration_under_load.verdict_changed()
        savings = self.draft_savings(policy) if load == 1 else None
        saves = savings.share if savings is not None else None
        if not policy.autoregressive_for_good(state, row.block_size, option, saves):
            if saves is not None and row.block_size == AUTOREGRESSIVE:
                savings.verdict_changed()  # what its drafts saved now keeps a row that starts autoregressive drafting
            return False
        measured_alone = saves is not None and not policy.autoregressive_for_good(state, row.block_size, option)
        return not (measured_alone and savings.explores())

    # ---------------------------------------------------------------- one cycle for the whole batch

    def _cycle(self, updates: list[RowUpdate]) -> None:
        started = time.perf_counter()
        rows, n = self.rows, len(self.rows)
        self.recent_load.observe(n)
        last = self._last_lone
        if n == 1 and last is not None and last[2]:
            self.lone_periods.observe(last[1], started - last[0])
        chosen = [min(row.block_size, self.width) for row in rows]
        bucket = next(b for b in self.buckets if b >= n)
        chains = all(row.tree_budget is None for row in rows)
        # The cycle's width: the bucket of the widest chosen b (not cut to the rows' budgets, which only stop
        # acceptance: a generation's last cycles need no narrower shape compiled).
        width = next(w for w in self.widths if w >= max(chosen))
        if self.batch_pricing and chains and n > 1:  # a lone row runs its policy's b
            width = self._batch_width(rows, chosen, bucket, width)
            chosen = self._widened(rows, chosen, width) if width > 1 else [AUTOREGRESSIVE] * n
        sizes = [min(b, row.config.max_new_tokens - len(row.tokens)) for b, row in zip(chosen, rows, strict=True)]
        self.decoder.set_block_sizes(sizes)
        span = span_bucket(max(row.length for row in rows) + self.reach, self.capacity)
        # An autoregressive cycle keeps the drafter's context for later (`defer`) where a row may draft again, and
        # skips it where none will; a drafting cycle first writes what autoregressive ones kept.
        context = "encode"
        if chains and width == 1:
            drafts_later = self.decoder.drafter is not None and any(row.drafter_context for row in rows)
            context = "defer" if drafts_later else "skip"
        pending = max((row.pending_context for row in rows if row.drafter_context), default=0)
        flushed = 0.0
        if flushes(context == "encode", pending):
            flushing = time.perf_counter()
            self.decoder.flush_context(bucket)
            synchronize(self.device)
            flushed = time.perf_counter() - flushing
            self.option_price.observe("flush", flushed / pending)  # a kept cycle's
            self._last_shape = None
            for row in rows:
                row.pending_context = 0
        truncate = any(row.config.truncates for row in rows)
        if chains:  # the chain cycle, also on a tree engine
            rejection = any(row.config.temperature > 0 and row.config.verify == "rejection" for row in rows)
            decide = n > 1 or not rows[0].keeps_block_size  # a lone row that keeps its b skips the choice
            if n == 1 and decide and not rows[0].decision_placed:
                self._place_decision_inputs(rows[0])
            self.decoder.cycle(bucket, span, width, rejection, context, truncate, decide)
            if self.tree_nodes is not None:  # a chain of b is the tree of b - 1 nodes
                for row, size in zip(rows, sizes, strict=True):
                    row.tree_nodes.append(size - 1)
            if context == "defer":
                for row in rows:
                    row.pending_context += 1
        else:
            self._tree_cycle(rows, sizes, bucket, span, truncate)
        # One device-to-host copy for the batch (`StaticDecoder.report`): each row's tokens, count, whether its logits
        # were finite, its anchor's top-1 probability and the next b a lone row's policy chose inside the cycle
        host = self.decoder.report[:n].tolist()
        elapsed = time.perf_counter() - started
        # a width's price at this bucket (not a packed cycle's: it costs less); what flushing the drafter's kept
        # context adds is the option's, and an autoregressive cycle that keeps it (`defer`) costs what one that skips
        # it does (0.162 against 0.163 ms on the mini zoo, docs/log.md): both price b = 1
        if chains and not self.decoder.packed:
            batch_chose = self.batch_pricing and n > 1  # its width runs in stretches: compared warm
            cold = batch_chose and self._last_shape != (bucket, width)
            self.prices.observe(bucket, width, elapsed - flushed, cold)
            self._last_shape = (bucket, width)
        else:
            self._last_shape = None
        if n == 1:
            self._observe_savings(rows[0], sizes[0], host[0][-4], elapsed - flushed)
        finished, going_on = [], []
        for index, (row, size, out) in enumerate(zip(rows, sizes, host, strict=True)):
            *_, count, usable, quantized, decided = out
            if not usable:
                row.fail(NonFiniteLogits("the target's distribution over this request's block is not finite"))
                finished.append(index)
                continue
            new_tokens = truncate_at_stop(out[:count], row.config.stop_token_ids)
            if row.record is not None:
                self._record(row, index, len(new_tokens))
            row.length += count
            if chains:
                row.acceptance.add(size, count)
                self.acceptance.add(size, count)
                key = temperature_key(row.config.temperature)
                peers = self.acceptance_at.get(key)
                if peers is None:  # (not `setdefault`, which builds one for every row at every cycle)
                    peers = self.acceptance_at[key] = SlotAcceptance()
                peers.add(size, count)
            row.tokens.extend(new_tokens)
            row.block_sizes.append(size)
            row.acceptance_lengths.append(len(new_tokens))
            row.drafter_passes += int(size > 1)
            row.decode_time += elapsed
            updates.append(RowUpdate(row.id, new_tokens))
            if new_tokens[-1] in row.config.stop_token_ids:
                row.stop_reason = "stop"
            elif len(row.tokens) >= row.config.max_new_tokens:
                row.stop_reason = "length"
            if row.stop_reason is None and n == 1 and self.batch_pricing:  # else every policy's own b
                self._price_lone_chain(row)
            if row.stop_reason is None:
                chose = decided if chains and self._cycle_decides(row) and decided > 0 else None
                going_on.append((row, len(new_tokens), index, quantized / CONFIDENCE_UNITS, chose))
            else:
                finished.append(index)
        self._end_cycle(going_on, finished, updates)
        lone = n == 1 and chains
        self._last_lone = (started, width, last is not None and last[1] == width) if lone else None

    @staticmethod
    def _widened(rows: list[Row], chosen: list[int], width: int) -> list[int]:
        """The b each row drafts in a chain cycle of several rows at `width`: every row computes the width's slots,
        so a row whose policy adapts and that keeps the drafter's context drafts all of them (a longer chain commits
        at least what its prefix would, at no cost: lossless, as any b is); a fixed b is the request's own, and a
        row autoregressive for good has no drafter context to draft from. (A lone row's b is its policy's: what the
        acceptance tables' walks of that policy run.)"""
        return [width if row.batch_chooses else b for row, b in zip(rows, chosen, strict=True)]

    def _batch_width(self, rows: list[Row], chosen: list[int], bucket: int, width: int) -> int:
        """The width of this chain cycle of several rows (`batch_pricing`): where a fixed b drafts, the chosen width
        (the request's own); else the measured width at this row bucket, autoregression included, at which the rows
        commit the most expected tokens a second (`batch_width`), each adaptive row drafting all of it (`_widened`),
        whatever its policy chose; now and then the runner-up, to measure it again (`MeasuredPrices.remeasures`). A
        chosen width not priced yet, or no drafted slot seen, runs as chosen (it gets measured); an autoregressive
        price not measured yet is measured first."""
        if any(b > 1 and not row.policy.adapts for row, b in zip(rows, chosen, strict=True)):
            return width
        prices = self.prices.at(bucket) or {}
        if width not in prices or not self.acceptance.tried:
            return width
        if AUTOREGRESSIVE not in prices:
            return AUTOREGRESSIVE
        prior = self.acceptance.measured
        rates = [row.acceptance.rate(prior) if row.batch_chooses else None for row in rows]
        if all(rate is None for rate in rates):
            return width
        measured = self.prices.of_widths(prices)
        best = batch_width(rates, prior, measured)
        if len(measured) > 1 and self.prices.remeasures(bucket, best):  # the runner-up, twice
            return batch_width(rates, prior, {w: price for w, price in measured.items() if w != best})
        return best

    def _batch_drafts(self, batch_rows: int, joining: list[Row]) -> bool | None:
        """Whether the chain cycles of `batch_rows` rows (the running ones and `joining`) would draft were every row
        able to, each at the engine's slot acceptance rate (`batch_width` on the measured prices of their row
        bucket), or draft anyway (a row's fixed b); None where drafting and autoregression are not both priced
        there, or no drafted slot was seen."""
        if any(row.block_size > AUTOREGRESSIVE and not row.policy.adapts for row in [*self.rows, *joining]):
            return True
        measured = self.prices.of_widths(self._prices(batch_rows))
        if AUTOREGRESSIVE not in measured or len(measured) < 2 or not self.acceptance.tried:
            return None
        rate = self.acceptance.measured
        return batch_width([rate] * batch_rows, rate, measured) > AUTOREGRESSIVE

    def _chosen_by_batch(self, row: Row, batch_rows: int) -> bool:
        """A chain row the batch chooses for (`Row.batch_chooses`) in a cycle of several rows drafts the batch's
        width, whatever its policy would answer (`_batch_width`): the hook, 10% of such a row's time at 4 rows through
        the endpoint on a 2-core CPU (docs/log.md), is asked only before a cycle it runs alone."""
        return self.batch_pricing and batch_rows > 1 and row.batch_chooses and row.tree_budget is None

    def _price_lone_chain(self, row: Row) -> None:
        """After a cycle of a lone row that keeps the chain its adaptive policy chose: where the chain loses to
        autoregression (`_drafts_at_a_loss`), the row decodes autoregressive for good from its next cycle; where no
        lone autoregressive cycle was measured (a replica whose rows all keep chains), it first runs `LONE_PROBE`
        autoregressive cycles, keeping the drafter's context, then its chain again (lossless, as any b is)."""
        if row.probing:
            row.probing -= 1
            if not row.probing:
                row.block_size = row.chosen_block_size
            return
        loses = self._drafts_at_a_loss(row)
        if loses:
            row.stop_drafting()
        elif loses is None:
            row.block_size, row.probing = AUTOREGRESSIVE, LONE_PROBE

    def _chain_loses_unrun(self, row: Row) -> bool:
        """Whether a row joining where it can expect to run alone, whose chain loses to autoregression here before it
        drafted a slot (`_drafts_at_a_loss` at the acceptance of rows at its temperature, the verdict its first
        cycle would mostly repeat), decodes autoregressive for good from its first cycle: that chain cycle and the
        drafter's context for its prompt went to every sampled request on the mini zoo's CPU, 2.5% below
        autoregression at 1 client (docs/log.md). Now and then such a row drafts anyway (`Exploration`), so that
        the acceptance at its temperature stays measured."""
        return bool(self._drafts_at_a_loss(row)) and not self.exploration_alone.explores()

    def _drafts_at_a_loss(self, row: Row) -> bool | None:
        """Whether a lone row that keeps the chain its adaptive policy chose for the request would commit fewer
        expected tokens a second drafting it than decoding autoregressively: at its own slot acceptance rate so far
        (shrunk by `LONE_PRIOR_SLOTS` slots toward the rate of every row at its temperature: a greedy row's drafts
        are matched, a sampled one's are not) and what a lone row's cycles cost here, all in (`LonePeriods`). Such a
        row decodes autoregressive for good from its next cycle. A per-request choice is made from the prompt, on
        labels priced by a cost curve of another spell; this one is the row's own, here and now (docs/log.md, "a
        lone row's chain priced"). No verdict before the rows at its temperature tried the `LONE_PRIOR_SLOTS` slots
        the prior counts for: a replica's first chain cycle kept none of its 7 slots on the small zoo, and as the
        prior of every later row it sent them all autoregressive, where chains commit 5.1 tokens a cycle
        (docs/log.md). None: its chain is priced and autoregression is not."""
        if not (row.keeps_block_size and row.policy.adapts and row.drafter_context and row.tree_budget is None):
            return False
        b = min(row.block_size, self.width)
        peers = self.acceptance_at.get(temperature_key(row.config.temperature), self.acceptance)
        if b == AUTOREGRESSIVE or peers.tried < LONE_PRIOR_SLOTS:
            return False
        width, periods = next(w for w in self.widths if w >= b), self.lone_periods
        if width not in periods.counted:
            return False
        if AUTOREGRESSIVE not in periods.counted:
            return None
        tokens = expected_commits(row.acceptance.rate(peers.measured, LONE_PRIOR_SLOTS), b)
        return tokens / periods.median(width) < 1.0 / periods.median(AUTOREGRESSIVE)

    def _observe_savings(self, row: Row, size: int, committed: int, seconds: float) -> None:
        """A lone cycle of a row that started autoregressive and keeps the option to draft: what its policy's drafts
        save (`DraftSavings`), against the measured autoregressive price of a lone row."""
        if row.chosen_block_size != AUTOREGRESSIVE or not row.drafter_context:
            return
        price = (self._prices(1) or {}).get(AUTOREGRESSIVE)
        savings = self.draft_savings(row.policy)
        if price and savings is not None:
            savings.add(size, committed, seconds, price)

    def _prices(self, batch_rows: int) -> dict[int, float] | None:
        return self.prices.at(next(b for b in self.buckets if b >= batch_rows))

    def _policy_prices(self, batch_rows: int) -> Mapping[int, float] | None:
        """The prices a policy reads for a row in a batch of `batch_rows` (`PrefillState.prices`, `CycleState.prices`):
        a lone row's are what its cycles cost, all in (`LonePeriods`: each width the median of its last cycles), where
        one was counted; `MeasuredPrices` compares a width with the others by the first cycle after a switch, and a
        lone row whose per-step policy switches often had a width it chose rarely priced off by that one cycle's
        noise (the mini zoo's b = 4 at 0.86 ms where its cycles took 1.19-1.34 ms, and the confidence rule drafted
        at a loss: docs/log.md, "a lone row's prices"). Under load, the batch's (`_prices`)."""
        if batch_rows == 1 and self.lone_periods.view:
            return self.lone_periods.view
        return self._prices(batch_rows)

    def _record(self, row: Row, index: int, kept: int) -> None:
        """The row's committed positions' features and the distributions that drew its new tokens, from the cycle's
        record buffers (cache row `index`, the first `kept` entries)."""
        decoder = self.decoder
        buffers = (decoder.record_features, decoder.record_entropy, decoder.record_top_ids, decoder.record_top_probs)
        for name, buffer in zip(("features", "entropy", "top_ids", "top_probs"), buffers, strict=True):
            row.record[name].append(buffer[index, :kept].to("cpu", copy=True))  # the next cycle rewrites the buffer

    def _tree_cycle(self, rows: list[Row], sizes: list[int], bucket: int, span: int, truncate: bool = False) -> None:
        """Every row's tree grown on the device (a chain for a row without a tree policy: b - 1 nodes of width 1)
        and verified cut to the size bucket that holds the largest, in one step (its outputs as a chain cycle's)."""
        budgets, widths = [], []
        for row, size in zip(rows, sizes, strict=True):
            chain = row.tree_budget is None
            budgets.append(size - 1 if chain else min(row.tree_budget, self.tree_nodes))
            widths.append(1 if chain else self.decoder.top_k)
        # What each tree can hold: its budget, or every continuation its depth and width allow.
        holds = [
            min(nodes, sum(width**d for d in range(1, size)))
            for nodes, width, size in zip(budgets, widths, sizes, strict=True)
        ]
        pad = bucket - len(rows)
        self.decoder.set_tree_shapes(budgets + [0] * pad, widths + [1] * pad)
        verified = next(size for size in self.tree_sizes if size >= max(holds))
        self.decoder.tree_cycle(bucket, span, verified + 1, truncate)
        self.verified_nodes[verified] += 1
        for row, nodes in zip(rows, holds, strict=True):
            row.tree_nodes.append(min(nodes, verified))

    def _anchor_logits(self, index: int) -> torch.Tensor:
        return self.decoder.anchor_logits[index]

    # ---------------------------------------------------------------- leaving

    def _free_row(self, index: int, last: int) -> None:
        # A failed row's slots may hold NaN (its logits were not finite, or a pass died midway): a masked NaN still
        # poisons attention (0 x NaN), so the cache row is zeroed before any other row uses it.
        self.decoder.free(index, clear=self.rows[index].failure is not None)
        if index != last:
            self.decoder.move(last, index, self.rows[last].length + 1)
        self._seeds.pop(self.rows[index].id, None)


# ----------------------------------------------------------------------------- entry points


def engine_for(
    models: SpeculativeModels,
    requests: Sequence[GenerationRequest],
    *,
    max_batch: int | None = None,
    compile: str = "off",
) -> Engine:
    """An engine shaped for `requests`: as wide as their widest fixed b or tree (the drafter's B + 2 at least), with
    room for the longest prompt and budget (compiled, rounded up to a power of two, at least `MIN_SPAN`: the next
    generation of another length then loads the same compiled steps instead of compiling its own; eager, exactly
    that, as a cycle reads at most the capacity), sampling only where a request samples, recording where one
    records."""
    if not requests:
        raise ValueError("expected at least one request")
    policies = [request.policy for request in requests if request.policy is not None]
    width = tree_nodes = None
    if models.drafter is not None:
        shapes = [shape_for(policy) for policy in policies]
        width = max([models.train_block_size + 2, *(w for w, _ in shapes if w is not None)])
        trees = [nodes for _, nodes in shapes if nodes is not None]
        tree_nodes = max(trees) if trees else None
    reach = max(width or 1, (tree_nodes or 0) + 1)
    need = max(len(request.prompt_ids) + request.config.max_new_tokens for request in requests) + reach
    capacity = need
    if compile_mode(compile, models.device) != "off":
        context = getattr(models.target.config.get_text_config(), "max_position_embeddings", None) or need
        capacity = max(need, span_bucket(need, context))
    return Engine(
        models,
        max_batch=max_batch or len(requests),
        width=width,
        capacity=capacity,
        compile=compile,
        sampling=any(request.config.temperature > 0 for request in requests),
        tree_nodes=tree_nodes,
        record=any(request.record for request in requests),
    )


def generate_many(
    models: SpeculativeModels,
    requests: Sequence[GenerationRequest],
    *,
    max_batch: int | None = None,
    engine: Engine | None = None,
    compile: str = "off",
) -> list[GenerationResult]:
    """Run `requests` through one engine (all at once by default) and return their results in order. `engine`: one
    already built, whose compiled shapes are reused across calls; else one shaped for the requests (`engine_for`).
    A row that fails raises its error here (the engine itself goes on with the other rows: a server reads
    `RowUpdate.error`)."""
    engine = engine or engine_for(models, requests, max_batch=max_batch, compile=compile)
    ids: list[int] = []
    results: dict[int, GenerationResult] = {}
    try:
        ids = [engine.submit(request) for request in requests]
        for update in engine.run():
            if update.error is not None:
                raise update.error
            if update.result is not None:
                results[update.row_id] = update.result
    except BaseException:
        # The engine may be reused (a server's, a labeler's): nothing of this call stays queued or decoding in it.
        for row_id in ids:
            engine.cancel(row_id)
        try:
            for _ in engine.run():
                pass
        except Exception:
            pass
        raise
    return [results[i] for i in ids]


def generate(
    models: SpeculativeModels,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    policy: BlockSizePolicy | None = None,
    config: GenerationConfig | None = None,
    record: bool = False,
    compile: str = "off",
) -> GenerationResult:
    """Generate after `prompt_ids` (one row of the engine), to the end."""
    prompt = torch.as_tensor(prompt_ids).flatten().tolist()
    request = GenerationRequest(prompt, config or GenerationConfig(), policy, record)
    return generate_many(models, [request], compile=compile)[0]
