"""Every MLflow call of the project lives here.

The default store is SQLite under `$BLOCKPILOT_HOME/mlflow/` with artifacts beside it;
`MLFLOW_TRACKING_URI` overrides. Where MLflow is not installed (the GPU machine has none) or tracking is
switched off, `start_run` yields a `NullTracker` and the work goes on untracked: `tracker.enabled` is the one
place that says whether a run is being tracked.

Experiments are marked as model-training experiments, so the MLflow UI opens on their runs table. The
per-request predictor is registered as `blockpilot-predictor`, the per-step model as `blockpilot-step-policy`;
each one's `champion` alias moves to a new version only when that version beats the current champion on
held-out modeled throughput.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from blockpilot.home import blockpilot_home

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
PREDICTOR_MODEL_NAME = "blockpilot-predictor"
SHAPE_PREDICTOR_MODEL_NAME = "blockpilot-shape-predictor"  # a per-request predictor over block sizes and tree budgets
STEP_MODEL_NAME = "blockpilot-step-policy"
CHAMPION_ALIAS = "champion"
CHAMPION_METRIC_TAG = "heldout_throughput"
# The UI's experiment type: model training (its runs table), not GenAI (its traces overview).
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
_MODEL_CODE = Path(__file__).parent / "predictor" / "pyfunc.py"


class Tracker(Protocol):
    enabled: bool
    run_id: str | None

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_figure(self, figure: Any, name: str) -> None: ...

    def log_dataset(self, path: str | Path, frame: Any, name: str, context: str) -> None: ...


class NullTracker:
    """Tracks nothing; what runs get when MLflow is off or absent."""

    enabled = False
    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_figure(self, figure: Any, name: str) -> None:
        pass

    def log_dataset(self, path: str | Path, frame: Any, name: str, context: str) -> None:
        pass


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else SQLite under the home folder."""
    configured = os.environ.get(TRACKING_URI_ENV)
    if configured:
        return configured
    folder = blockpilot_home() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


def artifact_root() -> Path:
    return blockpilot_home() / "mlflow" / "artifacts"


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]
    return flat


def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}


