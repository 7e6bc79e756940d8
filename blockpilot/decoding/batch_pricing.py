"""The width a batch's cycle drafts (autoregression included), and what a row's option to draft later costs.

A cycle computes its widest row's width for every row, so under load one row's draft costs the whole batch, and
every adaptive row drafts the whole width (`Engine._widened`). A chain cycle of several rows where no fixed b drafts
(a fixed b is the request's own choice) runs the width, among those the engine measured at that row bucket
(`MeasuredPrices`: compared under the same conditions), autoregression included, at which its rows commit the most
expected tokens a second (`batch_width`); lossless, as any b is, and each policy chooses again after it. At one row
the policy's own choice stands, but for a row that keeps a chain: where, at its own acceptance so far and what a lone
row's cycles cost (`LonePeriods`), the chain would commit fewer tokens a second than autoregression, the row decodes
autoregressive for good (`Engine._drafts_at_a_loss`).

A chain's expected tokens at b: its slots accepted independently at a slot acceptance rate a (drafted slots kept over
those tried up to each first rejection) commit (1 - a^b) / (1 - a) tokens, the target's own included. A row's: the
chain at the engine's rate, its accepted drafts scaled by the row's rate (shrunk toward the engine's by
`PRIOR_SLOTS` slots) over the engine's.

A row that starts autoregressive under a policy that may draft later keeps that option at a price
(`OptionPrice`): its prompt's drafter context at admission, the flushes of the context its autoregressive cycles
keep, and its per-cycle hook. The engine measures them as it runs and hands their share of the row's
autoregressive time to the policy, which weighs it against what its drafts would save
(`BlockSizePolicy.autoregressive_for_good`). What they save the engine measures too, per policy, in the cycles such
rows run alone (`DraftSavings`): a row that joins alone weighs that, where it was measured, against the price.
Alone or under load is the load a joining row can expect (`RecentLoad`), not only the batch it joins.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, insort
from collections import Counter, deque
from collections.abc import Container, Iterator, KeysView, Mapping, Sequence
from dataclasses import dataclass, field

from blockpilot.blocks import AUTOREGRESSIVE

PRIOR_SLOTS = 4  # how many drafted slots the engine-wide rate counts for in a row's own
# ... in a lone row's own, where its chain is weighed against autoregression for the rest of the row
# (`Engine._drafts_at_a_loss`): a row's acceptance comes in bursts, and at 16 slots rows whose chains paid were
# switched (docs/log.md, "a lone row's chain priced")
LONE_PRIOR_SLOTS = 64
PRICE_WARM_UP = 2  # a shape's first passes (building it, cold caches) are no price
PRICE_WEIGHT = 0.1  # the newest measurement's weight in a measured price
LEVEL_FRESH = 4  # priced cycles after which a row bucket's level is set again by its next cycle
FACTOR_SAMPLES = 5  # a width's factor: the median of its last this many measurements (each at a switch)
REMEASURE_FIRST = 32  # cycles of one width at a row bucket before the runner-up is measured again
REMEASURE_MOST = 512  # ... doubling each time the choice stands, up to this many
SAVINGS_CYCLES = 128  # a policy's lone cycles of rows keeping the option before what its drafts saved decides
EXPLORE_EVERY = 16  # of the rows a measured saving sends autoregressive for good, one in this many keeps the option
EXPLORE_MOST = 256  # ... one in twice as many each time the verdict stands, up to one in this many
LONE_PERIODS = 64  # a lone row's cycles at a width whose median prices that width (`LonePeriods`)
# ... none older than this many counted lone cycles (of any width): a width not run for that long is priced again
LONE_HORIZON = 512
# autoregressive cycles a lone row that keeps a chain runs where no lone autoregressive cycle was measured, to price
# its chain against autoregression (`Engine._price_lone_chain`): the first follows the chain and is no period
LONE_PROBE = 3
LOAD_CYCLES = 64  # the engine's last cycles whose rows tell the load a joining row can expect (`RecentLoad`)


def moving_price(old: float | None, seconds: float) -> float:
    """A measured price after one more measurement of `seconds`: a moving average in which one measurement counts
    at most twice the price (a pause of the process is no price)."""
    return seconds if old is None else old + PRICE_WEIGHT * (min(seconds, 2 * old) - old)


@dataclass
class BucketPrices:
    """One row bucket's measured cycle prices: a level, which moves with whatever else the device runs, times each
    width bucket's factor, which is the shape's own (seconds = level x factor)."""

    level: float | None = None
    factors: dict[int, float] = field(default_factory=dict)
    samples: dict[int, deque[float]] = field(default_factory=dict)  # each width's last factor measurements
    last_width: int | None = None
    run: int = 0  # priced cycles in a row at last_width
    moved: int = 0  # the engine's priced cycle that last moved the level
    chosen: int | None = None  # the width the prices chose last (`MeasuredPrices.remeasures`)
    remeasure_after: int = REMEASURE_FIRST
    remeasuring: bool = False  # the runner-up runs once more: its first cycle ran cold

    def measure_factor(self, width: int, factor: float) -> None:
        """A measurement of `width`'s factor against the level; then the scale is pinned: the narrowest measured width's
        factor is 1 and the level its seconds. Only the factors' ratios price anything, and each factor is measured
        against a level another width's factor set, so their common scale, left free, drifted at every switch: a lone
        row switching widths every few cycles took the level to 1e-10 s in minutes on the mini zoo, and in a simulation
        of its cycles it grew 38-45 decades every 100,000 cycles, to a float's overflow and NaN prices (docs/log.md, "a
        lone row's prices")."""
        samples = self.samples.setdefault(width, deque(maxlen=FACTOR_SAMPLES))
        samples.append(factor)
        self.factors[width] = statistics.median(samples)
        unit = self.factors[min(self.factors)]
        if unit != 1.0:
            self.factors = {each: value / unit for each, value in self.factors.items()}
            for each, kept in self.samples.items():
                self.samples[each] = deque((value / unit for value in kept), maxlen=FACTOR_SAMPLES)
            if self.level is not None:
                self.level *= unit


