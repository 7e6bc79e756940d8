"""Predictor training on Ray Train with MLflow: a tracked run, a killed worker, resuming by name, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from pipelines.train_predictor import TrainJob, prepare, run_train_job

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def job(label_dirs: dict, tmp_path: Path, **overrides) -> TrainJob:
    defaults = dict(
        labels=label_dirs["train"],
        eval=label_dirs["heldout"],
        kind="sparse",
        hidden_size=64,
        epochs=3,
        batch_size=32,
        lr=3e-3,
        storage=tmp_path / "ray",
        out=tmp_path / "predictor",
        name="tiny",
    )
    return TrainJob(**{**defaults, **overrides})


def _train_workers() -> list[psutil.Process]:
    """This test process's Ray Train workers: its embedded Ray's processes descend from it. Another pytest worker
    runs a Ray of its own, whose Train workers must not be killed here (CI once lost a step-model fit so)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if "RayTrainWorker" in " ".join(process.cmdline()):
                found.append(process)
    return found


def _committed_checkpoint(snapshot: Path) -> bool:
    try:
        return json.loads(snapshot.read_text()).get("latest_checkpoint_result") is not None
    except (OSError, json.JSONDecodeError):  # not written yet, or being written
        return False


def test_a_tracked_run_survives_a_killed_worker_and_resumes_only_on_request(
    local_ray, tiny_labels, tmp_path, mlflow_store, capsys
):
    """One tracked Ray Train fit whose worker is killed once it has committed a checkpoint: the restarted worker
    resumes from it, every epoch is logged to the same MLflow run, and the predictor is registered and loads by
    URI. Afterwards the finished run continues only under --resume, and only as the same job."""
    import mlflow

    outcome, failures = [], []

    def train() -> None:
        try:
            outcome.append(run_train_job(job(tiny_labels, tmp_path, epochs=6)))
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=train)
    thread.start()
    snapshot = tmp_path / "ray" / "tiny" / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and thread.is_alive():
        # Kill once Ray Train has committed a checkpoint (its snapshot names one) and the worker still runs.
        if _committed_checkpoint(snapshot) and _train_workers():
            break
        time.sleep(0.1)
    victims = _train_workers()
    assert victims, "a running Ray Train worker to kill"
    for process in victims:
        process.kill()
    thread.join(timeout=600)
    assert not failures, failures
    result = outcome[0]
    assert result.first_epoch > 0, "the restarted worker resumed from a checkpoint instead of epoch 0"
    assert (result.last_epoch, result.model_version) == (5, "1")
    assert (result.predictor_dir / "model.safetensors").is_file()
    assert {"tau_pred", "tau_B", "tau_best_fixed", "tau_oracle", "gap_captured", "accuracy"} <= set(result.val_metrics)
    assert "T0/tau_pred" in result.eval_metrics and "T1/gap_captured" in result.eval_metrics
    # Ray Train tracks the last two checkpoints (a checkpoint the killed worker was writing may stay on disk).
    tracked = json.loads(snapshot.read_text())["checkpoint_results"]
    assert [entry["metrics"]["epoch"] for entry in tracked] == [4, 5], tracked
    assert all((snapshot.parent / entry["checkpoint_dir_name"]).is_dir() for entry in tracked)

    mlflow.set_tracking_uri(mlflow_store)
    client = mlflow.MlflowClient()
    # Epochs after the last checkpoint ran twice (before and after the kill); every epoch is there.
    history = client.get_metric_history(result.run_id, "val/tau_pred")
    assert {m.step for m in history} == set(range(6))
    run = client.get_run(result.run_id)
    assert run.data.params["kind"] == "sparse" and "eval/tau_pred" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"confusion_matrix.png", "tau_by_policy.png", "predictor"} <= artifacts
    assert client.get_model_version("blockpilot-predictor", "1").run_id == result.run_id

    from blockpilot.cli import main

    zoo = Path(pq.read_table(tiny_labels["train"]).column("target_id")[0].as_py()).parent
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--target",
                str(zoo / "target"),
                "--drafter",
                str(zoo / "drafter"),
                "--prompt",
                "Count from 1 to 9.",
                "--predictor",
                "models:/blockpilot-predictor/1",
                "--max-new-tokens",
                "16",
                "--compile",  # what is checked is the registered predictor loading by URI; compiled: the on-Ray test
                "off",
                "--json",
            ]
        )
        == 0
    )
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["policy"] == "learned" and payload["block_size"] in (2, 3, 4, 5, 6)

    with pytest.raises(ValueError, match="already exists.*--resume"):
        run_train_job(job(tiny_labels, tmp_path, epochs=7, track=False))
    with pytest.raises(ValueError, match="differing: .*hidden_size"):
        run_train_job(job(tiny_labels, tmp_path, epochs=7, hidden_size=32, resume=True, track=False))
    again = run_train_job(job(tiny_labels, tmp_path, epochs=7, resume=True, track=False))
    assert (again.first_epoch, again.last_epoch) == (6, 6), "the resumed run starts after the last epoch"


