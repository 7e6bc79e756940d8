"""Measuring the cost curve c(b, batch) of the engine's cycle on a device (`blockpilot calibrate`);
the curve itself, its fit and its file are `blockpilot.cost`."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockpilot.blocks import AUTOREGRESSIVE, PENDING_CONTEXT, label_candidates
from blockpilot.checks import distinct_block_sizes, distinct_tree_budgets
from blockpilot.cost import CycleCost, nondecreasing_in_block_size, one_cost_per_bucket, round_relative_medians
from blockpilot.decoding.compiled import compile_mode
from blockpilot.decoding.engine import DEFAULT_CAPACITY, Engine
from blockpilot.decoding.request import GenerationConfig, GenerationRequest
from blockpilot.decoding.static import MIN_SPAN
from blockpilot.models.loading import synchronize
from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState
from blockpilot.policies.fixed import FixedBlockSize, FixedTree
from blockpilot.policies.step import CycleDecision, StepPolicy
from blockpilot.predictor.step_model import StepModel, StepModelConfig


def seconds_per_cycle(
    models: Any,
    prompts: Sequence[Sequence[int]],
    block_sizes: Sequence[int],
    cycles: int,
    engine: Engine | None = None,
    tree_nodes: int | None = None,
    policy: Callable[[int], BlockSizePolicy] | None = None,
) -> float:
    """Mean wall time of one engine cycle with row i at block size `block_sizes[i]`, all rows in one batch; with
    `tree_nodes`, every row verifies a tree of that many nodes, b deep (on an `engine` built for them). `engine`: an
    idle one to time (whose compiled shapes then serve every measurement), else a new one run eagerly. `policy`: the
    rows' policy at b (default: `FixedBlockSize`, or `FixedTree` with `tree_nodes`).

    The rows are prefilled and run one cycle untimed, then `cycles` cycles are timed (synchronised). Each row
    may generate up to its drafted tokens a cycle, so none finishes inside the timed cycles.
    """
    if len(prompts) != len(block_sizes) or not prompts:
        raise ValueError(f"expected one block size per prompt, got {len(block_sizes)} for {len(prompts)} prompts")
    given = engine is not None
    if engine is None:
        width = max(block_sizes)
        capacity = max(len(p) for p in prompts) + (cycles + 3) * width + 1 + max(width, tree_nodes or 0)
        engine = Engine(models, max_batch=len(prompts), width=width, capacity=capacity, tree_nodes=tree_nodes)
    for prompt, b in zip(prompts, block_sizes, strict=True):
        config = GenerationConfig(max_new_tokens=1 + (cycles + 2) * b)  # never cut short
        if policy is not None:
            chosen = policy(b)
        else:
            chosen = FixedBlockSize(b) if tree_nodes is None else FixedTree(tree_nodes, b)
        engine.submit(GenerationRequest(list(prompt), config, chosen))
    updates = engine.step()  # admission (prefill) and the first cycle: not timed
    started = time.perf_counter()
    ran = 0
    while engine.busy and ran < cycles:
        updates += engine.step()
        ran += 1
    synchronize(models.device)
    seconds = (time.perf_counter() - started) / max(ran, 1)
    raise_if_failed(updates, "a row")  # a time of rows that stopped is no cycle's cost
    if given:  # an engine the caller keeps goes back idle; a new one is dropped with its rows
        for _ in engine.run():
            pass
    return seconds


class HeldDecision(nn.Module):
    """A per-step model's choice computed inside the cycle and not taken: the row keeps its b, so that the cycle that
    computes the choice is timed at every b (`calibrate`)."""

    def __init__(self, decision: CycleDecision) -> None:
        super().__init__()
        self.decision = decision
        self.inputs = decision.inputs

    def row_inputs(self, prefill: PrefillState, first_block_size: int) -> list[float]:
        return self.decision.row_inputs(prefill, first_block_size)

    def forward(self, *cycle: torch.Tensor) -> torch.Tensor:
        """`CycleDecision.forward`'s inputs -> (N,) long: each row's b (`last_block_size`) as it was."""
        chosen = self.decision(*cycle)
        last_block_size = cycle[5]
        # No candidate is negative, so b stays; the compile cannot drop the choice as unused.
        return torch.where(chosen < 0, chosen, last_block_size)


class HeldDecisionPolicy(BlockSizePolicy):
    """Rows at a given b whose lone cycles compute a per-step model's choice (`HeldDecision`), a model of the default
    shape over `label_candidates` with random weights (they time like trained ones). One object serves every b, set
    by `at` before each measurement: an engine computes one policy's choice in its cycles (`Engine.decide_in_cycle`)."""

    name = "held-decision"

    def __init__(self, models: Any) -> None:
        vocab = models.target.get_input_embeddings().weight.shape[0]
        with torch.random.fork_rng(devices=[]):  # the same weights every time: the compiled cycle's cache holds
            torch.manual_seed(0)
            self.candidates = label_candidates(models.train_block_size)
            model = StepModel(StepModelConfig(self.candidates, vocab_size=vocab))
        self.decision = HeldDecision(CycleDecision(StepPolicy(model)))
        self.block_size = 1

    @property
    def keeps_block_size(self) -> bool:
        return False  # so the engine computes the choice in its cycles

    def at(self, block_size: int) -> HeldDecisionPolicy:
        self.block_size = block_size
        return self

    def autoregressive_for_good(
        self, prefill: PrefillState, block_size: int, option_price: float = 0.0, saves: float | None = None
    ) -> bool:
        """Never: an autoregressive row here is timed keeping its option to draft. Its drafts save nothing (it never
        drafts), and the engine's verdict on that sent it autoregressive for good after 128 cycles, so later rounds
        timed the plain cycle as the choice's (on the mini zoo, every round of 60 cycles from the fourth on)."""
        return False

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.block_size

    def cycle_decision(self, device: torch.device) -> HeldDecision:
        return self.decision.to(device)


