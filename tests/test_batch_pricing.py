"""Batch pricing: a cycle of several rows where no fixed b drafts runs the measured width (autoregression included)
at which its rows, each adaptive one drafting all of it, commit the most expected tokens a second; never a fixed b's
row, never a lone row; the output is greedy decoding's either way. Properties for any weights."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from support import greedy_reference

from blockpilot.decoding import GenerationConfig, GenerationRequest, batch_pricing, generate_many
from blockpilot.decoding.batch_pricing import (
    EXPLORE_EVERY,
    EXPLORE_MOST,
    LEVEL_FRESH,
    LONE_HORIZON,
    LONE_PERIODS,
    LONE_PRIOR_SLOTS,
    LONE_PROBE,
    PRICE_WARM_UP,
    PRIOR_SLOTS,
    REMEASURE_FIRST,
    REMEASURE_MOST,
    SAVINGS_CYCLES,
    DraftSavings,
    Exploration,
    LonePeriods,
    MeasuredPrices,
    OptionPrice,
    SlotAcceptance,
    batch_width,
    expected_commits,
)
from blockpilot.decoding.engine import Engine
from blockpilot.policies.base import BlockSizePolicy
from blockpilot.policies.fixed import FixedBlockSize


def test_a_rows_rate_and_what_a_chain_commits_at_it():
    counts = SlotAcceptance()
    counts.add(1, 1)  # autoregressive: no slot tried
    assert counts.tried == 0 and counts.rate(0.5) == pytest.approx(0.5)
    counts.add(4, 4)  # three slots kept, none rejected
    counts.add(4, 2)  # one kept, the second rejected
    assert (counts.accepted, counts.rejected) == (4, 1)
    assert counts.rate(0.0) == pytest.approx(4 / (5 + PRIOR_SLOTS))
    assert expected_commits(0.0, 8) == 1.0 and expected_commits(1.0, 8) == 8.0 and expected_commits(0.7, 1) == 1.0
    assert expected_commits(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)
    # Two rows at rate 1/2: 1.5 tokens each at width 2, 1.875 at 4; a width's tokens a second decide, ties narrower.
    assert batch_width([0.5, 0.5], 0.5, {1: 1.0, 2: 1.4, 4: 2.0}) == 2
    assert batch_width([0.5, 0.5], 0.5, {1: 1.0, 2: 1.5}) == 1
    assert batch_width([0.5, 0.5], 0.5, {1: 1.0, 2: 1.6, 4: 1.8}) == 4
    assert batch_width([0.5, 0.5], 0.5, {1: 1.0, 2: 2.0, 4: 3.0}) == 1
    assert batch_width([0.5, None], 0.5, {1: 1.0, 2: 1.2}) == 2 and batch_width([0.5, None], 0.5, {1: 1.0, 2: 1.3}) == 1
    # Linear in the rows' rates: rows of rates 0.9 and 0.1 are worth two of 0.5 (a chain at 0.9 alone would commit
    # 3.44 of 4, and buy the wide cycle); a batch that never drafted (engine rate 0) commits one token a row.
    prices = {1: 1.0, 2: 1.6, 4: 1.8}
    assert batch_width([0.9, 0.1], 0.5, prices) == batch_width([0.5, 0.5], 0.5, prices) == 4
    assert batch_width([0.9, 0.1], 0.5, {1: 1.0, 4: 2.0}) == 1 and batch_width([0.0, 0.0], 0.0, prices) == 1


def test_a_lone_rows_switching_widths_leave_the_prices_on_the_scale_of_seconds():
    """Each width's factor is measured against a level another width's factor set: a lone row switching widths every
    few cycles, each cycle's time noisy, drifted their common scale at every switch (the level 38-45 decades every
    100,000 cycles in this simulation, to a float's overflow). Pinned, the narrowest width's factor is 1 and the level
    its seconds, and the prices stay finite and on the cycles' scale."""
    rng = random.Random(0)
    seconds = {1: 0.4e-3, 4: 1.2e-3, 8: 1.7e-3}
    prices = MeasuredPrices([1, 2, 4, 8])
    for _ in range(10_000):  # a per-step policy's choices: mostly autoregressive, often 8, now and then 4
        draw = rng.random()
        width = 4 if draw < 0.03 else 8 if draw < 0.4 else 1
        for _ in range(rng.randint(1, 4)):
            prices.observe(1, width, seconds[width] * rng.lognormvariate(0, 0.3))
    bucket = prices.buckets[1]
    assert bucket.factors[1] == 1.0 and 0.5 * seconds[1] < bucket.level < 2 * seconds[1]
    assert all(0.25 * seconds[width] < prices.at(1)[width] < 4 * seconds[width] for width in seconds)


