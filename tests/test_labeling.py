"""The sweep and the labeler on the trained tiny zoo: replay against live, label rows, bad prompts."""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import pyarrow as pa
import pytest

from blockpilot.blocks import best_block_size, candidates_around, label_candidates
from blockpilot.data.labels import LABEL_SCHEMA, deduplicate, read_label_files, read_labels, rows_to_table
from blockpilot.data.sources import PromptRecord, prompt_texts
from blockpilot.decoding.engine import generate_many
from blockpilot.labeling import Labeler, LabelSettings, summarize, task_keys, task_seed
from blockpilot.sweep import SweepConfig, sweep_prompt, sweep_prompts
from blockpilot.table import tables_from_row


@pytest.fixture(scope="module")
def heldout(tiny_zoo, tiny_models):
    return [tiny_models.encode_prompt(text) for text in prompt_texts(f"zoo:{tiny_zoo}:heldout")]


@pytest.mark.parametrize("candidates", [(2, 3, 4, 5, 6), (1, 2, 4, 8, 14, 15, 16, 17, 18)])
def test_table_walks_equal_live_runs_at_temperature_zero(tiny_models, heldout, candidates):
    """fp32 on the CPU: every candidate's walk through the acceptance table is its live run, cycle by cycle."""
    stop = tuple(tiny_models.stop_token_ids())
    config = dict(candidates=candidates, max_new_tokens=48, stop_token_ids=stop)
    seeds = list(range(12))
    live = sweep_prompts(tiny_models, heldout[:12], seeds, SweepConfig(mode="live", **config))
    replay = sweep_prompts(tiny_models, heldout[:12], seeds, SweepConfig(mode="replay", **config))
    for live_sweep, replay_sweep in zip(live, replay, strict=True):
        assert replay_sweep.acceptance_lengths == live_sweep.acceptance_lengths
        assert replay_sweep.tau == live_sweep.tau
        assert replay_sweep.best_block_size == live_sweep.best_block_size
        assert [table.tau() for table in replay_sweep.tables] == [replay_sweep.tau]


@pytest.mark.slow  # a cold compile (about 30 s) unless the on-Ray label test built its step first
def test_labels_from_the_compiled_cycle_are_the_eager_cycles_at_temperature_zero(tiny_zoo, tiny_models):
    """The reference generations run on the engine's compiled cycle (the default) or its eager one (`compile="off"`):
    at T = 0 the rows' sequences, tau vectors, tables and trees are the same; T = 1 rows are labeled from the
    engine's own samples."""
    records = [PromptRecord(f"p{i}", "zoo", (text,)) for i, text in enumerate(prompt_texts(f"zoo:{tiny_zoo}:heldout")[:4])]
    rows = {}
    for compile in ("off", "compile"):
        # the label command's batch (8 rows): its compiled step, which the on-Ray label test builds too
        labeler = Labeler(tiny_models, LabelSettings(max_new_tokens=24, compile=compile))
        rows[compile] = [row for rows_ in labeler.label_many([(r, t) for r in records for t in (0.0, 1.0)]) for row in rows_]
    for eager, compiled in zip(rows["off"], rows["compile"], strict=True):
        assert compiled["error"] is None and eager["error"] is None
        if eager["temperature"] == 0:
            for column in ("table_tokens", "tau", "table_commits", "tree_tau", "table_tree_commits"):
                assert compiled[column] == eager[column], column
        else:
            (table,) = tables_from_row(compiled)
            assert table.tau() == pytest.approx(compiled["tau"], nan_ok=True)
    with pytest.raises(ValueError, match="compile must be one of"):
        LabelSettings(compile="fast")