def random_prompts(models: Any, count: int, length: int, generator: Any) -> list[list[int]]:
    """`count` prompts of `length` uniformly drawn token ids of the target's vocabulary."""
    vocab = models.target.get_input_embeddings().weight.shape[0]
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def raise_if_failed(updates: Sequence[Any], rows: str) -> None:
    """Raises the first error among the engine's `updates` (`RowUpdate`), naming the timed `rows`."""
    failed = next((update.error for update in updates if update.error is not None), None)
    if failed is not None:
        raise RuntimeError(f"{rows} failed while its cycles were timed: {failed!r}") from failed


class BatchRig:
    """The engines and measurements `calibrate` times at one batch size: a closure a key ("plain", b), ("decided", b)
    or ("tree", nodes), each running `cycles` cycles of `batch` rows. Built alike in any process from the same
    arguments (the prompts' tokens aside), so their compiled steps are the same: what `SecondBuilder` relies on."""

    def __init__(
        self,
        models: Any,
        batch: int,
        block_sizes: Sequence[int],
        tree_nodes: Sequence[int],
        step_decision: bool,
        prompt_tokens: int,
        cycles: int,
        compile: str,
        generator: torch.Generator,
    ) -> None:
        self.arguments = (batch, tuple(block_sizes), tuple(tree_nodes), step_decision, prompt_tokens, cycles, compile)
        depth = max(block_sizes)
        prompts = {b: random_prompts(models, batch, prompt_tokens, generator) for b in block_sizes}
        # At least the smallest span a live engine reads (`MIN_SPAN`): a short request's cycles read that many slots,
        # and a calibration that read fewer priced a wide cycle a few percent low against an autoregressive one.
        capacity = max(prompt_tokens + (cycles + 3) * depth + 1 + max((depth, *tree_nodes)), MIN_SPAN)
        if batch == 1 and capacity <= DEFAULT_CAPACITY:
            # A lone row's engines at the default capacity, as live engines of one row are built (the demo's policy
            # table): their steps are then the ones built here, not compiled again (the mini zoo's b = 1, 4, 8 and
            # trees of 7 and 15 nodes: 84.4 s of compiles in the same process before, none after, docs/log.md). A
            # cycle reads its span, not the capacity: it costs the same.
            capacity = None
        self.engine = Engine(models, max_batch=batch, width=depth, capacity=capacity, compile=compile)
        self.tree_engine = None
        if tree_nodes:
            self.tree_engine = Engine(
                models, max_batch=batch, width=depth, capacity=capacity, compile=compile, tree_nodes=max(tree_nodes)
            )
        self.deciding, self.chosen = None, []
        if step_decision and batch == 1 and models.drafter is not None:
            held = HeldDecisionPolicy(models)
            self.chosen = [b for b in block_sizes if b in held.candidates]  # what a step model may choose
        if self.chosen:
            # Its cycles alone compiled (each costs a compile, cold); a drafter even where b = 1 is all it times, as a
            # live engine's autoregressive row keeps the drafter's context for later.
            width = max(self.chosen) if max(self.chosen) > AUTOREGRESSIVE else depth
            self.deciding = Engine(models, max_batch=1, width=width, capacity=capacity, compile=compile)
            self.deciding.decide_in_cycle(held)
        engine, deciding, tree_engine = self.engine, self.deciding, self.tree_engine
        self.measurements: dict[Any, Callable[[], float]] = {
            ("plain", b): partial(seconds_per_cycle, models, prompts[b], [b] * batch, cycles, engine)
            for b in block_sizes
        }
        if deciding is not None:  # keyed apart, in the same round: its level is the plain cycles'
            self.measurements |= {
                ("decided", b): partial(seconds_per_cycle, models, prompts[b], [b], cycles, deciding, policy=held.at)
                for b in self.chosen
            }
        self.measurements |= {
            ("tree", nodes): partial(
                seconds_per_cycle, models, prompts[depth], [depth] * batch, cycles, tree_engine, nodes
            )
            for nodes in tree_nodes
        }

    def step_of(self, key: tuple[str, int]) -> tuple[str, int]:
        """The compiled step a measurement builds, as far as telling measurements apart needs: a chain's width bucket
        (every b of a bucket runs its widest step), a tree's budget."""
        kind, size = key
        if kind == "tree":
            return key
        engine = self.deciding if kind == "decided" else self.engine
        return kind, next(width for width in engine.widths if width >= size)


