"""The MLflow UI in headless Chromium (`benchmarks/mlflow_screenshots.py`): a tracked run's experiment opens on
its runs table, and the comparison and artifact pages render. Needs Debian's `chromium` (CI installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed"),
]

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "mlflow_screenshots.py"


def test_screenshots_of_a_tracked_run(tmp_path, monkeypatch):
    import pandas as pd

    from blockpilot.tracking import start_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with start_run("blockpilot-predictor", "ui-check-run") as tracker:
        tracker.log_metrics({"eval/T0/throughput_pred": 3.5, "eval/T0/tau_pred": 2.5})
        frame = pd.DataFrame({"prompt_id": ["a", "b"], "tau": [1.5, 2.0]})
        tracker.log_dataset(tmp_path / "labels", frame, name="labels/train", context="train")
        (tmp_path / "notes.txt").write_text("artifact\n")
        tracker.log_artifact(tmp_path / "notes.txt", "files")
    out = tmp_path / "shots"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--experiment", "blockpilot-predictor", "--port", str(free_port())]
    subprocess.run(command, check=True, timeout=400, env=os.environ.copy())
    for name in ("experiment.png", "compare.png", "artifacts.png"):
        assert (out / name).stat().st_size > 20_000, f"{name} looks blank"
    # Rendered on the runs table (not MLflow's GenAI overview): the run's name is on the page.
    assert "ui-check-run" in (out / "experiment.html").read_text()