def test_widths_are_compared_on_prices_measured_under_the_same_conditions():
    """A width's price moves with the device while another width runs (its bucket's level), and the first cycle at a
    width after another's measures that width's factor against the level the other just set."""
    prices = MeasuredPrices([1, 2, 4, 8])

    def run(width: int, seconds: float, cycles: int, bucket: int = 4) -> None:
        for _ in range(cycles):
            prices.observe(bucket, width, seconds)

    run(1, 1.0, PRICE_WARM_UP)
    assert prices.at(4) is None  # a shape's first cycles are no price
    run(1, 1.0, 3)
    run(8, 3.0, PRICE_WARM_UP + 1)
    assert prices.at(4) == {1: 1.0, **dict.fromkeys(range(5, 9), 3.0)}  # widths 2 and 4 not measured
    run(8, 9.0, 100)  # the device slows 3x while width 8 runs: autoregression's price with it, not a calm spell's
    assert prices.at(4)[8] == pytest.approx(9.0, rel=1e-3) and prices.at(4)[1] == pytest.approx(3.0, rel=1e-3)
    run(1, 6.0, 1)  # against width 8's level just before, autoregression now costs 2x what it did
    # its factor the median of its two measurements (1 and 6 / 3) at width 8's level; width 8's price unmoved
    assert prices.at(4)[1] == pytest.approx(3.0 * (1.0 + 6.0 / 3.0) / 2, rel=1e-3)
    assert prices.at(4)[8] == pytest.approx(9.0, rel=1e-3) and prices.buckets[4].factors[1] == 1.0  # pinned
    run(1, 1.0, LEVEL_FRESH + 1, bucket=16)  # other rows ran meanwhile: the level held under other conditions
    run(1, 4.4, 1)
    assert prices.buckets[4].level == pytest.approx(4.4 / prices.buckets[4].factors[1])  # set again, not moved


