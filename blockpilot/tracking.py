"""Every MLflow call of the project lives here.

The default store is SQLite under `$BLOCKPILOT_HOME/mlflow/` with artifacts beside it;
`MLFLOW_TRACKING_URI` overrides. Where MLflow is not installed (the GPU machine has none) or tracking is
switched off, `start_run` yields a `NullTracker` and the work goes on untracked.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from blockpilot.home import blockpilot_home

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"


class Tracker(Protocol):
    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_figure(self, figure: Any, name: str) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...


class NullTracker:
    """Tracks nothing; what runs get when MLflow is off or absent."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_figure(self, figure: Any, name: str) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
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


class MLflowTracker:
    """One active MLflow run."""

    def __init__(self, mlflow: Any, run: Any) -> None:
        self._mlflow = mlflow
        self.run_id: str = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._mlflow.log_params(_flatten(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        finite = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
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

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._mlflow.set_tags(dict(tags))


def mlflow_available() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def start_run(
    experiment: str, run_name: str | None = None, *, enabled: bool = True, tags: Mapping[str, str] | None = None
) -> Iterator[Tracker]:
    """An MLflow run in `experiment` (created with its artifacts under the home folder), or a NullTracker."""
    if not enabled or not mlflow_available():
        yield NullTracker()
        return
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        # A SQLite store would put artifacts in ./mlruns of whatever folder we run in; keep them at home.
        location = (artifact_root() / experiment).as_uri() if uri.startswith("sqlite") else None
        mlflow.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name, tags=dict(tags or {})) as run:
        yield MLflowTracker(mlflow, run)


# ----------------------------------------------------------------------------- the predictor as an MLflow model

PREDICTOR_MODEL_NAME = "blockpilot-predictor"
_MODEL_CODE = Path(__file__).with_name("predictor_pyfunc.py")


def log_predictor_model(
    tracker: Tracker, predictor_dir: str | Path, registered_name: str = PREDICTOR_MODEL_NAME
) -> str | None:
    """Log the predictor folder as a pyfunc (models-from-code: nothing pickled) and register a new version.

    Returns the registered version, or None when tracking is off. The folder rides as the model's
    artifact `predictor`; `download_model_folder` gives it back from `models:/NAME/VERSION`.
    """
    if not isinstance(tracker, MLflowTracker):
        return None
    import mlflow

    _quiet_artifact_transfers()
    info = mlflow.pyfunc.log_model(
        name="predictor-model",
        python_model=str(_MODEL_CODE),
        artifacts={"predictor": str(predictor_dir)},
        code_paths=[str(Path(__file__).parent)],
        pip_requirements=["torch", "safetensors"],
        registered_model_name=registered_name,
    )
    version = getattr(info, "registered_model_version", None)
    return None if version is None else str(version)


def _quiet_artifact_transfers() -> None:
    """A predictor is a few small files: a progress bar per file is noise in `generate`, `train` and the demo."""
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def download_model_folder(uri: str, artifact: str) -> Path:
    """The folder logged as `artifact` inside the MLflow model at `uri` (`models:/NAME/VERSION` or `runs:/...`).

    A pinned version (or a run) never changes, so its download is kept under the home folder and reused;
    an alias (`models:/NAME/latest`, `@champion`) is fetched again each time.
    """
    import hashlib
    import re
    import shutil
    import tempfile

    import mlflow

    _quiet_artifact_transfers()
    uri_of_store = tracking_uri()
    mlflow.set_tracking_uri(uri_of_store)
    pinned = uri.startswith("runs:/") or re.fullmatch(r"models:/[^/@]+/\d+", uri) is not None
    key = hashlib.sha256(f"{uri_of_store}|{uri}".encode()).hexdigest()[:16]
    target = blockpilot_home() / "mlflow" / "downloads" / key if pinned else Path(tempfile.mkdtemp(prefix="predictor-"))
    if not pinned or not target.is_dir():
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(staging))
        except Exception as error:  # unknown model, version or store: all mean "cannot get it"
            shutil.rmtree(staging, ignore_errors=True)
            raise FileNotFoundError(
                f"could not fetch {uri!r} from the MLflow store at {uri_of_store}: {error}"
            ) from error
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
    matches = sorted(p.parent for p in target.rglob("config.json") if p.parent.name == artifact)
    if not matches:
        raise FileNotFoundError(f"{uri!r} has no '{artifact}' folder with a config.json")
    return matches[0]


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
    finite = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    mlflow.MlflowClient().log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in finite.items()])
