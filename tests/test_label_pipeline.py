"""Labeling on Ray Data (embedded Ray, tiny zoo): rows, reruns, a stopped job, MLflow, the CLI and bad prompts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from blockpilot.data.labels import LABEL_SCHEMA, parquet_files, read_labels
from blockpilot.labeling import LabelSettings
from pipelines.label import LabelJob, run_label_job

pytestmark = pytest.mark.slow


def make_job(zoo: Path, out: Path, **overrides) -> LabelJob:
    settings = overrides.pop("settings", LabelSettings(temperatures=(0.0, 1.0), max_new_tokens=24, top_k=8, compile="off"))
    defaults = dict(
        prompts=f"zoo:{zoo}",
        target=str(zoo / "target"),
        drafter=str(zoo / "drafter"),
        out=out,
        settings=settings,
        actors=2,
        num_cpus_per_actor=0.5,
        batch_size=2,
        limit=8,
        track=False,
    )
    return LabelJob(**{**defaults, **overrides})


def keys(table) -> list[tuple[str, float]]:
    return list(zip(table["prompt_id"].to_pylist(), table["temperature"].to_pylist(), strict=True))


def test_labels_every_prompt_and_temperature_once(local_ray, tiny_zoo, tmp_path, monkeypatch):
    """One label folder, grown by three runs of the same job (the last one tracked in MLflow), then refused to a
    job with other settings."""
    import mlflow

    out = tmp_path / "labels"
    summary = run_label_job(make_job(tiny_zoo, out))
    assert (summary.rows, summary.new_rows, summary.errors) == (16, 16, 0)
    table = read_labels(out)
    assert table.num_rows == 16 and len(set(keys(table))) == 16
    assert pq.read_schema(parquet_files(out)[0]) == LABEL_SCHEMA
    assert set(table["temperature"].to_pylist()) == {0.0, 1.0}
    assert sum(summary.best_block_size_histogram.values()) == 16
    files = parquet_files(out)
    # The folder is a Parquet dataset as it is: its own files (the fingerprint, the lock) are skipped by every reader.
    import pandas
    import pyarrow.dataset

    assert len(pandas.read_parquet(out)) == 16
    assert pyarrow.dataset.dataset(out).to_table().num_rows == 16
    assert local_ray.data.read_parquet(str(out)).count() == 16

    again = run_label_job(make_job(tiny_zoo, out))
    assert (again.rows, again.new_rows) == (16, 0)
    assert parquet_files(out) == files  # nothing written twice

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    more = run_label_job(make_job(tiny_zoo, out, limit=10, track=True))
    assert (more.rows, more.new_rows) == (20, 4)
    assert len(set(keys(read_labels(out)))) == 20

    # The summary went to MLflow: metrics, the settings as params, the plots.
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["blockpilot-labels"], output_format="list")
    assert len(runs) == 1
    metrics = runs[0].data.metrics
    assert metrics["label/rows"] == 20 and metrics["label/errors"] == 0 and metrics["label/prompts_per_s"] > 0
    assert "label/mean_tau_b4" in metrics
    assert runs[0].data.params["settings.mode"] == "replay"
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id)}
    assert {"best_block_size_histogram.png", "tau_vs_block_size.png"} <= artifacts

    # A job with other settings may not write into this folder.
    other = make_job(tiny_zoo, out, limit=10, settings=LabelSettings(temperatures=(0.0, 1.0), max_new_tokens=16, top_k=8, compile="off"))
    with pytest.raises(ValueError, match="differing: max_new_tokens"):
        run_label_job(other)
    assert read_labels(out).num_rows == 20
    # A folder of an older version (its fingerprint under the old name) is refused, naming what to do.
    (out / "_job.json").rename(out / "job.json")
    with pytest.raises(ValueError, match="older version.*label again into a new --out"):
        run_label_job(make_job(tiny_zoo, out, limit=10))


def test_a_stopped_job_labels_only_what_is_missing(local_ray, tiny_zoo, tmp_path):
    """Kill a labeling driver once it has written some files; the rerun fills in the rest, no duplicates."""
    out = tmp_path / "labels"
    address = local_ray.get_runtime_context().gcs_address
    command = [
        sys.executable,
        "-m",
        "pipelines.label",
        "--prompts",
        f"zoo:{tiny_zoo}",
        "--target",
        str(tiny_zoo / "target"),
        "--drafter",
        str(tiny_zoo / "drafter"),
        "--out",
        str(out),
        "--limit",
        "24",
        "--temperatures",
        "0",
        "--max-new-tokens",
        "24",
        "--top-k",
        "8",
        "--batch-size",
        "1",
        "--actors",
        "1",
        "--num-cpus-per-actor",
        "0.5",
        "--no-track",
        "--compile",
        "off",
    ]
    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(Path(__file__).parents[1])}
    driver = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while len(parquet_files(out)) < 3 and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()

    # The rerun counts what the stopped driver left (a write in flight at the kill may land after the loop).
    summary = run_label_job(make_job(tiny_zoo, out, limit=24, settings=LabelSettings(max_new_tokens=24, top_k=8, compile="off")))
    assert 0 < summary.already_labeled < 24, f"the driver should have been stopped midway: {summary.already_labeled}"
    assert summary.new_rows == 24 - summary.already_labeled
    table = read_labels(out)
    assert table.num_rows == 24 and len(set(keys(table))) == 24


def test_two_jobs_on_one_folder_do_not_both_run(tiny_zoo, tmp_path):
    from pipelines.label import exclusive

    out = tmp_path / "labels"
    out.mkdir()
    with exclusive(out):
        with pytest.raises(RuntimeError, match="another labeling job is writing"):
            run_label_job(make_job(tiny_zoo, out))
    with exclusive(out):  # released when the first job ends
        pass


def test_unknown_source_stops_before_the_job_starts(tiny_zoo, tmp_path):
    with pytest.raises(ValueError, match="unknown prompt source 'gsm9k'"):
        run_label_job(make_job(tiny_zoo, tmp_path / "labels", prompts="gsm9k"))
    assert not (tmp_path / "labels").exists()


def test_label_command_makes_bad_prompts_rows_with_errors_and_goes_on(local_ray, tiny_zoo, tmp_path, capsys):
    """`blockpilot label` over two sources, one of them a file of bad prompts: each bad prompt is a row naming
    what is wrong with it, and the good ones are labeled with the candidates asked for."""
    from blockpilot.cli import main

    prompts = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"id": "good", "prompt": "Count from 1 to 6."}),
        json.dumps({"id": "empty", "prompt": ""}),
        json.dumps({"id": "long", "prompt": "word " * 1500}),
        "{broken json",
    ]
    prompts.write_text("\n".join(lines) + "\n")
    argv = [
        "label",
        "--prompts",
        f"zoo:{tiny_zoo}:heldout,jsonl:{prompts}",
        "--target",
        str(tiny_zoo / "target"),
        "--drafter",
        str(tiny_zoo / "drafter"),
        "--out",
        str(tmp_path / "labels"),
        "--limit",
        "4",
        "--candidates",
        "1,2,4,8",
        "--temperatures",
        "0",
        "--max-new-tokens",
        "16",
        "--no-track",
        "--compile",
        "off",
    ]
    assert main(argv) == 0
    assert "rows: 8" in capsys.readouterr().out
    rows = read_labels(tmp_path / "labels").to_pylist()
    errors = {row["prompt_id"]: row["error"] for row in rows}
    assert len(errors) == 8 and sum(error is not None for error in errors.values()) == 3
    assert errors["bad:good"] is None
    assert "empty prompt" in errors["bad:empty"]
    assert "exceeds the target's context" in errors["bad:long"]
    assert "line 4" in errors["bad:line4"]
    assert [row["candidates"] for row in rows if row["error"] is None] == [[1, 2, 4, 8]] * 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--candidates", "0,4"], "--candidates"),
        (["--candidates", "4,4"], "--candidates"),
        (["--temperatures", "-1"], "--temperatures"),
        (["--mode", "fast"], "--mode"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_label_command_rejects_bad_flags(tiny_zoo, tmp_path, capsys, flags, message):
    from blockpilot.cli import main

    argv = [
        "label",
        "--prompts",
        "gsm8k",
        "--target",
        str(tiny_zoo / "target"),
        "--drafter",
        str(tiny_zoo / "drafter"),
        "--out",
        str(tmp_path),
        *flags,
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_budget_past_the_context_is_refused_before_any_row(tiny_zoo, tmp_path, capsys):
    """`blockpilot label --max-new-tokens 2048` on the tiny zoo (a context of 1,024 positions): refused at once with
    one line naming the flag's value and the context, before any prompt is read or row written."""
    from blockpilot.cli import main

    out = tmp_path / "labels"
    argv = ["label", "--prompts", f"zoo:{tiny_zoo}", "--target", str(tiny_zoo / "target"), "--drafter",
            str(tiny_zoo / "drafter"), "--out", str(out), "--max-new-tokens", "2048", "--no-track"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "max_new_tokens 2048 leaves no room for a prompt in the target's context of 1024" in error
    assert len(error.strip().splitlines()) == 1 and not out.exists()


def test_restart_moves_the_old_labels_aside_and_the_refusal_names_it(tmp_path):
    """A job with other settings is refused naming --restart; with it, every file of the folder (parts and job
    file) moves to a sibling OUT.replaced-TIME, and the new job's fingerprint is written into the empty folder."""
    from pipelines.label import FINGERPRINT_FILE, check_fingerprint

    out = tmp_path / "labels"
    out.mkdir()
    zoo = tmp_path / "zoo"
    first = make_job(zoo, out)
    check_fingerprint(first)
    (out / "part-0.parquet").write_bytes(b"old rows")
    other = make_job(zoo, out, settings=LabelSettings(max_new_tokens=16, compile="off"))
    with pytest.raises(ValueError, match="differing: .*pass --restart to move these labels aside"):
        check_fingerprint(other)
    check_fingerprint(LabelJob(**{**other.__dict__, "restart": True}))
    (aside,) = [path for path in tmp_path.iterdir() if path.name.startswith("labels.replaced-")]
    assert (aside / "part-0.parquet").read_bytes() == b"old rows"
    assert json.loads((aside / FINGERPRINT_FILE).read_text()) == json.loads(json.dumps(first.fingerprint()))
    assert sorted(p.name for p in out.iterdir()) == [FINGERPRINT_FILE]
    assert json.loads((out / FINGERPRINT_FILE).read_text()) == json.loads(json.dumps(other.fingerprint()))