def block_sizes_of(widths: Sequence[int], counted: Container[int]) -> Iterator[tuple[int, range]]:
    """Each width bucket of `widths` (ascending) in `counted`, with the b's it prices: those past the next narrower
    bucket, up to its own width (a cycle runs b on the narrowest bucket that holds it)."""
    narrower = 0
    for width in widths:
        if width in counted:
            yield width, range(narrower + 1, width + 1)
        narrower = width


class MeasuredPrices:
    """What the engine's chain cycles cost here and now, per row bucket and b, for the batch's width (`batch_width`)
    and the policies that price their choices (`PrefillState.prices`).

    A cycle's time moves with what else the device runs (a server's other threads, its neighbours): a price kept
    from a calm spell, set against one measured under load, chooses by the spell and not by the width (through the
    endpoint, batches of 4 flapped between autoregression and width 8 that way). So widths are compared on prices
    measured under the same conditions: a run of cycles at one width moves its bucket's level; the first cycle at a
    width after another's measures that width's factor against the level the other just set (the factor: the median
    of its last `FACTOR_SAMPLES` measurements); a level not moved in `LEVEL_FRESH` priced cycles is set again by the
    next. A shape's first `PRICE_WARM_UP` cycles are no price. A factor is measured only where the width changes, so
    one measured under passing conditions would keep its bucket at one width for good: `remeasures` says when the
    runner-up is to run, to be measured again. Where the batch chooses the width, a cycle right after another
    shape's, or after anything else the device ran (a prefill, a flush), runs cold and is no price (`observe`'s
    `cold`): in a served replica such cycles priced 2 and 4 rows at 1.4-2.5x what they take warm (docs/log.md,
    "widths priced on warm cycles"). A lone row's cycles all count: its per-step policy switches as it chooses, and
    pays the switch."""

    def __init__(self, widths: Sequence[int]):
        self.widths = sorted(widths)  # the engine's width buckets
        self.buckets: dict[int, BucketPrices] = {}
        self.cycles: Counter[tuple[int, int]] = Counter()  # priced cycles seen per (row bucket, width)
        self._count = 0  # priced cycles seen, warm-ups included
        self._views: dict[int, dict[int, float]] = {}

    def at(self, bucket: int) -> dict[int, float] | None:
        """b -> seconds of a cycle of `bucket` rows, every b of each measured width bucket (None: none measured)."""
        view = self._views.get(bucket)
        if view is None and bucket in self.buckets:
            prices = self.buckets[bucket]
            view = self._views[bucket] = {
                b: prices.level * prices.factors[width]
                for width, sizes in block_sizes_of(self.widths, prices.factors)
                for b in sizes
            }
        return view

    def of_widths(self, view: Mapping[int, float] | None) -> dict[int, float]:
        """Width bucket -> seconds, of the measured width buckets in `view` (an answer of `at`)."""
        return {width: view[width] for width in self.widths if view and width in view}

    def observe(self, bucket: int, width: int, seconds: float, cold: bool = False) -> None:
        """A chain cycle of `bucket` rows at width bucket `width` took `seconds`; a `cold` one is no price."""
        if cold:
            return
        self._count += 1
        self.cycles[(bucket, width)] += 1
        if self.cycles[(bucket, width)] <= PRICE_WARM_UP:
            return
        prices = self.buckets.get(bucket)
        if prices is None:  # (not `setdefault`, which builds a `BucketPrices` at every cycle)
            prices = self.buckets[bucket] = BucketPrices()
        if prices.level is None:
            prices.level, prices.moved = seconds, self._count
            prices.measure_factor(width, 1.0)
        elif width not in prices.factors:
            prices.measure_factor(width, seconds / prices.level)
        elif self._count - prices.moved > LEVEL_FRESH:  # set again: the old level held under other conditions
            prices.level, prices.moved = min(seconds / prices.factors[width], 2 * prices.level), self._count
        elif width == prices.last_width:
            prices.level, prices.moved = moving_price(prices.level, seconds / prices.factors[width]), self._count
        else:
            prices.measure_factor(width, seconds / prices.level)
        prices.run = prices.run + 1 if width == prices.last_width else 1
        prices.last_width = width
        self._views.pop(bucket, None)  # built when read: a lone row's cycles observe at every cycle, and read rarely

    def remeasures(self, bucket: int, best: int) -> bool:
        """Whether a cycle of `bucket` rows whose prices choose width `best` runs the runner-up instead, to measure
        its factor again: two cycles (the first after a switch runs cold) after `REMEASURE_FIRST` priced cycles in a
        row at `best`, then after twice as many each time the choice stands (at most `REMEASURE_MOST`), from
        `REMEASURE_FIRST` again once the prices choose another width."""
        prices = self.buckets.get(bucket)
        if prices is None:
            return False
        if prices.remeasuring:
            prices.remeasuring = False
            return True
        if best != prices.chosen:
            prices.chosen, prices.remeasure_after = best, REMEASURE_FIRST
        if prices.last_width != best or prices.run < prices.remeasure_after:
            return False
        prices.remeasure_after = min(2 * prices.remeasure_after, REMEASURE_MOST)
        prices.remeasuring = True
        return True


