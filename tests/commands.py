"""Running the project's commands the way a user types them: a subprocess, in the repository, with what it printed
shown when it fails."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's scripts: `blockpilot`, `ray`


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """The suite's environment (offline hubs, no Ray auth) with the venv's scripts on PATH, as in an activated venv,
    and `home` as BLOCKPILOT_HOME (MLflow's store and every artifact under it)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "BLOCKPILOT_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return {**env, **extra}


def run(command: str, env: dict[str, str], timeout: float = 300) -> str:
    """Run `command` (a shell line, as in the README) and return its standard output; fail naming what it printed."""
    completed = subprocess.run(
        shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert completed.returncode == 0, (
        f"`{command}` exited with {completed.returncode}\n--- stdout\n{completed.stdout[-4000:]}\n"
        f"--- stderr\n{completed.stderr[-4000:]}"
    )
    return completed.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