# A tree's cycle compiles in about 1.5x a chain's (the mini zoo, cold: 29-58 s against 20-23, docs/log.md).
BUILD_WEIGHT = {"plain": 1.0, "decided": 1.0, "tree": 1.5}
# What the second process spends before its first build (its imports and the models' load), in chain builds.
HELPER_START = 0.5


def split_builds(rig: BatchRig) -> list[tuple[str, int]]:
    """The measurements a second process builds: whole steps (never a step both processes would compile), assigned
    longest first to whichever process has less to build, the second one starting behind by `HELPER_START`."""
    steps: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for key in rig.measurements:
        steps.setdefault(rig.step_of(key), []).append(key)
    loads, shares = [0.0, HELPER_START], [[], []]
    for step in sorted(steps, key=lambda step: -BUILD_WEIGHT[step[0]]):
        lighter = 0 if loads[0] <= loads[1] else 1
        loads[lighter] += BUILD_WEIGHT[step[0]]
        shares[lighter] += steps[step]
    return [key for key in rig.measurements if key in shares[1]]


class SecondBuilder:
    """A second process that compiles a share of a calibration's steps (`split_builds`) into the on-disk kernel cache
    while this one compiles the rest; this process then loads them (about a second each) instead of compiling them.
    On a CPU a compile keeps one core busy (its Python), and two processes built a tiny-zoo shape each in the time one
    built one (docs/log.md). Started only where it can pay and nothing it does can be wrong: compiled steps on a CPU
    of at least two cores, models loadable again from their folders, room in memory for a second copy. Whatever it
    fails to build, this process builds. A new interpreter (`python -m blockpilot.decoding.calibration`), not a fork
    (OpenMP's threads do not survive one) nor a spawn (which runs the caller's script again)."""

    def __init__(self, keys: list[tuple[str, int]], process: subprocess.Popen, errors: Any, log: Callable) -> None:
        self.keys, self._process, self._errors, self._log = keys, process, errors, log
        self._joined = False

    @classmethod
    @contextmanager
    def started(cls, rig: BatchRig, models: Any, log: Callable[[str], None]) -> Iterator[SecondBuilder | None]:
        """The second process building its share of `rig`'s steps, or None where it cannot pay
        (`second_builder_fits`); stopped on leaving the block if it is still running (this process failed)."""
        builder = cls.start(rig, models, log) if second_builder_fits(models, rig.arguments[-1]) else None
        try:
            yield builder
        finally:
            if builder is not None:
                builder.close()

    @classmethod
    def start(cls, rig: BatchRig, models: Any, log: Callable[[str], None]) -> SecondBuilder | None:
        keys = split_builds(rig)
        if not keys:
            return None
        from blockpilot.decoding import forwards

        job = {
            "target": models.target_id,
            "drafter": models.drafter_id if models.drafter is not None else None,
            "dtype": str(models.target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),  # the threads a compiled kernel is generated for, as here
            "few_rows": forwards.few_rows,  # the projections' form as measured here: part of the graph
            "arguments": rig.arguments,
            "keys": keys,
        }
        package = str(Path(__file__).resolve().parents[2])  # the blockpilot this process runs, wherever it came from
        paths = os.pathsep.join(path for path in (package, os.environ.get("PYTHONPATH")) if path)
        env = {**os.environ, "PYTHONPATH": paths}
        errors = tempfile.TemporaryFile("w+")
        command = [sys.executable, "-m", "blockpilot.decoding.calibration", json.dumps(job)]
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        log(f"[calibrate] batch {rig.arguments[0]}: a second process builds {len(keys)} of {len(rig.measurements)}")
        return cls(keys, process, errors, log)

    def join(self) -> None:
        """Wait for the second process (once); where it failed, say so: this process builds what it did not."""
        if self._joined:
            return
        self._joined = True
        if self._process.wait() != 0:
            self._errors.seek(0)
            last = (self._errors.read().strip().splitlines() or ["no message"])[-1]
            self._log(f"[calibrate] the second process failed ({last}): its shapes are built here")

    def close(self) -> None:
        """Stop the second process if it still runs (this one failed before joining it), and drop its messages."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._errors.close()


def second_builder_fits(models: Any, compile: str) -> bool:
    """Whether `SecondBuilder` may run for `models`' steps compiled as `compile` says (its docstring)."""
    if models.device.type != "cpu" or compile_mode(compile, models.device) != "compile":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    folders = [models.target_id] + ([models.drafter_id] if models.drafter is not None else [])
    if cores < 2 or not all(folder and Path(folder).is_dir() for folder in folders):
        return False
    weights = sum(p.numel() * p.element_size() for m in (models.target, models.drafter) if m for p in m.parameters())
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no such figure here (macOS): no second copy
        return False
    return 4 * weights < free