def test_runs_are_named_uniquely_unless_named(tiny_labels, tmp_path):
    names = {TrainJob(labels=tiny_labels["train"]).name for _ in range(3)}
    assert len(names) == 3 and all(name.startswith("sparse-normalized-gain-") for name in names)
    with pytest.raises(ValueError, match="--resume needs --name"):
        TrainJob(labels=tiny_labels["train"], resume=True)


def test_bad_labels_stop_before_training(tiny_labels, tmp_path):
    table = pq.read_table(tiny_labels["train"])
    pq.write_table(table.drop_columns(["tau"]), tmp_path / "no_tau.parquet")
    with pytest.raises(ValueError, match=r"missing columns \['tau'\]"):
        run_train_job(job(tiny_labels, tmp_path, labels=tmp_path / "no_tau.parquet"))

    import pyarrow as pa

    errors = table.set_column(
        table.schema.get_field_index("error"), "error", pa.array(["empty prompt"] * table.num_rows)
    )
    pq.write_table(errors, tmp_path / "all_errors.parquet")
    with pytest.raises(ValueError, match="zero valid rows"):
        run_train_job(job(tiny_labels, tmp_path, labels=tmp_path / "all_errors.parquet"))

    other = table.set_column(
        table.schema.get_field_index("candidates"),
        "candidates",
        pa.array([[1, 2, 3, 4, 5]] * table.num_rows, pa.list_(pa.int32())),
    )
    pq.write_table(other, tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="mismatched candidates"):
        run_train_job(job(tiny_labels, tmp_path, val=tmp_path / "other.parquet"))