class LonePeriods:
    """What a lone row's cycle costs at each width bucket, all in: from its start to the next cycle's start, so with
    what the host spends after it (the engine's step, a server handing out its tokens: per cycle, so more a token
    for autoregression); the median of the last `LONE_PERIODS` at that width. `MeasuredPrices` compares a width
    with the others by the first cycle after a switch, and a cycle right after another width's runs cold: in a
    served replica, where such a switch comes with a request's start, its level and factors priced an
    autoregressive cycle of 0.61-0.64 ms at 0.84-1.31 ms, and a width-8 one of 1.38-1.53 ms at 1.25-1.66 ms
    (docs/log.md, "a lone row's chain priced"). So only a cycle that follows one of its own width counts.

    A period older than `LONE_HORIZON` counted cycles is dropped, and a width left with none is unpriced: the width
    a lone row's verdict keeps running is measured all along, the other only when run, so its price could stay one
    measured in a slow spell (an autoregressive period of 0.63 ms in a replica's first cycles, against 0.44-0.47 ms
    after) and hold every later row at a chain that lost (0.86x autoregression at T = 1 on the mini zoo, docs/log.md).
    Unpriced, autoregression is probed again (`Engine._price_lone_chain`) and a chain drafted again."""

    def __init__(self, widths: Sequence[int] = ()) -> None:
        self.widths = sorted(widths)  # the engine's width buckets, for `view`
        # width -> its last periods, each (lone cycles counted when it was observed, seconds), oldest first
        self._periods: dict[int, deque[tuple[int, float]]] = {}
        # width -> the same periods' seconds in ascending order: the median read at every lone cycle of a row that
        # keeps a chain (`Engine._drafts_at_a_loss`) without a sort (`statistics.median` of 64 took most of that
        # check's 36 us a cycle on the mini zoo, 2% of a width-8 cycle: docs/log.md)
        self._ordered: dict[int, list[float]] = {}
        self._counted = 0  # lone cycles counted, every width
        self._first_counted = 0  # at most the count of the oldest period kept, any width
        # b -> the period of its width bucket: the prices a lone row's policy reads (`Engine._policy_prices`)
        self.view: Mapping[int, float] = _PeriodsByBlockSize(self)

    def observe(self, width: int, seconds: float) -> None:
        """A lone cycle at width bucket `width`, after one at the same width, took `seconds` to the next's start."""
        self._counted += 1
        periods = self._periods.setdefault(width, deque())
        if len(periods) == LONE_PERIODS:
            self._forget_oldest(width)
        periods.append((self._counted, seconds))
        insort(self._ordered.setdefault(width, []), seconds)
        oldest = self._counted - LONE_HORIZON
        if self._first_counted <= oldest:  # the widths scanned only where one's oldest period may have aged out
            for other in [w for w, kept in self._periods.items() if kept[0][0] <= oldest]:
                while other in self._periods and self._periods[other][0][0] <= oldest:
                    self._forget_oldest(other)
            self._first_counted = min(kept[0][0] for kept in self._periods.values())

    def _forget_oldest(self, width: int) -> None:
        """Drop `width`'s oldest period; a width left with none is unpriced."""
        _, seconds = self._periods[width].popleft()
        ordered = self._ordered[width]
        del ordered[bisect_left(ordered, seconds)]
        if not ordered:
            del self._periods[width], self._ordered[width]

    def at(self) -> dict[int, float]:
        """Width bucket -> the median period of its counted cycles (the widths with at least one)."""
        return {width: self.median(width) for width in self._periods}

    @property
    def counted(self) -> KeysView[int]:
        """The width buckets of which a cycle was counted."""
        return self._periods.keys()

    def median(self, width: int) -> float:
        """The median period of width bucket `width`'s counted cycles (KeyError: none counted)."""
        ordered = self._ordered[width]
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class _PeriodsByBlockSize(Mapping):
    """`LonePeriods` as prices by b (every b of a counted width bucket: that width's median period), read as asked."""

    def __init__(self, periods: LonePeriods) -> None:
        self._periods = periods

    def _width(self, block_size: int) -> int | None:
        return next((width for width in self._periods.widths if width >= block_size), None)

    def __getitem__(self, block_size: int) -> float:
        width = self._width(block_size)
        if width is None or width not in self._periods.counted:
            raise KeyError(block_size)
        return self._periods.median(width)

    def __iter__(self) -> Iterator[int]:
        for _, sizes in block_sizes_of(self._periods.widths, self._periods.counted):
            yield from sizes

    def __len__(self) -> int:
        return sum(1 for _ in self)


