"""Continuous batching on the static cycle (`static.py`): the same requests, policies, updates and results as the
eager engine (`engine.py`), decoded by one compiled (or graph-replayed) cycle over preallocated caches.

Rows live in cache rows 0 .. n - 1 of a `StaticDecoder` built for `max_batch` rows (and one more, where a long
prompt is prefilled a chunk a step beside the running rows). A step: drop cancelled rows -> prefill joining rows
into the next free cache rows (eager, a few passes of prompts of similar length) -> one cycle for the n rows at the
smallest compiled row count >= n (powers of two: a handful of variants) and the span of cache their contexts need
-> one device-to-host copy of what the rows committed -> stop tokens, budgets, per-step policies on the host ->
finished rows leave, the last row moving into the hole.

What differs from the eager engine, on purpose:
- every row of a cycle computes the engine's `width` slots (a row's b <= width is where its acceptance stops), so a
  policy's b is capped at the width, and a cost curve has nothing to price;
- sampling is counter-based (`static.pick_tokens`): a row's output for a seed is a function of its prompt and seed
  alone (any b, any batch), a different draw from the eager engine's generator for the same seed;
- `rejection` rows draft samples of the drafter (`static.speculative_sampling`), in a cycle variant compiled when
  one runs, and a tree engine verifies by matching only; no draft-then-trim (`verify_count`);
- feature records (`GenerationRequest.record`, labeling's reference generations) need an engine built with
  `record=True`: its compiled cycle then also keeps every committed position's features and distribution summary;
- draft trees (`tree.py`, policy `tree:N`) run here only: an engine built with `tree_nodes` drafts, grows every
  row's tree on the device (`static.grow_trees`) and verifies the batch's trees in one target pass, one step a
  cycle; a priced engine reads the trees' probabilities in between (one more round trip) to choose their size.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import Counter

import torch

from blockpilot.checks import positive_int
from blockpilot.cost import nondecreasing_in_block_size, round_relative_medians
from blockpilot.decoding.request import GenerationRequest
from blockpilot.decoding.rows import (
    PREFILL_MAX_PADDING,
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
from blockpilot.decoding.static import StaticDecoder, span_bucket
from blockpilot.home import blockpilot_home
from blockpilot.models.loading import SpeculativeModels, synchronize
from blockpilot.policies.base import BlockSizePolicy, PrefillState
from blockpilot.policies.fixed import Autoregressive, FixedBlockSize
from blockpilot.tree import TOP_K

ENGINES = ("eager", "static")  # `SpeculativeEngine` on transformers' modules; `StaticEngine` on the compiled cycle
ENGINE_HELP = "eager: the engine on transformers' modules; static: the compiled cycle over preallocated caches"
COMPILE_HELP = "with --engine static: torch.compile the cycle, replay it as a CUDA graph, or both (GPU for graphs)"
# Cache slots a row holds by default: its prompt, its budget and one block must fit.
DEFAULT_CAPACITY = 2048


def keep_compiled_kernels() -> None:
    """Inductor's compiled kernels go under $BLOCKPILOT_HOME/inductor, with everything else the project writes (a
    second run of the same shapes loads them instead of compiling), unless TORCHINDUCTOR_CACHE_DIR says otherwise."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(blockpilot_home() / "inductor"))


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