def test_a_budget_the_context_cannot_hold_is_refused_before_any_row(tiny_models):
    """The labeler's engine holds every prompt a row may have and max_new_tokens: a budget that leaves no room for
    a prompt in the target's context is refused as the labeler is built; a prompt past what its rows hold is a
    too_long row, never a failed batch."""
    context = tiny_models.target.config.max_position_embeddings
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        Labeler(tiny_models, LabelSettings(max_new_tokens=context))
    labeler = Labeler(tiny_models, LabelSettings(max_new_tokens=context - 16, compile="off"), max_batch=2)
    assert labeler.prompt_limit == 16 and labeler.engine.capacity >= context
    long_text = " ".join(["word"] * 64)
    (row,) = labeler.label(PromptRecord("long", "test", (long_text,)), 0.0)
    assert row["error_kind"] == "too_long"


def test_table_walks_equal_live_runs_on_random_models(random_models):
    """The same on random models, whose acceptance lengths are mostly 1: the table's cap and cuts at the end.
    Each mode reports the seconds of its stages, within the call's own wall time."""
    prompts = [random_models.encode_prompt(p) for p in ("hello there", "def f(x):", "one two three")]
    config = dict(candidates=(1, 2, 4, 8, 14, 15, 16, 17, 18), max_new_tokens=30)
    sweeps, stages, walls = {}, {"live": {}, "replay": {}}, {}
    for mode in ("live", "replay"):
        started = time.perf_counter()
        sweeps[mode] = sweep_prompts(
            random_models, prompts, [0, 1, 2], SweepConfig(mode=mode, **config), stage_seconds=stages[mode]
        )
        walls[mode] = time.perf_counter() - started
    assert [s.acceptance_lengths for s in sweeps["replay"]] == [s.acceptance_lengths for s in sweeps["live"]]
    assert set(stages["live"]) == {"live"} and set(stages["replay"]) == {"reference", "tables"}
    for mode, seconds in stages.items():
        assert all(value > 0 for value in seconds.values())
        assert sum(seconds.values()) <= walls[mode]


def test_slots_past_a_wrong_draft_change_nothing_in_the_table(tiny_models, heldout):
    """The table computes a block's slots only up to its first wrong draft (every slot of the largest candidate,
    whose confidences it keeps); asking for every slot's accuracy computes them all. Same tables."""
    stop = tuple(tiny_models.stop_token_ids())
    config = SweepConfig(candidates=(2, 3, 4, 8, 16), max_new_tokens=40, stop_token_ids=stop)
    prompts, seeds = heldout[:4], [0, 1, 2, 3]
    slots = np.zeros((5, 15, 2), dtype=np.int64)
    staged = sweep_prompts(tiny_models, prompts, seeds, config)
    every = sweep_prompts(tiny_models, prompts, seeds, config, slot_hits=slots)
    for a, b in zip(staged, every, strict=True):
        assert [t.commits.tolist() for t in a.tables] == [t.commits.tolist() for t in b.tables]
        for staged_table, every_table in zip(a.tables, b.tables, strict=True):
            assert np.array_equal(staged_table.confidences, every_table.confidences, equal_nan=True)
    assert (slots[..., 0] <= slots[..., 1]).all()
    # Slot j of candidate b is drafted at every anchor whose block (cut at the budget) still has it.
    tables = [t for s in every for t in s.tables]
    for column, b in enumerate(config.candidates):
        drafted = [sum(t.block_size_at(i, b) > j for t in tables for i in range(1, t.n)) for j in range(1, 16)]
        assert slots[column, :, 1].tolist() == drafted
    assert slots[0, 0, 1] > 0


def test_the_reference_generation_drafts_at_the_training_block_size(random_models, monkeypatch):
    """B need not be a candidate: the reference is the target's own sequence, drafted where drafts are best."""
    prompts = [random_models.encode_prompt(p) for p in ("hello there", "def f(x):")]
    config = dict(candidates=(1, 3, 16), max_new_tokens=30)
    assert random_models.train_block_size not in config["candidates"]
    live = sweep_prompts(random_models, prompts, [0, 1], SweepConfig(mode="live", **config))
    reference_sizes = []

    def spy(models, requests, **kwargs):
        reference_sizes.extend(request.policy.block_size for request in requests)
        return generate_many(models, requests, **kwargs)

    monkeypatch.setattr("blockpilot.sweep.generate_many", spy)
    replay = sweep_prompts(random_models, prompts, [0, 1], SweepConfig(mode="replay", **config))
    assert reference_sizes == [random_models.train_block_size] * len(prompts)
    assert [s.acceptance_lengths for s in replay] == [s.acceptance_lengths for s in live]


