"""The cost of a draft/verify cycle, c(b) and c(b, batch), measured on a device.

`calibrate` times whole cycles of the engine (draft + verify + accept + commit) at each block size and
batch size: warmed up, synchronised, each b's median taken relative to its round of every b, then made
non-decreasing in b (a cycle that drafts and verifies more tokens does not cost less; a dip is the machine's
noise, and a policy trained on it learns to seek it). Random weights time like trained ones, so a curve at a
real model's shape needs no real weights. A `CycleCost` prices the cycles of a walk: modeled throughput =
committed tokens / total cost, in tokens per second when the cost is in seconds. Without a cost file every
cycle costs 1 (`CycleCost.uniform()`), and modeled throughput is tokens per cycle, i.e. tau.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from blockpilot.blocks import AUTOREGRESSIVE, flush_passes, switches
from blockpilot.checks import positive_int
from blockpilot.files import write_text_atomic

Timed = TypeVar("Timed")  # what a calibration round times: a block size, or a (kind of cycle, block size)


# `CycleCost`'s prices of what a lone request pays beyond its cycles (`CycleCost.request`), in seconds.
REQUEST_PRICES = ("context_token", "flush", "context_pass", "start_pass", "start_token", "switch")


def nearest_batch_size(measured: Iterable[int], batch: int) -> int:
    """The measured batch size that stands for `batch`: the nearest, ties to the smaller."""
    return min(measured, key=lambda size: (abs(size - batch), size))


@dataclass(frozen=True)
class CycleCost:
    """Median seconds of one cycle per (batch size, block size); `__call__` interpolates in b.

    `measured` keeps a calibration's raw medians, of which `seconds` is the non-decreasing fit (empty for a curve
    made by hand).
    """

    seconds: dict[int, dict[int, float]]  # batch -> b -> seconds
    unit: str = "s"
    device: str = ""
    dtype: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    target_id: str = ""
    drafter_id: str = ""
    measured: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> b -> raw median seconds
    # Tree cycles (`blockpilot.tree`): batch -> drafted nodes -> seconds, the trees `tree_depth` deep (none measured:
    # empty, and trees have no price).
    trees: dict[int, dict[int, float]] = field(default_factory=dict)
    tree_depth: int | None = None
    # b -> seconds of a lone row's chain cycle that also computes a per-step model's choice (`Engine.decide_in_cycle`),
    # at batch 1, fitted as `seconds` is (none measured: empty, and that choice is priced as free).
    decided: dict[int, float] = field(default_factory=dict)
    # What a lone request pays beyond its cycles, at batch 1 (0: not measured, free; `request`): its start, common to
    # every shape (admission, the prompt's prefill and first token: a pass, plus so much a prompt token); where it may
    # draft, the drafter's context of its prompt, written once at prefill (`prompt_context`, likewise); and, for a
    # request that keeps the option to draft, one pass that writes the context its autoregressive cycles kept
    # (`blocks.flush_passes`). A request autoregressive for good writes neither. And `switch`: what a drafting cycle
    # after autoregressive ones costs beyond its warm price and the flush, plus the first autoregressive cycle after a
    # draft beyond its own (`calibration.switch_price`), paid at each draft that follows autoregression
    # (`blocks.switches`).
    context_token: float = 0.0
    flush: float = 0.0
    context_pass: float = 0.0
    start_pass: float = 0.0
    start_token: float = 0.0
    switch: float = 0.0
    # The request prices the loaded file did not hold (a curve saved before they were measured): each reads 0 there,
    # as a price measured at 0 does, so a caller that would measure them again asks this.
    unpriced: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.seconds or any(not by_b for by_b in self.seconds.values()):
            raise ValueError("a cost curve needs at least one (batch, block size) measurement")
        if bool(self.trees) != (self.tree_depth is not None):
            raise ValueError(
                f"tree prices ({sorted(self.trees)} batches) come with the trees' depth, got {self.tree_depth!r}"
            )
        for batch, by_b in [*self.seconds.items(), *self.trees.items(), (1, self.decided)]:
            for b, value in by_b.items():
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"cost of b={b} at batch {batch} must be a positive number, got {value!r}")
        for name in REQUEST_PRICES:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")

    @classmethod
    def uniform(cls) -> CycleCost:
        """Every cycle costs 1 (tokens per cycle = tau)."""
        return cls({1: {1: 1.0}}, unit="cycle")

    @property
    def is_uniform(self) -> bool:
        return self.unit == "cycle"

    def __call__(self, block_size: int, batch: int = 1) -> float:
        """c(b) at `batch` (the nearest measured batch size), linear in b between and beyond measured points."""
        if self.is_uniform:
            return 1.0
        return _interpolate(self.seconds[self._nearest_batch(batch)], block_size)

    def tree(self, nodes: int, batch: int = 1) -> float:
        """The cost of a cycle that verifies a draft tree of `nodes` nodes (`tree_depth` deep) at `batch` (the nearest
        measured batch size), linear in nodes between and beyond measured points."""
        if self.is_uniform:
            return 1.0
        if not self.trees:
            raise ValueError("this cost curve prices no tree cycles: calibrate with --tree-nodes (static engine)")
        return _interpolate(self.trees[nearest_batch_size(self.trees, batch)], nodes)

    def _nearest_batch(self, batch: int) -> int:
        return nearest_batch_size(self.seconds, batch)

    def at_batch(self, batch: int) -> CycleCost:
        """The curve at one load: c(b) of the result is c(b, batch) of this one (the nearest measured batch size).

        Training and scoring price every cycle with c(b); a policy meant for a replica that runs `batch` rows
        at a time is trained and scored with this curve, where a wider block costs more than at batch 1."""
        positive_int(batch, "batch")
        if self.is_uniform:
            return self
        nearest = self._nearest_batch(batch)
        measured = {nearest: dict(self.measured[nearest])} if nearest in self.measured else {}
        trees = {batch: dict(self.trees[nearest_batch_size(self.trees, batch)])} if self.trees else {}
        lone = batch == 1  # a cycle of several rows computes no such choice, and shares its flushes
        return replace(
            self,
            seconds={nearest: dict(self.seconds[nearest])},
            measured=measured,
            trees=trees,
            decided=dict(self.decided) if lone else {},
            **{name: getattr(self, name) if lone else 0.0 for name in REQUEST_PRICES},
        )

    def deciding(self) -> CycleCost:
        """The curve a per-step model's lone rows pay when the compiled cycle computes its choice: c(b) at batch 1
        raised to the `decided` cycle's time (never below c(b); its other batches and trees as they are). Without
        `decided`, or without batch 1, the curve itself."""
        if not self.decided or 1 not in self.seconds:
            return self
        lone = {b: max(value, _interpolate(self.decided, b)) for b, value in self.seconds[1].items()}
        return replace(self, seconds={**self.seconds, 1: lone}, decided={})

    def prompt_context(self, prompt_tokens: int) -> float:
        """Seconds of the drafter's context of a lone request's prompt of `prompt_tokens` (0: not known, not priced):
        what a request that drafts, or keeps the option to, pays at prefill; one autoregressive for good does not."""
        return self.context_pass + self.context_token * prompt_tokens if prompt_tokens > 0 else 0.0

    def request(self, block_sizes: Sequence[int], prompt_tokens: int, keeps_option: bool = False) -> float:
        """Seconds a lone request pays beyond its cycles (`block_sizes`, first to last; a tree's cycles draft: any b
        but `AUTOREGRESSIVE` does), for a prompt of `prompt_tokens` (0: not known, nothing priced): its start, every
        shape's alike; its prompt's drafter context where a cycle drafts or it `keeps_option` to draft (written at
        prefill whether it drafts at once or later); and, keeping the option, the flushes of what its autoregressive
        cycles kept and the switches back to drafting."""
        if prompt_tokens <= 0:
            return 0.0
        start = self.start_pass + self.start_token * prompt_tokens
        drafts = keeps_option or any(b != AUTOREGRESSIVE for b in block_sizes)
        context = self.prompt_context(prompt_tokens) if drafts else 0.0
        if not keeps_option:
            return start + context
        return start + context + self.flush * flush_passes(block_sizes) + self.switch * switches(block_sizes)

    @property
    def after_autoregression(self) -> float:
        """What a lone row's draft right after an autoregressive cycle pays before it: the flush of what that kept and
        the switch (what the walks' dynamic program charges, `AcceptanceTable.cost_to_go_keeping_option`)."""
        return self.flush + self.switch

    def scaled(self, factor: float) -> CycleCost:
        """The curve with every time multiplied by `factor` (> 0): its shape, at another level."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a cost curve scales by a positive factor, got {factor!r}")

        def times(by_b: dict[int, float]) -> dict[int, float]:
            return {b: value * factor for b, value in by_b.items()}

        def curves(curve: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
            return {batch: times(by_b) for batch, by_b in curve.items()}

        return replace(
            self,
            seconds=curves(self.seconds),
            measured=curves(self.measured),
            trees=curves(self.trees),
            decided=times(self.decided),
            **{name: getattr(self, name) * factor for name in REQUEST_PRICES},
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("seconds", "measured", "trees"):
            out[name] = {str(batch): {str(b): v for b, v in by_b.items()} for batch, by_b in out[name].items()}
        out["decided"] = {str(b): v for b, v in self.decided.items()}
        del out["unpriced"]
        return out

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CycleCost:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cost file {str(path)!r} does not exist (make one with `blockpilot calibrate`)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"cost file {str(path)!r} is not a blockpilot cost curve: {error}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CycleCost:
        def curve(by_batch: dict[str, dict[str, Any]]) -> dict[int, dict[int, float]]:
            return {int(batch): {int(b): float(v) for b, v in by_b.items()} for batch, by_b in by_batch.items()}

        return cls(
            curve(raw["seconds"]),
            unit=raw.get("unit", "s"),
            device=raw.get("device", ""),
            dtype=raw.get("dtype", ""),
            versions=raw.get("versions", {}),
            target_id=raw.get("target_id", ""),
            drafter_id=raw.get("drafter_id", ""),
            measured=curve(raw.get("measured", {})),
            trees=curve(raw.get("trees", {})),
            tree_depth=raw.get("tree_depth"),
            decided={int(b): float(v) for b, v in raw.get("decided", {}).items()},
            **{name: float(raw.get(name, 0.0)) for name in REQUEST_PRICES},
            unpriced=tuple(name for name in REQUEST_PRICES if name not in raw),
        )

    def describe(self) -> str:
        if self.is_uniform:
            return "uniform (every cycle costs 1)"
        batch = min(self.seconds)
        curve = ", ".join(f"b={b}: {v * 1000:.2f} ms" for b, v in sorted(self.seconds[batch].items()))
        trees = ""
        if self.trees:
            by_nodes = self.trees[nearest_batch_size(self.trees, batch)]
            trees = f"; trees {self.tree_depth} deep: " + ", ".join(
                f"{n} nodes: {v * 1000:.2f} ms" for n, v in sorted(by_nodes.items())
            )
        decided = ""
        if self.decided:
            decided = "; a per-step model's choice in the cycle: " + ", ".join(
                f"b={b}: {v * 1000:.2f} ms" for b, v in sorted(self.decided.items())
            )
        request = f"; {self.describe_request()}" if any(getattr(self, name) for name in REQUEST_PRICES) else ""
        return f"{self.device} {self.dtype}, batch {batch}: {curve}{trees}{decided}{request}"

    def describe_request(self) -> str:
        """What a lone request pays beyond its cycles (`request`), in words."""
        return (
            f"a request's start {self.start_pass * 1e3:.3f} ms + {self.start_token * 1e6:.1f} us a prompt token; its "
            f"prompt's drafter context {self.context_pass * 1e3:.3f} ms + {self.context_token * 1e6:.1f} us a token; "
            f"a flush {self.flush * 1e3:.3f} ms; a switch to drafting and back {self.switch * 1e3:.3f} ms"
        )


def _interpolate(points_by_x: dict[int, float], x: int) -> float:
    """A measured curve at `x`: linear between and beyond its points, never below a tenth of its lowest point."""
    points = sorted(points_by_x.items())
    if len(points) == 1:
        return points[0][1]
    right = next((i for i, (p, _) in enumerate(points) if p >= x), len(points) - 1)
    (x0, c0), (x1, c1) = points[max(right - 1, 0)], points[max(right, 1)]
    return max(c0 + (c1 - c0) * (x - x0) / (x1 - x0), min(c for _, c in points) / 10)


def nondecreasing_in_block_size(by_b: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of c(b) over b (pool adjacent violators): where a wider block was
    timed cheaper than a narrower one, both get their mean; a curve that already rises is returned as it is."""
    pools: list[tuple[float, int]] = []  # (sum of seconds, block sizes pooled), in increasing b
    for _, value in sorted(by_b.items()):
        total, count = value, 1
        while pools and pools[-1][0] / pools[-1][1] > total / count:
            previous_total, previous_count = pools.pop()
            total, count = total + previous_total, count + previous_count
        pools.append((total, count))
    fitted = [total / count for total, count in pools for _ in range(count)]
    return dict(zip(sorted(by_b), fitted, strict=True))


def one_cost_per_bucket(by_b: dict[int, float], buckets: Sequence[int]) -> dict[int, float]:
    """c(b) for an engine that runs each b at the narrowest of a few compiled widths (`buckets`) that holds it:
    every b of a bucket gets the median of its bucket's times. Those b run the same shape, so they cost the same;
    the differences between their times are noise, which a fit that kept them would turn into a slope."""
    bucket_of = {b: next((w for w in sorted(buckets) if w >= b), None) for b in by_b}
    if None in bucket_of.values():
        raise ValueError(f"block sizes {sorted(by_b)} do not all fit the widths {sorted(buckets)}")
    pooled = {
        width: statistics.median(value for b, value in by_b.items() if bucket_of[b] == width)
        for width in set(bucket_of.values())
    }
    return {b: pooled[bucket_of[b]] for b in sorted(by_b)}


def round_relative_medians(rounds: Sequence[dict[Timed, float]]) -> dict[Timed, float]:
    """c(b) from rounds that each timed every b once: the median over rounds of each time divided by its round's
    level (the geometric mean of the round), times the median level. Any keys do (b, or (kind of cycle, b)).

    Dividing by the round's level takes out what slowed or sped up the whole round, and the time of each b is
    compared with the other b of its own round. Per-b medians alone would take each b from a different round:
    a flat curve timed in a round that slowed halfway through would come out steep. With one round it is that
    round's times.
    """
    if not rounds or any(set(timed) != set(rounds[0]) for timed in rounds):
        raise ValueError(f"expected rounds that each time the same block sizes, got {[sorted(r) for r in rounds]}")
    levels = [math.exp(statistics.fmean(math.log(value) for value in timed.values())) for timed in rounds]
    level = statistics.median(levels)
    return {
        b: statistics.median(timed[b] / round_level for timed, round_level in zip(rounds, levels, strict=True)) * level
        for b in sorted(rounds[0])
    }


def load_cost(path: str | Path | None, batch: int | None = None) -> CycleCost:
    """The cost curve in `path`, or the uniform one when no path is given; with `batch`, at that load only
    (`CycleCost.at_batch`)."""
    cost = CycleCost.uniform() if path is None else CycleCost.load(path)
    return cost if batch is None else cost.at_batch(batch)
