"""A worker node removed while labeling: every prompt still ends labeled exactly once."""

from __future__ import annotations

import threading
import time

import pytest

from blockpilot.data.labels import parquet_files, read_label_files
from blockpilot.labeling import LabelSettings
from pipelines.label import LabelJob, run_label_job

pytestmark = pytest.mark.slow


@pytest.fixture
def two_worker_cluster(isolated_home):
    """A head with no CPUs (driver only) and two 3-CPU worker nodes, all on this machine."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.data import DataContext

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=3) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    context = DataContext.get_current()
    context.execution_no_progress_timeout_s = 180
    context.enable_progress_bars = False
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def test_removing_a_worker_node_mid_job(two_worker_cluster, tiny_zoo, tmp_path):
    cluster, workers = two_worker_cluster
    out = tmp_path / "labels"
    # Two CPUs per actor: one actor per worker node, one CPU left on each for the Parquet writes.
    job = LabelJob(
        prompts=f"zoo:{tiny_zoo}",
        target=str(tiny_zoo / "target"),
        drafter=str(tiny_zoo / "drafter"),
        out=out,
        settings=LabelSettings(max_new_tokens=24, top_k=8, compile="off"),
        actors=2,
        num_cpus_per_actor=2,
        batch_size=1,
        limit=30,
        track=False,
    )
    results, failures = [], []

    def label() -> None:
        try:
            results.append(run_label_job(job))
        except BaseException as error:  # reported below
            failures.append(error)

    thread = threading.Thread(target=label)
    thread.start()
    deadline = time.monotonic() + 240
    while len(parquet_files(out)) < 3 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
    written_before = len(parquet_files(out))
    cluster.remove_node(workers[0])
    thread.join(timeout=600)
    assert not thread.is_alive(), "labeling did not finish after the node was removed"
    assert not failures, failures
    assert 0 < written_before < 30, "the node should have been removed while the job was running"
    table, _ = read_label_files(out)
    keys = list(zip(table["prompt_id"].to_pylist(), table["temperature"].to_pylist(), strict=True))
    assert len(keys) == 30 and len(set(keys)) == 30, "every prompt labeled exactly once"
    assert results[0].rows == 30 and results[0].errors == 0