def test_a_factor_measured_under_passing_conditions_is_measured_again():
    """Four rows whose drafted slots are kept at rate 1/2 on a device where width 8 costs 4x autoregression: a
    switch measured while autoregression ran 3x slow for a moment prices width 8 as the better. The runner-up runs
    now and then to be measured again: the batch turns to autoregression, and measures width 8 again ever more
    rarely."""
    prices, truth, rates = MeasuredPrices([1, 8]), {1: 1.0, 8: 4.0}, [0.5] * 4
    for width, seconds in [(1, 3.0), (8, 4.0)]:
        for _ in range(PRICE_WARM_UP + 1):
            prices.observe(4, width, seconds)
    ran = [8]
    for _ in range(2_000):
        measured = {width: prices.at(4)[width] for width in (1, 8)}
        best = batch_width(rates, 0.5, measured)
        width = (8 if best == 1 else 1) if prices.remeasures(4, best) else best
        cold = width != ran[-1]  # the first cycle after a switch, 3x slow: no price (`Engine._cycle`)
        prices.observe(4, width, 3 * truth[width] if cold else truth[width], cold)
        ran.append(width)
    ran = ran[1:]
    assert set(ran[: REMEASURE_FIRST - 1]) == {8}  # the prices chose width 8
    # then autoregression; width 8 still measured, two cycles each time
    assert 2 <= ran[-1_000:].count(8) <= 2 * (1_000 // REMEASURE_FIRST + 1)
    assert ran[-500:].count(1) >= 500 - 2 * (500 // REMEASURE_MOST + 1) and REMEASURE_FIRST < REMEASURE_MOST


@dataclass(frozen=True)
class Drafts(BlockSizePolicy):
    """An adaptive policy (its b its own choice) that always drafts `block_size`."""

    block_size: int
    name: str = field(default="drafts", init=False)

    def initial_block_size(self, prefill) -> int:
        return self.block_size


TEXTS = ["Count from 1 to 30.", "List four colors.", "Spell cat."]
TOKENS = 24


def decode(models, engine: Engine, policies: list[BlockSizePolicy]) -> list:
    prompts = [models.encode_prompt(text) for text in TEXTS[: len(policies)]]
    config = GenerationConfig(max_new_tokens=TOKENS)
    requests = [GenerationRequest(p, config, q) for p, q in zip(prompts, policies, strict=True)]
    results = generate_many(models, requests, engine=engine)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == greedy_reference(models.target, prompt, TOKENS)
    return results


def before_the_budget(result) -> set[int]:
    """The b of a result's cycles before its budget cut them (b = min(chosen, tokens left): a falling tail below the
    rest, however the weights accepted), the last cycle always left out."""
    sizes = result.block_sizes
    tail = len(sizes) - 1
    while tail > 0 and sizes[tail] <= sizes[tail - 1] and sizes[tail] < max(sizes[:tail]):
        tail -= 1
    return set(sizes[: min(tail + 1, len(sizes) - 1)])


def priced(engine: Engine, autoregressive: float | None, draft: float) -> Engine:
    """The engine's measured prices at every row bucket, as if it had timed those cycles, and one drafted slot seen."""
    widths = [(1, autoregressive)] if autoregressive is not None else []
    for bucket in engine.buckets:
        for width, seconds in widths + [(width, draft) for width in engine.widths if width > 1]:
            for _ in range(PRICE_WARM_UP + 1):
                engine.prices.observe(bucket, width, seconds)
    engine.acceptance.add(4, 2)
    return engine


def test_a_batch_runs_autoregressive_where_drafting_does_not_pay_for_it(tiny_models):
    def slow_drafts() -> Engine:
        return priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1e-6, draft=1.0)

    results = decode(tiny_models, slow_drafts(), [Drafts(4)] * 3)
    # Every cycle of several rows is autoregressive (the rows keep no option to draft: the test below).
    for result in results:
        assert set(result.block_sizes) <= {1, 4} and result.block_sizes[0] == 1 and 1 in result.block_sizes
    # A fixed b is the request's own choice: its batch drafts whatever it costs.
    fixed = decode(tiny_models, slow_drafts(), [Drafts(4), FixedBlockSize(4)])
    assert all(b > 1 for result in fixed for b in result.block_sizes[:-1])
    # Drafting that pays is kept.
    cheap_drafts = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1.0, draft=1.0)
    assert all(
        b > 1 for result in decode(tiny_models, cheap_drafts, [Drafts(4)] * 3) for b in result.block_sizes[:-1]
    )