def test_replay_agrees_with_live_in_distribution_at_temperature_one(tiny_models, heldout):
    """T = 1, `match`: per candidate, the mean tau over 6 prompts x 20 seeds of the two modes agree within
    4 standard errors of their difference (each mode's runs are independent samples of one law)."""
    stop = tuple(tiny_models.stop_token_ids())
    candidates = (3, 4, 5)
    samples = {"live": {b: [] for b in candidates}, "replay": {b: [] for b in candidates}}
    prompts = [ids for ids in heldout[:6] for _ in range(20)]
    for mode, offset in (("live", 0), ("replay", 10_000)):
        config = SweepConfig(candidates, temperature=1.0, max_new_tokens=32, stop_token_ids=stop, mode=mode)
        seeds = [offset + seed for _ in heldout[:6] for seed in range(20)]
        for sweep in sweep_prompts(tiny_models, prompts, seeds, config, max_batch=40):
            for b, tau in zip(candidates, sweep.tau, strict=True):
                if not math.isnan(tau):
                    samples[mode][b].append(tau)
    for b in candidates:
        live, replay = samples["live"][b], samples["replay"][b]
        standard_error = math.sqrt(statistics.variance(live) / len(live) + statistics.variance(replay) / len(replay))
        gap = abs(statistics.fmean(live) - statistics.fmean(replay))
        assert gap < 4 * standard_error, (
            f"b={b}: live {statistics.fmean(live):.3f} vs replay {statistics.fmean(replay):.3f}"
        )


def test_replay_rejects_the_rejection_rule_at_temperature():
    with pytest.raises(ValueError, match="sweep 'rejection' with mode='live'"):
        SweepConfig((2, 3), temperature=1.0, verify="rejection", mode="replay")
    SweepConfig((2, 3), temperature=0.0, verify="rejection", mode="replay")  # T = 0: every rule is greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"candidates": ()}, "empty"),
        ({"candidates": (0, 2)}, ">= 1"),
        ({"candidates": (2, 2)}, "distinct"),
        ({"candidates": (2,), "mode": "fast"}, "mode"),
    ],
)
def test_bad_sweep_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SweepConfig(**kwargs)


def test_best_block_size_ties_go_to_the_smaller_b():
    assert best_block_size([4, 5, 6], [2.0, 2.5, 2.5]) == 5
    assert best_block_size([4, 5, 6], [float("nan"), 1.0, 0.5]) == 5
    assert candidates_around(8) == (6, 7, 8, 9, 10)
    assert candidates_around(2) == (1, 2, 3, 4)
    assert label_candidates(8) == (1, 6, 7, 8, 9, 10) and label_candidates(2) == (1, 2, 3, 4)
    # A label folder records the default's rule, so rows of an earlier default are never mixed with these.
    assert LabelSettings().fingerprint()["candidates"] == "default: 1 and B-2..B+2"
    assert LabelSettings(candidates=(2, 3)).fingerprint()["candidates"] == (2, 3)


def test_the_stop_token_and_the_budget_bound_what_counts(tiny_models, heldout):
    """Every candidate's walk covers exactly the tokens of the output, however b cuts it into cycles."""
    stop = tuple(tiny_models.stop_token_ids())
    for budget in (1, 2, 7, 48):
        sweep = sweep_prompt(tiny_models, heldout[0], SweepConfig((1, 3, 4, 9), max_new_tokens=budget, stop_token_ids=stop))
        for lengths, b in zip(sweep.acceptance_lengths, sweep.candidates, strict=True):
            assert sum(lengths) == len(sweep.token_ids) - 1
            assert all(1 <= t <= b for t in lengths)