def test_the_step_model_trains_on_ray_and_reports_every_policy(local_ray, tiny_labels, tmp_path, mlflow_store, tiny_models):
    import mlflow

    from blockpilot.cost import CycleCost
    from blockpilot.decoding import GenerationConfig, generate
    from blockpilot.policies.resolve import resolve_policy
    from pipelines.train_step_policy import StepTrainJob, run_step_train_job

    # A curve measured at batch 1 and at batch 8: a load-aware model, trained and reported at each, each priced
    # with its own curve.
    curve = CycleCost({1: {1: 0.010, 8: 0.011}, 8: {1: 0.020, 8: 0.045}}, device="test")
    cost = curve.save(tmp_path / "cost.json")
    outcome = run_step_train_job(
        StepTrainJob(
            labels=tiny_labels["train"], eval=tiny_labels["heldout"], cost=cost, epochs=2,
            storage=tmp_path / "ray", out=tmp_path / "step", name="step-tiny",
        )
    )
    kept = [path for path in (tmp_path / "ray" / "step-tiny").glob("checkpoint_*") if path.is_dir()]
    assert len(kept) == 2, f"a checkpoint per epoch, the last two kept: found {kept}"
    with pytest.raises(ValueError, match="already exists.*another --name"):
        run_step_train_job(StepTrainJob(labels=tiny_labels["train"], storage=tmp_path / "ray", name="step-tiny"))
    for group in ("", "T0/", "T1/", "load1/", "load8/T0/"):
        assert outcome.metrics[f"{group}throughput_step"] <= outcome.metrics[f"{group}throughput_step_oracle"] + 1e-9
        assert {f"{group}tau_B", f"{group}tau_best_fixed", f"{group}tau_oracle"} <= set(outcome.metrics)
    # Without a prefix: at the largest load. Fixed walks cost what the curve at that load says.
    assert outcome.metrics["throughput_step"] == outcome.metrics["load8/throughput_step"]
    assert outcome.metrics["load1/tau_B"] == outcome.metrics["load8/tau_B"]
    assert outcome.metrics["load1/throughput_B"] > outcome.metrics["load8/throughput_B"]
    mlflow.set_tracking_uri(mlflow_store)
    client = mlflow.MlflowClient()
    assert sorted(m.step for m in client.get_metric_history(outcome.run_id, "train/regret_loss")) == [0, 1]
    run = client.get_run(outcome.run_id)
    assert "eval/T0/throughput_step" in run.data.metrics
    assert {i.dataset.name for i in run.inputs.dataset_inputs} == {"labels/train/train", "labels/heldout/evaluation"}
    champion = client.get_model_version_by_alias("blockpilot-step-policy", "champion")
    assert champion.run_id == outcome.run_id

    prompt = tiny_models.encode_prompt("Count from 1 to 9.")
    config = GenerationConfig(max_new_tokens=16)
    from_folder = generate(tiny_models, prompt, policy=resolve_policy(f"learned-step:{outcome.model_dir}", tiny_models), config=config)
    assert from_folder.policy == "learned-step" and len(from_folder.block_sizes) == from_folder.cycles
    registered = resolve_policy("learned-step:models:/blockpilot-step-policy@champion", tiny_models)
    assert generate(tiny_models, prompt, policy=registered, config=config).block_sizes == from_folder.block_sizes
    # Its confidence rule, fitted on the same labels, saved beside it, reported, and served from either place.
    assert (outcome.model_dir / "confidence.json").is_file() and "eval/T0/throughput_rule" in run.data.metrics
    for rule in (outcome.model_dir, "models:/blockpilot-step-policy@champion"):
        ruled = generate(tiny_models, prompt, policy=resolve_policy(f"confidence:{rule}", tiny_models), config=config)
        assert ruled.policy == "confidence" and ruled.token_ids == from_folder.token_ids
    # MLflow's own loader: the pyfunc picks, per row of step features, the block size the model picks.
    import numpy as np
    import pandas as pd

    from blockpilot.predictor.step_features import NO_TOKEN, CycleView
    from blockpilot.predictor.step_model import StepModel

    rng = np.random.default_rng(0)
    vocab = tiny_models.target.get_output_embeddings().weight.shape[0]
    model = StepModel.load(outcome.model_dir)
    view = CycleView(
        rng.random(16), 0.0, rng.integers(1, 40, 16), rng.integers(NO_TOKEN, vocab, (16, 2)),
        batch_rows=rng.choice([1, 2, 8, 30], size=16),
    )
    features = model.config.features.build(view)
    assert model.config.vocab_size == vocab and model.config.loads == (1, 8) and not model.config.prior
    assert curve.describe() in model.config.extra["cost"]
    assert model.feature_mean.abs().sum() > 0  # standardized on its training cycles
    pyfunc = mlflow.pyfunc.load_model(f"models:/blockpilot-step-policy/{champion.version}")
    expected = [model.config.candidates[k] for k in model.choose(features)]
    assert list(pyfunc.predict(pd.DataFrame(features, columns=list(model.config.features.names)))) == expected