def build_share(job: dict[str, Any]) -> None:
    """In a second process (`SecondBuilder`): load the models, build the rig and run each measurement of the job's
    keys once, which compiles its step into the on-disk cache (`TORCHINDUCTOR_CACHE_DIR`, inherited)."""
    from blockpilot.decoding import forwards
    from blockpilot.models import load_models

    torch.set_num_threads(job["threads"])
    forwards.few_rows = job["few_rows"]
    models = load_models(job["target"], job["drafter"], device="cpu", dtype=job["dtype"])
    rig = BatchRig(models, *job["arguments"], torch.Generator().manual_seed(0))
    for kind, size in job["keys"]:
        rig.measurements[(kind, size)]()


def calibrate(
    models: Any,
    block_sizes: Sequence[int],
    batch_sizes: Sequence[int] = (1,),
    *,
    prompt_tokens: int = 64,
    cycles: int = 12,
    repeats: int = 5,
    warmup: int = 2,
    compile: str = "auto",
    tree_nodes: Sequence[int] = (),
    step_decision: bool = False,
    log: Callable[[str], None] = print,
) -> CycleCost:
    """Median wall time of one engine cycle at each (batch, b), on the models' device.

    Each measurement runs `batch` rows of a `prompt_tokens`-token prompt through `cycles` cycles at a fixed b,
    `repeats` times after `warmup` untimed runs. Cycles are timed by the engine (synchronised), prefill not.
    Repeats go round the block sizes (b = 1, 2, ..., then again): one round times every b once. A machine
    whose speed drifts (a shared CPU) runs whole rounds faster or slower, so each b's median is taken over
    its times relative to its round (`round_relative_medians`): the drift moves the curve's level, not its
    shape, which is what choosing b reads. The medians at each batch are then fitted non-decreasing in b
    (`nondecreasing_in_block_size`); the raw ones are kept as `measured`.

    The cycle timed is the engine's, run as `compile` says (`compiled.COMPILE_MODES`), one engine per batch size: it
    runs each b at the narrowest width compiled that holds it, so every b of a width costs the same, and each is
    priced at the median of its width's times (`one_cost_per_bucket`).
    With `tree_nodes` too, the cycles of draft trees of each of those budgets, max(block_sizes) deep (the trees
    the labels walk), on a static engine built for the largest: `CycleCost.trees`, timed and fitted the same way.
    With `step_decision` (and batch 1), the lone cycles of each b a step model may choose (`label_candidates`) that
    also compute its choice, on an engine that computes it (`HeldDecisionPolicy`), in the same rounds:
    `CycleCost.decided`, fitted the same way and never below c(b), what a step model's walk pays
    (`CycleCost.deciding`). At batch 1 with a drafter, also what a lone request pays beyond its cycles: its start, its
    prompt's drafter context and a flush (`request_prices`, `CycleCost.request`), and a switch between drafting and
    autoregression (`switch_price`).

    `log` gets a line per batch, one per shape its first round builds, with the seconds it took, and one when its
    rounds are done: compiled cold on a 2-core CPU, a chain's shape took 20-23 s and a tree's 29-58 s, 303 of the 322
    s the mini zoo's demo curve took (docs/log.md). A second process compiles about half of them meanwhile where that
    can pay (`SecondBuilder`, said in a line); the first round times its own share first, then loads the other.
    """
    block_sizes = distinct_block_sizes(block_sizes, "block sizes")
    batch_sizes = distinct_block_sizes(batch_sizes, "batch sizes")
    tree_nodes = distinct_tree_budgets(tree_nodes, "tree nodes")
    generator = torch.Generator().manual_seed(0)
    measured: dict[int, dict[int, float]] = {}  # batch -> b -> median seconds, before the fit
    fitted: dict[int, dict[int, float]] = {}  # batch -> b -> the curve
    trees: dict[int, dict[int, float]] = {}  # batch -> nodes -> median seconds, before the fit
    decided: dict[int, float] = {}  # b -> seconds of a lone cycle that computes a per-step model's choice
    prices: dict[str, float] = {}  # what a lone request pays beyond its cycles (`request_prices`)
    depth = max(block_sizes)
    for batch in batch_sizes:
        rig = BatchRig(models, batch, block_sizes, tree_nodes, step_decision, prompt_tokens, cycles, compile, generator)
        engine, deciding, measurements = rig.engine, rig.deciding, rig.measurements
        log(
            f"[calibrate] batch {batch}: {len(measurements)} cycles (b = {_listed(block_sizes)}"
            + (f"; choosing b = {_listed(rig.chosen)}" if rig.chosen else "")
            + (f"; trees of {_listed(tree_nodes)} nodes" if tree_nodes else "")
            + f"), {warmup + repeats} rounds, {compile_mode(compile, models.device)}"
        )
        engines = [each for each in (engine, deciding, rig.tree_engine) if each is not None]
        started = time.perf_counter()
        with SecondBuilder.started(rig, models, log) if warmup > 0 else nullcontext() as second:
            rounds, tree_rounds = [], []
            for attempt in range(warmup + repeats):
                timed, timed_trees = {}, {}
                waits = second.keys if attempt == 0 and second is not None else []  # the second process's share
                for key in [key for key in measurements if key not in waits] + waits:  # this process's share first
                    if key in waits:
                        second.join()
                    before = _compile_seconds(engines)
                    seconds = measurements[key]()
                    built, (kind, size) = _compile_seconds(engines) - before, key
                    if built > 0:
                        shape = f"a tree of {size} nodes" if kind == "tree" else f"b = {size}"
                        choosing = ", choosing the next b" if kind == "decided" else ""
                        log(f"[calibrate] batch {batch}: {shape}{choosing} built in {built:.1f} s")
                    if kind == "tree":
                        timed_trees[size] = seconds
                    else:
                        timed[key] = seconds
                if attempt >= warmup:
                    rounds.append(timed)
                    tree_rounds.append(timed_trees)
        log(f"[calibrate] batch {batch}: timed in {time.perf_counter() - started:.1f} s")
        medians = round_relative_medians(rounds)
        measured[batch] = {b: value for (kind, b), value in medians.items() if kind == "plain"}
        fitted[batch] = nondecreasing_in_block_size(one_cost_per_bucket(measured[batch], engine.widths))
        if deciding is not None:
            by_b = {b: value for (kind, b), value in medians.items() if kind == "decided"}
            by_b = nondecreasing_in_block_size(one_cost_per_bucket(by_b, deciding.widths))
            decided = {b: max(value, fitted[batch][b]) for b, value in by_b.items()}
        if tree_nodes:
            trees[batch] = nondecreasing_in_block_size(round_relative_medians(tree_rounds))
        if batch == 1 and models.drafter is not None:
            prices = request_prices(models, engine, prompt_tokens, warmup, repeats * cycles, generator)
            prices["switch"] = switch_price(
                models, engine, prompt_tokens, repeats * cycles, generator, prices["flush"], 1 + (cycles + 2) * depth
            )
    return CycleCost(
        fitted,
        device=device_name(models.device),
        dtype=str(models.target.dtype).removeprefix("torch."),
        versions=_versions(),
        target_id=models.target_id,
        drafter_id=models.drafter_id,
        measured=measured,
        trees=trees,
        tree_depth=depth if tree_nodes else None,
        decided=decided,
        **prices,
    )