# ----------------------------------------------------------------------------- label rows


@pytest.fixture(scope="module")
def labeler(tiny_models):
    return Labeler(tiny_models, LabelSettings(temperatures=(0.0, 1.0), max_new_tokens=32, top_k=8, dense=True, compile="off"))


def test_label_rows_follow_the_schema(labeler, tiny_zoo):
    record = PromptRecord("zoo:1", "count", ("Count from 3 to 14.",))
    rows = labeler.label(record, 0.0)
    assert len(rows) == 1
    row = rows[0]
    table = rows_to_table(rows)
    assert table.schema == LABEL_SCHEMA
    assert row["error"] is None
    # Autoregression (b = 1, tau 1 exactly) and BlockPilot's window B-2..B+2.
    assert row["candidates"] == [1, 2, 3, 4, 5, 6] and row["train_block_size"] == 4 and row["tau"][0] == 1.0
    assert len(row["tau"]) == 6 and all(1.0 <= t <= b for t, b in zip(row["tau"], row["candidates"], strict=True))
    assert row["best_block_size"] == best_block_size(row["candidates"], row["tau"])
    assert len(row["topk_ids"]) == 8 and row["topk_probs"] == sorted(row["topk_probs"], reverse=True)
    assert 0 < sum(row["topk_probs"]) <= 1.0001 and row["entropy"] > 0
    assert len(row["probs_fp16"]) == len(labeler.models.tokenizer)
    assert row["seed"] == task_seed(0, "zoo:1", 0.0)
    assert row["target_id"].endswith("target") and row["sweep_mode"] == "replay"
    # The acceptance table rides in the row and gives back the row's tau vector.
    (table,) = tables_from_row(table.to_pylist()[0])
    assert table.tau() == pytest.approx(row["tau"]) and table.candidates == (1, 2, 3, 4, 5, 6)
    assert len(row["anchor_entropy"]) == table.n - 1 and len(row["anchor_top_probs"][0]) == 4
    # The same task gives the same row: seeded per (prompt, temperature). Compared as text: the confidences of a
    # block cut to the budget are NaN, which equals nothing, itself included.
    assert repr(labeler.label(record, 1.0)) == repr(labeler.label(record, 1.0))


def test_multi_turn_records_continue_the_conversation(labeler):
    record = PromptRecord("mt:7", "mt-bench", ("Count from 1 to 5.", "Now count back."))
    rows = labeler.label(record, 0.0)
    assert [r["prompt_id"] for r in rows] == ["mt:7#t0", "mt:7#t1"]
    assert [r["turn"] for r in rows] == [0, 1]
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]  # the answer to turn 0 is in turn 1's context
    assert [key for key, _ in task_keys(record, 0.0)] == ["mt:7#t0", "mt:7#t1"]


@pytest.mark.parametrize(
    "record, message",
    [
        (PromptRecord("e:1", "x", ("   ",)), "empty prompt"),
        (PromptRecord("e:2", "x", ("word " * 1500,)), "exceeds the target's context"),
        (PromptRecord("e:3", "x", (), "line 3 is not valid UTF-8"), "not valid UTF-8"),
    ],
)
def test_bad_prompts_give_rows_with_errors(labeler, record, message):
    rows = labeler.label(record, 0.0)
    assert len(rows) == 1 and message in rows[0]["error"]
    assert rows[0]["tau"] is None and rows[0]["prompt_id"] == record.id
    assert rows_to_table(rows).schema == LABEL_SCHEMA


def test_a_failed_turn_marks_the_later_turns(labeler):
    rows = labeler.label(PromptRecord("m:1", "x", ("", "second")), 0.0)
    assert "empty prompt" in rows[0]["error"] and "earlier turn failed" in rows[1]["error"]


