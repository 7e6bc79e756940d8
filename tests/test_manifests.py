"""The runtime environment and cluster manifests parse and carry the keys that matter."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_ray_job_runtime_env():
    env = load("ray_job.yaml")
    assert env["working_dir"] == "."
    assert {".git", ".venv"} <= set(env["excludes"])
    assert {"MLFLOW_TRACKING_URI", "HF_HOME", "BLOCKPILOT_HOME"} <= set(env["env_vars"])
    packages = " ".join(env["pip"]["packages"])
    assert "transformers" in packages and "mlflow>=3.17,<3.18" in packages


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split("."))


def test_versions_compare_as_numbers():
    assert version("2.60") > version("2.52") > version("2.9")


def _gpu_group(spec: dict) -> dict:
    groups = [
        g
        for g in spec["workerGroupSpecs"]
        if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
    ]
    assert groups, "a GPU worker group"
    return groups[0]


def test_raycluster_has_gpu_workers_and_token_auth():
    cluster = load("cluster/raycluster-label.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    assert spec["authOptions"]["mode"] == "token"
    assert version(spec["rayVersion"]) >= (2, 52)
    assert _gpu_group(spec)["template"]["spec"]["containers"][0]["image"].startswith("rayproject/ray:2.60.0")


def test_rayjob_runs_the_label_pipeline_with_token_auth():
    job = load("cluster/rayjob-label.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["entrypoint"].startswith("python -m pipelines.label ")
    assert "--num-gpus-per-actor 1" in spec["entrypoint"]
    assert spec["rayClusterSpec"]["authOptions"]["mode"] == "token"
    _gpu_group(spec["rayClusterSpec"])
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert "MLFLOW_TRACKING_URI" in runtime_env["env_vars"]


def test_cluster_launcher_config():
    config = load("cluster/cluster-launcher.yaml")
    assert config["head_node_type"] in config["available_node_types"]
    assert any("RAY_AUTH_MODE=token" in option for option in config["docker"]["run_options"])
    assert all("RAY_AUTH_MODE=token" in cmd for cmd in config["head_start_ray_commands"] if "ray start" in cmd)
    assert "127.0.0.1" in " ".join(config["head_start_ray_commands"])


def test_the_serve_config_lets_a_replica_queue_what_it_cannot_batch():
    """Serve's router must route a replica more requests than it batches, or its own queue (and its 503 with
    Retry-After) is never used: the default (`build_app`) is twice the batch plus the queue."""
    from blockpilot.serving import ServeLimits

    from pipelines.serve import DEPLOYMENT_OPTIONS, ModelLoader

    (application,) = load("cluster/serve.yaml")["applications"]
    args = application["args"]
    unknown = set(args) - set(DEPLOYMENT_OPTIONS) - set(ModelLoader.__dataclass_fields__)
    assert not unknown, f"app_builder would refuse {unknown}"
    limits = ServeLimits(**args.get("limits", {}))
    assert args.get("max_ongoing_requests", 2 * (limits.max_batch + limits.max_queue)) > limits.max_batch + limits.max_queue
