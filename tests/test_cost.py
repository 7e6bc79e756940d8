"""The cycle cost curve: calibration measures every (batch, b) asked for, files round-trip, and the curve
prices any b (interpolated between measured points)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random

import pytest
import torch
from commands import run, script_module, user_env

from blockpilot.blocks import AUTOREGRESSIVE, PENDING_CONTEXT, flush_passes, label_candidates, switches
from blockpilot.cost import (
    CycleCost,
    load_cost,
    nondecreasing_in_block_size,
    one_cost_per_bucket,
    round_relative_medians,
)
from blockpilot.data.labels import rows_to_table, write_label_file
from blockpilot.decoding.calibration import (
    BUILD_WEIGHT,
    HELPER_START,
    SWITCH_DRAFTS,
    SWITCH_RUN,
    BatchRig,
    SecondBuilder,
    calibrate,
    random_prompts,
    second_builder_fits,
    seconds_per_cycle,
    split_builds,
    switch_price,
)
from blockpilot.decoding.engine import Engine
from blockpilot.policies.fixed import FixedBlockSize


def test_calibration_measures_every_point_and_round_trips(random_models, tmp_path):
    said: list[str] = []
    cost = calibrate(random_models, (1, 2, 4), (1, 2), cycles=2, repeats=3, warmup=0, compile="off", log=said.append)
    # what it is doing, batch by batch (an eager cycle builds nothing: no shape is said to be built)
    assert [line.split(":")[0] for line in said] == ["[calibrate] batch 1"] * 2 + ["[calibrate] batch 2"] * 2
    assert said[0] == "[calibrate] batch 1: 3 cycles (b = 1, 2, 4), 3 rounds, off" and said[1].endswith(" s")
    assert not any("built" in line for line in said)
    assert set(cost.seconds) == {1, 2} and all(set(by_b) == {1, 2, 4} for by_b in cost.seconds.values())
    assert all(value > 0 for by_b in cost.seconds.values() for value in by_b.values())
    assert cost.device and cost.dtype == "float32" and "torch" in cost.versions
    assert load_cost(cost.save(tmp_path / "cost.json")) == cost
    assert cost(3) == pytest.approx((cost(2) + cost(4)) / 2)  # priced between measured block sizes
    for batch, by_b in cost.seconds.items():  # the fit of the raw medians, which the file keeps beside it
        assert by_b == nondecreasing_in_block_size(cost.measured[batch])
        assert list(by_b.values()) == sorted(by_b.values())
    assert cost.at_batch(2).measured == {2: cost.measured[2]}


def test_a_lone_cycle_computing_a_step_models_choice_is_measured_beside_the_plain_one(random_models, tmp_path):
    cost = calibrate(random_models, (1, 2, 3, 9), cycles=2, repeats=2, warmup=0, compile="off", step_decision=True)
    assert set(cost.decided) == {1, 2, 3, 9} & set(label_candidates(random_models.train_block_size))  # its choices
    assert set(cost.decided) != set(cost.seconds[1])
    assert all(cost.decided[b] >= cost.seconds[1][b] for b in cost.decided)  # a choice never makes a cycle cheaper
    assert list(cost.decided.values()) == sorted(cost.decided.values())
    assert load_cost(cost.save(tmp_path / "cost.json")) == cost
    assert "a per-step model's choice in the cycle: b=1" in cost.describe()
    # and what keeping a lone row's option to draft costs beyond its cycles
    assert cost.context_token >= 0 and cost.context_pass >= 0 and cost.prompt_context(16) > 0 and cost.flush > 0
    assert cost.start_token >= 0 and cost.start_pass >= 0 and cost.request([1], 16) > 0
    assert cost.request([4], 16) > cost.request([1], 16) and "a request's start" in cost.describe()
    assert cost.switch >= 0 and "a switch to drafting and back" in cost.describe()


def test_a_switch_is_priced_by_the_cycles_around_it(random_models, monkeypatch):
    """On a clock where a warm drafting cycle takes 1 s and one after autoregressive cycles 1.5 s, a warm
    autoregressive cycle 0.2 s and the first after a draft 0.25 s, a switch costs what both cold cycles add, less the
    flush the draft runs first (priced apart): 0.5 - 0.1 + 0.05 s. The row runs the schedule's periods."""
    from blockpilot.decoding import calibration

    engine = Engine(random_models, max_batch=1, width=4, compile="off")
    clock, schedules, step, submit = [0.0], [], engine.step, engine.submit

    def timed_step():
        ran = schedules[-1].ran
        before = len(ran)
        updates = step()
        if len(ran) > before >= 1:
            (_, previous), (_, b) = ran[-2:]
            if b != AUTOREGRESSIVE:
                clock[0] += 1.5 if previous == AUTOREGRESSIVE else 1.0
            else:
                clock[0] += 0.2 if previous == AUTOREGRESSIVE else 0.25
        return updates

    monkeypatch.setattr(engine, "submit", lambda request: schedules.append(request.policy) or submit(request))
    monkeypatch.setattr(engine, "step", timed_step)

    def now():  # every reading later than the last (the engine times its own passes too)
        clock[0] += 1e-9
        return clock[0]

    monkeypatch.setattr(calibration.time, "perf_counter", now)
    price = switch_price(random_models, engine, 16, 3, torch.Generator().manual_seed(0), flush=0.1)
    assert price == pytest.approx(0.5 - 0.1 + 0.05, abs=1e-6)
    period = [4] * SWITCH_DRAFTS + [AUTOREGRESSIVE] * SWITCH_RUN
    assert [b for _, b in schedules[0].ran][: 2 * len(period)] == 2 * period
    assert not engine.busy