class RecentLoad:
    """The rows a joining row can expect to run beside: at least those of the batch it joins, and the median rows of
    the engine's last `LOAD_CYCLES` cycles. Under a steady load a row can still join an idle engine, between a
    closed loop's requests (at 4 clients through the decoder on the mini zoo, a quarter of the rows did), and a
    moment later runs beside the others: its option to draft is priced at that load (docs/log.md, "the load a
    joining row expects")."""

    def __init__(self) -> None:
        self._rows: deque[int] = deque(maxlen=LOAD_CYCLES)

    def observe(self, rows: int) -> None:
        """A cycle ran `rows` rows."""
        self._rows.append(rows)

    def rows(self, batch_rows: int) -> int:
        """The load a row joining a batch of `batch_rows` rows (itself included) can expect."""
        return max(batch_rows, statistics.median_low(self._rows)) if self._rows else batch_rows


@dataclass
class SlotAcceptance:
    """The drafted slots a row (or every row) kept, and how many of its drafting cycles rejected one."""

    accepted: int = 0
    rejected: int = 0

    def add(self, block_size: int, committed: int) -> None:
        """A chain cycle of `block_size` that committed `committed` tokens (an autoregressive one tells nothing)."""
        if block_size > 1:
            self.accepted += committed - 1
            self.rejected += committed < block_size

    @property
    def tried(self) -> int:
        return self.accepted + self.rejected

    @property
    def measured(self) -> float:
        """The slot acceptance rate as counted (at least one slot tried)."""
        return self.accepted / self.tried

    def rate(self, prior: float, slots: int = PRIOR_SLOTS) -> float:
        """The slot acceptance rate, shrunk toward `prior` by `slots` slots."""
        return (self.accepted + slots * prior) / (self.tried + slots)


