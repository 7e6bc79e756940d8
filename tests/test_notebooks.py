"""The notebooks run top to bottom, in a Jupyter kernel, on tiny-zoo artifacts laid out as the main job
leaves them under $BLOCKPILOT_HOME (labels, cost curve, predictor, step model, MLflow runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parents[1] / "notebooks"))
from execute import cells_missing_figures, execute  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def demo_home(tiny_zoo, tiny_models, tiny_labels, tmp_path_factory):
    """A home folder in the main job's layout (`pipelines.demo.DemoPaths`) over the session's tiny artifacts."""
    import torch

    from blockpilot.cost import CycleCost
    from blockpilot.load_curve import LOAD_EXPERIMENT, log_load_curve
    from blockpilot.predictor import BlockSizePredictor, PredictorConfig
    from blockpilot.predictor.step_model import StepModel, StepModelConfig
    from blockpilot.table import tables_from_row
    from blockpilot.tracking import PARENT_RUN_TAG, parent_run, start_run
    from pipelines.demo import DemoPaths

    home = tmp_path_factory.mktemp("demo-home")
    paths = DemoPaths("tiny", home)
    paths.zoo.parent.mkdir(parents=True)
    paths.zoo.symlink_to(tiny_zoo)
    paths.labels.mkdir(parents=True)
    for split, folder in tiny_labels.items():
        (paths.labels / split).symlink_to(folder)
    CycleCost({1: {1: 1.0, 4: 1.5, 8: 3.0}}).save(paths.cost)
    import pyarrow.parquet as pq

    candidates = tables_from_row(pq.read_table(tiny_labels["train"]).slice(0, 1).to_pylist()[0])[0].candidates
    vocab = tiny_models.target.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)  # untrained weights: the notebooks must run whatever the models choose
    BlockSizePredictor(PredictorConfig("sparse", candidates, vocab, top_k=16, hidden_size=8)).save(paths.predictor)
    StepModel(StepModelConfig(candidates, vocab, hidden_size=8, prior=True)).save(paths.step_model)
    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKPILOT_HOME", str(home))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        with start_run("blockpilot-step-policy", "tiny-step") as tracker:
            tracker.log_metrics({"eval/T0/tau_step": 1.5, "eval/T0/throughput_step": 1.2, "eval/T1/tau_B": 1.1})
        # Two predictors compared as the demo nests them (notebook 02 draws them from MLflow).
        parent = parent_run("blockpilot-predictor", "predictors-tiny")
        for name, tau, baselines in (("project", 2.2, {"eval/tau_autoregressive": 1.0}), ("paper", 2.0, {})):
            with start_run("blockpilot-predictor", name, tags={PARENT_RUN_TAG: parent, "configuration": name}) as run:
                run.log_metrics({"eval/tau_pred": tau, "eval/throughput_pred": tau / 2, "eval/tau_oracle": 2.5, **baselines})
        # A load curve as bench_serve logs it (notebook 04 draws the newest).
        with start_run(LOAD_EXPERIMENT, "tiny-T0") as tracker:
            log_load_curve(tracker, {"autoregressive": {1: 90.0, 4: 200.0}, "adaptive": {1: 100.0, 4: 210.0}})
    return home, uri


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_the_notebook_runs_top_to_bottom(notebook, demo_home, monkeypatch):
    home, uri = demo_home
    monkeypatch.setenv("BLOCKPILOT_HOME", str(home))
    monkeypatch.setenv("BLOCKPILOT_DEMO_SIZE", "tiny")
    monkeypatch.setenv("BLOCKPILOT_NOTEBOOK_PROMPTS", "2")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend puts each figure in its cell
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    nb = execute(notebook)
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
    assert sum(1 for cell in nb.cells if cell.cell_type == "code" and cell.outputs) >= 2
    assert cells_missing_figures(nb) == [], "a cell that draws shows no figure"


def test_a_logged_load_curve_reads_back_by_mode_and_concurrency(tmp_path, monkeypatch):
    from blockpilot.load_curve import LOAD_EXPERIMENT, latest_load_curve, log_load_curve
    from blockpilot.tracking import start_run

    monkeypatch.setenv("BLOCKPILOT_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert latest_load_curve() is None
    older = {"autoregressive": {1: 1.0}}
    newer = {"autoregressive": {1: 2103.0, 4: 2944.3, 16: 4564.1}, "adaptive": {1: 2031.1, 4: 3045.4, 16: 4734.0}}
    for name, curves in (("older", older), ("newer", newer)):
        with start_run(LOAD_EXPERIMENT, name) as tracker:
            log_load_curve(tracker, curves, p99_ms={"adaptive": {1: 36.0}})
    assert latest_load_curve() == ("newer", newer)


def test_the_committed_notebooks_show_their_figures():
    """What a code-hosting page renders: every drawing cell of every committed notebook holds its image."""
    import nbformat

    for notebook in NOTEBOOKS:
        missing = cells_missing_figures(nbformat.read(notebook, as_version=4))
        assert missing == [], f"{notebook.name}: cells {missing} draw but were committed without their figure"
