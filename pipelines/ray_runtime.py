"""Connecting to Ray: an existing cluster when there is one, else an embedded local one."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from blockpilot.home import blockpilot_home

# Where the embedded cluster's workers look for a State API: a port nothing listens on (see `ensure_ray`).
NO_STATE_API = "http://127.0.0.1:9"
# The module of Ray Train's worker context, under the ray package (its logger is named after its file).
TRAIN_CONTEXT_FILE = Path("train", "v2", "_internal", "execution", "context.py")


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to `address` (or `$RAY_ADDRESS`), else start an embedded Ray for this process; True when this call
    started an embedded Ray (its caller may then shut it down).

    An embedded Ray gets at least 4 logical CPUs even on a 2-core machine: actor pools and Train workers
    take fractional or whole CPUs, and with only 2 logical CPUs a pool can take every one and hang the
    job. Its auth token (Ray 2.60 turns token authentication on for new local clusters) lives under the
    project's home folder rather than `~/.ray`.
    """
    import ray

    if ray.is_initialized():
        return False
    with own_signal_handlers():
        return _init_ray(address, num_cpus)


@contextlib.contextmanager
def own_signal_handlers() -> Iterator[None]:
    """This process's SIGINT and SIGTERM handlers as they were before the block. `ray.init` installs Ray's failure
    handler for SIGTERM in the driver, which prints a stack trace and ends the process without running ours: a
    served endpoint stopped by a process manager then left Ray's processes running. (Only the main thread can set
    handlers; elsewhere nothing is restored.)"""
    main = threading.current_thread() is threading.main_thread()
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            if handler is not None:
                signal.signal(number, handler)


def _init_ray(address: str | None, num_cpus: int | None) -> bool:
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return False
    if "RAY_AUTH_TOKEN_PATH" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(embedded_auth_token())
    # Token authentication stays on (Ray's default for a new local cluster); its notice on every start goes.
    import logging

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # address="local": always a fresh cluster of our own, never one that happens to run on this machine.
    ray.init(
        address="local",
        num_cpus=num_cpus or max(4, os.cpu_count() or 1),
        include_dashboard=False,
        configure_logging=True,
        logging_level="WARNING",
        runtime_env={
            "worker_process_setup_hook": "pipelines.ray_runtime.quiet_embedded_workers",
            "env_vars": {
                # Train re-logs a worker's `print` at INFO and also passes it through: every epoch line came twice.
                "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                # Train's watcher of node preemption (draining nodes) has nothing to watch on one machine, and its
                # actor's start logged a core_worker error line in every run.
                "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
                # This cluster serves no State API (no dashboard). Unset, Ray's State API clients in its workers
                # (Train's placement-group cleaner asks whether the controller lives) look for one in another
                # cluster: the one /tmp/ray/ray_current_cluster names or the dashboard at 127.0.0.1:8265. With a
                # `ray start --head` cluster running, the cleaner found no controller there and quit, warning; with
                # that cluster gone but its file left, it waited 40 s for its GCS and printed a traceback. An
                # address where nothing listens fails each query at once, and the cleaner's warning is quieted.
                "RAY_API_SERVER_ADDRESS": NO_STATE_API,
            },
        },
    )
    return True


def quiet_embedded_workers() -> None:
    """Runs in every worker process of an embedded cluster. Ray Train's placement-group cleaner asks the State
    API, which a cluster without a dashboard does not serve, whether the controller lives, and warns each
    second that it could not; the embedded cluster ends with this process, placement groups included. The
    other lines quieted here repeat, per worker or per epoch, what the driver's stages already print."""
    import logging
    import warnings

    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
    # The driver turned Ray Data's progress bars off (`quiet_ray_data`): each worker would say so once, and
    # Train's split coordinator would announce each epoch's execution end.
    _quiet_ray_data_logs()
    # Ray's own Train dataset manager still passes a deprecated Ray Data option.
    warnings.filterwarnings("ignore", message=".*exclude_resources.* is deprecated")
    # Train's worker context logs 'Reporting training result N' per report under a logger named after its
    # file path, which `train_run_config`'s level (for `ray.train.*` names) does not reach. The path is found
    # without importing ray.train: that import took 2.5-3.7 s of CPU in every worker of the cluster (a Serve
    # replica, a Data actor, an idle one), most of them never training.
    import ray

    logging.getLogger(str(Path(ray.__file__).parent / TRAIN_CONTEXT_FILE)).setLevel(logging.WARNING)


# Ray Train's controller polls its workers every 2 s, and `ray.train.report` waits while the worker's previous report
# is still unread: an epoch of a few milliseconds took 2 s (`blockpilot train --epochs 30` on the tiny zoo's labels:
# 86.6 s, against 28.0 s polling every 0.1 s). A missed poll is not a failure (a worker is declared dead after
# RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, 10 minutes), so polling faster only ends reports and fits sooner.
REPORT_POLL_S = "0.1"
REPORT_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # Train passes it from the driver to its controller


def train_run_config(**fields: Any) -> Any:
    """`ray.train.RunConfig(**fields)` with the console at WARNING (no line per report or checkpoint: the fits print
    their own line per epoch; a worker's `print`, which Train both passes through and re-logs at INFO, shown once)
    and the controller polling every `REPORT_POLL_S` seconds unless $RAY_TRAIN_HEALTH_CHECK_INTERVAL_S says
    otherwise."""
    from ray.train import LoggingConfig, RunConfig

    os.environ.setdefault(REPORT_POLL_ENV, REPORT_POLL_S)
    return RunConfig(logging_config=LoggingConfig(log_level="WARNING"), **fields)


def ray_storage(kind: str) -> Path:
    """Where Ray Train keeps runs and checkpoints of `kind`, under the home folder."""
    path = blockpilot_home() / "ray_results" / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def embedded_auth_token() -> Path:
    """The token file of embedded clusters, created on first use (Ray reads but never creates a token at a
    custom RAY_AUTH_TOKEN_PATH)."""
    import secrets

    path = blockpilot_home() / "ray" / "auth_token"
    if not path.is_file() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path


def quiet_ray_data() -> None:
    """No Ray Data progress block every few seconds, no plan printed per execution: stages show their own bar."""
    from ray.data import DataContext

    context = DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    _quiet_ray_data_logs()


def _quiet_ray_data_logs() -> None:
    """Nor the lines that announce that progress bars are off (a warning) and each execution's end (info), in
    the driver and in every worker of an embedded cluster."""
    import logging

    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    logging.getLogger("ray.data._internal.execution.streaming_executor").setLevel(logging.WARNING)