def test_a_lone_row_decodes_autoregressive_for_good_once_its_own_acceptance_says_its_chain_loses(tiny_models):
    """A lone row that keeps the chain its adaptive policy chose drafts it while, at the row's slot acceptance rate
    (shrunk toward every row's at its temperature) and what a lone row's cycles cost here (`LonePeriods`), the chain
    commits more tokens a second than autoregression; once it would not, the row decodes autoregressive for good,
    without the drafter: from its first cycle where the rows' rate already says so, but now and then
    (`Exploration`), which drafts once and decides after it. A fixed b is the request's own. Where autoregression's
    period is not measured, the row first runs `LONE_PROBE` autoregressive cycles (the first no period), then its
    chain, then decides. Before the rows tried as many slots as the prior counts (a replica's first rows), no
    verdict: the row drafts its chain. Greedy either way."""

    def alone(
        policy: BlockSizePolicy,
        autoregressive: float | None,
        draft: float,
        explores: bool = False,
        tried: int = LONE_PRIOR_SLOTS,  # the slots the rows tried before this one joins
    ):
        engine = Engine(tiny_models, max_batch=1, width=4)
        for width, seconds in ((1, autoregressive), (4, draft)):
            for _ in range(LONE_PERIODS if seconds is not None else 0):  # the median, whatever the real cycles take
                engine.lone_periods.observe(width, seconds)  # as if lone cycles had taken it
        half = tried // 2
        engine.acceptance = SlotAcceptance(accepted=half, rejected=tried - half)  # the slots every row tried
        engine.acceptance_at[0.0] = SlotAcceptance(accepted=half, rejected=tried - half)  # ... every greedy row
        engine.exploration_alone.declined = EXPLORE_EVERY - 1 if explores else 0
        return decode(tiny_models, engine, [policy])[0]

    slow = alone(Drafts(4), autoregressive=1e-6, draft=1.0)
    assert set(slow.block_sizes) == {1} and slow.drafter_forward_passes == 0  # no chain cycle, no drafter context
    exploring = alone(Drafts(4), autoregressive=1e-6, draft=1.0, explores=True)
    assert exploring.block_sizes[0] == 4 and set(exploring.block_sizes[1:]) == {1}
    assert exploring.drafter_forward_passes == 1
    for kept in (alone(Drafts(4), autoregressive=1.0, draft=1e-6), alone(FixedBlockSize(4), 1e-6, 1.0)):
        assert before_the_budget(kept) == {4}
    probe = [4, *[1] * LONE_PROBE, 4]  # its chain, a probe of autoregression, its chain again (after a flush)
    probed = alone(Drafts(4), autoregressive=None, draft=1.0)
    assert probed.block_sizes[: len(probe)] == probe and set(probed.block_sizes[len(probe) :]) == {1}
    assert probed.drafter_forward_passes == 2
    fast = alone(Drafts(4), autoregressive=None, draft=1e-6)
    assert fast.block_sizes[: len(probe)] == probe and 1 not in fast.block_sizes[len(probe) : -2]
    unseen = alone(Drafts(4), autoregressive=1e-6, draft=1.0, tried=1)  # a rejection of a replica's first cycle
    assert unseen.block_sizes[:2] == [4, 4] and unseen.drafter_forward_passes >= 2


def test_a_lone_price_not_measured_for_the_horizon_is_measured_again(tiny_models):
    """A width's lone periods older than `LONE_HORIZON` counted cycles are dropped (`LonePeriods`): autoregression
    priced once in a slow spell, then only chains run, is probed again instead of holding every later row at a chain
    that loses; a chain's price ages out alike while rows run autoregressive (unpriced, a chain does not lose)."""
    periods = LonePeriods([1, 4])
    periods.observe(1, 5.0)
    for _ in range(LONE_HORIZON - 1):
        periods.observe(4, 1.0)
    assert periods.at() == {1: 5.0, 4: 1.0}
    periods.observe(4, 1.0)
    assert periods.at() == {4: 1.0} and dict(periods.view) == {2: 1.0, 3: 1.0, 4: 1.0}
    for _ in range(LONE_HORIZON):
        periods.observe(1, 2.0)
    assert periods.at() == {1: 2.0} and 4 not in periods.counted

    engine = Engine(tiny_models, max_batch=1, width=4)
    for _ in range(LONE_PERIODS):
        engine.lone_periods.observe(1, 1.0)  # autoregression in a slow spell: every chain wins against it
    for _ in range(LONE_HORIZON):
        engine.lone_periods.observe(4, 1e-6)  # ... then chains alone for the horizon
    engine.acceptance = SlotAcceptance(accepted=0, rejected=LONE_PRIOR_SLOTS)
    engine.acceptance_at[0.0] = SlotAcceptance(accepted=0, rejected=LONE_PRIOR_SLOTS)
    probed = decode(tiny_models, engine, [Drafts(4)])[0]
    assert probed.block_sizes[: 1 + LONE_PROBE] == [4, *[1] * LONE_PROBE]


@dataclass
class SeesPrices(BlockSizePolicy):
    """An adaptive policy that chooses b = 4 before every cycle and keeps the prices it was handed."""

    seen: list = field(default_factory=list)
    name: str = field(default="sees-prices", init=False)

    def initial_block_size(self, prefill) -> int:
        self.seen.append(dict(prefill.prices or {}))
        return 4

    def next_block_size(self, cycle) -> int:
        self.seen.append(dict(cycle.prices or {}))
        return 4


