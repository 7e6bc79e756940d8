"""Running the project's commands the way a user types them: a subprocess, in the repository, with what it printed
shown when it fails."""

from __future__ import annotations

import importlib.util
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's scripts: `blockpilot`, `ray`
PROMPT = "Count from 3 to 14."


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """The suite's environment (offline hubs, no Ray auth) with the venv's scripts on PATH, as in an activated venv,
    and `home` as BLOCKPILOT_HOME (MLflow's store and every artifact under it)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "BLOCKPILOT_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return {**env, **extra}


# Lines a user cannot act on, which the project's commands once printed and must not print again.
UNACTIONABLE = (
    "`past_key_values` is deprecated",  # transformers' old keyword, from every process
    "NumPy array is not writable",  # a read-only array handed to torch
    "graceful_shutdown failed",  # Serve's controller killed under its own shutdown task
)
# On the embedded one-machine Ray also Train's preemption watcher, which has no node to watch there (on a cluster it
# watches real nodes, and the line its start logs is Ray's own), and Train's placement-group cleaner, which looked
# for its controller in another cluster running on the machine.
EMBEDDED_UNACTIONABLE = (*UNACTIONABLE, "'PreemptionWatcher'", "PlacementGroupCleaner")


def check_quiet(output: str, command: str, noise: tuple[str, ...] = EMBEDDED_UNACTIONABLE) -> None:
    """Fail on a line of `noise` in a command's output."""
    found = [line for line in output.splitlines() if any(text in line for text in noise)]
    assert not found, f"`{command}` printed lines a user cannot act on:\n" + "\n".join(found[:5])


def script_module(relative: str) -> ModuleType:
    """A script of the repository (`benchmarks/...py`) imported as a module, to test its pieces in process."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(command: str, env: dict[str, str], timeout: float = 600, noise: tuple[str, ...] = EMBEDDED_UNACTIONABLE) -> str:
    """Run `command` (a shell line, as in the README) and return its standard output; fail naming what it printed,
    and on a line of `noise`, lines a user cannot act on. `timeout` (as `wait_healthy`'s) only guards against a hang:
    a 2-core machine without AVX-512 ran the suite 2.4x slower than the usual one (docs/log.md, 2026-11-27)."""
    completed = subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, (
        f"`{command}` exited with {completed.returncode}\n--- stdout\n{completed.stdout[-4000:]}\n"
        f"--- stderr\n{completed.stderr[-4000:]}"
    )
    check_quiet(completed.stdout + completed.stderr, command, noise)
    return completed.stdout


# Ports for the servers the tests start: below Linux's ephemeral range (32768 and up), where the kernel places the
# client end of every outgoing connection (Ray's processes open many), and above Ray's worker ports (10002-19999). A
# port the kernel hands out as free (bind to 0) is ephemeral: minutes later, when the demo's endpoint binds it, a
# connection may hold it ("Failed to bind to address '127.0.0.1:43001'", seen in CI).
SERVER_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port nothing listens on now, from `SERVER_PORTS` (random: the two test workers draw independently)."""
    for port in random.sample(SERVER_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS}")


def wait_healthy(
    url: str, process: subprocess.Popen | None = None, log: Path | None = None, timeout_s: float = 600
) -> None:
    """Until GET `url` answers 200; fails if `process` (the server's, when the test started it) exits first, with the
    end of its `log`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            output = log.read_text()[-4000:] if log is not None else ""
            raise AssertionError(f"the server exited with {process.returncode} before it answered:\n{output}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer 200 in {timeout_s} s")


def check_endpoint(url: str, model: str) -> None:
    """One completion and one streamed chat through the openai client, and one bad request answered 4xx."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion.usage.completion_tokens >= 1 and completion.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    bad = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "temperature": -1}, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.text
