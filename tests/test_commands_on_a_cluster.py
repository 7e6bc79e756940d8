"""`ray job submit` of the pipelines and `serve deploy` of cluster/serve.yaml, as the README shows them, against a Ray
head the test starts (`ray start --head`, with the dashboard that serves jobs) on free ports: two replicas, and one
started after the champion moved serves the version the deployment pinned."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from commands import ROOT, UNACTIONABLE, check_endpoint, free_port, run, wait_healthy

from blockpilot.data.labels import read_labels

pytestmark = pytest.mark.slow


def local_runtime_env(path: Path, home: Path) -> Path:
    """`ray_job.yaml` for this machine: the same working directory and excludes; no pip packages (the head runs in
    this venv, which has them) and the environment pointing at local folders instead of the cluster's."""
    runtime_env = yaml.safe_load((ROOT / "ray_job.yaml").read_text())
    runtime_env.pop("pip")
    runtime_env["working_dir"] = str(ROOT)
    runtime_env["env_vars"] = {"BLOCKPILOT_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    path.write_text(yaml.safe_dump(runtime_env))
    return path


# Ray's race (ray-project/ray issue 36703): a job submitted right after another with the same working directory can
# find the package still listed, skip the upload, and then fail to download it on the node. Resubmitting the same
# directory is not enough: the package stays listed and the second download fails too (a CI run, 2026-11-26). Ray's
# own advice is to change a file of the package, so the resubmission packs a copy of the repository's files with one
# file added, which uploads under a new name.
PACKAGE_LOST = "Failed to download runtime_env file package"


def fresh_package(runtime_env: Path, attempt: str) -> Path:
    """A copy of `runtime_env` whose working directory is a copy of the repository's tracked files plus a file naming
    `attempt`, so its content (and with it the package's name) is new."""
    copy = runtime_env.parent / f"working_dir_{attempt}"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    (copy / "resubmission.txt").write_text(f"{attempt}\n")
    settings = yaml.safe_load(runtime_env.read_text())
    settings["working_dir"] = str(copy)
    fresh = runtime_env.with_name(f"{runtime_env.stem}_{attempt}.yaml")
    fresh.write_text(yaml.safe_dump(settings))
    return fresh


def submit(address: str, runtime_env: Path, command: str, env: dict[str, str]) -> str:
    """`ray job submit` of `command`, as the README shows it; once more with a fresh package where Ray lost it."""
    line = f"ray job submit --address {address} --runtime-env {{}} -- {command}"
    try:
        return run(line.format(runtime_env), env, noise=UNACTIONABLE)
    except AssertionError as failure:
        if PACKAGE_LOST not in str(failure):
            raise
    return run(line.format(fresh_package(runtime_env, uuid.uuid4().hex[:8])), env, noise=UNACTIONABLE)


def test_ray_job_submit_and_serve_deploy_on_a_running_head(ray_head, tiny_zoo, tmp_path):
    address, env, home = ray_head
    runtime_env = local_runtime_env(tmp_path / "ray_job.yaml", home)
    models = f"--target {tiny_zoo / 'target'} --drafter {tiny_zoo / 'drafter'}"
    labels, predictor = tmp_path / "labels", tmp_path / "predictor"
    submit(
        address,
        runtime_env,
        f"python -m pipelines.label --prompts zoo:{tiny_zoo} {models} --out {labels} --limit 8 "
        f"--temperatures 0 --max-new-tokens 16 --top-k 8 --actors 1 --num-cpus-per-actor 0.5 --no-track --compile off",
        env,
    )
    assert read_labels(labels).num_rows == 8
    # Tracked in the head's home (the runtime env's BLOCKPILOT_HOME): registered and crowned, as serve.yaml's
    # `models:/blockpilot-predictor@champion` expects.
    submit(
        address,
        runtime_env,
        f"python -m pipelines.train_predictor --labels {labels} --eval {labels} --epochs 1 --out {predictor}",
        env,
    )
    assert (predictor / "config.json").is_file()

    # cluster/serve.yaml with this zoo's models and a free port, as `serve deploy` sends it (the package is installed
    # in the venv the head runs in, as in the cluster's image).
    config = yaml.safe_load((ROOT / "cluster" / "serve.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    application = config["applications"][0]
    # The eager cycle: what this test is about is the deployment (compiled serving is test_commands_on_ray.py's).
    # Two replicas from the start, each serving the predictor as serve.yaml names it (the champion alias).
    assert application["args"]["predictor"] == "models:/blockpilot-predictor@champion"
    application["args"].update(target=str(tiny_zoo / "target"), drafter=str(tiny_zoo / "drafter"), compile="off")
    application["args"]["autoscaling_config"]["min_replicas"] = 2
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    run(f"serve deploy --address {address} {tmp_path / 'serve.yaml'}", env, noise=UNACTIONABLE)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/health")
    check_endpoint(url, application["args"]["model_name"])
    first = replica_processes(home, 2)
    assert served_predictors(url) == {"models:/blockpilot-predictor/1"}  # pinned as the app deployed

    # A new champion, then a replica that starts after it (one killed, which Serve replaces): it serves the version
    # the deployment pinned, as its sibling does, until the next deploy.
    import mlflow

    from blockpilot.tracking import log_predictor_model, start_run

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKPILOT_HOME", str(home))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        with start_run("blockpilot-predictor", "a later champion") as tracker:
            version, _ = log_predictor_model(tracker, predictor, heldout_throughput=1.0)
        mlflow.MlflowClient().set_registered_model_alias("blockpilot-predictor", "champion", version)
    assert version == "2"
    first[0].kill()
    replacement = replica_processes(home, 2, other_than={process.pid for process in first})
    wait_healthy(f"{url}/health")
    assert replacement and served_predictors(url) == {"models:/blockpilot-predictor/1"}


def replica_processes(
    home: Path, count: int, other_than: set[int] = frozenset(), timeout_s: float = 120
) -> list[psutil.Process]:
    """The decoder's replica processes of the head whose home is `home` (Ray titles them `ray::ServeReplica:...`; the
    other worker's servers have homes of their own), once `count` of them run and one is not in `other_than` (when
    given): a replacement has started."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if not any("ServeReplica:blockpilot:BlockPilotDecoder" in part for part in process.info["cmdline"] or ()):
                continue
            with contextlib.suppress(psutil.Error):
                if process.environ().get("BLOCKPILOT_HOME") == str(home):
                    found.append(process)
        if len(found) == count and (not other_than or {p.pid for p in found} - set(other_than)):
            return found
        assert time.monotonic() < deadline, f"expected {count} replicas, found {len(found)}"
        time.sleep(0.5)


def served_predictors(url: str, requests: int = 12) -> set[str]:
    """The predictor each of `requests` answers of `/v1/models` names: Serve spreads them over the replicas."""
    return {httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["blockpilot"]["predictor"] for _ in range(requests)}