def test_a_lone_rows_policy_reads_what_its_cycles_cost_all_in():
    """A lone row's policy prices its choices by what a lone row's cycles cost here, each width the median of its last
    cycles (`LonePeriods`), not by `MeasuredPrices`, which compares a width by the first cycle after a switch: every b
    of each counted width, one mapping updated in place as cycles are counted."""
    periods = LonePeriods([1, 2, 4])
    view = periods.view
    for seconds in (1.0, 3.0, 2.0):
        periods.observe(4, seconds)
    periods.observe(1, 0.5)
    assert periods.view is view and view == {1: 0.5, 3: 2.0, 4: 2.0} and periods.at() == {4: 2.0, 1: 0.5}


def test_a_lone_periods_median_is_the_median_of_its_widths_last_periods_within_the_horizon():
    """The median `LonePeriods` keeps in order as periods come and go is `statistics.median` of each width's last
    `LONE_PERIODS` periods not older than `LONE_HORIZON` counted cycles, through runs of each width, long and short."""
    rng = random.Random(0)
    periods, seen = LonePeriods([1, 2, 4, 8]), []
    for _ in range(3000):
        width = rng.choice([1, 4]) if rng.random() < 0.2 else (seen[-1][0] if seen else 8)
        seconds = round(rng.uniform(0.1, 2.0), 2)  # ties too
        seen.append((width, seconds))
        periods.observe(width, seconds)
        recent = seen[-LONE_HORIZON:]
        expected = {}
        for w in {w for w, _ in recent}:
            expected[w] = statistics.median([s for each, s in recent if each == w][-LONE_PERIODS:])
        assert periods.at() == expected


def test_a_lone_rows_policy_is_handed_the_lone_periods(tiny_models):
    engine = Engine(tiny_models, max_batch=1, width=4)
    for width, seconds in ((1, 1.0), (4, 3.0)):
        for _ in range(LONE_PERIODS):  # the median, whatever the real cycles take
            engine.lone_periods.observe(width, seconds)
    policy = SeesPrices()
    decode(tiny_models, engine, [policy])
    assert len(policy.seen) > 2 and all(seen == {1: 1.0, 3: 3.0, 4: 3.0} for seen in policy.seen)
    assert engine.prices.at(1) and engine.prices.at(1)[4] < 1.0  # what `MeasuredPrices` holds: its cycles' time


def test_a_lone_rows_chain_is_priced_at_the_acceptance_of_rows_at_its_temperature(tiny_models):
    """A sampled row's drafts are kept less often than a greedy one's: its own rate is shrunk toward the rows' at its
    temperature, not every row's. Every other row's drafts were kept (greedy ones), every sampled row's rejected: a
    sampled lone row whose chain costs 2x autoregression decodes autoregressive from its first cycle; a greedy one
    drafts its chain."""
    prompt = tiny_models.encode_prompt(TEXTS[0])

    def alone(temperature: float):
        engine = Engine(tiny_models, max_batch=1, width=4)
        engine.lone_periods.observe(1, 1.0)
        engine.lone_periods.observe(4, 2.0)
        engine.acceptance = SlotAcceptance(accepted=1_000, rejected=0)
        engine.acceptance_at[1.0] = SlotAcceptance(accepted=0, rejected=1_000)
        config = GenerationConfig(max_new_tokens=TOKENS, temperature=temperature, seed=0)
        return generate_many(tiny_models, [GenerationRequest(prompt, config, Drafts(4))], engine=engine)[0]

    sampled, greedy = alone(1.0), alone(0.0)
    assert set(sampled.block_sizes) == {1} and sampled.drafter_forward_passes == 0
    assert greedy.block_sizes[0] == 4


def test_a_batchs_cycle_right_after_a_prefill_or_another_shape_is_no_price(tiny_models):
    """Where the batch chooses the width, widths are compared on warm cycles: the first after a prefill, a flush or
    another shape is no price. A lone row's cycles all are: its per-step policy pays its switches."""
    engine = Engine(tiny_models, max_batch=4, width=4)
    seen, observe = [], engine.prices.observe

    def recording(bucket: int, width: int, seconds: float, cold: bool = False) -> None:
        seen.append((bucket, width, cold))
        observe(bucket, width, seconds, cold)

    engine.prices.observe = recording
    prompts = [tiny_models.encode_prompt(text) for text in TEXTS[:2]]
    configs = [GenerationConfig(max_new_tokens=n) for n in (8, 24)]
    requests = [GenerationRequest(p, c, Drafts(4)) for p, c in zip(prompts, configs, strict=True)]
    generate_many(tiny_models, requests, engine=engine)
    batch = [entry for entry in seen if entry[0] > 1]  # the two rows' cycles, then the longer one's alone
    shapes = [entry[:2] for entry in batch]
    after_another = [shape != before for shape, before in zip(shapes[1:], shapes[:-1], strict=True)]
    assert len(batch) > 1 and [cold for *_, cold in batch] == [True, *after_another]  # the first after the prefill
    lone = [entry for entry in seen if entry[0] == 1]
    assert lone and not any(cold for *_, cold in lone)


