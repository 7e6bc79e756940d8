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
import platform
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from blockpilot.checks import distinct_block_sizes, positive_int
from blockpilot.files import write_text_atomic


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
    # Draft-then-trim's cycles: every cycle drafted this many slots and b is what it verified (None: it drafted b).
    drafted: int | None = None

    def __post_init__(self) -> None:
        if not self.seconds or any(not by_b for by_b in self.seconds.values()):
            raise ValueError("a cost curve needs at least one (batch, block size) measurement")
        if self.drafted is not None:
            positive_int(self.drafted, "drafted")
            wider = sorted(b for by_b in self.seconds.values() for b in by_b if b > self.drafted)
            if wider:
                raise ValueError(f"a curve of cycles that draft {self.drafted} cannot verify b = {wider}")
        for batch, by_b in self.seconds.items():
            for b, value in by_b.items():
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"cost of b={b} at batch {batch} must be a positive number, got {value!r}")

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
        points = sorted(self.seconds[self._nearest_batch(batch)].items())
        if len(points) == 1:
            return points[0][1]
        right = next((i for i, (b, _) in enumerate(points) if b >= block_size), len(points) - 1)
        (b0, c0), (b1, c1) = points[max(right - 1, 0)], points[max(right, 1)]
        return max(c0 + (c1 - c0) * (block_size - b0) / (b1 - b0), min(c for _, c in points) / 10)

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
        return replace(self, seconds={nearest: dict(self.seconds[nearest])}, measured=measured)

    def scaled(self, factor: float) -> CycleCost:
        """The curve with every time multiplied by `factor` (> 0): its shape, at another level."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a cost curve scales by a positive factor, got {factor!r}")

        def times(curve: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
            return {batch: {b: value * factor for b, value in by_b.items()} for batch, by_b in curve.items()}

        return replace(self, seconds=times(self.seconds), measured=times(self.measured))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("seconds", "measured"):
            out[name] = {str(batch): {str(b): v for b, v in by_b.items()} for batch, by_b in out[name].items()}
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
            drafted=raw.get("drafted"),
        )

    def describe(self) -> str:
        if self.is_uniform:
            return "uniform (every cycle costs 1)"
        batch = min(self.seconds)
        curve = ", ".join(f"b={b}: {v * 1000:.2f} ms" for b, v in sorted(self.seconds[batch].items()))
        drafting = f", drafting {self.drafted} (b verified)" if self.drafted is not None else ""
        return f"{self.device} {self.dtype}, batch {batch}{drafting}: {curve}"


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


def round_relative_medians(rounds: Sequence[dict[int, float]]) -> dict[int, float]:
    """c(b) from rounds that each timed every b once: the median over rounds of each time divided by its round's
    level (the geometric mean of the round), times the median level.

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


class _DraftThenVerify:
    """Drafts `drafted` slots every cycle and verifies `verified` positions: a trimmed cycle, for timing."""

    name = "draft-then-verify"

    def __init__(self, drafted: int, verified: int) -> None:
        self.drafted, self.verified = drafted, verified

    def initial_block_size(self, prefill: Any) -> int:
        return self.drafted

    def next_block_size(self, cycle: Any) -> int:
        return self.drafted

    def verify_count(self, confidences: Any) -> int:
        return min(self.verified - 1, len(confidences))


def seconds_per_cycle(
    models: Any,
    prompts: Sequence[Sequence[int]],
    block_sizes: Sequence[int],
    cycles: int,
    drafted: int | None = None,
    *,
    packed: bool = True,
) -> float:
    """Mean wall time of one engine cycle with row i at block size `block_sizes[i]`, all rows in one batch; with
    `drafted`, every row drafts that many slots and verifies its block size (a draft-then-trim cycle). Rows of
    unequal blocks run as the engine's `packed` says.

    The rows are prefilled and run one cycle untimed, then `cycles` cycles are timed (synchronised). Each row
    may generate up to its drafted tokens a cycle, so none finishes inside the timed cycles.
    """
    from blockpilot.decoding.engine import SpeculativeEngine
    from blockpilot.decoding.policies import FixedBlockSize
    from blockpilot.decoding.request import GenerationConfig, GenerationRequest
    from blockpilot.models.loading import synchronize

    if len(prompts) != len(block_sizes) or not prompts:
        raise ValueError(f"expected one block size per prompt, got {len(block_sizes)} for {len(prompts)} prompts")
    engine = SpeculativeEngine(models, max_batch=len(prompts), packed=packed)
    for prompt, b in zip(prompts, block_sizes, strict=True):
        config = GenerationConfig(max_new_tokens=1 + (cycles + 2) * (drafted or b))  # never cut short
        policy = FixedBlockSize(b) if drafted is None else _DraftThenVerify(drafted, b)
        engine.submit(GenerationRequest(list(prompt), config, policy))
    engine.step()  # admission (prefill) and the first cycle: not timed
    started = time.perf_counter()
    ran = 0
    while engine.busy and ran < cycles:
        engine.step()
        ran += 1
    synchronize(models.device)
    return (time.perf_counter() - started) / max(ran, 1)


