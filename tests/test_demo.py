"""The main job: its own pieces (the live speed measurement, the example it traces, its policy table, its clock), and
`blockpilot demo` itself, as a user runs it."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
from commands import free_port, run, script_module, user_env

from blockpilot.blocks import cycle_shapes
from blockpilot.data.labels import read_labels
from blockpilot.data.sources import PromptRecord, zoo_prompts
from blockpilot.decoding import GenerationConfig
from blockpilot.decoding.engine import Engine
from blockpilot.decoding.speed import PLAIN_LOOP, PolicySpeed, measure_speed, measure_speeds, pooled_tau
from blockpilot.policies.resolve import resolve_policy
from blockpilot.zoo.build import RECIPES, zoo_cache_dir
from pipelines.demo import (
    ADAPTIVE_POLICIES,
    DEFAULT_SIZE,
    FIXED_SHAPES,
    PAPER_PREDICTOR,
    PROJECT_PREDICTOR,
    SIZE_ENV,
    DemoPaths,
    LiveDecoders,
    StageClock,
    fastest,
    fixed_specs,
    live_metrics,
    pick_example,
    policy_table,
    reference_answers,
    serving_policy,
    shapes_chosen,
)


def test_measure_speed_counts_every_generated_token(random_models):
    prompts = [random_models.encode_prompt(text) for text in ("count to ten", "sort 3 1 2", "hello")]
    config = GenerationConfig(max_new_tokens=7)  # no stop tokens: every prompt decodes exactly 7 tokens
    policy = resolve_policy("fixed:3", random_models)
    speed = measure_speed(random_models, prompts, policy, config, max_batch=2)
    assert speed.policy == policy.name
    assert speed.tokens == 3 * 7
    assert speed.seconds > 0 and speed.tokens_per_s == pytest.approx(21 / speed.seconds)
    assert 1.0 <= speed.tau <= 4.0  # a cycle at b = 3 commits 1 to b + 1 tokens
    with pytest.raises(ValueError, match="at least one prompt"):
        measure_speed(random_models, [], policy, config)


def test_the_live_tables_engines_are_shaped_as_calibrates_lone_ones(random_models, monkeypatch):
    """The live table's chains and trees decode on engines shaped as `calibrate`'s of one row (rows, capacity,
    width, tree budget), so that the cycles calibrate compiled are the ones they run, not compiled again."""
    import blockpilot.decoding.calibration as calibration

    built: list[Engine] = []

    class Recorded(Engine):
        def __init__(self, models, **kwargs) -> None:
            super().__init__(models, **kwargs)
            built.append(self)

    monkeypatch.setattr(calibration, "Engine", Recorded)
    calibration.calibrate(random_models, (1, 4), cycles=1, repeats=1, warmup=0, compile="off", tree_nodes=(3, 7))
    shape = lambda engine: (engine.max_batch, engine.capacity, engine.width, engine.tree_nodes)  # noqa: E731
    calibrated = {shape(engine) for engine in built}
    decoders = LiveDecoders(random_models, compile="off", depth=4, tree_nodes=7)
    for spec in ("fixed:4", "autoregressive", "tree:3:4"):
        assert shape(decoders(spec)[1]) in calibrated, spec


def test_tau_counts_committed_tokens_over_cycles_not_a_mean_over_prompts():
    """tau as a walk counts it: a short answer in one block of 7 tokens and a long one in 6 autoregressive cycles
    are 13 tokens in 7 cycles (1.86), not the mean of 7 and 1 (4, what a prompt's mean made of a rule that drafted
    one cycle in ten)."""
    assert pooled_tau([(7, 1), (6, 6)]) == pytest.approx(13 / 7)
    assert pooled_tau([(7, 1), (0, 0)]) == 7.0  # a generation of no cycle (the prefill's token was the last)
    assert math.isnan(pooled_tau([])) and math.isnan(pooled_tau([(0, 0)]))


def test_measure_speeds_interleaves_every_decoder_and_counts_each_prompts_median_round(random_models):
    """Each decoder (policies on one engine, and the plain loop) decodes every prompt, and its figure counts each
    prompt once: at T = 0 the same tokens as a pass of `measure_speed`, the loop's as the target's greedy loop."""
    from support import greedy_reference

    prompts = [random_models.encode_prompt(text) for text in ("count to ten", "sort 3 1 2")]
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=tuple(random_models.stop_token_ids()))
    engine = Engine(random_models, width=4, compile="off")
    runs = {"fixed": (resolve_policy("fixed:3", random_models), engine)}
    runs["autoregressive"] = (resolve_policy("autoregressive", random_models), engine)
    speeds = measure_speeds(random_models, prompts, runs, config, rounds=3, plain_loop_key="loop")
    assert list(speeds) == ["fixed", "autoregressive", "loop"]
    greedy = sum(len(greedy_reference(random_models.target, p, 6, config.stop_token_ids)) for p in prompts)
    for key, (policy, _) in runs.items():
        alone = measure_speed(random_models, prompts, policy, config, engine=engine)
        assert speeds[key].tokens == alone.tokens == greedy and speeds[key].policy == alone.policy
        assert speeds[key].tau == alone.tau  # the same cycles, counted the same way
        assert speeds[key].seconds > 0
    assert speeds["loop"].tokens == greedy and speeds["loop"].policy == PLAIN_LOOP
    assert speeds["autoregressive"].tau == 1.0
    # the shapes each decoder ran, counted over the same generations: every cycle, and each prompt once a shape
    cycles = greedy - len(prompts)  # a token a cycle after the prefill's
    assert speeds["autoregressive"].shapes == (("b=1", cycles, 2),) and speeds["autoregressive"].generations == 2
    assert speeds["autoregressive"].shape_shares() == "b=1 100.0% of cycles, 2 of 2 prompts"
    assert speeds["fixed"].shapes[0][0] == "b=3" and speeds["fixed"].shapes[0][2] == 2
    assert speeds["loop"].shapes == () and speeds["loop"].generations == 0
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        measure_speeds(random_models, prompts, runs, config, rounds=0)
    with pytest.raises(ValueError, match="names a run too"):
        measure_speeds(random_models, prompts, runs, config, rounds=1, plain_loop_key="fixed")


def test_the_example_is_a_checkable_prompt_answered_right_else_the_closest_and_says_which(random_models):
    from blockpilot.decoding import generate

    records = [
        PromptRecord("zoo-heldout:a", "count", ("Count from 1 to 5.",)),
        PromptRecord("zoo-heldout:b", "sort", ("Sort these numbers: 3 1 2",)),
        PromptRecord("zoo-heldout:c", "code", ("def f():",)),  # not a checkable family: never picked
    ]
    config = GenerationConfig(max_new_tokens=8, stop_token_ids=tuple(random_models.stop_token_ids()))
    answer = generate(random_models, random_models.encode_prompt(records[1].turns[0]), config=config)
    exact = random_models.tokenizer.decode(answer.token_ids, skip_special_tokens=True).strip()
    references = {"Count from 1 to 5.": "\x00 nothing alike \x00", "Sort these numbers: 3 1 2": exact, "def f():": exact}
    example = pick_example(random_models, records, references, max_new_tokens=8)
    assert example.record is records[1] and example.similarity == pytest.approx(1.0) and example.right
    assert example.reference == exact
    # No prompt answered exactly right: the closest, marked as not right.
    near = {**references, "Sort these numbers: 3 1 2": exact + " and more"}
    closest = pick_example(random_models, records, near, max_new_tokens=8)
    assert closest.record is records[1] and 0 < closest.similarity < 1 and not closest.right
    # Without references (a zoo copied without its corpus) the first held-out prompt is shown, unjudged.
    fallback = pick_example(random_models, records, {})
    assert fallback.record is records[0] and fallback.reference is None and fallback.similarity is None


def test_the_references_are_the_zoo_corpus_answers_to_its_heldout_prompts(tiny_zoo):
    references = reference_answers(tiny_zoo)
    heldout = zoo_prompts(tiny_zoo, "heldout")
    assert heldout and all(record.turns[0] in references for record in heldout)
    assert all(isinstance(answer, str) and answer for answer in references.values())
    assert reference_answers(tiny_zoo / "no-such-zoo") == {}


def test_policy_table_has_a_row_per_policy_and_dashes_where_nothing_ran():
    metrics = {"T0/tau_B": 2.5, "T0/throughput_B": 100.0, "T0/tau_step_oracle": 3.0, "T0/throughput_step_oracle": 130.0}
    live = {"B": PolicySpeed("fixed", tokens=50, seconds=0.5, tau=2.4)}
    loop = PolicySpeed("transformers loop", tokens=50, seconds=1.0, tau=1.0)
    text = policy_table(metrics, live, {"B": "fixed B = 6", "step_oracle": "per-step oracle", "request": "learned"}, 4, loop)
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines()[2:]}
    assert set(rows) == {"fixed B = 6", "per-step oracle", "learned", "transformers loop"}
    assert rows["fixed B = 6"].split()[-5:] == ["2.50", "100.0", "2.40", "100.0", "2.00"]
    assert rows["per-step oracle"].split()[-5:] == ["3.00", "130.0", "-", "-", "-"]
    assert rows["learned"].split()[-5:] == ["-", "-", "-", "-", "-"]  # not evaluated on the tables
    assert rows["transformers loop"].split()[-5:] == ["-", "-", "1.00", "50.0", "1.00"]


def test_the_policy_table_at_t1_reads_that_temperatures_walks_and_has_no_loop():
    metrics = {"T0/tau_B": 2.5, "T1/tau_B": 1.5, "T1/throughput_B": 60.0}
    live = {"B": PolicySpeed("fixed", tokens=30, seconds=0.5, tau=1.4)}
    text = policy_table(metrics, live, {"B": "fixed B = 6"}, 4, temperature=1.0)
    assert text.startswith("policies on the held-out prompts at T = 1:")
    [row] = text.splitlines()[2:]
    assert row.split()[-5:] == ["1.50", "60.0", "1.40", "60.0", "-"]


def test_the_fixed_shapes_are_the_best_of_each_temperature():
    metrics = {"T0/best_fixed_b": 8.0, "T1/best_fixed_b": 1.0, "T0/best_tree_nodes": 15.0}
    cold, warm = fixed_specs(metrics, 0.0, 6, 8), fixed_specs(metrics, 1.0, 6, 8)
    assert cold["best_fixed"] == ("fixed:8", "best fixed b = 8") and warm["best_fixed"][0] == "fixed:1"
    assert cold["best_tree"][0] == "tree:15:8" and "shape_oracle" in cold
    assert "best_tree" not in warm and "shape_oracle" not in warm  # no tree walked at T = 1: no tree row
    assert cold["B"] == warm["B"] == ("fixed:6", "fixed B = 6") and cold["oracle"][0] is None
    with pytest.raises(KeyError):
        fixed_specs(metrics, 0.5, 6, 8)  # a temperature the walks do not hold


def speeds(**tokens_per_s: float) -> dict[str, PolicySpeed]:
    return {key: PolicySpeed(key, tokens=rate, seconds=1.0, tau=2.0) for key, rate in tokens_per_s.items()}


def test_the_endpoint_serves_the_adaptive_policy_that_was_fastest_live():
    live = speeds(request=90, step=80, B=95)
    assert fastest(live, ADAPTIVE_POLICIES) == "request" and fastest(live, FIXED_SHAPES) == "B"
    live["step"] = PolicySpeed("learned+step", tokens=99, seconds=1.0, tau=2.1)
    assert fastest(live, ADAPTIVE_POLICIES) == "step"
    with pytest.raises(ValueError, match="measured"):
        fastest(live, ("best_tree",))


def test_the_endpoint_serves_the_adaptive_policy_whose_worst_temperature_is_best():
    # `step` is the fastest at T = 0 but loses at T = 1; `request` is a little behind at T = 0 and ahead at T = 1.
    tables = {0.0: speeds(request=98, step=105, B=100), 1.0: speeds(request=101, step=90, autoregressive=100, B=80)}
    chosen, margins = serving_policy(tables)
    assert chosen == "request"
    assert margins == {0.0: (0.98, "B"), 1.0: (1.01, "autoregressive")}
    assert serving_policy({0.0: tables[0.0]})[0] == "step"  # at T = 0 alone, the other
    # a policy measured at one temperature only is not served
    assert serving_policy({0.0: speeds(request=90, step=105, B=100), 1.0: speeds(request=90, B=100)})[0] == "request"
    with pytest.raises(ValueError, match="every temperature"):
        serving_policy({0.0: speeds(step=105, B=100), 1.0: speeds(B=100)})


def test_each_cycle_is_named_by_its_shape_and_the_demo_says_what_the_adaptive_policies_chose():
    assert cycle_shapes([1, 4, 4]) == ["b=1", "b=4", "b=4"]
    # on a tree engine, where every cycle counts its nodes (a chain of b, b - 1)
    assert cycle_shapes([1, 8, 8, 4], [0, 15, 7, 3]) == ["b=1", "tree:15", "b=8", "b=4"]
    step = PolicySpeed("learned+step", 30, 1.0, 1.5, shapes=(("b=1", 3, 2), ("tree:15", 1, 1)), generations=2)
    live = {"step": step, "B": PolicySpeed("fixed", 30, 1.0, 2.0, shapes=(("b=6", 5, 2),), generations=2)}
    text = shapes_chosen(live, {"step": "learned+step (per step)", "B": "fixed B = 6"}, 1.0)
    assert text.splitlines() == [
        "shapes the adaptive policies chose live at T = 1 (the median round of each prompt)",
        f"  {'learned+step (per step)':<31} b=1 75.0% of cycles, 2 of 2 prompts; "
        "tree:15 25.0% of cycles, 1 of 2 prompts",
    ]  # the fixed shapes chose nothing
    assert live_metrics({0.0: live}, "step") == {
        "live/T0/tokens_per_s": 30.0,
        "live/T0/tau": 1.5,
        "live/T0/cycles_share/b1": 0.75,
        "live/T0/cycles_share/tree15": 0.25,
    }


def test_live_metrics_name_each_temperature():
    tables = {0.0: speeds(request=90, B=100), 1.0: speeds(request=70)}
    assert live_metrics(tables, "request") == {
        "live/T0/tokens_per_s": 90.0, "live/T0/tau": 2.0, "live/T1/tokens_per_s": 70.0, "live/T1/tau": 2.0
    }
    assert live_metrics(tables, "B") == {"live/T0/tokens_per_s": 100.0, "live/T0/tau": 2.0}


def test_stage_clock_keeps_every_stage_in_order(capsys):
    clock = StageClock()
    clock.start("zoo", "the zoo")
    clock.start("labels", "labels")
    summary = clock.summary()
    assert [name for name, _ in clock.times] == ["zoo", "labels"]
    assert all(seconds >= 0 and not math.isnan(seconds) for _, seconds in clock.times)
    assert summary.startswith("stage times: zoo ") and "labels" in summary
    printed = capsys.readouterr().out
    assert "=== 1/7 the zoo" in printed and "=== 2/7 labels" in printed


def test_demo_paths_follow_the_size_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKPILOT_HOME", str(tmp_path))
    monkeypatch.delenv(SIZE_ENV, raising=False)
    assert DemoPaths.from_environment() == DemoPaths(DEFAULT_SIZE, tmp_path)
    monkeypatch.setenv(SIZE_ENV, "tiny")
    paths = DemoPaths.from_environment()
    assert paths.size == "tiny" and paths.run == tmp_path / "demo" / "tiny"


def test_the_plain_loop_baseline_decodes_the_targets_greedy_output(random_models):
    from support import greedy_reference

    from blockpilot.decoding.speed import measure_plain_loop

    prompts = [[1, 2, 3], [4, 5]]
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=tuple(random_models.stop_token_ids()))
    speed = measure_plain_loop(random_models, prompts, config)
    expected = [greedy_reference(random_models.target, p, 6, config.stop_token_ids) for p in prompts]
    assert speed.policy == PLAIN_LOOP and speed.tokens == sum(map(len, expected)) and speed.tokens_per_s > 0


@pytest.fixture(scope="module")
def demo_run(tiny_zoo, tmp_path_factory) -> tuple[Path, str]:
    """`blockpilot demo` (what `make demo` runs) on the tiny zoo, in a fresh home that already holds that zoo, as a
    second run finds it; the static engine's cycle uncompiled (compiling every shape it prices takes minutes). The
    home and what the demo printed."""
    home = tmp_path_factory.mktemp("demo") / "home"
    cached = zoo_cache_dir(RECIPES["tiny"], 0, home)
    cached.parent.mkdir(parents=True)
    cached.symlink_to(tiny_zoo, target_is_directory=True)

    command = f"blockpilot demo --size tiny --compile off --live-prompts 4 --port {free_port()}"
    # A hang guard only: the demo took 545-797 s in fresh-clone runs of the suite on a 2-core CPU without AVX-512.
    return home, run(command, user_env(home), timeout=1800)


@pytest.mark.slow
def test_blockpilot_demo_runs_every_stage_as_a_user_types_it(demo_run):
    home, printed = demo_run
    cached = zoo_cache_dir(RECIPES["tiny"], 0, home)
    assert f"[zoo] reusing {cached}" in printed and "=== 7/7 the endpoint" in printed and "stage times: zoo" in printed
    # The endpoint serves the adaptive policy that decoded fastest live: any of them, as this machine's timing goes.
    line = printed.split("the endpoint's adaptive policy: ", 1)[1].split("\n", 1)[0]
    served = line.split(", the adaptive policy", 1)[0]
    adaptive = ("learned (per request)", "learned (the paper's predictor)", "learned+step", "confidence rule")
    assert served.startswith(adaptive), f"the endpoint serves {served!r}, not an adaptive policy of the live table"
    # The paper's predictor and the project's, on the same labels: side by side, and nested under one MLflow run
    # with their held-out and live figures under the same names.
    assert PROJECT_PREDICTOR in printed and PAPER_PREDICTOR in printed and "learned (the paper's predictor)" in printed
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    tracked = mlflow.search_runs(experiment_names=["blockpilot-predictor"], output_format="list")
    children = [child for child in tracked if "mlflow.parentRunId" in child.data.tags]
    assert sorted(child.data.tags["configuration"] for child in children) == [PAPER_PREDICTOR, PROJECT_PREDICTOR]
    [parent] = {child.data.tags["mlflow.parentRunId"] for child in children}
    for child in children:
        named = {"eval/tau_pred", "eval/throughput_pred", "eval/accuracy", "live/T0/tokens_per_s", "live/T1/tau"}
        assert named <= set(child.data.metrics)
        shares = [value for name, value in child.data.metrics.items() if name.startswith("live/T0/cycles_share/")]
        assert shares and sum(shares) == pytest.approx(1.0)  # the shapes its cycles ran, live
    artifacts = [item.path for item in mlflow.MlflowClient().list_artifacts(parent)]
    assert "predictors.png" in artifacts
    cold = printed[printed.index("policies on the held-out prompts at T = 0") :]
    warm = cold[cold.index("policies on the held-out prompts at T = 1") :]
    rows = [f"fixed B = {RECIPES['tiny'].block_size}", "best fixed b", "learned (per request)", "learned+step"]
    rows += ["autoregressive", "static oracle", "per-step oracle"]
    for table, expected in ((cold[: len(cold) - len(warm)], [*rows, "transformers loop"]), (warm, rows)):
        for row in expected:
            assert f"\n  {row}" in table, f"the policy table has no {row!r} row:\n{table[:3000]}"
    assert "\n  transformers loop" not in warm.split("the endpoint's adaptive policy", 1)[0]  # greedy: T = 0 only
    chosen = warm.split("shapes the adaptive policies chose live at T = 1", 1)[1].split("\n\n", 1)[0]
    assert "\n  learned+step (per step)" in chosen and "% of cycles" in chosen
    assert "T = 0: " in line and "T = 1: " in line  # the served policy's margin at each temperature
    # The traced example and the endpoint's reply are both the target's greedy decoding of one prompt (T = 0).
    traced = printed.split("\nanswer:    ", 1)[1].split("\n", 1)[0]
    assert "POST /v1/chat/completions -> 200" in printed
    assert f"\nanswer: {traced}\n" in printed, "the endpoint answered otherwise than the traced greedy generation"
    paths = DemoPaths("tiny", home)  # what the notebooks read
    assert paths.cost.is_file() and (paths.predictor / "config.json").is_file()
    assert (paths.step_model / "config.json").is_file()
    assert read_labels(paths.labels / "train").num_rows > 0 and read_labels(paths.labels / "heldout").num_rows > 0


def test_a_chromium_load_that_hangs_is_killed_and_tried_again(monkeypatch, tmp_path):
    """Chromium's virtual time now and then never runs out: such a load is killed after its timeout and the page
    loaded again; one that hangs every time is an error naming the page (a stand-in browser: a script that hangs
    until a marker file exists)."""
    screenshots = script_module("benchmarks/mlflow_screenshots.py")
    marker = tmp_path / "hung-once"
    browser = tmp_path / "chromium"
    browser.write_text(
        f"#!/bin/sh\nif [ -e {marker} ]; then echo '<html>runs</html>'; exit 0; fi\ntouch {marker}\nsleep 600\n"
    )
    browser.chmod(0o755)
    monkeypatch.setattr(screenshots, "chromium", lambda: str(browser))
    monkeypatch.setattr(screenshots, "RENDER_TIMEOUT_S", 0.5)
    screenshots.render("http://127.0.0.1:1/#/page", dom=tmp_path / "page.html")
    assert (tmp_path / "page.html").read_text().strip() == "<html>runs</html>"
    browser.write_text("#!/bin/sh\nsleep 600\n")
    with pytest.raises(TimeoutError, match="did not render http://127.0.0.1:1/#/page in 3 loads"):
        screenshots.render("http://127.0.0.1:1/#/page", dom=tmp_path / "page.html")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_mlflow_compare_view_shows_both_predictors_after_the_demo(demo_run, tmp_path):
    """What docs/operations.md tells a user to open after the demo, in headless Chromium
    (`benchmarks/mlflow_screenshots.py`): the experiment opens on its runs table, and the compare view of the two
    predictors the demo nested under one parent run shows both runs and each one's held-out and live figures."""
    home, _ = demo_run
    env = user_env(home)
    out = tmp_path / "shots"
    script = Path(__file__).parents[1] / "benchmarks" / "mlflow_screenshots.py"
    run(f"python {script} --out {out} --port {free_port()}", env, timeout=1500)
    for name in ("experiment.png", "compare.png", "artifacts.png"):
        assert (out / name).stat().st_size > 20_000, f"{name} looks blank"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKPILOT_HOME", str(home))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        from blockpilot.tracking import latest_comparison

        comparison = latest_comparison("blockpilot-predictor")
    assert comparison is not None and set(comparison.runs) == {PROJECT_PREDICTOR, PAPER_PREDICTOR}
    # Rendered on the runs table (not MLflow's GenAI overview): the parent run's name is on the page.
    assert "predictors-tiny-" in (out / "experiment.html").read_text()
    page = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", (out / "compare.html").read_text()))
    assert "Comparing 2 Runs" in page
    # The metrics table: the names of the rows it renders (MLflow draws the rows in view), then each row's values,
    # one per run, in the order of the runs' columns.
    tokens = page.split("Metrics Show diff only", 1)[1].split(" Artifacts ", 1)[0].split()
    names = [token for token in tokens if "/" in token]
    values = [math.nan if token == "NaN" else float(token.replace("\u2212", "-")) for token in tokens[len(names) :]]
    columns = sorted(comparison.runs.values(), key=lambda compared: page.index(compared.run_id))
    assert {"eval/T0/tau_pred", "eval/T0/accuracy"} <= set(names) and len(values) == len(columns) * len(names)
    for row, metric in enumerate(names):
        for column, compared in enumerate(columns):
            shown, value = values[row * len(columns) + column], compared.metrics.get(metric, math.nan)
            # MLflow rounds what it shows (2.7396 as 2.74).
            assert shown == pytest.approx(value, rel=5e-3, abs=1e-3, nan_ok=True), (metric, compared.run_id)
    for name in comparison.runs:
        assert name in page  # each run's configuration tag