def test_an_autoregressive_row_computing_the_choice_keeps_its_option_to_draft_in_every_round(random_models):
    """The lone autoregressive row that `calibrate` times computing a step model's choice keeps the drafter's context
    and the choice in every round: the engine's verdict that its drafts save nothing (they never draft) sent it
    autoregressive for good after a few rounds, which then timed the plain cycle under the choice's name. Where b = 1
    is the only candidate timed (here b = 4 is none), its engine has a drafter all the same."""
    assert 4 not in label_candidates(random_models.train_block_size)
    rig = BatchRig(random_models, 1, (1, 4), (), True, 16, 30, "off", torch.Generator().manual_seed(0))
    assert rig.chosen == [1] and rig.deciding.decoder.drafter is not None
    steps, ran = rig.deciding.decoder.steps, []
    run = steps.run
    steps.run = lambda name, *shape: ran.append(name) or run(name, *shape)
    for _ in range(6):  # 33 cycles each: past the cycles the engine's verdict on the drafts' savings waits for
        rig.measurements[("decided", 1)]()
    assert "_deferred_cycle" in ran and "_plain_cycle" not in ran


def test_a_second_process_builds_whole_steps_about_half_of_them(random_models):
    rig = BatchRig(random_models, 1, (1, 2, 3, 4, 5, 6), (3, 7, 15), True, 16, 2, "off", torch.Generator())
    second = split_builds(rig)
    ours = {rig.step_of(key) for key in rig.measurements if key not in second}
    theirs = {rig.step_of(key) for key in second}
    assert ours and theirs and not ours & theirs  # no step compiled twice: b = 3 and 4 share a width, for one
    assert len(ours | theirs) < len(rig.measurements)
    load = lambda steps: sum(BUILD_WEIGHT[kind] for kind, _ in steps)  # noqa: E731
    assert abs(load(ours) - load(theirs) - HELPER_START) <= max(BUILD_WEIGHT.values())
    assert second == [key for key in rig.measurements if key in second]  # in the rounds' order