def test_summary_counts_rows_errors_and_histogram(labeler):
    rows = labeler.label(PromptRecord("s:1", "count", ("Count from 1 to 9.",)), 0.0)
    rows += labeler.label(PromptRecord("s:2", "x", ("",)), 0.0)
    summary = summarize(rows, new_rows=2, seconds=1.0)
    assert (summary.rows, summary.errors) == (2, 1)
    assert sum(summary.best_block_size_histogram.values()) == 1
    assert set(summary.mean_tau) == {1, 2, 3, 4, 5, 6}
    assert "1 with errors" in summary.format()


def test_reading_labels_skips_broken_files_and_duplicates(labeler, tmp_path):
    import pyarrow.parquet as pq

    rows = labeler.label(PromptRecord("r:1", "count", ("Count from 1 to 4.",)), 0.0)
    pq.write_table(rows_to_table(rows), tmp_path / "a.parquet")
    pq.write_table(rows_to_table(rows), tmp_path / "b.parquet")  # the same key again
    (tmp_path / "c.parquet").write_bytes(b"PAR1 truncated")
    table, broken = read_label_files(tmp_path)
    assert table.num_rows == 2 and [p.name for p in broken] == ["c.parquet"]
    assert read_labels(tmp_path).num_rows == 1
    # Quarantined, the broken file takes a name Parquet readers skip, and the folder reads as a dataset again.
    read_label_files(tmp_path, quarantine=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_corrupt-c.parquet", "a.parquet", "b.parquet"]
    assert pq.ParquetDataset(tmp_path).read().num_rows == 2
    assert deduplicate(pa.concat_tables([table, table])).num_rows == 1
    with pytest.raises(FileNotFoundError, match="no label Parquet files"):
        read_labels(tmp_path / "nothing")


def test_label_files_carry_their_schema_version_and_another_is_refused(labeler, tmp_path):
    import pyarrow.parquet as pq

    from blockpilot.data.labels import LABEL_SCHEMA_VERSION, write_label_file

    rows = labeler.label(PromptRecord("r:1", "count", ("Count from 1 to 4.",)), 0.0)
    (tmp_path / "new").mkdir()
    written = write_label_file(rows_to_table(rows), tmp_path / "new" / "part.parquet")
    metadata = pq.read_schema(written).metadata
    assert metadata[b"blockpilot.label_schema_version"] == str(LABEL_SCHEMA_VERSION).encode()
    assert read_labels(tmp_path / "new").num_rows == 1 and [p.name for p in (tmp_path / "new").iterdir()] == ["part.parquet"]
    (tmp_path / "old").mkdir()
    pq.write_table(rows_to_table(rows).replace_schema_metadata(None), tmp_path / "old" / "part.parquet")
    with pytest.raises(ValueError, match="schema version before versions.*label again into a new folder"):
        read_labels(tmp_path / "old")


def test_samples_pool_runs_at_temperature(tiny_models, heldout):
    stop = tuple(tiny_models.stop_token_ids())
    base = dict(candidates=(2, 4, 6), temperature=1.0, max_new_tokens=24, stop_token_ids=stop)
    single = [sweep_prompt(tiny_models, heldout[1], SweepConfig(**base), seed=seed) for seed in (7, 8)]
    pooled = sweep_prompt(tiny_models, heldout[1], SweepConfig(samples=2, **base), seed=7)
    assert len(pooled.tables) == 2
    for i in range(3):
        lengths = single[0].acceptance_lengths[i] + single[1].acceptance_lengths[i]
        assert pooled.acceptance_lengths[i] == lengths
        assert pooled.tau[i] == pytest.approx(sum(lengths) / len(lengths))
        assert pooled.cycles[i] == len(lengths)
    greedy = dict(base, temperature=0.0)
    assert (
        sweep_prompt(tiny_models, heldout[1], SweepConfig(samples=3, **greedy)).cycles
        == sweep_prompt(tiny_models, heldout[1], SweepConfig(**greedy)).cycles
    )
    with pytest.raises(ValueError, match="samples"):
        SweepConfig((2, 3), samples=0)


def test_out_of_memory_retries_one_prompt_at_a_time_and_marks_only_the_prompt_that_needs_more(labeler, monkeypatch):
    """A batch out of memory is swept again prompt by prompt; a prompt out of memory alone gets an `oom` row;
    its neighbours get their labels, the same as without the fault."""
    import torch

    import blockpilot.sweep as sweep_module

    records = [PromptRecord(f"r:{i}", "count", (f"Count from {i} to {i + 4}.",)) for i in range(3)]
    tasks = [(record, 0.0) for record in records]
    clean = labeler.label_many(tasks)
    huge = labeler._prompt_ids(records[1].turns[0], [{"role": "user", "content": records[1].turns[0]}])
    sweep_prompts = sweep_module.sweep_prompts

    def short_of_memory(models, prompts, *args, **kwargs):
        if len(prompts) > 1 or list(prompts[0]) == list(huge):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return sweep_prompts(models, prompts, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "sweep_prompts", short_of_memory)
    rows = labeler.label_many(tasks)
    assert rows[1][0]["error_kind"] == "oom" and "out of memory" in rows[1][0]["error"]
    for index in (0, 2):
        assert rows[index][0]["error"] is None and rows[index][0]["tau"] == clean[index][0]["tau"]


def test_a_device_failure_is_raised_for_the_actor_to_restart(labeler, monkeypatch):
    import blockpilot.sweep as sweep_module
    from blockpilot.labeling import DeviceFailure

    def assert_failed(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(sweep_module, "sweep_prompts", assert_failed)
    with pytest.raises(DeviceFailure, match="device-side assert"):
        labeler.label_many([(PromptRecord("r:1", "count", ("Count from 1 to 4.",)), 0.0)])

    # The actor exits on it (Ray Data restarts the actor and retries the batch); it writes nothing.
    import pipelines.label as label_module

    exits = []
    monkeypatch.setattr(label_module.os, "_exit", lambda code: exits.append(code))
    label_module.restart_after(DeviceFailure("device-side assert triggered"))
    assert exits == [1]


def test_labels_narrowed_to_blockpilots_window_hold_what_that_sweep_would(tiny_labels):
    """`train --candidates` (the paper's B-2..B+2 out of labels that also hold autoregression): every per-candidate
    column keeps those entries, the acceptance tables too, and B* is chosen among them."""
    from blockpilot.data.labels import read_labels, with_candidates
    from blockpilot.predictor.training import valid_rows

    table = valid_rows(read_labels(tiny_labels["train"]))
    window = candidates_around(4)
    narrowed = with_candidates(table, window)
    for row, full in zip(narrowed.to_pylist(), table.to_pylist(), strict=True):
        keep = [full["candidates"].index(b) for b in window]
        assert row["candidates"] == list(window) and row["tau"] == [full["tau"][k] for k in keep]
        assert row["cycles"] == [full["cycles"][k] for k in keep]
        assert row["best_block_size"] == best_block_size(window, row["tau"])
        for mine, theirs in zip(tables_from_row(row), tables_from_row(full), strict=True):
            assert (mine.commits == theirs.commits[keep]).all() and mine.candidates == window
            assert np.array_equal(mine.confidences, theirs.confidences, equal_nan=True)  # the largest b stays
    shallow = with_candidates(table, (1, 2, 3))
    assert shallow["table_confidences"].null_count == shallow.num_rows  # of a block no longer among them
    assert tables_from_row(shallow.to_pylist()[0])[0].confidences is None
    with pytest.raises(ValueError, match="subset of the labels'"):
        with_candidates(table, (4, 7))
