"""The README's commands that start an embedded Ray, run as a user types them (subprocesses on the tiny zoo, small
limits): `label`, `train`, `train-step`, `generate` with the learned policies, `serve` (the openai client, a bad
request, then SIGTERM). `test_commands_on_a_cluster.py` has `ray job submit` and `serve deploy`."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess

import httpx
import psutil
import pytest
from commands import BIN, PROMPT, ROOT, check_endpoint, check_quiet, free_port, run, user_env, wait_healthy
from support import greedy_reference

from blockpilot.cli import main
from blockpilot.data.labels import read_labels

pytestmark = pytest.mark.slow

PREDICTOR = "models:/blockpilot-predictor@champion"
STEP_MODEL = "models:/blockpilot-step-policy@champion"
LABEL_LIMITS = "--temperatures 0,1 --max-new-tokens 16 --top-k 8 --samples 2"


def test_label_train_generate_and_serve(tiny_zoo, tiny_models, tmp_path, local_ray_head, capsys):
    """Beside a local cluster that `ray start --head` started (`local_ray_head`), as on a machine where one runs: the
    commands start their own embedded Ray all the same, and nothing in them reaches for that cluster."""
    env = user_env(tmp_path / "home")
    models = f"--target {tiny_zoo / 'target'} --drafter {tiny_zoo / 'drafter'}"
    labels = tmp_path / "labels"  # --eval gets the same folder: a second labeling run would show nothing new
    # The curve the training prices with, in process (not a README form; a subprocess costs about 8 s of imports).
    calibrate = f"calibrate {models} --block-sizes 1,2,4,8 --repeats 1 --cycles 2 --compile off"
    assert main(shlex.split(f"{calibrate} --out {tmp_path / 'cost.json'}")) == 0
    assert "b=8" in capsys.readouterr().out
    # The README's labeling, as a user types it: the reference generations on the compiled cycle.
    printed = run(f"blockpilot label --prompts zoo:{tiny_zoo} {models} --out {labels} --limit 8 {LABEL_LIMITS}", env)
    assert "rows: 16 (16 new, 0 with errors)" in printed and "shape or" in printed  # the trees' headroom too
    assert read_labels(labels).num_rows == 16

    printed = run(
        f"blockpilot train --labels {labels} --eval {labels} --objective normalized-gain "
        f"--score throughput --cost {tmp_path / 'cost.json'} --epochs 1",
        env,
    )
    assert "the new champion" in printed
    # The endpoint as the README shows it, started now: the replica builds its compiled shapes (about a minute on 2
    # cores) while the commands below run, as a user would go on working beside a server. (A step model's pinning
    # and replica: test_serving.py.)
    port = free_port()
    command = f"{BIN / 'blockpilot'} serve {models} --predictor {PREDICTOR} --port {port}"
    log = tmp_path / "serve.log"  # a file, not a pipe: a pipe nobody reads would stall a chatty server
    with open(log, "w") as output_file:
        server = subprocess.Popen(command.split(), cwd=ROOT, env=env, stdout=output_file, stderr=subprocess.STDOUT)
    started: list[psutil.Process] = []
    try:
        _train_and_generate_beside_the_server(tiny_zoo, tiny_models, models, labels, tmp_path, env, capsys)
        # The replica's cold build is this test's longest step: 379 s alone on a 2-core CPU without AVX-512, more
        # beside the other test worker; the guard is against a hang only.
        wait_healthy(f"http://127.0.0.1:{port}/health", server, log, timeout_s=900)
        started = psutil.Process(server.pid).children(recursive=True)  # Ray's processes: GCS, raylet, workers
        assert started
        check_endpoint(f"http://127.0.0.1:{port}", "blockpilot")
        # The alias was pinned as the app deployed: the version it named then, which every replica serves.
        served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["blockpilot"]
        assert (served["predictor"], served["step_model"], served["policy"]) == (
            "models:/blockpilot-predictor/1",
            None,
            "learned:models:/blockpilot-predictor/1",
        )
        # What a process manager sends (Ctrl-C's SIGINT takes the same path, and reaches Ray's processes too): the
        # server alone gets it, lets the request in flight finish, and must leave none of them running.
        long_body = {"prompt": PROMPT, "max_tokens": 512, "block_size": 1, "ignore_eos": True, "stream": True}
        long_body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=long_body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # decoding has begun
            server.send_signal(signal.SIGTERM)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        server.wait(timeout=90)
    finally:
        if server.poll() is None:
            server.kill()
    output = log.read_text()
    assert server.returncode == 0, output[-4000:]
    # Stopped with that request in flight, which finished: every token it asked for, then its end.
    assert "stopping the endpoint (1 in flight, up to 20 s to finish)" in output
    assert rest[-1]["choices"][0]["finish_reason"] == "length" and rest[-1]["usage"]["completion_tokens"] == 512
    check_quiet(output, "blockpilot serve")
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left running after SIGTERM: {[p.info for p in alive]}"


def _train_and_generate_beside_the_server(tiny_zoo, tiny_models, models, labels, tmp_path, env, capsys) -> None:
    """`train-step`, `train --trees` and `generate` (both predictors, compiled and eager, and both registered models
    in one spec in process), each as the README shows it."""
    printed = run(
        f"blockpilot train-step --labels {labels} --eval {labels} --cost {tmp_path / 'cost.json'} "
        f"--epochs 1 --prior {PREDICTOR}",
        env,
    )
    assert "the new champion" in printed

    printed = run(f"blockpilot train --labels {labels} --eval {labels} --trees --epochs 1", env)
    assert "models:/blockpilot-shape-predictor/1 (the new champion)" in printed and "shape or" in printed

    greedy = greedy_reference(tiny_models.target, tiny_models.encode_prompt(PROMPT), 24, tiny_models.stop_token_ids())
    generate = f"blockpilot generate {models} --prompt '{PROMPT}' --max-new-tokens 24 --json"
    for flags, policy in [  # the first as the README shows it (compiled), the other on the eager cycle
        (f"--predictor {PREDICTOR}", "learned"),
        ("--policy learned:models:/blockpilot-shape-predictor@champion --compile off", "learned"),
    ]:
        payload = json.loads(run(f"{generate} {flags}", env))
        assert payload["token_ids"] == greedy and payload["policy"] == policy
    # Both registered models in one spec, in process (not a README form; a subprocess costs about 8 s of imports).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKPILOT_HOME", env["BLOCKPILOT_HOME"])
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        spec = f"--policy learned+step:{PREDICTOR},{STEP_MODEL} --compile off"
        assert main(shlex.split(f"{generate.removeprefix('blockpilot ')} {spec}")) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["token_ids"] == greedy and payload["policy"] == "learned+step"