def test_a_second_process_runs_only_for_compiled_cpu_steps_of_models_it_can_load_again(random_models, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert second_builder_fits(random_models, "compile") and second_builder_fits(random_models, "auto")
    assert not second_builder_fits(random_models, "off")
    assert not second_builder_fits(dataclasses.replace(random_models, target_id="org/a-hub-id"), "compile")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert not second_builder_fits(random_models, "compile")  # one core: nothing to run it on


def test_a_second_process_that_fails_says_why_and_leaves_its_steps_to_this_one(random_models, tmp_path):
    rig = BatchRig(random_models, 1, (1, 4), (), False, 16, 2, "off", torch.Generator())
    said: list[str] = []
    not_models = dataclasses.replace(random_models, target_id=str(tmp_path))  # a folder without a model
    with SecondBuilder.started(rig, not_models, said.append) as second:
        assert second is None  # eager steps: nothing to build
    builder = SecondBuilder.start(rig, not_models, said.append)
    assert builder is not None and builder.keys == split_builds(rig)
    builder.join()
    assert said[0] == "[calibrate] batch 1: a second process builds 1 of 2"
    assert said[1].startswith("[calibrate] the second process failed (") and str(tmp_path) in said[1]
    assert all(measure() > 0 for measure in rig.measurements.values())  # this process runs every one


def test_what_a_lone_request_pays_beyond_its_cycles():
    """A request pays its start (every shape alike); one that may draft also pays its prompt's drafter context (a
    pass and so much a token), whether it drafts at once or keeps the option from autoregressive cycles; one that
    keeps the option also pays a flush before each draft that follows autoregressive cycles and before an
    autoregressive cycle that would keep more than the decoder holds. A request autoregressive for good pays its start
    alone; one of unknown length (0 tokens) nothing."""
    assert flush_passes([4, 4]) == 0 and flush_passes([1, 1, 4]) == 1 and flush_passes([1, 4, 1, 4]) == 2
    assert flush_passes([1] * PENDING_CONTEXT) == 0 and flush_passes([1] * (PENDING_CONTEXT + 1)) == 1
    assert flush_passes([4, 1, 1]) == 0  # kept to the end: never written
    assert switches([4, 4, 1, 1]) == 0 and switches([1, 4, 1, 4, 4]) == 2 and switches([1] * 40 + [4]) == 1
    prices = dict(context_token=0.01, flush=0.5, context_pass=0.2, start_pass=3.0, start_token=0.02, switch=0.25)
    cost = CycleCost({1: {1: 1.0, 4: 2.0}, 8: {1: 3.0, 4: 6.0}}, **prices)
    start, context = 3.0 + 0.02 * 100, 0.2 + 0.01 * 100
    assert cost.prompt_context(100) == pytest.approx(context) and cost.prompt_context(0) == 0.0
    assert cost.request([1, 1], 100) == pytest.approx(start) and cost.request([], 100) == pytest.approx(start)
    assert cost.request([4, 4], 100) == cost.request([1, 4], 100) == pytest.approx(start + context)
    assert cost.request([1, 1, 4], 100, keeps_option=True) == pytest.approx(start + context + 0.5 + 0.25)
    assert cost.request([4, 1, 4], 100, keeps_option=True) == pytest.approx(start + context + 0.5 + 0.25)
    assert cost.after_autoregression == 0.75
    assert cost.request([1, 1], 100, keeps_option=True) == pytest.approx(start + context)  # written, never read
    assert cost.request([4, 1, 4], 0, keeps_option=True) == 0.0
    assert cost.at_batch(1).request([1, 4], 100, True) == cost.request([1, 4], 100, True) > 0
    assert cost.at_batch(8).request([1, 4], 100, True) == 0.0  # several rows share them: not a lone row's prices
    assert cost.deciding().flush == 0.5
    assert cost.scaled(2.0).request([1, 4], 100, True) == pytest.approx(2 * cost.request([1, 4], 100, True))
    saved = CycleCost.from_dict(cost.to_dict())
    assert saved == cost and saved.unpriced == ()
    assert CycleCost({1: {1: 1.0}}).request([1, 4], 100, True) == 0.0  # not measured: free
    # A file saved before the switch was priced reads it as 0, and says so (a switch measured at 0 reads 0 too).
    older = CycleCost.from_dict({key: value for key, value in cost.to_dict().items() if key != "switch"})
    assert older.switch == 0.0 and older.unpriced == ("switch",)
    assert "unpriced" not in cost.to_dict()
    assert "a request's start 3000.000 ms" in cost.describe()
    with pytest.raises(ValueError, match="flush must be a number of seconds >= 0"):
        CycleCost({1: {1: 1.0}}, flush=-1.0)
    with pytest.raises(ValueError, match="start_pass must be a number of seconds >= 0"):
        CycleCost({1: {1: 1.0}}, start_pass=math.nan)


def test_the_curve_a_step_models_walk_pays():
    cost = CycleCost({1: {1: 1.0, 4: 2.0}, 8: {1: 3.0, 4: 6.0}}, decided={1: 1.5, 4: 1.9})
    lone = cost.deciding()
    assert lone.seconds == {1: {1: 1.5, 4: 2.0}, 8: cost.seconds[8]}  # raised to the choice's, never below c(b)
    assert lone.decided == {} and lone.deciding() == lone
    assert cost(1) == 1.0 and lone(1) == 1.5 and lone(1, batch=8) == 3.0
    assert cost.at_batch(1).decided == cost.decided and cost.at_batch(8).decided == {}  # several rows: no choice
    assert cost.at_batch(8).deciding() == cost.at_batch(8)
    assert cost.scaled(2.0).decided == {1: 3.0, 4: 3.8}
    assert CycleCost({1: {1: 1.0}}).deciding() == CycleCost({1: {1: 1.0}})  # not measured: the curve itself
    with pytest.raises(ValueError, match="b=4 at batch 1"):
        CycleCost({1: {1: 1.0}}, decided={4: -1.0})


def test_a_calibration_refuses_to_time_rows_that_failed(random_models):
    class Failing(FixedBlockSize):
        def initial_block_size(self, prefill):
            raise RuntimeError("no b")

    prompts = random_prompts(random_models, 1, 16, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="a row failed while its cycles were timed: RuntimeError\\('no b'\\)"):
        seconds_per_cycle(random_models, prompts, [2], 2, policy=Failing)


def test_a_wider_block_is_never_priced_below_a_narrower_one():
    assert nondecreasing_in_block_size({2: 1.0, 4: 2.0, 8: 3.0}) == {2: 1.0, 4: 2.0, 8: 3.0}
    # b = 7 timed cheaper than b = 6 (a noisy machine): both get their mean, the rest stays
    assert nondecreasing_in_block_size({6: 29.8, 5: 27.3, 7: 28.6, 8: 32.1}) == pytest.approx(
        {5: 27.3, 6: 29.2, 7: 29.2, 8: 32.1}
    )
    # a dip that spans several points pools them all, and the fit keeps the curve's total
    raw = {1: 10.0, 2: 12.0, 3: 9.0, 4: 8.0, 5: 13.0}
    fitted = nondecreasing_in_block_size(raw)
    assert fitted == pytest.approx({1: 9.75, 2: 9.75, 3: 9.75, 4: 9.75, 5: 13.0})
    assert sum(fitted.values()) == pytest.approx(sum(raw.values()))


def test_block_sizes_that_run_at_one_compiled_width_cost_the_same():
    # the static engine runs b = 3, 4 at width 4 and b = 5..8 at width 8: the times within a width are noise
    timed = {1: 0.54, 2: 0.97, 3: 1.32, 4: 1.23, 5: 1.41, 6: 1.36, 7: 1.46, 8: 1.50}
    priced = one_cost_per_bucket(timed, [1, 2, 4, 8])
    assert priced == pytest.approx({1: 0.54, 2: 0.97, 3: 1.275, 4: 1.275, 5: 1.435, 6: 1.435, 7: 1.435, 8: 1.435})
    with pytest.raises(ValueError, match="do not all fit"):
        one_cost_per_bucket({9: 1.0}, [1, 2, 4, 8])


def test_rounds_of_a_drifting_machine_change_the_curves_level_not_its_shape():
    shape = {2: 1.0, 4: 1.5, 8: 3.0}
    rounds = [{b: factor * value for b, value in shape.items()} for factor in (1.0, 1.7, 0.8, 2.5)]
    fitted = round_relative_medians(rounds)
    assert all(fitted[b] / fitted[2] == pytest.approx(shape[b]) for b in shape)
    assert fitted[2] == pytest.approx(1.35 * round_relative_medians([shape])[2])  # the median level
    # a flat curve; the middle round slowed after timing b = 2: per-b medians (1, 2) would make b = 4 cost double
    rounds = [{2: 1.0, 4: 1.0}, {2: 1.0, 4: 2.0}, {2: 2.0, 4: 2.0}]
    fitted = round_relative_medians(rounds)
    assert fitted[4] == pytest.approx(fitted[2])
    with pytest.raises(ValueError, match="same block sizes"):
        round_relative_medians([{2: 1.0}, {4: 1.0}])


def test_a_curve_interpolates_and_refuses_bad_values(tmp_path):
    cost = CycleCost({1: {2: 1.0, 4: 2.0}, 8: {2: 3.0}})
    assert cost(3) == pytest.approx(1.5) and cost(6) == pytest.approx(3.0)  # linear between and beyond
    assert cost(3, batch=6) == pytest.approx(3.0)  # the nearest measured batch
    assert CycleCost.uniform()(17) == 1.0 and load_cost(None).is_uniform
    with pytest.raises(ValueError, match="positive number"):
        CycleCost({1: {2: 0.0}})
    (tmp_path / "bad.json").write_text('{"seconds": {"1": {"2": "x"}}}')
    with pytest.raises(ValueError, match="not a blockpilot cost curve"):
        load_cost(tmp_path / "bad.json")


def test_a_curve_at_one_load_prices_every_b_as_the_full_curve_does_at_that_batch(tmp_path):
    cost = CycleCost({1: {2: 1.0, 4: 1.2}, 8: {2: 2.0, 4: 3.0}, 32: {2: 5.0, 4: 9.0}}, device="cpu")
    for batch in (1, 6, 8, 20, 64):
        loaded = cost.at_batch(batch)
        assert len(loaded.seconds) == 1 and loaded.device == "cpu"
        assert all(loaded(b) == pytest.approx(cost(b, batch=batch)) for b in (1, 2, 3, 4, 7))
    assert "batch 32" in cost.at_batch(30).describe() and "batch 1:" in cost.describe()
    path = cost.save(tmp_path / "cost.json")
    assert load_cost(path, batch=8) == cost.at_batch(8) and load_cost(path) == cost
    assert load_cost(None, batch=8).is_uniform
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        cost.at_batch(0)


def test_a_cycle_can_be_timed_with_every_row_at_its_own_block_size(random_models):
    prompts = random_prompts(random_models, 3, 8, torch.Generator().manual_seed(0))
    assert all(len(p) == 8 for p in prompts)
    assert seconds_per_cycle(random_models, prompts, [2, 5, 9], cycles=2) > 0
    with pytest.raises(ValueError, match="one block size per prompt"):
        seconds_per_cycle(random_models, prompts, [2, 5], cycles=2)


def test_a_curve_put_on_another_level_moves_only_its_level():
    cost = CycleCost({1: {1: 1.0, 3: 2.0}})
    level = cost.scaled(2.0)
    assert level(3) == pytest.approx(2 * cost(3)) and level(1) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive factor"):
        cost.scaled(0.0)


def test_tree_cycles_have_their_own_prices_that_travel_with_the_curve(tmp_path):
    cost = CycleCost(
        {1: {1: 1.0, 4: 2.0}, 8: {1: 3.0, 4: 5.0}}, trees={1: {8: 4.0, 16: 6.0}, 8: {8: 9.0}}, tree_depth=4
    )
    assert cost.tree(8) == 4.0 and cost.tree(12) == pytest.approx(5.0) and cost.tree(8, batch=6) == 9.0
    assert load_cost(cost.save(tmp_path / "trees.json")) == cost
    assert cost.at_batch(8).tree(16) == 9.0 and cost.scaled(2.0).tree(16) == 12.0
    assert "trees 4 deep: 8 nodes: 4000.00 ms" in cost.describe()
    assert CycleCost.uniform().tree(64) == 1.0
    with pytest.raises(ValueError, match="prices no tree cycles"):
        CycleCost({1: {1: 1.0}}).tree(8)
    with pytest.raises(ValueError, match="the trees' depth"):
        CycleCost({1: {1: 1.0}}, trees={1: {8: 1.0}})


def test_the_packed_pass_is_the_best_assignment_of_block_sizes_within_its_buckets():
    """`eval_packed_load.packed_choice` against every assignment of b to the rows, on random tau tables."""
    packed_choice = script_module("benchmarks/eval_packed_load.py").packed_choice
    rng = random.Random(0)
    curve = {1: 2.0, 2: 3.0, 4: 5.5}
    for _ in range(30):
        taus = [{1: 1.0, 2: 1 + rng.random(), 4: 1 + 3 * rng.random()} for _ in range(3)]
        rates = []
        for sizes in itertools.product((1, 2, 4), repeat=3):
            bucket = next(w for w in sorted(curve) if 3 * w >= sum(sizes))
            rates.append(sum(t[b] for t, b in zip(taus, sizes, strict=True)) / curve[bucket])
        best = max(rates)
        tokens, seconds, _ = packed_choice(taus, curve)
        assert tokens / seconds == pytest.approx(best)


def test_the_packed_load_model_runs_as_a_user_runs_it(tmp_path):
    """`benchmarks/eval_packed_load.py` on labels and a cost curve: the packed oracle is never below the choices it
    contains (autoregression, a fixed b, the padded oracle), equals the padded one at one row, and a concurrency
    without a measured batch is refused."""
    rows = [
        {"prompt_id": f"p{i}", "temperature": t, "candidates": [2, 4], "tau": taus, "error": None}
        for i, taus in enumerate([[1.9, 3.6], [1.1, 1.2], [1.5, 2.0]])
        for t in (0.0, 1.0)
    ]
    labels = tmp_path / "labels"
    labels.mkdir()
    write_label_file(rows_to_table(rows), labels / "labels.parquet")
    CycleCost({1: {1: 1.0, 2: 1.4, 4: 2.0}, 4: {1: 2.0, 2: 4.0, 4: 8.0}}).save(tmp_path / "cost.json")
    command = f"python benchmarks/eval_packed_load.py --labels {labels} --cost {tmp_path / 'cost.json'} --batches 50"
    printed = run(f"{command} --concurrency 1,4", user_env(tmp_path / "home"))
    lines = [line.split() for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert [line[0] for line in lines] == ["1", "4", "1", "4"]
    assert all(float(line[-2]) >= 1.0 for line in lines)
    assert all(line[-2] == "1.000" for line in lines if line[0] == "1")
    with pytest.raises(AssertionError, match="concurrency 3 is not a batch size"):
        run(f"{command} --concurrency 3", user_env(tmp_path / "home"))
