"""The confidence rule: a per-step choice of b from what a cycle already computed, calibrated on the labels'
acceptance tables and priced at decision time.

Before the cycle at cursor i the rule knows the target's top-1 probability at the anchor (the distribution that drew
the block's first token, g_{i-1}: the cycle computes it, `StaticDecoder.anchor_confidence`) and how the last cycle
ended (`cycle_outcome`). For every temperature group, bucket of that probability (`EDGES`) and outcome it holds
the mean tokens each candidate b commits there. The means come from the cycles of every candidate's fixed-b walk
over the training tables, not from every cursor: a walk lands right after a rejected draft, where the drafter has
just been wrong and the next block accepts less than at the average cursor (priced by cursor averages, the rule
decoded 0.93x autoregression at T = 1 on the mini zoo's held-out tables; conditioned on the outcome, 1.03x).

The policy (`blockpilot.policies.confidence`) drafts the b of the best expected tokens per second,
commits(b) / price(b), with prices from the device: the engine's measured cycles where it has them, else the
calibrated curve the rule keeps. Each request's own drafts correct the table (`DraftRecord`): the accepted drafts
the table expects are scaled by those the request's drafted cycles got against what the table expected of them,
shrunk toward the table by `PRIOR_DRAFTS`, so that a request whose drafts accept less than the labels' (a prompt
unlike them, a continuation past the end of the answer) stops paying for them.

At a temperature where the rule's walks over the training tables are not surely faster than autoregression's
(`walks.adapts`, with what a request pays beyond its cycles: the drafter's context, its flushes), the rule never
drafts (`never_drafts`): a request there is autoregressive for good.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from blockpilot.cost import CycleCost, nearest_batch_size
from blockpilot.files import write_text_atomic
from blockpilot.walks import adapts

# Buckets of the anchor's top-1 probability: drafts accept most where the target is sure, and the differences are
# in the last few hundredths.
EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
# How the last cycle ended: the first cycle or an autoregressive one; a draft rejected; every draft accepted.
FIRST_OR_AUTOREGRESSIVE, REJECTED, ALL_ACCEPTED = 0, 1, 2
OUTCOMES = 3
MIN_CYCLES = 20  # a cell measured on fewer cycles takes its bucket's mean over every outcome
RULE_FILE = "confidence.json"
PRIOR_DRAFTS = 8.0  # accepted drafts both sides of a request's record start from: about two drafted cycles' worth


def cycle_outcome(block_size: int | None, committed: int | None) -> int:
    """The last cycle's outcome: `FIRST_OR_AUTOREGRESSIVE` (none yet, or b = 1), `ALL_ACCEPTED` (it committed its
    whole block), else `REJECTED`."""
    if not block_size or block_size == 1:
        return FIRST_OR_AUTOREGRESSIVE
    return ALL_ACCEPTED if committed is not None and committed >= block_size else REJECTED


@dataclass
class DraftRecord:
    """One request's drafted cycles against the rule: the accepted drafts the table expected of them and those they
    got. `scale` (their ratio, both sides starting from `PRIOR_DRAFTS`) multiplies what the table expects next."""

    expected: float = 0.0
    realized: float = 0.0
    pending: tuple[int, float] | None = None  # (b, the accepted drafts the table expected) of the choice in flight

    @property
    def scale(self) -> float:
        return (self.realized + PRIOR_DRAFTS) / (self.expected + PRIOR_DRAFTS)

    def settle(self, block_size: int | None, committed: int | None) -> None:
        """The last cycle ran `block_size` and committed `committed` tokens: counted if it ran at least the b
        chosen (not one cut to the budget, nor a batch's autoregressive cycle), as the drafts of that b it kept (a
        wider chain's first b - 1 slots are that b's: a cycle the batch widened, `Engine._widened`)."""
        if self.pending is not None and committed is not None and block_size is not None:
            chosen = self.pending[0]
            if block_size >= chosen:
                self.expected += self.pending[1]
                self.realized += min(committed, chosen) - 1
        self.pending = None


@dataclass(frozen=True)
class ConfidenceRule:
    candidates: tuple[int, ...]
    temperatures: tuple[float, ...]  # the label groups; a request is read as the nearest
    commits: np.ndarray  # (temperatures, buckets, OUTCOMES, candidates) mean tokens a cycle of each b commits
    cycles: np.ndarray  # (temperatures, buckets, OUTCOMES) cycles each mean was measured on
    cost: dict[int, float]  # b -> seconds of a cycle at batch 1: the calibrated curve, the prices' fallback
    edges: tuple[float, ...] = EDGES
    autoregressive: tuple[bool, ...] = ()  # per temperature group, whether the rule never drafts there (empty: none)

    def __post_init__(self) -> None:
        shape = (len(self.temperatures), len(self.edges) + 1, OUTCOMES, len(self.candidates))
        if self.commits.shape != shape or self.cycles.shape != shape[:-1]:
            raise ValueError(f"a rule over {shape} needs commits of that shape, got {self.commits.shape}")
        missing = [b for b in self.candidates if b not in self.cost]
        if missing:
            raise ValueError(f"the rule's cost curve lacks the candidates {missing}")
        if len(self.autoregressive) not in (0, len(self.temperatures)):
            raise ValueError(
                f"a rule of {len(self.temperatures)} temperature groups needs whether it drafts at each, or at none: "
                f"got {len(self.autoregressive)}"
            )
        if any(self.autoregressive) and 1 not in self.candidates:
            raise ValueError("a rule that never drafts at a temperature needs b = 1 among its candidates")

    def expected(self, temperature: float, confidence: float, outcome: int) -> list[float]:
        """The mean tokens a cycle of each candidate commits after `outcome` at an anchor of top-1 probability
        `confidence`."""
        return self._means[self._group(temperature)][bisect_right(self.edges, confidence)][outcome]

    def choose(
        self,
        temperature: float,
        confidence: float,
        outcome: int,
        prices: Mapping[int, float] | None = None,
        record: DraftRecord | None = None,
    ) -> int:
        """The candidate of the most expected tokens per second (the smaller on a tie), each priced by `priced`;
        with a request's `record`, the accepted drafts the table expects scaled by it, and the choice kept in it.
        Autoregressive where the rule `never_drafts`. Plain Python over a few candidates: it runs before every
        cycle."""
        if self.never_drafts(temperature):
            return 1
        scale = record.scale if record is not None else 1.0
        expected = self.expected(temperature, confidence, outcome)
        best, best_rate, best_tokens = self.candidates[0], -1.0, 1.0
        for b, tokens, price in zip(self.candidates, expected, self.priced(prices), strict=True):
            rate = (1.0 + (tokens - 1.0) * scale) / price
            if rate > best_rate:
                best, best_rate, best_tokens = b, rate, tokens
        if record is not None:
            record.pending = (best, best_tokens - 1.0) if best > 1 else None
        return best

    def drafting_saves(self, temperature: float, prices: Mapping[int, float] | None = None) -> float:
        """The share of an autoregressive row's time that its drafts would save, at these prices: after an
        autoregressive cycle the outcome is FIRST_OR_AUTOREGRESSIVE again, and in each anchor bucket, met as often
        as the labels' autoregressive cycles met it, the rule's choice there takes price(b) / commits(b) a token
        against price(1). 0 where it chooses b = 1 at every confidence: a row that starts autoregressive never
        drafts (as where the rule `never_drafts`). What keeping the option costs (the drafter's context) is the
        engine's to weigh against it."""
        if 1 not in self.candidates:  # a rule of older labels, without autoregression: it always drafts
            return float("inf")
        if self.never_drafts(temperature):
            return 0.0
        share = self._autoregressive_share[self._group(temperature)]
        priced = self.priced(prices)
        autoregressive = priced[self.candidates.index(1)]
        saves = 0.0
        for bucket, confidence in enumerate((0.0, *self.edges)):  # a confidence in each bucket
            b = self.choose(temperature, confidence, FIRST_OR_AUTOREGRESSIVE, prices)
            if b > 1:
                index = self.candidates.index(b)
                tokens = self.expected(temperature, confidence, FIRST_OR_AUTOREGRESSIVE)[index]
                saves += share[bucket] * (1.0 - priced[index] / (tokens * autoregressive))
        return saves

    def never_drafts(self, temperature: float) -> bool:
        """Whether the rule never drafts at `temperature` (its group's walks over the training tables were not surely
        faster than autoregression's: `fit_confidence_rule`)."""
        return bool(self.autoregressive) and self.autoregressive[self._group(temperature)]

    def priced(self, prices: Mapping[int, float] | None = None) -> list[float]:
        """Each candidate's price: measured where `prices` (the engine's, at the batch the row runs in) has it, else
        the calibrated curve scaled to the measured price of the nearest candidate that has one, so that what was
        measured and what was not compare at the device's level now (the curve may be of one row, the batch of
        sixteen). Without prices, the calibrated curve."""
        if not prices:
            return self._calibrated
        key = tuple(prices)
        if key not in self._nearest:
            measured = [b for b in self.candidates if b in prices]
            self._nearest[key] = []
            if measured:
                nearest = [min(measured, key=lambda m, b=b: (abs(m - b), m)) for b in self.candidates]
                pairs = zip(self.candidates, nearest, strict=True)
                self._nearest[key] = [(m, self.cost[b] / self.cost[m]) for b, m in pairs]
        scaled = self._nearest[key]
        return [prices[m] * ratio for m, ratio in scaled] if scaled else self._calibrated

    @cached_property
    def _means(self) -> list:
        return self.commits.tolist()

    @cached_property
    def _autoregressive_share(self) -> list[list[float]]:
        """Per temperature group, how often the labels' cycles after an autoregressive one met each anchor bucket."""
        met = self.cycles[:, :, FIRST_OR_AUTOREGRESSIVE].astype(np.float64)
        total = met.sum(axis=1, keepdims=True)
        return np.where(total > 0, met / np.maximum(total, 1.0), 1.0 / met.shape[1]).tolist()

    @cached_property
    def _calibrated(self) -> list[float]:
        return [self.cost[b] for b in self.candidates]

    @cached_property
    def _nearest(self) -> dict[tuple, list[tuple[int, float]]]:
        return {}  # the measured candidates' set -> each candidate's nearest measured one and its calibrated ratio

    def _group(self, temperature: float) -> int:
        group = self._groups.get(temperature)
        if group is None:
            group = self._groups[temperature] = min(
                range(len(self.temperatures)), key=lambda i: abs(self.temperatures[i] - temperature)
            )
        return group

    @cached_property
    def _groups(self) -> dict[float, int]:
        return {}

    def to_dict(self) -> dict:
        return {
            "kind": "confidence",
            "candidates": list(self.candidates),
            "temperatures": list(self.temperatures),
            "edges": list(self.edges),
            "commits": self.commits.round(4).tolist(),
            "cycles": self.cycles.astype(int).tolist(),
            "cost": {str(b): seconds for b, seconds in self.cost.items()},
            "autoregressive": list(self.autoregressive),
        }

    def save(self, path: str | Path) -> Path:
        """Write the rule as JSON: a file, or `RULE_FILE` in a folder (a step model's, beside its weights)."""
        path = Path(path)
        if path.is_dir():
            path = path / RULE_FILE
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ConfidenceRule:
        """A rule from its JSON file, or from the `RULE_FILE` of a folder."""
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / RULE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no confidence rule at {str(path)!r} (blockpilot train-step writes {RULE_FILE})")
        raw = json.loads(path.read_text())
        if raw.get("kind") != "confidence":
            raise ValueError(f"{str(path)!r} holds no confidence rule (kind {raw.get('kind')!r})")
        return cls(
            candidates=tuple(int(b) for b in raw["candidates"]),
            temperatures=tuple(float(t) for t in raw["temperatures"]),
            commits=np.asarray(raw["commits"], dtype=np.float64),
            cycles=np.asarray(raw["cycles"], dtype=np.int64),
            cost={int(b): float(seconds) for b, seconds in raw["cost"].items()},
            edges=tuple(float(e) for e in raw["edges"]),
            autoregressive=tuple(bool(a) for a in raw.get("autoregressive", [])),  # older rules: none
        )


def fit_confidence_rule(
    rows: Sequence, cost: CycleCost, edges: Sequence[float] = EDGES, min_cycles: int = MIN_CYCLES
) -> ConfidenceRule:
    """The rule's means from label rows with tables and anchors (`step_data.StepRow`): every cycle of every
    candidate's fixed-b walk over each table adds what each candidate commits at its cursor to the cell of its
    temperature, anchor bucket and the outcome of the walk's last cycle. A cell of fewer than `min_cycles` cycles
    takes its bucket's mean over every outcome. At each temperature where the rule's walks over `rows` are not
    surely faster than autoregression's (`drafting_pays`), it never drafts."""
    if not rows:
        raise ValueError("a confidence rule needs label rows with acceptance tables; got none")
    candidates = rows[0].tables[0].candidates
    temperatures = tuple(sorted({row.temperature for row in rows}))
    edges = tuple(edges)
    sums = np.zeros((len(temperatures), len(edges) + 1, OUTCOMES, len(candidates)))
    counts = np.zeros(sums.shape[:-1])
    for row in rows:
        group = temperatures.index(row.temperature)
        for table, anchors in zip(row.tables, row.anchors, strict=True):
            buckets = np.searchsorted(np.asarray(edges), anchors.confidence, side="right")
            commits = table.commits.T.astype(np.float64)  # (n - 1, K)
            for index, b in enumerate(candidates):
                cursor, outcome = 1, FIRST_OR_AUTOREGRESSIVE
                while cursor < table.n:
                    cell = (group, buckets[cursor - 1], outcome)
                    sums[cell] += commits[cursor - 1]
                    counts[cell] += 1
                    step = int(table.commits[index, cursor - 1])
                    outcome = cycle_outcome(b, step)
                    cursor += step
    means = sums / np.maximum(counts, 1)[..., None]
    pooled = sums.sum(axis=2) / np.maximum(counts.sum(axis=2), 1)[..., None]  # (T, buckets, K)
    sparse = counts < min_cycles
    means[sparse] = np.broadcast_to(pooled[:, :, None], means.shape)[sparse]
    curve = cost.at_batch(nearest_batch_size(cost.seconds, 1))
    rule = ConfidenceRule(candidates, temperatures, means, counts, {b: curve(b) for b in candidates}, edges)
    if 1 not in candidates:
        return rule
    groups = [[row for row in rows if row.temperature == t] for t in temperatures]
    return replace(rule, autoregressive=tuple(not drafting_pays(rule, group, curve) for group in groups))


def drafting_pays(rule: ConfidenceRule, rows: Sequence, cost: CycleCost) -> bool:
    """Whether the rule's walks over the tables of `rows` (`step_data.StepRow`s) are surely faster than
    autoregression's (`walks.adapts`, the gate of every adaptive choice against the fixed one it would replace), each
    priced by `cost` with what a request pays beyond its cycles (`CycleCost.request`: the rule's requests keep the
    option to draft, autoregressive ones do not)."""
    drafting, autoregressive = np.zeros((len(rows), 3)), np.zeros((len(rows), 3))  # (tokens, cycles, cost) a row
    for index, row in enumerate(rows):
        for table, anchors in zip(row.tables, row.anchors, strict=True):
            sizes, steps = walk_rule(rule, table, anchors), [1] * (table.n - 1)
            spent = table.walk_cost(sizes, cost=cost) + cost.request(sizes, row.prompt_tokens, keeps_option=True)
            drafting[index] += (table.n - 1, len(sizes), spent)
            plain = table.walk_cost(steps, cost=cost) + cost.request(steps, row.prompt_tokens)
            autoregressive[index] += (table.n - 1, len(steps), plain)
    return bool(rows) and adapts(drafting, autoregressive)[0]


def walk_rule(rule: ConfidenceRule, table, anchors) -> list[int]:
    """The block sizes of the rule's walk over `table` (priced by its calibrated curve), cycle by cycle, as the
    engine runs it: the first cycle from the prefill's anchor, each later one from its anchor, the last cycle and
    the walk's drafts so far (`DraftRecord`)."""
    temperature, record = anchors.temperature, DraftRecord()

    def choose(cursor: int, last_size: int | None, last_accepted: int | None) -> int:
        confidence = float(anchors.confidence[cursor - 1])
        record.settle(last_size, last_accepted)
        return rule.choose(temperature, confidence, cycle_outcome(last_size, last_accepted), record=record)

    return table.walk_policy(choose)[0]
