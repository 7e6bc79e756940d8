"""The README's commands that start Ray, run as a user types them (subprocesses on the tiny zoo, small limits):
`label`, `train`, `train-step`, `generate` with the learned policies, `serve` (the openai client, a bad request,
then Ctrl-C), and `python -m pipelines.X` under `ray job submit` plus `serve deploy` against a Ray head the test
starts."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from commands import BIN, ROOT, free_port, run, user_env
from support import greedy_reference

from blockpilot.data.labels import read_labels

pytestmark = pytest.mark.slow

PROMPT = "Count from 3 to 14."
PREDICTOR = "models:/blockpilot-predictor@champion"
STEP_MODEL = "models:/blockpilot-step-policy@champion"
LABEL_LIMITS = "--temperatures 0,1 --max-new-tokens 16 --top-k 8 --samples 2"


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout_s: float = 180) -> None:
    """Until GET `url` answers 200; fails if `process` (the server's, when the test started it) exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            output = process.stdout.read()[-4000:] if process.stdout else ""
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


def test_label_train_generate_and_serve(tiny_zoo, tiny_models, tmp_path):
    env = user_env(tmp_path / "home")
    models = f"--target {tiny_zoo / 'target'} --drafter {tiny_zoo / 'drafter'}"
    labels = tmp_path / "labels"
    run(f"blockpilot calibrate {models} --block-sizes 1,2,4,8 --repeats 1 --cycles 2 --out {tmp_path / 'cost.json'}", env)
    run(f"blockpilot label --prompts zoo:{tiny_zoo} {models} --out {labels / 'train'} --limit 8 {LABEL_LIMITS}", env)
    printed = run(
        f"blockpilot label --prompts zoo:{tiny_zoo}:heldout {models} --out {labels / 'heldout'} --limit 4 {LABEL_LIMITS}",
        env,
    )
    assert "rows: 8 (8 new, 0 with errors)" in printed
    assert read_labels(labels / "train").num_rows == 16

    printed = run(
        f"blockpilot train --labels {labels / 'train'} --eval {labels / 'heldout'} --objective normalized-gain "
        f"--score throughput --cost {tmp_path / 'cost.json'} --epochs 1",
        env,
    )
    assert "the new champion" in printed
    printed = run(
        f"blockpilot train-step --labels {labels / 'train'} --eval {labels / 'heldout'} --cost {tmp_path / 'cost.json'} "
        f"--epochs 1 --prior {PREDICTOR}",
        env,
    )
    assert "the new champion" in printed

    greedy = greedy_reference(tiny_models.target, tiny_models.encode_prompt(PROMPT), 24, tiny_models.stop_token_ids())
    generate = f"blockpilot generate {models} --prompt '{PROMPT}' --max-new-tokens 24 --json"
    for flags, policy in [(f"--predictor {PREDICTOR}", "learned"), (f"--policy learned+step:{PREDICTOR},{STEP_MODEL}", "learned+step")]:
        payload = json.loads(run(f"{generate} {flags}", env))
        assert payload["token_ids"] == greedy and payload["policy"] == policy

    port = free_port()
    command = f"{BIN / 'blockpilot'} serve {models} --predictor {PREDICTOR} --step-model {STEP_MODEL} --port {port}"
    server = subprocess.Popen(command.split(), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: list[psutil.Process] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server)
        started = psutil.Process(server.pid).children(recursive=True)  # Ray's processes: GCS, raylet, workers
        assert started
        check_endpoint(f"http://127.0.0.1:{port}", "blockpilot")
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=90)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, output[-4000:]
    assert "stopping the endpoint" in output
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left running after Ctrl-C: {[p.info for p in alive]}"


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head with its dashboard (the job server) on free ports, as `ray start --head` starts one; stopped by
    killing its process group, so no other cluster on this machine is touched (`ray stop` would stop them all)."""
    home = tmp_path / "home"
    dashboard, gcs = free_port(), free_port()
    env = user_env(home, RAY_AUTH_MODE="disabled")
    command = (
        f"{BIN / 'ray'} start --head --block --num-cpus 4 --port {gcs} --dashboard-host 127.0.0.1 "
        f"--dashboard-port {dashboard} --ray-client-server-port {free_port()} "
        f"--dashboard-agent-listen-port {free_port()} --include-dashboard true --disable-usage-stats"
    )
    head = subprocess.Popen(
        command.split(), env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_healthy(f"{address}/api/version", head, timeout_s=120)
        yield address, env, home
    finally:
        processes = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=30)


def local_runtime_env(path: Path, home: Path) -> Path:
    """`ray_job.yaml` for this machine: the same working directory and excludes; no pip packages (the head runs in
    this venv, which has them) and the environment pointing at local folders instead of the cluster's."""
    runtime_env = yaml.safe_load((ROOT / "ray_job.yaml").read_text())
    runtime_env.pop("pip")
    runtime_env["working_dir"] = str(ROOT)
    runtime_env["env_vars"] = {"BLOCKPILOT_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    path.write_text(yaml.safe_dump(runtime_env))
    return path


def test_ray_job_submit_and_serve_deploy_on_a_running_head(ray_head, tiny_zoo, tmp_path):
    address, env, home = ray_head
    runtime_env = local_runtime_env(tmp_path / "ray_job.yaml", home)
    submit = f"ray job submit --address {address} --runtime-env {runtime_env} --"
    models = f"--target {tiny_zoo / 'target'} --drafter {tiny_zoo / 'drafter'}"
    labels, predictor = tmp_path / "labels", tmp_path / "predictor"
    run(
        f"{submit} python -m pipelines.label --prompts zoo:{tiny_zoo} {models} --out {labels} --limit 8 "
        f"--temperatures 0 --max-new-tokens 16 --top-k 8 --actors 1 --num-cpus-per-actor 0.5 --no-track",
        env,
    )
    assert read_labels(labels).num_rows == 8
    run(f"{submit} python -m pipelines.train_predictor --labels {labels} --epochs 1 --out {predictor} --no-track", env)
    assert (predictor / "config.json").is_file()

    # cluster/serve.yaml with this zoo's models and a free port, as `serve deploy` sends it (the package is installed
    # in the venv the head runs in, as in the cluster's image).
    config = yaml.safe_load((ROOT / "cluster" / "serve.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    application = config["applications"][0]
    application["args"].update(target=str(tiny_zoo / "target"), drafter=str(tiny_zoo / "drafter"), predictor=str(predictor))
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    run(f"serve deploy --address {address} {tmp_path / 'serve.yaml'}", env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/health")
    check_endpoint(url, application["args"]["model_name"])