def temperature_key(temperature: float) -> float:
    """The temperature whose rows' acceptance a row's is shrunk toward: to 0.1, so a server keeps at most 21."""
    return round(temperature, 1)


def expected_commits(rate: float, block_size: int) -> float:
    """Tokens a chain of `block_size` commits when each drafted slot is accepted at `rate`, given its predecessors."""
    if rate >= 1.0:
        return float(block_size)
    return (1.0 - rate**block_size) / (1.0 - rate)


def batch_width(rates: Sequence[float | None], engine_rate: float, prices: Mapping[int, float]) -> int:
    """The width of a chain cycle whose rows draft all of it that commits the most expected tokens a second, among
    the widths `prices` holds (width -> seconds of the batch's cycle; 1, autoregression, included). A chain commits
    what one at the engine's slot acceptance rate `engine_rate` does, its accepted drafts scaled by the row's rate over
    the engine's (None: a row that cannot draft, one token a cycle): linear in each row's rate, so a few rows' noisy
    rates do not buy a wide cycle (a chain's tokens grow faster than linearly in its rate). Ties to the narrower."""
    shares = sum(rate / engine_rate for rate in rates if rate is not None) if engine_rate > 0 else 0.0
    best, value = AUTOREGRESSIVE, -1.0
    for width in sorted(prices):
        tokens = len(rates) + (expected_commits(engine_rate, width) - 1.0) * shares
        if tokens / prices[width] > value:
            best, value = width, tokens / prices[width]
    return best