def random_prompts(models: Any, count: int, length: int, generator: Any) -> list[list[int]]:
    """`count` prompts of `length` uniformly drawn token ids of the target's vocabulary."""
    import torch

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
    drafted: int | None = None,
) -> CycleCost:
    """Median wall time of one engine cycle at each (batch, b), on the models' device; with `drafted`, of a
    cycle that drafts that many slots and verifies b (draft-then-trim's price, `CycleCost.drafted`).

    Each measurement runs `batch` rows of a `prompt_tokens`-token prompt through `cycles` cycles at a fixed b,
    `repeats` times after `warmup` untimed runs. Cycles are timed by the engine (synchronised), prefill not.
    Repeats go round the block sizes (b = 1, 2, ..., then again): one round times every b once. A machine
    whose speed drifts (a shared CPU) runs whole rounds faster or slower, so each b's median is taken over
    its times relative to its round (`round_relative_medians`): the drift moves the curve's level, not its
    shape, which is what choosing b reads. The medians at each batch are then fitted non-decreasing in b
    (`nondecreasing_in_block_size`); the raw ones are kept as `measured`.
    """
    import torch

    block_sizes = distinct_block_sizes(block_sizes, "block sizes")
    batch_sizes = distinct_block_sizes(batch_sizes, "batch sizes")
    if drafted is not None and max(block_sizes) > drafted:
        raise ValueError(f"cycles that draft {drafted} verify at most {drafted} positions, not b = {max(block_sizes)}")
    generator = torch.Generator().manual_seed(0)
    measured: dict[int, dict[int, float]] = {}  # batch -> b -> median seconds, before the fit
    for batch in batch_sizes:
        prompts = {b: random_prompts(models, batch, prompt_tokens, generator) for b in block_sizes}
        rounds = []
        for attempt in range(warmup + repeats):
            timed = {b: seconds_per_cycle(models, prompts[b], [b] * batch, cycles, drafted) for b in block_sizes}
            if attempt >= warmup:
                rounds.append(timed)
        measured[batch] = round_relative_medians(rounds)
    return CycleCost(
        {batch: nondecreasing_in_block_size(by_b) for batch, by_b in measured.items()},
        device=_device_name(models.device),
        dtype=str(models.target.dtype).removeprefix("torch."),
        versions=_versions(),
        target_id=models.target_id,
        drafter_id=models.drafter_id,
        measured=measured,
        drafted=drafted,
    )


def ladder(top: int, step: int) -> tuple[int, ...]:
    """1, step, step^2, ... below `top`, then `top`: the sizes a short calibration measures up to `top`."""
    if top < 1 or step < 2:
        raise ValueError(f"a ladder needs top >= 1 and step >= 2, got top={top}, step={step}")
    rungs, size = [], 1
    while size < top:
        rungs.append(size)
        size *= step
    return (*rungs, top)


def serving_calibration(
    models: Any, max_block_size: int, max_batch: int, *, cycles: int = 4, repeats: int = 3
) -> CycleCost:
    """A short `calibrate` for an engine about to serve: b = 1, 2, 4, ... up to `max_block_size` (the cost is
    linear in b between them) at batch sizes 1, 4, 16, ... up to `max_batch` (the nearest one prices a batch)."""
    return calibrate(
        models, ladder(max_block_size, 2), ladder(max_batch, 4), cycles=cycles, repeats=repeats, warmup=1
    )


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import blockpilot

    return {"torch": torch.__version__, "transformers": transformers.__version__, "blockpilot": blockpilot.__version__}
