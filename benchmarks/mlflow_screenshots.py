"""The MLflow UI as a user meets it, seen in headless Chromium: screenshots of an experiment's runs table, of
the comparison of its runs, and of one run's artifacts.

    python benchmarks/mlflow_screenshots.py --out shots/ [--experiment blockpilot-predictor] [--port 5055]

Starts `mlflow server` on 127.0.0.1 over the project's store (`MLFLOW_TRACKING_URI`, else SQLite under
$BLOCKPILOT_HOME), opens each page in Debian's `chromium` (`apt-get install chromium`) and writes PNGs under
--out, then stops the server. The comparison is of the runs nested under the newest parent run (the demo's two
predictors), else of the newest runs. Also writes the rendered DOMs of the experiment page (`experiment.html`: the
runs table's run names are in it when the experiment opens on its training runs, not on MLflow's GenAI overview)
and of the comparison (`compare.html`: the compared runs' names and metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL_TRAINING = "machine_learning"
RENDER_TIMEOUT_S = 150.0
RENDER_TRIES = 3
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # this machine's network is closed: no update or sync calls
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise FileNotFoundError("headless Chromium is needed: install Debian's `chromium` package")
    return found


def start_server(uri: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise TimeoutError(f"mlflow server on port {port} did not answer /health in 120 s")


def render(url: str, *, screenshot: Path | None = None, dom: Path | None = None, wait_ms: int = 8_000) -> None:
    """One page in a fresh headless Chromium profile, after `wait_ms` of (virtual) time for the app's scripts: its
    screenshot, or its rendered DOM (the compare view's metrics table scrolls in a box of its own, so the DOM holds its
    first rows, whatever the window's height). Chromium's virtual time budget now and then never expires (a run of
    the suite's hung 180 s on one page that renders in seconds), so a load that outlasts `RENDER_TIMEOUT_S` is
    killed with its processes and tried again, up to `RENDER_TRIES` loads."""
    for attempt in range(1, RENDER_TRIES + 1):
        with tempfile.TemporaryDirectory() as profile:
            command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={wait_ms}"]
            command += ["--window-size=1600,1000"]
            if screenshot is not None:
                command += [f"--screenshot={screenshot}"]
            if dom is not None:
                command += ["--dump-dom"]
            # A session of its own, so that a hung load is killed with its renderer and GPU processes.
            browser = subprocess.Popen(
                [*command, url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
            )
            try:
                page, _ = browser.communicate(timeout=RENDER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(browser.pid, signal.SIGKILL)
                browser.communicate()
                print(f"chromium: {url} hung {RENDER_TIMEOUT_S} s (load {attempt} of {RENDER_TRIES})", file=sys.stderr)
                continue
        if dom is not None:
            dom.write_text(page)
        return
    raise TimeoutError(f"chromium did not render {url} in {RENDER_TRIES} loads of {RENDER_TIMEOUT_S} s each")


def take_screenshots(out: Path, experiment: str, port: int) -> list[Path]:
    """The pages' screenshots under `out`, beside the rendered DOMs of the runs table and of the comparison (of the
    runs nested under the newest parent run, the demo's predictors; else of the newest runs)."""
    import mlflow

    from blockpilot.tracking import latest_comparison, tracking_uri

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(f"no MLflow experiment {experiment!r} in {uri} (run the main job first: make demo)")
    runs = mlflow.search_runs([found.experiment_id], order_by=["start_time DESC"], max_results=4)
    if runs.empty:
        raise ValueError(f"experiment {experiment!r} has no runs")
    comparison = latest_comparison(experiment)
    compared = [run.run_id for run in comparison.runs.values()] if comparison else list(runs["run_id"])
    shown = comparison.parent_id if comparison else runs["run_id"].iloc[0]  # the parent holds predictors.png
    base = f"http://127.0.0.1:{port}/#"
    # The UI's "GenAI | Model training" switch (a browser setting, GenAI at first) decides which page an
    # experiment opens on; the link says which it means.
    mode = f"workflowType={MODEL_TRAINING}"
    pages = {
        "experiment.png": f"{base}/experiments/{found.experiment_id}?{mode}",
        "compare.png": f"{base}/compare-runs?runs={json.dumps(compared)}&experiments={json.dumps([found.experiment_id])}&{mode}",
        "artifacts.png": f"{base}/experiments/{found.experiment_id}/runs/{shown}/artifacts?{mode}",
    }
    out.mkdir(parents=True, exist_ok=True)
    server = start_server(uri, port)
    try:
        # The DOM in a load of its own: one Chromium run asked for both a screenshot and the DOM hung (180 s).
        render(pages["experiment.png"], dom=out / "experiment.html")
        render(pages["compare.png"], dom=out / "compare.html")
        for name, url in pages.items():
            render(url, screenshot=out / name)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return [out / name for name in pages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--experiment", default="blockpilot-predictor")
    parser.add_argument("--port", type=int, default=5055)
    args = parser.parse_args()
    for path in take_screenshots(args.out, args.experiment, args.port):
        print(path)


if __name__ == "__main__":
    main()
