"""Starting the embedded Ray (`pipelines.ray_runtime.ensure_ray`) keeps the process's own signal handlers; the setup
hook of its workers stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from commands import ROOT, user_env

KEEPS_SIGTERM = """
import os, signal, sys, time
from pipelines.ray_runtime import ensure_ray

def stop(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, stop)
assert ensure_ray()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
except KeyboardInterrupt:
    import ray
    ray.shutdown()
    print("stopped by our handler", flush=True)
    sys.exit(0)
sys.exit(3)
"""


def run_python(code: str, home: Path) -> subprocess.CompletedProcess:
    """`code` run by this venv's Python in the repository, with `home` as BLOCKPILOT_HOME."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=user_env(home), capture_output=True, text=True, timeout=120
    )


def test_a_sigterm_after_ray_started_runs_the_processs_own_handler(tmp_path):
    """Ray's driver installs a failure handler for SIGTERM that printed a stack trace and killed the process before
    `blockpilot serve` could stop its Ray (a process manager's stop during a replica's start left it running)."""
    completed = run_python(KEEPS_SIGTERM, tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "stopped by our handler" in completed.stdout and "SIGTERM received" not in completed.stderr


QUIETS_WORKER = """
import importlib.util, logging, sys
from pipelines.ray_runtime import quiet_embedded_workers

quiet_embedded_workers()
heavy = sorted(name for name in ("ray.train", "ray.data", "pandas", "torch") if name in sys.modules)
context = importlib.util.find_spec("ray.train.v2._internal.execution.context").origin
print(heavy, logging.getLogger(context).level == logging.WARNING)
"""


def test_a_workers_setup_hook_quiets_trains_context_without_importing_train(tmp_path):
    """Every worker of an embedded cluster runs the hook: importing Ray Train there cost each Serve replica, Data
    actor and idle worker 2.5-3.7 s of CPU."""
    completed = run_python(QUIETS_WORKER, tmp_path)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["[]", "True"]