class MLflowTracker:
    """One active MLflow run."""

    enabled = True

    def __init__(self, mlflow: Any, run: Any) -> None:
        self._mlflow = mlflow
        self.run_id: str | None = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._mlflow.log_params(_flatten(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        finite = _finite(metrics)
        if finite:
            self._mlflow.log_metrics(finite, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            self._mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_figure(self, figure: Any, name: str) -> None:
        self._mlflow.log_figure(figure, name)

    def log_dataset(self, path: str | Path, frame: Any, name: str, context: str) -> None:
        """Record a label set as an input of the run (the lineage labels -> predictor -> registered model)."""
        with _without_mlflow_hints():
            dataset = self._mlflow.data.from_pandas(frame, source=str(Path(path).resolve()), name=name)
            self._mlflow.log_input(dataset, context=context)


def mlflow_available() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def _experiment_id(mlflow: Any, name: str, uri: str) -> str:
    """The experiment's id, created when missing: creation first, so that two processes cannot both miss it
    and both create it."""
    from mlflow.exceptions import MlflowException

    # A SQLite store would put artifacts in ./mlruns of whatever folder we run in; keep them at home.
    location = (artifact_root() / name).as_uri() if uri.startswith("sqlite") else None
    try:
        experiment_id = mlflow.create_experiment(name, artifact_location=location)
    except MlflowException:
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is None:
            raise
        experiment_id = experiment.experiment_id
    mlflow.MlflowClient().set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return experiment_id


@contextlib.contextmanager
def start_run(
    experiment: str, run_name: str | None = None, *, enabled: bool = True, tags: Mapping[str, str] | None = None
) -> Iterator[Tracker]:
    """An MLflow run in `experiment` (created with its artifacts under the home folder), or a NullTracker."""
    if not enabled or not mlflow_available():
        yield NullTracker()
        return
    import mlflow

    _quiet_artifact_transfers()
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    experiment_id = _experiment_id(mlflow, experiment, uri)
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=dict(tags or {})) as run:
        yield MLflowTracker(mlflow, run)


# MLflow's tag that nests a run under another in the UI.
PARENT_RUN_TAG = "mlflow.parentRunId"


def parent_run(experiment: str, run_name: str, tags: Mapping[str, str] | None = None) -> str | None:
    """A finished run in `experiment` to nest runs under (their `PARENT_RUN_TAG`), so the UI groups them: its id,
    or None when tracking is unavailable. What compares them is logged to it afterwards (`log_to_run`)."""
    if not mlflow_available():
        return None
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    run = client.create_run(_experiment_id(mlflow, experiment, uri), run_name=run_name, tags=dict(tags or {}))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@dataclass(frozen=True)
class ComparedRun:
    """One run nested under a comparison's parent: its id and its metrics under their logged names."""

    run_id: str
    metrics: dict[str, float]

    def under(self, prefix: str) -> dict[str, float]:
        """The metrics logged under `prefix` (`eval/`, `live/`), without it: `walks` names."""
        return {key[len(prefix) :]: value for key, value in self.metrics.items() if key.startswith(prefix)}


@dataclass(frozen=True)
class Comparison:
    """The runs nested under an experiment's newest parent run, by their `configuration` tag."""

    experiment_id: str
    parent_id: str
    runs: dict[str, ComparedRun]


def _runs_newest_first(experiment: str, max_results: int | None = None) -> tuple[str, list[Any]] | None:
    """`experiment`'s id and its runs, newest first; None when tracking is unavailable or there is no such
    experiment."""
    if not mlflow_available():
        return None
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    found = mlflow.get_experiment_by_name(experiment)
    if found is None:
        return None
    limit = {} if max_results is None else {"max_results": max_results}
    runs = mlflow.search_runs([found.experiment_id], order_by=["start_time DESC"], output_format="list", **limit)
    return found.experiment_id, runs


def latest_comparison(experiment: str, tag: str = "configuration") -> Comparison | None:
    """The newest parent run of `experiment` that has runs nested under it (the demo's two predictors on the same
    labels), each child named by its `tag`; None when tracking is unavailable or nothing was compared."""
    found = _runs_newest_first(experiment)
    if found is None:
        return None
    experiment_id, runs = found
    children: dict[str, list[Any]] = {}
    for run in runs:
        if PARENT_RUN_TAG in run.data.tags:
            children.setdefault(run.data.tags[PARENT_RUN_TAG], []).append(run)
    for run in runs:  # newest first
        if run.info.run_id in children:
            nested = {
                child.data.tags.get(tag, child.info.run_name): ComparedRun(child.info.run_id, dict(child.data.metrics))
                for child in reversed(children[run.info.run_id])  # in the order they were trained
            }
            return Comparison(experiment_id, run.info.run_id, nested)
    return None


def latest_metric_histories(experiment: str, prefix: str) -> tuple[str, dict[str, dict[int, float]]] | None:
    """The newest run of `experiment`: its name and, for each metric named `prefix` + a key, the values it logged by
    step; None when tracking is unavailable or the experiment has no run."""
    found = _runs_newest_first(experiment, max_results=1)
    if found is None or not found[1]:
        return None
    import mlflow

    run, client = found[1][0], mlflow.MlflowClient()
    histories = {
        key[len(prefix) :]: {int(point.step): point.value for point in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
        if key.startswith(prefix)
    }
    return run.info.run_name, histories


def log_to_run(
    run_id: str, metrics: Mapping[str, float] | None = None, figures: Mapping[str, Any] | None = None
) -> None:
    """Metrics and figures (matplotlib, saved as `name`) into a run that has ended: a parent's comparison, a
    child's live figures measured after its training."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    for key, value in _finite(metrics or {}).items():
        client.log_metric(run_id, key, value)
    for name, figure in (figures or {}).items():
        client.log_figure(run_id, figure, name)


def _quiet_artifact_transfers() -> None:
    """A predictor is a few small files: a progress bar per file is noise in `generate`, `train` and the demo.
    Nor does a new SQLite store need two INFO lines about creating its tables."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


@contextlib.contextmanager
def _without_mlflow_hints() -> Iterator[None]:
    """MLflow's advice that does not apply here, said once per label set or model logged: a local Parquet
    folder 'can be interpreted in multiple ways' (both are the local artifact source), integer columns
    'cannot represent missing values' (labels have none), and a pyfunc whose type hints (a DataFrame in, a
    list of block sizes out) 'cannot be used to infer' a signature."""
    pyfunc_logger = logging.getLogger("mlflow.pyfunc")
    level = pyfunc_logger.level
    pyfunc_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
            yield
    finally:
        pyfunc_logger.setLevel(level)


def log_figures(tracker: Tracker, figures: Mapping[str, Any]) -> None:
    for name, figure in figures.items():
        tracker.log_figure(figure, name)


def log_epoch_metrics(run_id: str, metrics: Mapping[str, float], step: int, uri: str | None = None) -> None:
    """Log to an existing run from another process (a Ray Train worker), in the store at `uri` (the driver's:
    a worker's environment may differ; on a cluster that store must be a server every node reaches)."""
    import time

    import mlflow
    from mlflow.entities import Metric

    mlflow.set_tracking_uri(uri or tracking_uri())
    now = int(time.time() * 1000)
    mlflow.MlflowClient().log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in _finite(metrics).items()])


def log_label_set(tracker: Tracker, source: str | Path, table: Any, context: str) -> None:
    """Record a label set (a pyarrow table read from `source`) as the run's `context` dataset input: the
    lineage labels -> model -> registered version, one row per label (prompt, temperature, B*, tau)."""
    frame = table.select(["prompt_id", "source", "temperature", "best_block_size", "tau"]).to_pandas()
    tracker.log_dataset(source, frame, name=f"labels/{Path(source).name}/{context}", context=context)


# ----------------------------------------------------------------------------- the predictor as an MLflow model


CHAMPION_CONTEXT_TAG = "blockpilot.champion_context"


def champion_context(
    *, cost: Any, batch: int | None, evaluation: Any | None, target_id: str, drafter_id: str
) -> dict[str, str] | None:
    """What a held-out modeled throughput means, for comparing it with another: the cost curve and the batch it was
    priced at (or tokens per cycle without a curve), the evaluation set (its (prompt, temperature) keys), the target
    and the drafter. None without an evaluation set: a figure on the training labels crowns nothing."""
    if evaluation is None:
        return None

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    keys = sorted(zip(evaluation["prompt_id"].to_pylist(), evaluation["temperature"].to_pylist(), strict=True))
    return {
        "unit": "tokens per cycle" if cost.is_uniform else f"tokens per {cost.unit}",
        "cost": digest(cost.to_dict()["seconds"]),
        "batch": str(batch),
        "evaluation": digest(keys),
        "target_id": target_id,
        "drafter_id": drafter_id,
    }


def log_predictor_model(
    tracker: Tracker,
    predictor_dir: str | Path,
    heldout_throughput: float,
    registered_name: str = PREDICTOR_MODEL_NAME,
    context: dict[str, str] | None = None,
) -> tuple[str | None, bool]:
    """Log a predictor folder (per-request or per-step: its config says which) as a pyfunc (models-from-code:
    nothing pickled), register a new version of `registered_name`, and move its `champion` alias to it when its
    held-out modeled throughput beats the current champion's in the same `context` (`champion_context`: the same
    cost curve and batch, evaluation set, target and drafter). A version without a context (no held-out set) or in
    another context than the champion's is registered, never crowned; the first one with a context is.

    Returns (version, became champion); (None, False) when tracking is off. The folder rides as the model's
    artifact `predictor`; `download_model_folder` gives it back from `models:/NAME/VERSION` or `@champion`.
    """
    if not tracker.enabled:
        return None, False
    import mlflow

    with _without_mlflow_hints():
        info = mlflow.pyfunc.log_model(
            name="predictor-model",
            python_model=str(_MODEL_CODE),
            artifacts={"predictor": str(predictor_dir)},
            code_paths=[str(Path(__file__).parent)],
            pip_requirements=["torch", "safetensors", "numpy", "pandas", "pyarrow"],
            registered_model_name=registered_name,
        )
    version = getattr(info, "registered_model_version", None)
    if version is None:
        return None, False
    version = str(version)
    client = mlflow.MlflowClient()
    client.set_model_version_tag(registered_name, version, CHAMPION_METRIC_TAG, repr(float(heldout_throughput)))
    mine = json.dumps(context, sort_keys=True) if context is not None else None
    if mine is not None:
        client.set_model_version_tag(registered_name, version, CHAMPION_CONTEXT_TAG, mine)
    if mine is None or not math.isfinite(heldout_throughput):
        return version, False
    return version, _crown_the_best(client, registered_name, mine) == version


def _crown_the_best(client: Any, registered_name: str, context: str, attempts: int = 5) -> str | None:
    """Point the champion alias at the registered version of the best held-out figure in `context` (ties: the
    earlier version), re-reading until it stays there; None when the champion is of another context (figures that
    do not compare). MLflow has no compare-and-set, so every run that registers a version moves the alias to the
    best of all registered ones: runs racing each other converge on the same one, and a better run whose write lost
    the race is crowned by whichever reads after it registered."""
    import mlflow

    best = None
    for _ in range(attempts):
        try:
            champion = client.get_model_version_by_alias(registered_name, CHAMPION_ALIAS)
        except mlflow.exceptions.MlflowException:  # no champion yet
            champion = None
        if champion is not None and champion.tags.get(CHAMPION_CONTEXT_TAG) != context:
            return None
        comparable = []
        for v in client.search_model_versions(f"name = '{registered_name}'"):
            figure = float(v.tags.get(CHAMPION_METRIC_TAG, "nan"))
            if v.tags.get(CHAMPION_CONTEXT_TAG) == context and math.isfinite(figure):
                comparable.append((figure, -int(v.version), str(v.version)))
        best = max(comparable)[2]
        if champion is not None and str(champion.version) == best:
            return best
        client.set_registered_model_alias(registered_name, CHAMPION_ALIAS, best)
    return best


def download_model_folder(uri: str, artifact: str) -> Path:
    """The folder logged as `artifact` inside the MLflow model at `uri` (`models:/NAME/VERSION`, `@ALIAS`,
    `models:/NAME/latest`, `runs:/...`).

    An alias or `latest` is resolved to the version it names now, so a load follows the alias while every
    download is of one fixed version: kept under the home folder and reused, never left in a temporary folder.
    Downloads stage in a unique folder and are renamed into place, so concurrent readers never see half a model.
    """
    import hashlib

    import mlflow

    from blockpilot.files import atomic_folder

    _quiet_artifact_transfers()
    uri_of_store = tracking_uri()
    mlflow.set_tracking_uri(uri_of_store)
    try:
        fixed = _fixed_model_uri(uri)
        key = hashlib.sha256(f"{uri_of_store}|{fixed}".encode()).hexdigest()[:16]
        target = blockpilot_home() / "mlflow" / "downloads" / key
        if not target.is_dir():
            with atomic_folder(target) as staging:
                mlflow.artifacts.download_artifacts(artifact_uri=fixed, dst_path=str(staging))
    except Exception as error:  # unknown model, version, alias or store: all mean "cannot get it"
        raise FileNotFoundError(f"could not fetch {uri!r} from the MLflow store at {uri_of_store}: {error}") from error
    return _artifact_folder(target, uri, artifact)


def pinned_model_uri(uri: str) -> str:
    """`uri` as a deployment pins it: a registered model's alias or `latest` replaced by the version it names in the
    store now (`models:/NAME/VERSION`); anything else as it is."""
    import mlflow

    if not uri.startswith("models:/"):
        return uri
    store = tracking_uri()
    mlflow.set_tracking_uri(store)
    try:
        return _fixed_model_uri(uri)
    except Exception as error:  # unknown model, alias or store
        raise FileNotFoundError(f"could not resolve {uri!r} in the MLflow store at {store}: {error}") from error


def pinned_spec(spec: str) -> str:
    """A policy spec with every MLflow model URI in it pinned (`pinned_model_uri`)."""
    import re

    return re.sub(r"models:/[^,\s]+", lambda match: pinned_model_uri(match.group(0)), spec)


def _fixed_model_uri(uri: str) -> str:
    """`uri` with a registered model's alias or `latest` replaced by the version it names in the store now; a
    version, a run or any other artifact URI as it is."""
    import re

    import mlflow

    alias = re.fullmatch(r"models:/([^/@]+)@([^/@]+)", uri)
    latest = re.fullmatch(r"models:/([^/@]+)/latest", uri)
    if alias:
        name = alias.group(1)
        version = mlflow.MlflowClient().get_model_version_by_alias(name, alias.group(2)).version
    elif latest:
        name = latest.group(1)
        versions = mlflow.MlflowClient().search_model_versions(f"name = '{name}'")
        if not versions:
            raise ValueError(f"registered model {name!r} has no version")
        version = max(int(v.version) for v in versions)
    else:
        return uri
    return f"models:/{name}/{version}"


def _artifact_folder(model_dir: Path, uri: str, artifact: str) -> Path:
    """Where the pyfunc model downloaded to `model_dir` keeps its artifact `artifact`: MLflow names that folder
    after the logged source folder, and its MLmodel file says which it is."""
    import yaml

    folder = None
    for mlmodel in sorted(model_dir.rglob("MLmodel")):
        artifacts = (
            yaml.safe_load(mlmodel.read_text()).get("flavors", {}).get("python_function", {}).get("artifacts", {})
        )
        if artifact in artifacts:
            folder = mlmodel.parent / artifacts[artifact]["path"]
            break
    if folder is None or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{uri!r} has no artifact {artifact!r} with a config.json (is it a blockpilot model?)")
    return folder
