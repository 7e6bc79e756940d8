"""Session fixtures: tiny models built here, in a temporary BLOCKPILOT_HOME, with no hub."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray 2.60 turns token authentication on for a new local cluster and writes the token under ~/.ray;
# tests run without it and write nothing to the home directory.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import contextlib  # noqa: E402
import fcntl  # noqa: E402
import hashlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from commands import BIN, free_port, user_env, wait_healthy  # noqa: E402

# Each xdist worker gets its share of the cores: two workers of two threads each on 2 cores made torch's
# OpenMP threads wait on one another (a 2 s sampling test took 80 s). The processes a test starts (the commands, a
# notebook's kernel) get the same share: a notebook took 62 s beside `blockpilot demo` on two threads each, 9 s alone.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS, torch.get_num_threads()))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def shared_folder(tmp_path_factory: pytest.TempPathFactory, *, kept: bool = False) -> Path:
    """A folder every xdist worker of this run sees (the run's base temp), or this session's own without xdist.
    With `kept`, `BLOCKPILOT_TEST_HOME` when it is set, so that what is built there is kept between runs."""
    if kept and os.environ.get("BLOCKPILOT_TEST_HOME"):
        folder = Path(os.environ["BLOCKPILOT_TEST_HOME"]).expanduser()
    else:
        base = tmp_path_factory.getbasetemp()
        folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def built_once(folder: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock named `name` in `folder`: the first worker builds, the others wait and reuse."""
    with open(folder / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def home_at(folder: Path) -> Iterator[None]:
    """BLOCKPILOT_HOME set to `folder` inside the block, restored (or unset) after it."""
    previous = os.environ.get("BLOCKPILOT_HOME")
    os.environ["BLOCKPILOT_HOME"] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("BLOCKPILOT_HOME", None)
        else:
            os.environ["BLOCKPILOT_HOME"] = previous


# Wall seconds of the slowest modules in CI (2 cores, a fresh clone, `-n 2`; docs/log.md, 2026-11-27). xdist deals
# whole modules to the workers in collection order (the Makefile turns off its reordering by test count, which put
# the single 4-minute test last while the other worker sat idle), so the longest ones start first. The figures order
# the modules, and that order is what was measured: with 2026-11-30's own figures test_demo started beside
# test_commands_on_ray, and the suite ran 16:28 against 14:40 (docs/log.md).
MODULE_SECONDS = {
    "test_commands_on_ray.py": 360,
    "test_demo.py": 180,
    "test_serve.py": 165,
    "test_label_pipeline.py": 145,
    "test_commands_offline.py": 120,
    "test_serving.py": 112,
    "test_zoo.py": 85,
    "test_commands_on_a_cluster.py": 85,
    "test_predictor_pipeline.py": 67,
}


@pytest.hookimpl(trylast=True)  # after `-m` deselects: the order is of the tests that run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest module that opens with a test that needs the trained tiny zoo first, then the modules that need
    none, then the others, longest first; each module's tests stay together and in order (a module's cluster or app
    starts once, on one worker).

    The zoo takes about 45 s to build, and a worker that needs it while the other builds it waits on its lock: the
    first module builds it at once, while the other worker runs the zoo-free ones. (`make test-fast` put the
    zoo-free ones first, so both workers reached the zoo together and waited for it: 57 s of its 159.)"""
    needs_zoo = {item.path for item in items if "tiny_zoo" in item.fixturenames}
    module_starts: dict[Path, pytest.Item] = {}
    for item in items:
        module_starts.setdefault(item.path, item)
    # a module whose first test needs the zoo: one that opens with other tests would start its build late
    starts_on_zoo = [path for path, item in module_starts.items() if "tiny_zoo" in item.fixturenames]
    first = max(starts_on_zoo, key=lambda path: MODULE_SECONDS.get(path.name, 0), default=None)

    def order(item: pytest.Item) -> tuple[bool, bool, int]:
        return item.path != first, item.path in needs_zoo, -MODULE_SECONDS.get(item.path.name, 0)

    items.sort(key=order)


@pytest.fixture(autouse=True, scope="session")
def isolated_home(tmp_path_factory: pytest.TempPathFactory):
    """Every artifact of the session under one temporary BLOCKPILOT_HOME; nothing in the real home.

    `BLOCKPILOT_TEST_HOME=/some/folder` keeps that home between local runs (the tiny zoo is then built once).
    """
    kept = os.environ.get("BLOCKPILOT_TEST_HOME")
    home = Path(kept) if kept else tmp_path_factory.mktemp("blockpilot-home")
    # One compiled-kernel cache for the whole run, both workers and every command a test starts (each with a home of
    # its own): a shape compiles once, as on a user's machine, where the cache under $BLOCKPILOT_HOME persists.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(shared_folder(tmp_path_factory, kept=True) / "inductor"))
    with home_at(home):
        yield home


@pytest.fixture(scope="session")
def random_zoo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`blockpilot zoo random` output: target/ (with tokenizer) and drafter/ folders."""
    from blockpilot.zoo.random_models import write_random_zoo

    return write_random_zoo(tmp_path_factory.mktemp("random-zoo"), seed=0)


@pytest.fixture(scope="session")
def random_models(random_zoo):
    from blockpilot.models import load_models

    return load_models(random_zoo["target"], random_zoo["drafter"], device="cpu")


class RecordingTrainer:
    """The local trainer, keeping a copy of what training left in memory (to compare with what was saved)."""

    def __init__(self) -> None:
        from blockpilot.zoo.build import LocalTrainer

        self.local, self.trained = LocalTrainer(), {}

    def train_target(self, target, fit):
        losses = self.local.train_target(target, fit)
        self.trained["target"] = {k: v.detach().clone() for k, v in target.state_dict().items()}
        return losses

    def train_drafter(self, drafter, target, fit):
        losses = self.local.train_drafter(drafter, target, fit)
        self.trained["drafter"] = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        return losses


_TRAINER = RecordingTrainer()


def trained_state_record(zoo: Path) -> Path:
    """Where the worker that trained `zoo` leaves the state dicts training held in memory (beside the zoo)."""
    return zoo.parent / f"{zoo.name}.trained.pt"


@pytest.fixture(scope="session")
def tiny_zoo(isolated_home, tmp_path_factory) -> Path:
    """The trained tiny zoo (target, drafter, prompts, zoo.json), built once per run (about 45 s), in a
    folder the xdist workers share; the worker that trains it leaves what training held in memory beside it."""
    from blockpilot.zoo.build import build_zoo

    shared = shared_folder(tmp_path_factory, kept=True)
    with built_once(shared, "tiny-zoo"), home_at(shared):
        # On this worker's share of the cores, as every test: alone it builds in 25 s on two threads and 36 s on
        # one, but two threads beside the other worker's busy one took 96-104 s in CI (OpenMP's threads waiting on
        # one another, as the note above the thread count says).
        zoo = build_zoo("tiny", trainer=_TRAINER, track=False)
        if len(_TRAINER.trained) == 2:
            torch.save(_TRAINER.trained, trained_state_record(zoo))
    return zoo


@pytest.fixture(scope="session")
def tiny_zoo_trained(tiny_zoo) -> dict | None:
    """The state dicts the tiny zoo's training left in memory (saved by the worker that trained it); None when
    the zoo came from a kept home that has no such record."""
    if len(_TRAINER.trained) == 2:
        return _TRAINER.trained
    record = trained_state_record(tiny_zoo)
    return torch.load(record, weights_only=True) if record.is_file() else None


@pytest.fixture(scope="session")
def tiny_models(tiny_zoo):
    from blockpilot.models import load_models

    return load_models(tiny_zoo / "target", tiny_zoo / "drafter", device="cpu")


@pytest.fixture(scope="session")
def _ray_session():
    """Shuts the embedded Ray down once, at the end of the session."""
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def local_ray(isolated_home, _ray_session):
    """An embedded Ray with 4 logical CPUs (2 real cores: fractional actors must not take them all).

    One Ray serves every module that asks for it (starting and stopping it cost about 7 s a module); a module
    that needs another cluster (the fault-tolerance test's) shuts it down, and the next module starts it again.
    """
    import ray
    from ray.data import DataContext

    if not ray.is_initialized():
        # address="local": without it ray.init joins the last cluster started on this machine, which may be
        # the other xdist worker's (the fault-tolerance test's), and refuses num_cpus for a cluster it joins.
        ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    context = DataContext.get_current()
    context.execution_no_progress_timeout_s = 120  # a hung pool fails the test instead of the CI run
    context.enable_progress_bars = False
    return ray


@pytest.fixture(scope="session")
def tiny_labels(tiny_zoo, tiny_models, tmp_path_factory):
    """Labels of the tiny zoo's train and held-out prompts at T = 0 and 1 (in-process, no Ray)."""
    import pyarrow.parquet as pq

    from blockpilot.data.labels import LABEL_SCHEMA, rows_to_table
    from blockpilot.data.sources import load_prompt_source
    from blockpilot.files import atomic_folder
    from blockpilot.labeling import Labeler, LabelSettings

    shared = shared_folder(tmp_path_factory)
    # Labels of another schema (a column added since) are labeled again, not read.
    schema = hashlib.sha256(str(LABEL_SCHEMA).encode()).hexdigest()[:8]
    folder = shared / f"tiny-labels-{tiny_zoo.name}-{schema}"
    out = {split: folder / split for split in ("train", "heldout")}
    with built_once(shared, "tiny-labels"):
        if all((path / "labels.parquet").is_file() for path in out.values()):
            return out
        labeler = Labeler(
            tiny_models, LabelSettings(temperatures=(0.0, 1.0), max_new_tokens=32, top_k=16, compile="off"), max_batch=16
        )
        for split, path in out.items():
            tasks = [(record, t) for record in load_prompt_source(f"zoo:{tiny_zoo}:{split}") for t in (0.0, 1.0)]
            rows = [row for rows in labeler.label_many(tasks) for row in rows]
            with atomic_folder(path) as staging:
                pq.write_table(rows_to_table(rows), staging / "labels.parquet")
    return out


@contextlib.contextmanager
def started_ray_head(folder: Path, temp_dir: Path | None) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A Ray head with its dashboard (the job server) on free ports, as `ray start --head` starts one, in Ray's temp
    dir `temp_dir` (None: the machine's); stopped by killing its process tree, so no other cluster on this machine is
    touched (`ray stop` would stop them all), and its address file removed where it still names this head, as `ray
    stop` does. Yields (dashboard URL, environment, BLOCKPILOT_HOME)."""
    from ray._common.utils import get_ray_address_file  # where `ray start` writes the head's address

    home = folder / "home"
    dashboard, gcs = free_port(), free_port()
    env = user_env(home, RAY_AUTH_MODE="disabled")
    command = (
        f"{BIN / 'ray'} start --head --block --num-cpus 4 --port {gcs} --dashboard-host 127.0.0.1 "
        f"--dashboard-port {dashboard} --ray-client-server-port {free_port()} "
        f"--dashboard-agent-listen-port {free_port()} --include-dashboard true --disable-usage-stats"
        + (f" --temp-dir {temp_dir}" if temp_dir is not None else "")
    )
    head = subprocess.Popen(
        command.split(),
        env=env,
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_healthy(f"{address}/api/version", head, timeout_s=120)
        yield address, env, home
    finally:
        processes: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):  # a head already gone leaves nothing to find
            root = psutil.Process(head.pid)
            processes = [root, *root.children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=30)
        address_file = Path(get_ray_address_file(None if temp_dir is None else str(temp_dir)))
        with contextlib.suppress(FileNotFoundError):
            if address_file.read_text().strip().endswith(f":{gcs}"):
                address_file.unlink()


@pytest.fixture
def ray_head(tmp_path):
    """A head for `ray job submit` and `serve deploy`, in a Ray temp dir of its own. In the machine's, a job's driver
    joins the cluster that dir's address file names, the last one `ray start` started: with two heads up at once
    (the other xdist worker's `local_ray_head`), a job of this one ran in the other, which had none of its files."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        with started_ray_head(tmp_path, temp_dir) as head:
            yield head
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def local_ray_head(tmp_path):
    """A head as a user starts one with `ray start --head`, in the machine's Ray temp dir: the cluster the commands'
    embedded Ray must leave alone."""
    with started_ray_head(tmp_path, None) as head:
        yield head