def _listed(values: Sequence[int]) -> str:
    return ", ".join(str(value) for value in values)


def _compile_seconds(engines: Sequence[Engine]) -> float:
    return sum(engine.compile_seconds or 0.0 for engine in engines)


def request_prices(
    models: Any, engine: Engine, prompt_tokens: int, warmup: int, repeats: int, generator: torch.Generator
) -> dict[str, float]:
    """What a lone request pays beyond its cycles on `engine` (idle), as its engine runs it, in seconds
    (`CycleCost.request`; the medians of `repeats` after `warmup`, round by round: a drift moves every price alike):
    its start (`start_pass`, `start_token`: an autoregressive request of one token, admitted, prefilled and answered),
    its prompt's drafter context (`context_pass`, `context_token`, written in cache row 0) and one flush pass
    (`flush`). A start and a context are timed at `prompt_tokens` and at a quarter of that, and fitted as a pass plus
    so much a token: a short prompt's are mostly the pass. Nothing a row reads is left behind: the next prefill of row
    0 writes its context again, and a flush with nothing kept writes only the row's last cache slot."""
    decoder = engine.decoder
    width = decoder.pending_features.shape[-1]
    lengths = (max(prompt_tokens // 4, 1), prompt_tokens)
    prompts = dict(zip(lengths, (random_prompts(models, 1, n, generator)[0] for n in lengths), strict=True))
    features = {n: decoder.pending_features[:1, :1].new_zeros(1, n, width) for n in lengths}

    def start(prompt: list[int]) -> None:
        engine.submit(GenerationRequest(prompt, GenerationConfig(max_new_tokens=1), FixedBlockSize(AUTOREGRESSIVE)))
        while engine.busy:
            engine.step()

    runs: dict[Any, Callable[[], None]] = {
        ("context", n): partial(decoder.keep_context, 0, features[n]) for n in lengths
    }
    runs |= {("start", n): partial(start, prompts[n]) for n in lengths}
    runs["flush"] = partial(decoder.flush_context, 1)
    times: dict[Any, list[float]] = {key: [] for key in runs}
    with torch.inference_mode():
        for attempt in range(warmup + repeats):
            for key, run in runs.items():
                synchronize(decoder.device)
                started = time.perf_counter()
                run()
                synchronize(decoder.device)
                if attempt >= warmup:
                    times[key].append(time.perf_counter() - started)
    prices = {"flush": statistics.median(times["flush"])}
    for kind in ("context", "start"):
        short, long = (statistics.median(times[(kind, n)]) for n in lengths)
        per_token = max(long - short, 0.0) / max(lengths[1] - lengths[0], 1)
        prices |= {f"{kind}_token": per_token, f"{kind}_pass": max(long - per_token * lengths[1], 0.0)}
    return prices


# A switch is timed in periods of `SWITCH_DRAFTS` drafting cycles, then a run of `SWITCH_RUN` autoregressive ones,
# half the context a row keeps before it flushes (`PENDING_CONTEXT`): a period's first cycle drafts after the run
# before it (the drafter idle for as long as a row drafting again after a pause usually waits), and its first
# autoregressive cycle follows a draft.
SWITCH_DRAFTS = 3
SWITCH_RUN = PENDING_CONTEXT // 2


@dataclass(frozen=True)
class SwitchSchedule(FixedBlockSize):
    """A lone row's cycles in periods of `SWITCH_DRAFTS` drafting cycles of b, then `SWITCH_RUN` autoregressive ones;
    it keeps the (cycle, b) of each cycle it ran (`switch_price` reads them)."""

    ran: list[tuple[int, int]] = field(default_factory=list, compare=False)

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        return (AUTOREGRESSIVE, self.block_size)

    def next_block_size(self, cycle: CycleState) -> int:
        self.ran.append((cycle.cycle, cycle.block_size))
        drafts = (cycle.cycle + 1) % (SWITCH_DRAFTS + SWITCH_RUN) < SWITCH_DRAFTS
        return self.block_size if drafts else AUTOREGRESSIVE


def switch_price(
    models: Any,
    engine: Engine,
    prompt_tokens: int,
    periods: int,
    generator: torch.Generator,
    flush: float = 0.0,
    max_new_tokens: int = 0,
) -> float:
    """What switching costs a lone row of `engine` (idle, its cycles of b = 1 and of its widest b built), in seconds:
    a drafting cycle after autoregressive ones beyond a warm drafting cycle and the `flush` it runs first (priced
    apart, `request_prices`), plus the first autoregressive cycle after a draft beyond a warm one. Each is the median,
    over at least `periods` periods of a `SwitchSchedule` (a request's first not counted), of that cycle's time less
    its period's warm cycles of the same kind: a drift moves both alike. Each request generates `max_new_tokens` (at
    least two periods' worth), the length of the rounds' requests, so that its cycles read the spans they built: the
    mini zoo's requests of up to 1,967 tokens compiled 98 s of steps more (docs/log.md). A row that drafts again after a
    pause finds the drafter's weights and cache cold (the mini zoo's compiled width-8 cycle +14-26% after 8-16
    autoregressive cycles on a 2-core CPU, docs/log.md). 0 where the engine runs no drafter or no b = 1."""
    widest = max(engine.widths)
    if models.drafter is None or widest == AUTOREGRESSIVE or min(engine.widths) != AUTOREGRESSIVE:
        return 0.0
    period = SWITCH_DRAFTS + SWITCH_RUN
    pattern = [widest] * SWITCH_DRAFTS + [AUTOREGRESSIVE] * SWITCH_RUN
    most = SWITCH_DRAFTS * widest + SWITCH_RUN  # tokens a period commits at most
    budget = min(max(max_new_tokens, 2 * most + widest), engine.capacity - prompt_tokens - 2 * widest - 1)
    drafts: list[float] = []
    pauses: list[float] = []
    with torch.inference_mode():
        while len(drafts) < periods:
            schedule = SwitchSchedule(widest)
            prompt = random_prompts(models, 1, prompt_tokens, generator)[0]
            engine.submit(GenerationRequest(prompt, GenerationConfig(max_new_tokens=budget), schedule))
            updates = engine.step()  # admission (prefill) and the first cycle: not timed
            timed: dict[int, tuple[int, float]] = {}  # cycle -> (b, seconds)
            counted = len(drafts)
            while engine.busy:
                ran = len(schedule.ran)
                synchronize(models.device)
                started = time.perf_counter()
                updates += engine.step()
                synchronize(models.device)
                if len(schedule.ran) > ran:  # not the last cycle, which asks no next b
                    cycle, b = schedule.ran[-1]
                    timed[cycle] = (b, time.perf_counter() - started)
            raise_if_failed(updates, "a switching row")
            for first in range(period, max(timed, default=0) + 2 - period, period):
                runs = [timed.get(cycle, (0, 0.0)) for cycle in range(first, first + period)]
                if [b for b, _ in runs] != pattern:
                    continue  # a block cut short at the budget's end, or not timed
                times = [seconds for _, seconds in runs]
                drafts.append(times[0] - statistics.fmean(times[1:SWITCH_DRAFTS]))
                pauses.append(times[SWITCH_DRAFTS] - statistics.median(times[SWITCH_DRAFTS + 1 :]))
            if len(drafts) == counted:
                raise RuntimeError(f"a switching row of {budget} tokens ran no whole period after its first")
    return max(statistics.median(drafts) - flush, 0.0) + max(statistics.median(pauses), 0.0)


def device_name(device: Any) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import blockpilot

    return {"torch": torch.__version__, "transformers": transformers.__version__, "blockpilot": blockpilot.__version__}


if __name__ == "__main__":  # `SecondBuilder`'s process: the job as JSON
    build_share(json.loads(sys.argv[1]))