def test_an_autoregressive_price_not_measured_is_measured_first(tiny_models):
    """Where a row bucket's drafting price is known and its autoregressive one is not, the batch runs autoregressive
    until that price is measured, then chooses by both."""
    engine = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=None, draft=1e-6)
    results = decode(tiny_models, engine, [Drafts(4)] * 2)
    assert results[0].block_sizes[0] == 1 and 1 in engine.prices.at(2)
    assert 4 in results[0].block_sizes  # once measured, drafts at a millionth of its price pay


def test_a_row_whose_policy_adapts_drafts_every_slot_its_cycle_computes(tiny_models):
    """A cycle of several rows computes its width bucket for every row: an adaptive row drafts all of it (lossless,
    at no cost), a fixed b stays the request's own, a lone row runs its policy's b; without batch pricing every row
    runs its policy's b."""

    def engine(**options) -> Engine:  # drafting pays at any price, so no cycle of several rows runs autoregressive
        return priced(Engine(tiny_models, max_batch=4, width=4, **options), autoregressive=1.0, draft=1.0)

    ran = before_the_budget

    # Beside a fixed 2 (width 4 for both), a row that chose 3 drafts 4; alone (once the other finished), its 3.
    widened, fixed = decode(tiny_models, engine(), [Drafts(3), FixedBlockSize(2)])
    assert widened.block_sizes[0] == 4 and ran(widened) <= {3, 4} and ran(fixed) == {2}
    # Beside a fixed 3, a row that chose 2 drafts 4; alone, its 2 (width 2).
    widened, fixed = decode(tiny_models, engine(), [Drafts(2), FixedBlockSize(3)])
    assert widened.block_sizes[0] == 4 and ran(widened) <= {2, 4} and ran(fixed) == {3}
    own = decode(tiny_models, engine(batch_pricing=False), [Drafts(3), FixedBlockSize(2)])
    assert [ran(result) for result in own] == [{3}, {2}]


def test_rows_joining_where_the_batch_would_not_draft_start_autoregressive_for_good(tiny_models):
    """Under load the batch chooses an adaptive row's width: where at that load it would not draft were every row
    able to, a joining row keeps no option to draft (b = 1 to its end, alone too), but now and then (`Exploration`);
    where drafting pays, rows keep it. Rows of 8 and 24 tokens: the batch thins to one row. Greedy either way."""

    def decode_thinning(engine: Engine) -> list:
        prompts = [tiny_models.encode_prompt(text) for text in TEXTS[:2]]
        configs = [GenerationConfig(max_new_tokens=n) for n in (8, 24)]
        requests = [GenerationRequest(p, c, Drafts(4)) for p, c in zip(prompts, configs, strict=True)]
        results = generate_many(tiny_models, requests, engine=engine)
        for request, result in zip(requests, results, strict=True):
            n = request.config.max_new_tokens
            assert result.token_ids == greedy_reference(tiny_models.target, request.prompt_ids, n)
        return results

    slow = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1e-6, draft=1.0)
    assert [set(result.block_sizes) for result in decode_thinning(slow)] == [{1}, {1}]
    assert slow.exploration_under_load.declined == 2
    slow.exploration_under_load.declined = EXPLORE_EVERY - 2  # the second row to join keeps the option
    short, long = decode_thinning(slow)
    assert set(short.block_sizes) == {1} and 4 in long.block_sizes  # once alone, its policy's b
    assert slow.exploration_under_load.interval == 2 * EXPLORE_EVERY  # the next one explores later
    cheap = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1.0, draft=1.0)
    cheap.exploration_under_load = Exploration(declined=5, interval=4 * EXPLORE_EVERY)
    assert all(4 in result.block_sizes for result in decode_thinning(cheap))
    assert (cheap.exploration_under_load.declined, cheap.exploration_under_load.interval) == (0, 0)  # started over