def test_a_step_model_beside_a_prior_keeps_it_where_the_held_out_share_says_it_walks_faster(
    local_ray, tiny_labels, tmp_path, mlflow_store
):
    """With --prior, a first fit leaves a share of the --labels prompts out; per temperature, the model (fitted again
    on every prompt) keeps the prior's b0 where on that share the prior's walks were faster than the first fit's, as
    the run logs them."""
    import mlflow
    import pyarrow.parquet as pq
    import torch

    from blockpilot.cost import CycleCost
    from blockpilot.predictor import BlockSizePredictor, PredictorConfig
    from blockpilot.predictor.step_data import regret_dataset, step_rows
    from blockpilot.predictor.step_model import StepModel
    from blockpilot.walks import ADAPT_CONFIDENCE, ADAPT_MARGIN
    from pipelines.train_step_policy import StepTrainJob, run_step_train_job

    table = pq.read_table(tiny_labels["train"])
    candidates = tuple(table["candidates"][0].as_py())
    vocab = max(max(ids) for ids in table["topk_ids"].to_pylist() if ids) + 1
    torch.manual_seed(0)
    BlockSizePredictor(PredictorConfig("sparse", candidates, vocab, top_k=4, hidden_size=8)).save(tmp_path / "prior")
    outcome = run_step_train_job(
        StepTrainJob(
            labels=tiny_labels["train"], prior=str(tmp_path / "prior"), val_share=0.5, epochs=1,
            storage=tmp_path / "ray", out=tmp_path / "step", name="step-prior",
        )
    )
    config = StepModel.load(outcome.model_dir).config
    assert config.prior and config.temperatures == (0.0, 1.0)

    mlflow.set_tracking_uri(mlflow_store)
    run = mlflow.MlflowClient().get_run(outcome.run_id)
    for t in (0, 1):
        step, prior = (run.data.metrics[f"validation/T{t}/throughput_{k}"] for k in ("step", "request"))
        surely = run.data.metrics[f"validation/T{t}/p_faster"] >= ADAPT_CONFIDENCE
        assert (t not in config.prior_temperatures) == (step > (1 + ADAPT_MARGIN) * prior and surely)
    assert json.loads(run.data.params["prior_temperatures"]) == list(config.prior_temperatures)
    # The comparison's fit left the share out; the model's is on every prompt.
    rows = step_rows(table, BlockSizePredictor.load(tmp_path / "prior"))
    cycles = regret_dataset(rows, StepModel(config), CycleCost.uniform())[0]
    assert int(run.data.params["training_cycles"]) == len(cycles)


def test_train_runs_poll_their_reports_often_unless_the_user_says_otherwise(monkeypatch):
    """Ray Train's default 2 s poll made every reported epoch of a small fit wait up to 2 s."""
    from pipelines.ray_runtime import REPORT_POLL_ENV, REPORT_POLL_S, train_run_config

    monkeypatch.delenv(REPORT_POLL_ENV, raising=False)
    config = train_run_config(name="poll")
    assert config.name == "poll" and config.logging_config.log_level == "WARNING"
    assert float(REPORT_POLL_S) < 2.0 and os.environ[REPORT_POLL_ENV] == REPORT_POLL_S
    monkeypatch.setenv(REPORT_POLL_ENV, "1.5")
    train_run_config(name="poll")
    assert os.environ[REPORT_POLL_ENV] == "1.5"


def test_a_predictor_chooses_among_the_candidates_it_is_given(tiny_labels, tmp_path):
    """`train --candidates 2,3,4,5,6` (the paper's B-2..B+2): the predictor's classes, its training and held-out
    labels are those; none outside the labels' is accepted."""
    prepared = prepare(job(tiny_labels, tmp_path, candidates=(2, 3, 4, 5, 6)))
    assert prepared.predictor_config["candidates"] == [2, 3, 4, 5, 6]
    for labels in (prepared.train, prepared.val, prepared.evaluation):
        assert {tuple(c) for c in labels["candidates"].to_pylist()} == {(2, 3, 4, 5, 6)}
    assert prepare(job(tiny_labels, tmp_path)).predictor_config["candidates"][0] == 1  # autoregression, by default
    with pytest.raises(ValueError, match="subset of the labels'"):
        prepare(job(tiny_labels, tmp_path, candidates=(2, 40)))