class StaticEngine(RowScheduler):
    """The eager engine's interface (`submit`, `cancel`, `busy`, `run`, `step`) on the static cycle.

    `width`: the widest block a row drafts (default: the drafter's training block size B + 2, the widest candidate
    the project's sweeps label; 1 without a drafter). `capacity`: cache slots a row holds (prompt, budget and one
    block; default 2,048, at most the context). `compile`: `static.COMPILE_MODES`. `sampling`: whether rows may
    decode at T > 0 (off, the cycle skips the sampler). `prefill_chunk`: prompts longer than this are prefilled a
    chunk a step, beside the running rows' cycles. `tree_nodes`: every cycle verifies draft trees of up to this
    many nodes (`tree.py`; a row without a tree policy as the chain of its b), branching into each slot's `top_k`
    tokens; cut to the size `tree_cost` prices best once `calibrate_trees` has measured it.
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
    ) -> None:
        super().__init__(models, max_batch, prefill_chunk)
        if width is None:
            width = models.train_block_size + 2 if models.drafter is not None else 1
        self.width = positive_int(width, "width")
        capacity = capacity or min(DEFAULT_CAPACITY, self.context_limit or DEFAULT_CAPACITY)
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
        self.tree_nodes = tree_nodes  # the largest tree a cycle verifies, in nodes past the root (None: chains)
        self.tree_sizes = tree_buckets(tree_nodes) if tree_nodes is not None else []
        self.tree_cost: dict[int, float] = {}  # seconds a tree cycle by size (`calibrate_trees`); empty: unpriced
        self.verified_nodes: Counter[int] = Counter()  # cycles by the tree size they verified
        self.reach = max(self.width, (tree_nodes or 0) + 1)  # slots a cycle writes past a row's length
        self.cost = None  # every row of a static cycle pays the full width: no verify width to price
        self.buckets = power_buckets(self.max_batch)
        self.widths = power_buckets(self.width)  # the widths a chain cycle is compiled at
        self._seeds: dict[int, int] = {}  # row id -> the seed its draws are keyed on

    @property
    def capacity(self) -> int:
        return self.decoder.capacity

    @property
    def compile_seconds(self) -> float | None:
        return self.decoder.compile_seconds

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
        if policy.trims:
            raise ValueError(f"policy {policy.name!r} trims its drafts: the static cycle verifies whole blocks")
        if policy.tree_nodes is not None and self.tree_nodes is None:
            raise ValueError(f"policy {policy.name!r} drafts trees: build the engine with tree_nodes")
        row = Row(
            id=next(self._ids),
            request=request,
            prompt=prompt.to(self.device),
            policy=policy,
            generator=None,
            record=new_record() if request.record else None,
        )
        self._seeds[row.id] = config.seed if config.seed is not None else random.getrandbits(62)
        return self._queue(row)

    @torch.inference_mode()
    def step(self) -> list[RowUpdate]:
        updates: list[RowUpdate] = []
        self._drop_cancelled(updates)
        joining = self._joining()
        batch_rows = len(self.rows) + len(joining)
        for group in prefill_groups([row.prompt.numel() for row in joining], PREFILL_MAX_PADDING):
            self._prefill([joining[i] for i in group], batch_rows, updates)
        if self.prefilling is not None:
            self._prefill_chunk(updates)
        if self.rows:
            self._cycle(updates)
        return updates

    # ---------------------------------------------------------------- prefill

    def _prefill(self, joining: list[Row], batch_rows: int, updates: list[RowUpdate]) -> None:
        """Prefill rows into the next free cache rows in one target pass; each one joins with its first token."""
        started = time.perf_counter()
        first = len(self.rows)
        logits, features = self.decoder.prefill(first, [row.prompt for row in joining])
        synchronize(self.device)
        for index, row in enumerate(joining):
            row.prefill_time += time.perf_counter() - started
            if row.record is not None:
                row.record["features"].append(features[index, : row.prompt.numel()].cpu())
        self._join(joining, logits, batch_rows, updates)

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

    def _join(self, joining: list[Row], logits: torch.Tensor, batch_rows: int, updates: list[RowUpdate]) -> None:
        """Rows whose prompts are in cache rows len(rows) .. join: first token, first b, placed in the decoder."""
        first_row = len(self.rows)
        finite = torch.isfinite(logits.amax(dim=-1)).tolist()
        seeds = [self._seeds[row.id] for row in joining]
        temperatures = [row.config.temperature for row in joining]
        firsts = self.decoder.pick(logits, [row.prompt.numel() for row in joining], temperatures, seeds)
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
            )
        decide_block_sizes([(row, row.prefill_state) for row in joining if row.failure is None], initial=True)
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

    # ---------------------------------------------------------------- one cycle for the whole batch

    def _cycle(self, updates: list[RowUpdate]) -> None:
        started = time.perf_counter()
        rows, n = self.rows, len(self.rows)
        chosen = [min(row.block_size, self.width) for row in rows]
        sizes = [min(b, row.config.max_new_tokens - len(row.tokens)) for b, row in zip(chosen, rows, strict=True)]
        self.decoder.set_block_sizes(sizes)
        # The cycle's width: the bucket of the widest chosen b (not cut to the rows' budgets, which only stop
        # acceptance: a generation's last cycles need no narrower shape compiled).
        width = next(w for w in self.widths if w >= max(chosen))
        bucket = next(b for b in self.buckets if b >= n)
        span = span_bucket(max(row.length for row in rows) + self.reach, self.capacity)
        if all(row.tree_budget is None for row in rows):  # chains alone: the chain cycle, also on a tree engine
            rejection = any(row.config.temperature > 0 and row.config.verify == "rejection" for row in rows)
            tokens, counts, finite = self.decoder.cycle(bucket, span, width, rejection)
            if self.tree_nodes is not None:  # a chain of b is the tree of b - 1 nodes
                for row, size in zip(rows, sizes, strict=True):
                    row.tree_nodes.append(size - 1)
        else:
            tokens, counts, finite = self._tree_cycle(rows, sizes, bucket, span)
        # One device-to-host copy for the batch: each row's tokens, count and whether its logits were finite.
        host = torch.cat([tokens[:n], counts[:n, None], finite[:n, None].long()], dim=1).tolist()
        elapsed = time.perf_counter() - started
        finished, going_on = [], []
        for index, (row, size, out) in enumerate(zip(rows, sizes, host, strict=True)):
            if not out[-1]:
                row.fail(NonFiniteLogits("the target's distribution over this request's block is not finite"))
                finished.append(index)
                continue
            count = out[-2]
            new_tokens = truncate_at_stop(out[:count], row.config.stop_token_ids)
            if row.record is not None:
                self._record(row, index, len(new_tokens))
            row.length += count
            row.tokens.extend(new_tokens)
            row.block_sizes.append(size)
            row.acceptance_lengths.append(len(new_tokens))
            row.acceptance.add(size, count - 1)
            row.drafter_passes += int(size > 1)
            row.decode_time += elapsed
            updates.append(RowUpdate(row.id, new_tokens))
            if new_tokens[-1] in row.config.stop_token_ids:
                row.stop_reason = "stop"
            elif len(row.tokens) >= row.config.max_new_tokens:
                row.stop_reason = "length"
            if row.stop_reason is None:
                going_on.append((row, len(new_tokens), self.decoder.anchor_logits[index]))
            else:
                finished.append(index)
        self._end_cycle(going_on, finished, updates)

    def _record(self, row: Row, index: int, kept: int) -> None:
        """The row's committed positions' features and the distributions that drew its new tokens, from the cycle's
        record buffers (cache row `index`, the first `kept` entries)."""
        decoder = self.decoder
        buffers = (decoder.record_features, decoder.record_entropy, decoder.record_top_ids, decoder.record_top_probs)
        for name, buffer in zip(("features", "entropy", "top_ids", "top_probs"), buffers, strict=True):
            row.record[name].append(buffer[index, :kept].to("cpu", copy=True))  # the next cycle rewrites the buffer

    def _tree_cycle(self, rows: list[Row], sizes: list[int], bucket: int, span: int):
        """Every row's tree grown on the device (a chain for a row without a tree policy: b - 1 nodes of width 1)
        and verified cut to the size bucket that holds the largest, in one step; with `tree_cost`, the trees are
        grown whole first and the cycle verifies the size priced best (`tree_nodes_for`). Returns the device views
        `StaticDecoder.cycle` returns."""
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
        fits = next(size for size in self.tree_sizes if size >= max(holds))
        if self.tree_cost:
            probabilities = self.decoder.draft_tree(bucket, span)[: len(rows)]
            candidates = [size for size in self.tree_sizes if size <= fits]
            expected = probabilities.cumsum(dim=1)[:, candidates].sum(dim=0).tolist()
            verified = self.tree_nodes_for(dict(zip(candidates, expected, strict=True)))
            out = self.decoder.verify_tree(bucket, span, verified + 1)
        else:
            verified = fits
            out = self.decoder.tree_cycle(bucket, span, verified + 1)
        self.verified_nodes[verified] += 1
        for row, nodes in zip(rows, holds, strict=True):
            row.tree_nodes.append(min(nodes, verified))
        return out

    def tree_nodes_for(self, expected: dict[int, float]) -> int:
        """How many nodes of every row's tree a cycle verifies, given the tokens the batch's trees are expected to
        commit at each size bucket up to the one that holds the largest tree: the size that commits the most a second
        under `tree_cost`, were the drafter calibrated (each node commits with its continuation's probability, the
        target's own token always: CaDDTree's rule, per batch)."""
        return max(expected, key=lambda size: expected[size] / self.tree_cost[size])

    @torch.inference_mode()
    def calibrate_trees(self, cycles: int = 10, rounds: int = 3) -> dict[int, float]:
        """Seconds a tree cycle costs at every size bucket (batch 1, on a row of its own; the engine must be idle),
        measured with whatever compiling the engine does; kept as `tree_cost`, which prices each cycle's size.
        Every size is timed once a round (the median of `cycles`), and the rounds fitted as a cost curve's trees
        are (`round_relative_medians`, then non-decreasing in nodes): timed one size after another, the machine's
        drift priced 15 nodes below 7 (docs/log.md)."""
        if self.tree_nodes is None or self.busy:
            raise ValueError("calibrate_trees needs an idle engine built with tree_nodes")
        decoder = self.decoder
        span = span_bucket(8 + self.reach, self.capacity)
        decoder.prefill(0, [torch.arange(1, 9)])
        timed_rounds = []
        for _ in range(rounds):
            timed = {}
            for size in self.tree_sizes:
                samples = []
                for _ in range(cycles + 1):  # the first builds the shape, or warms it
                    decoder.place(0, length=8, last_token=1, temperature=0.0, seed=0)
                    decoder.set_block_sizes([self.width])
                    decoder.set_tree_shapes([size], [decoder.top_k])
                    started = time.perf_counter()  # what a priced cycle runs: grow whole, read, verify the size
                    decoder.draft_tree(1, span).tolist()
                    decoder.verify_tree(1, span, size + 1)[1].tolist()
                    samples.append(time.perf_counter() - started)
                timed[size] = statistics.median(samples[1:])
            timed_rounds.append(timed)
        decoder.free(0)
        self.tree_cost = nondecreasing_in_block_size(round_relative_medians(timed_rounds))
        return self.tree_cost

    # ---------------------------------------------------------------- leaving

    def _free_row(self, index: int, last: int) -> None:
        if index != last:
            self.decoder.move(last, index, self.rows[last].length + 1)
        else:
            self.decoder.free(index)
        self._seeds.pop(self.rows[index].id, None)