@dataclass
class OptionPrice:
    """What keeping a row's option to draft costs beyond its autoregressive cycles, measured (`moving_price`, after
    `PRICE_WARM_UP` passes of each kind): seconds of drafter context a prompt token, of flushing what a cycle's rows
    kept (a batch's, a cycle), and of a row's per-cycle hook; and the tokens a finished row generated (the cycles an
    autoregressive one runs). None: not measured yet."""

    context: float | None = None
    flush: float | None = None
    hook: float | None = None
    tokens: float | None = None
    passes: Counter[str] = field(default_factory=Counter, repr=False)

    def observe(self, name: str, seconds: float) -> None:
        """One more pass of `name` ("context", "flush" or "hook") took `seconds`."""
        self.passes[name] += 1
        if self.passes[name] > PRICE_WARM_UP:
            setattr(self, name, moving_price(getattr(self, name), seconds))

    def finished(self, tokens: int) -> None:
        """A row finished with `tokens` generated."""
        self.tokens = tokens if self.tokens is None else self.tokens + PRICE_WEIGHT * (tokens - self.tokens)

    def share(
        self,
        prompt_tokens: int,
        max_new_tokens: int,
        rows: int,
        autoregressive_price: float | None,
        asks_hook: bool = True,
    ) -> float:
        """The option's price as a share of a row's autoregressive time: a row of `prompt_tokens` that runs as many
        autoregressive cycles as finished rows generated tokens (at most `max_new_tokens`) among `rows`, each cycle
        `autoregressive_price` seconds for the batch (its share of it 1 / rows, as of the flushes), its hook asked
        every cycle where `asks_hook`. 0 until the autoregressive price is measured."""
        if not autoregressive_price:
            return 0.0
        cycles = max(1.0, min(float(max_new_tokens), self.tokens or float(max_new_tokens)))
        own = (self.context or 0.0) * prompt_tokens / cycles + ((self.hook or 0.0) if asks_hook else 0.0)
        return (rows * own + (self.flush or 0.0)) / autoregressive_price


@dataclass
class Exploration:
    """Rows a rule sends autoregressive for good, counted: the `EXPLORE_EVERY`-th keeps the option to draft anyway,
    so that what the rule reads stays measured as the requests change; then one in twice as many each time, up to
    one in `EXPLORE_MOST`, while the verdict stands, as `MeasuredPrices.remeasures` spaces its measurements. An
    exploring row keeps the drafter's context and asks its bucket's runner-up width to be measured, and in a
    closed loop a row that drafts finishes out of step with its batch: at 4 rows through the endpoint, one in 16
    cost the adaptive decoder 2-3% against autoregression (docs/log.md). The rule's other verdict starts the
    count over (`verdict_changed`)."""

    declined: int = 0
    interval: int = 0  # rows between explorations now; 0: `EXPLORE_EVERY`

    def explores(self) -> bool:
        self.declined += 1
        interval = self.interval or EXPLORE_EVERY
        if self.declined < interval:
            return False
        self.declined, self.interval = 0, min(2 * interval, EXPLORE_MOST)
        return True

    def verdict_changed(self) -> None:
        """The rule let a row keep the option: the next row it sends autoregressive starts the count over."""
        self.declined, self.interval = 0, 0


@dataclass
class DraftSavings(Exploration):
    """What one policy's drafts saved the rows that started autoregressive and kept the option to draft, in the
    cycles they ran alone: each drafting cycle's committed tokens at the measured autoregressive price, less the
    cycle's own seconds (the option's costs are `OptionPrice`'s), as a share of the autoregressive seconds of every
    token those cycles committed. The option's value as the engine measured it, which a row joining alone weighs
    against its price (`BlockSizePolicy.autoregressive_for_good`)."""

    saved: float = 0.0
    autoregressive: float = 0.0
    cycles: int = 0

    def add(self, block_size: int, committed: int, seconds: float, autoregressive_price: float) -> None:
        """A lone cycle of `block_size` that committed `committed` tokens in `seconds`."""
        self.cycles += 1
        self.autoregressive += committed * autoregressive_price
        if block_size > AUTOREGRESSIVE:
            self.saved += committed * autoregressive_price - seconds

    @property
    def share(self) -> float | None:
        """The saving, a share of the rows' autoregressive time; None before `SAVINGS_CYCLES` cycles."""
        if self.cycles < SAVINGS_CYCLES or self.autoregressive <= 0:
            return None
        return self.saved / self.autoregressive
