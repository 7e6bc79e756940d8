"""Measuring the cost curve c(b, batch) of the engine's cycle on a device (`blockpilot calibrate`);
the curve itself, its fit and its file are `blockpilot.cost`."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from blockpilot.blocks import AUTOREGRESSIVE, label_candidates
from blockpilot.checks import distinct_block_sizes, distinct_tree_budgets
from blockpilot.cost import CycleCost, nondecreasing_in_block_size, one_cost_per_bucket, round_relative_medians
from blockpilot.decoding.compiled import compile_mode
from blockpilot.decoding.engine import DEFAULT_CAPACITY, Engine
from blockpilot.decoding.request import GenerationConfig, GenerationRequest
from blockpilot.decoding.static import MIN_SPAN
from blockpilot.models.loading import synchronize
from blockpilot.policies.base import BlockSizePolicy, PrefillState
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
    failed = next((update.error for update in updates if update.error is not None), None)
    if failed is not None:  # a time of rows that stopped is no cycle's cost
        raise RuntimeError(f"a row failed while its cycles were timed: {failed!r}") from failed
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

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.block_size

    def cycle_decision(self, device: torch.device) -> HeldDecision:
        return self.decision.to(device)


def random_prompts(models: Any, count: int, length: int, generator: Any) -> list[list[int]]:
    """`count` prompts of `length` uniformly drawn token ids of the target's vocabulary."""
    vocab = models.target.get_input_embeddings().weight.shape[0]
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)]


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
    prompt's drafter context and a flush (`request_prices`, `CycleCost.request`).

    `log` gets a line per batch, one per shape its first round builds, with the seconds it took, and one when its
    rounds are done: compiled cold on a 2-core CPU, a chain's shape took 20-23 s and a tree's 29-58 s, 303 of the 322
    s the mini zoo's demo curve took (docs/log.md).
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
        engine = Engine(models, max_batch=batch, width=depth, capacity=capacity, compile=compile)
        tree_engine = None
        if tree_nodes:
            tree_engine = Engine(
                models, max_batch=batch, width=depth, capacity=capacity, compile=compile, tree_nodes=max(tree_nodes)
            )
        deciding, chosen = None, []
        if step_decision and batch == 1 and models.drafter is not None:
            held = HeldDecisionPolicy(models)
            chosen = [b for b in block_sizes if b in held.candidates]  # what a step model may choose
        if chosen:
            width = max(chosen)  # its cycles alone compiled: each costs a compile, cold
            deciding = Engine(models, max_batch=1, width=width, capacity=capacity, compile=compile)
            deciding.decide_in_cycle(held)
        measurements: dict[Any, Callable[[], float]] = {
            ("plain", b): partial(seconds_per_cycle, models, prompts[b], [b] * batch, cycles, engine)
            for b in block_sizes
        }
        if deciding is not None:  # keyed apart, in the same round: its level is the plain cycles'
            measurements |= {
                ("decided", b): partial(seconds_per_cycle, models, prompts[b], [b], cycles, deciding, policy=held.at)
                for b in chosen
            }
        measurements |= {
            ("tree", nodes): partial(
                seconds_per_cycle, models, prompts[depth], [depth] * batch, cycles, tree_engine, nodes
            )
            for nodes in tree_nodes
        }
        log(
            f"[calibrate] batch {batch}: {len(measurements)} cycles (b = {_listed(block_sizes)}"
            + (f"; choosing b = {_listed(chosen)}" if chosen else "")
            + (f"; trees of {_listed(tree_nodes)} nodes" if tree_nodes else "")
            + f"), {warmup + repeats} rounds, {compile_mode(compile, models.device)}"
        )
        engines = [each for each in (engine, deciding, tree_engine) if each is not None]
        started = time.perf_counter()
        rounds, tree_rounds = [], []
        for attempt in range(warmup + repeats):
            timed, timed_trees = {}, {}
            for key, measure in measurements.items():
                before = _compile_seconds(engines)
                seconds = measure()
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


def device_name(device: Any) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import blockpilot

    return {"torch": torch.__version__, "transformers": transformers.__version__, "blockpilot": blockpilot.__version__}