def test_a_row_joining_an_idle_engine_prices_its_option_at_the_load_the_engine_ran(tiny_models):
    """Between a closed loop's requests a row can join an idle engine and run beside the others a moment later: it
    prices its option to draft at the median rows of the engine's last cycles. After cycles of 3 rows where the
    batch would not draft, a lone row starts autoregressive for good; on an engine that ran nothing, it drafts."""
    prompt = tiny_models.encode_prompt(TEXTS[0])
    lone = [GenerationRequest(prompt, GenerationConfig(max_new_tokens=TOKENS), Drafts(4))]
    loaded = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1e-6, draft=1.0)
    decode(tiny_models, loaded, [Drafts(4)] * 3)
    assert loaded.recent_load.rows(1) == 3
    declined = loaded.exploration_under_load.declined
    (result,) = generate_many(tiny_models, lone, engine=loaded)
    assert set(result.block_sizes) == {1} and loaded.exploration_under_load.declined == declined + 1
    idle = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1e-6, draft=1.0)
    (result,) = generate_many(tiny_models, lone, engine=idle)
    assert result.block_sizes[0] == 4 and idle.exploration_under_load.declined == 0
    assert result.token_ids == greedy_reference(tiny_models.target, prompt, TOKENS)


class ChoosesAutoregression(BlockSizePolicy):
    """An adaptive per-step policy that chooses b = 1 every cycle: its rows keep the drafter's context."""

    name = "chooses-autoregression"

    def initial_block_size(self, prefill) -> int:
        return 1

    def next_block_size(self, cycle) -> int:
        return 1


def test_a_batch_drafts_where_it_pays_whatever_its_adaptive_rows_chose(tiny_models):
    """Rows whose policy chose autoregression draft the measured width where that commits more tokens a second for
    the batch (here drafts cost what autoregression does); a lone row runs its policy's b."""
    engine = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1.0, draft=1.0)
    results = decode(tiny_models, engine, [ChoosesAutoregression()] * 3)
    for result in results:
        assert result.block_sizes[0] == 4 and before_the_budget(result) <= {1, 4}
    slow = priced(Engine(tiny_models, max_batch=4, width=4), autoregressive=1e-6, draft=1.0)
    assert {b for result in decode(tiny_models, slow, [ChoosesAutoregression()] * 3) for b in result.block_sizes} == {1}


def test_what_drafts_saved_a_row_is_its_drafting_cycles_tokens_at_the_autoregressive_price_less_their_time():
    savings = DraftSavings()
    savings.add(1, 1, 0.9, 1.0)  # an autoregressive cycle saves nothing, whatever it took
    savings.add(4, 3, 2.0, 1.0)  # 3 tokens in 2 s against 3 autoregressive seconds
    savings.add(4, 1, 2.0, 1.0)  # 1 token in 2 s
    assert (savings.saved, savings.autoregressive) == (pytest.approx(0.0), pytest.approx(5.0))
    assert savings.share is None  # too few cycles to decide on
    for _ in range(SAVINGS_CYCLES):
        savings.add(4, 4, 2.0, 1.0)
    assert savings.share == pytest.approx(2.0 * SAVINGS_CYCLES / (5.0 + 4.0 * SAVINGS_CYCLES))
    assert [savings.explores() for _ in range(EXPLORE_EVERY)].count(True) == 1


def test_rows_explore_less_often_while_the_verdict_stands_and_as_often_as_at_first_once_it_changes():
    exploration = Exploration()
    explored = [row for row in range(1, 16 * EXPLORE_MOST) if exploration.explores()]
    gaps = [later - earlier for earlier, later in pairwise([0, *explored])]
    assert gaps[:3] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY] and max(gaps) == EXPLORE_MOST
    assert gaps == sorted(gaps)
    exploration.declined = EXPLORE_EVERY - 1  # one row short of the first interval, not of the spaced one
    assert not exploration.explores()
    exploration.verdict_changed()
    assert [exploration.explores() for _ in range(EXPLORE_EVERY)] == [False] * (EXPLORE_EVERY - 1) + [True]


def test_a_row_whose_b_the_batch_chooses_pays_no_hook_for_its_option():
    price = OptionPrice(context=0.0, flush=0.0, hook=0.5, tokens=10)
    assert price.share(4, 10, 2, 1.0) == pytest.approx(1.0)  # two rows' hooks a cycle, against the batch's price
    assert price.share(4, 10, 2, 1.0, asks_hook=False) == 0.0


class NeverDrafts(BlockSizePolicy):
    """Starts autoregressive and answers b = 1 before every cycle: a per-cycle hook whose drafts save nothing."""

    name = "never-drafts"

    def __init__(self) -> None:
        self.asked = 0

    def initial_block_size(self, prefill) -> int:
        return 1

    def next_block_sizes(self, cycles) -> list[int]:
        self.asked += len(cycles)
        return [1] * len(cycles)


def test_a_lone_row_keeps_the_option_to_draft_while_its_policys_drafts_are_measured_to_pay_for_it(
    tiny_models, monkeypatch
):
    """Rows that start autoregressive under a policy that may draft later keep the option (the drafter's context,
    the hook asked every cycle) until the engine has measured what that policy's drafts save rows run alone; where
    they save no more than the option costs, a row joining alone is autoregressive for good, but the
    `EXPLORE_EVERY`-th keeps measuring; where they save more, the option is kept. Greedy either way."""
    monkeypatch.setattr(batch_pricing, "SAVINGS_CYCLES", 40)
    monkeypatch.setattr(batch_pricing, "EXPLORE_EVERY", 3)
    policy, engine = NeverDrafts(), Engine(tiny_models, max_batch=1)
    prompt = tiny_models.encode_prompt(TEXTS[0])
    config = GenerationConfig(max_new_tokens=32)
    greedy = greedy_reference(tiny_models.target, prompt, 32)
    savings = engine.draft_savings(policy)

    def keeps_option() -> bool:
        asked = policy.asked
        (result,) = generate_many(tiny_models, [GenerationRequest(prompt, config, policy)], engine=engine)
        assert result.token_ids == greedy and set(result.block_sizes) == {1}
        return policy.asked > asked

    for _ in range(4):
        if savings.share is not None:
            break
        assert keeps_option()
    assert savings.share == 0.0  # measured: it never drafted
    assert [keeps_option() for _ in range(3)] == [False, False, True]
    assert savings.interval == 2 * 3  # the next row to explore comes later
    savings.saved = 10 * savings.autoregressive  # as if its drafts had saved far more than any option's price
    assert keeps_option()
    assert (savings.declined, savings.interval) == (0, 0)  # the verdict changed: the count starts over


class Asked(BlockSizePolicy):
    """Drafts 4 every cycle and records the rows of every cycle its hook was asked before."""

    name = "asked"

    def __init__(self, adapts: bool) -> None:
        self.adapts, self.batch_rows = adapts, []

    def initial_block_size(self, prefill) -> int:
        return 4

    def next_block_sizes(self, cycles) -> list[int]:
        self.batch_rows += [cycle.batch_rows for cycle in cycles]
        return [4] * len(cycles)


def test_the_batch_chooses_unasked_for_a_row_whose_policy_adapts(tiny_models):
    """In a cycle of several rows the batch chooses the b of a row whose policy adapts, so that policy's per-cycle
    hook is asked only before the cycles its row runs alone; a policy whose b is the request's own is asked before
    every cycle. Rows of 8 and 24 tokens: the batch thins to one row. Greedy either way."""
    for adapts in (True, False):
        policy = Asked(adapts)
        prompts = [tiny_models.encode_prompt(text) for text in TEXTS[:2]]
        requests = [GenerationRequest(p, GenerationConfig(max_new_tokens=n), policy) for p, n in zip(prompts, (8, 24))]
        results = generate_many(tiny_models, requests, engine=Engine(tiny_models, max_batch=2))
        for request, result in zip(requests, results, strict=True):
            n = request.config.max_new_tokens
            assert result.token_ids == greedy_reference(tiny_models.target, request.prompt_ids, n)
        assert set(policy.batch_rows) == ({1} if adapts else {1, 2})
