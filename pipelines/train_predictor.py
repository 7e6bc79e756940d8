"""Predictor training on Ray Train, tracked in MLflow.

    ray job submit --runtime-env ray_job.yaml -- python -m pipelines.train_predictor --labels /data/labels
    blockpilot train --labels labels/ --eval heldout-labels/ --kind sparse        # locally, embedded Ray

The labels are read and checked on the driver (missing columns, mismatched candidates or zero valid rows
stop here, naming the problem), split by prompt (or `--val`), and handed to a `TorchTrainer` as Ray
Datasets; each worker reads its shard with `iter_torch_batches`. Every epoch, rank 0 validates, logs the
metrics to the MLflow run and reports a checkpoint; a worker that dies restarts from the last one
(`FailureConfig`), and running again with the same `--name` resumes the run. At the end the driver logs
the confusion matrix, the tau-by-policy chart and the predictor folder, and registers a new version of
the `blockpilot-predictor` model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blockpilot.home import blockpilot_home


@dataclass
class TrainJob:
    labels: Path
    val: Path | None = None  # labels of other prompts to validate on; else a split of `labels`
    eval: Path | None = None  # labels of held-out prompts for the final report (e.g. the zoo's heldout)
    kind: str = "sparse"
    hidden_size: int | None = None  # None: 2048 for dense (the paper's), 256 for sparse
    dropout: float = 0.2
    epochs: int = 30
    batch_size: int = 64
    lr: float = 1e-3
    objective: str = "ce"
    val_share: float = 0.2
    seed: int = 0
    workers: int = 1
    use_gpu: bool = False
    name: str = "predictor"
    storage: Path | None = None
    max_failures: int = 2
    out: Path | None = None
    track: bool = True
    extra_tags: dict[str, str] = field(default_factory=dict)


@dataclass
class TrainOutcome:
    predictor_dir: Path
    val_metrics: dict[str, float]
    eval_metrics: dict[str, float] | None
    model_version: str | None
    run_id: str | None
    first_epoch: int  # where the last attempt started: > 0 when it resumed from a checkpoint
    last_epoch: int


def _worker(config: dict[str, Any]) -> None:
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch

    from blockpilot.predictor import BlockSizePredictor, PredictorConfig
    from blockpilot.predictor_training import evaluate_predictor, fit_epochs, make_optimizer

    context = ray.train.get_context()
    rank = context.get_world_rank()
    train_config = config["train"]
    torch.manual_seed(train_config.seed)
    predictor = BlockSizePredictor(PredictorConfig.from_dict(config["predictor"]))
    optimizer_state, start_epoch = None, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restarted worker, or the same run name again
        with checkpoint.as_directory() as directory:
            predictor = BlockSizePredictor.load(Path(directory) / "predictor")
            state = torch.load(Path(directory) / "trainer_state.pt", weights_only=True)
            optimizer_state, start_epoch = state["optimizer"], state["epoch"] + 1
    model = ray.train.torch.prepare_model(predictor)
    optimizer = make_optimizer(model, train_config)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    shard = ray.train.get_dataset_shard("train")
    val = config["val"]

    def batches(epoch: int):
        yield from shard.iter_torch_batches(
            batch_size=train_config.batch_size,
            local_shuffle_buffer_size=4 * train_config.batch_size,
            local_shuffle_seed=train_config.seed + epoch,
        )

    def on_epoch(epoch: int, loss: float) -> None:
        metrics = {"epoch": epoch, "train_loss": loss, "resumed_from_epoch": start_epoch}
        with tempfile.TemporaryDirectory() as directory:
            saved = None
            if rank == 0:
                unwrapped = model.module if hasattr(model, "module") else model
                scores = evaluate_predictor(unwrapped, val)
                metrics |= {f"val/{k}": v for k, v in scores.items() if "/" not in k}
                unwrapped.save(Path(directory) / "predictor")
                torch.save({"optimizer": optimizer.state_dict(), "epoch": epoch}, Path(directory) / "trainer_state.pt")
                saved = ray.train.Checkpoint.from_directory(directory)
                if config["run_id"]:
                    from blockpilot.tracking import log_epoch_metrics

                    scalars = {k: v for k, v in metrics.items() if k != "epoch"}
                    log_epoch_metrics(config["run_id"], scalars, epoch, config["tracking_uri"])
                print(
                    f"[predictor] epoch {epoch + 1}/{train_config.epochs} loss {loss:.4f} "
                    f"val tau {metrics['val/tau_pred']:.3f} accuracy {metrics['val/accuracy']:.3f}",
                    flush=True,
                )
            ray.train.report(
                {k: float(v) if not isinstance(v, str) else v for k, v in metrics.items()}, checkpoint=saved
            )

    np.random.seed(train_config.seed)
    fit_epochs(model, optimizer, range(start_epoch, train_config.epochs), batches, train_config, on_epoch)


def prepare_labels(job: TrainJob) -> tuple[Any, Any, Any | None]:
    """(train, val, eval) label tables, checked; raises naming what is wrong before anything starts."""
    from blockpilot.data.labels import read_labels
    from blockpilot.predictor_training import check_same_candidates, split_by_prompt, valid_rows

    table = valid_rows(read_labels(job.labels), what=f"labels {str(job.labels)!r}")
    if job.val is not None:
        train, val = table, valid_rows(read_labels(job.val), what=f"validation labels {str(job.val)!r}")
        check_same_candidates(train, val, "the validation labels")
    else:
        train, val = split_by_prompt(table, job.val_share, job.seed)
    evaluation = None
    if job.eval is not None:
        evaluation = valid_rows(read_labels(job.eval), what=f"evaluation labels {str(job.eval)!r}")
        check_same_candidates(train, evaluation, "the evaluation labels")
    return train, val, evaluation


def predictor_config(job: TrainJob, train: Any) -> dict[str, Any]:
    from blockpilot.predictor import PredictorConfig
    from blockpilot.predictor_training import candidates_of

    first = train.slice(0, 1).to_pylist()[0]
    hidden = job.hidden_size or (2048 if job.kind == "dense" else 256)
    return PredictorConfig(
        kind=job.kind,
        candidates=candidates_of(train),
        vocab_size=first["vocab_size"],
        top_k=len(first["topk_ids"]),
        hidden_size=hidden,
        dropout=job.dropout,
        train_block_size=first["train_block_size"],
        target_id=first["target_id"] or "",
        drafter_id=first["drafter_id"] or "",
        extra={"labels": str(job.labels), "objective": job.objective},
    ).to_dict()


def run_train_job(job: TrainJob) -> TrainOutcome:
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from blockpilot.predictor import BlockSizePredictor
    from blockpilot.predictor_training import PredictorTrainConfig, evaluate_predictor, label_arrays, training_columns
    from blockpilot.tracking import log_predictor_model, start_run, tracking_uri
    from pipelines.ray_runtime import ensure_ray

    train_config = PredictorTrainConfig(job.epochs, job.batch_size, job.lr, objective=job.objective, seed=job.seed)
    train, val, evaluation = prepare_labels(job)
    dense = job.kind == "dense"
    config = predictor_config(job, train)
    storage = job.storage or blockpilot_home() / "ray_results" / "predictor"
    out = job.out or blockpilot_home() / "predictors" / job.name
    print(
        f"[predictor] {job.kind}: {train.num_rows} training rows, {val.num_rows} validation rows, "
        f"candidates {config['candidates']}",
        flush=True,
    )
    with start_run(
        "blockpilot-predictor", job.name, enabled=job.track, tags={"stage": "train", "kind": job.kind, **job.extra_tags}
    ) as tracker:
        tracker.log_params(
            {
                **{k: v for k, v in asdict(job).items() if k != "extra_tags"},
                "predictor": config,
                "train_rows": train.num_rows,
                "val_rows": val.num_rows,
            }
        )
        ensure_ray()
        # Each epoch's shard iteration is a small Ray Data execution: without this, every one prints bars.
        data_context = ray.data.DataContext.get_current()
        data_context.enable_progress_bars = False
        data_context.print_on_execution_start = False
        columns = dict(fn_kwargs={"dense": dense}, batch_format="numpy")
        # Materialized once: every epoch then reads the prepared blocks instead of redoing the conversion.
        datasets = {"train": ray.data.from_arrow(train).map_batches(training_columns, **columns).materialize()}
        trainer = TorchTrainer(
            _worker,
            train_loop_config={
                "predictor": config,
                "train": train_config,
                "val": label_arrays(val, dense),
                "run_id": getattr(tracker, "run_id", None),
                "tracking_uri": tracking_uri() if job.track else None,
            },
            scaling_config=ScalingConfig(num_workers=job.workers, use_gpu=job.use_gpu),
            run_config=RunConfig(
                name=job.name,
                storage_path=str(storage),
                failure_config=FailureConfig(max_failures=job.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
            datasets=datasets,
            dataset_config=DataConfig(datasets_to_split=["train"]),
        )
        result = trainer.fit()
        with result.checkpoint.as_directory() as directory:
            predictor = BlockSizePredictor.load(Path(directory) / "predictor")
        predictor.save(out)
        val_metrics = evaluate_predictor(predictor, label_arrays(val, dense))
        eval_metrics = None if evaluation is None else evaluate_predictor(predictor, label_arrays(evaluation, dense))
        tracker.log_metrics({f"final_val/{k}": v for k, v in val_metrics.items()})
        if eval_metrics is not None:
            tracker.log_metrics({f"eval/{k}": v for k, v in eval_metrics.items()})
        report_rows = evaluation if evaluation is not None else val
        if hasattr(tracker, "run_id") and tracker.run_id:
            from blockpilot.tracking import log_figures

            log_figures(tracker, predictor_figures(predictor, label_arrays(report_rows, dense)))
        tracker.log_artifact(out, "predictor")
        version = log_predictor_model(tracker, out)
        first_epoch = int(result.metrics.get("resumed_from_epoch", 0))
        last_epoch = int(result.metrics.get("epoch", job.epochs - 1))
    print(format_metrics("validation", val_metrics))
    if eval_metrics is not None:
        print(format_metrics("evaluation (held-out labels)", eval_metrics))
    print(
        f"[predictor] saved to {out}" + (f"; registered as models:/blockpilot-predictor/{version}" if version else "")
    )
    return TrainOutcome(
        out, val_metrics, eval_metrics, version, getattr(tracker, "run_id", None), first_epoch, last_epoch
    )


def format_metrics(title: str, metrics: dict[str, float]) -> str:
    lines = [
        f"[predictor] {title}: accuracy {metrics['accuracy']:.3f}, gap captured {metrics['gap_captured']:.2f}",
        f"  {'group':<18} {'pred':>6} {'B':>6} {'best':>6} {'oracle':>6} {'gap':>5}",
    ]
    groups = [""] + sorted({k.rsplit("/", 1)[0] + "/" for k in metrics if k.startswith("T")})
    for group in groups:
        name = group.rstrip("/") or "all"
        lines.append(
            f"  {name:<18} {metrics[group + 'tau_pred']:>6.3f} {metrics[group + 'tau_B']:>6.3f} "
            f"{metrics[group + 'tau_best_fixed']:>6.3f} {metrics[group + 'tau_oracle']:>6.3f} "
            f"{metrics[group + 'gap_captured']:>5.2f}"
        )
    return "\n".join(lines)


def predictor_figures(predictor: Any, arrays: Any) -> dict[str, Any]:
    """Confusion matrix (B* vs predicted b) and the tau of each policy, as matplotlib figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from blockpilot.predictor_training import evaluate_choices, predict_indices

    choice = predict_indices(predictor, arrays)
    size = len(arrays.candidates)
    confusion = np.zeros((size, size), dtype=int)
    for truth, guess in zip(arrays.best_index, choice, strict=True):
        confusion[truth, guess] += 1
    matrix_figure, ax = plt.subplots(figsize=(4.5, 4))
    ax.imshow(confusion, cmap="Blues")
    labels = [str(b) for b in arrays.candidates]
    ax.set_xticks(range(size), labels)
    ax.set_yticks(range(size), labels)
    ax.set_xlabel("predicted b")
    ax.set_ylabel("B*")
    for i in range(size):
        for j in range(size):
            ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8)
    matrix_figure.tight_layout()
    metrics = evaluate_choices(choice, arrays)
    bars_figure, ax = plt.subplots(figsize=(5.5, 3.2))
    names = ["fixed B", "best fixed", "predictor", "oracle"]
    values = [metrics["tau_B"], metrics["tau_best_fixed"], metrics["tau_pred"], metrics["tau_oracle"]]
    ax.bar(names, [0 if math.isnan(v) else v for v in values], color=["#999", "#777", "#2a7", "#35a"])
    low = min(v for v in values if not math.isnan(v))
    ax.set_ylim(low * 0.97, max(values) * 1.01)
    ax.set_ylabel("mean tau")
    bars_figure.tight_layout()
    return {"confusion_matrix.png": matrix_figure, "tau_by_policy.png": bars_figure}


# ----------------------------------------------------------------------------- command line


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from blockpilot.cli import positive_int
    from blockpilot.predictor_training import OBJECTIVES

    parser.add_argument("--labels", type=Path, required=True, help="label Parquet file or folder")
    parser.add_argument("--val", type=Path, default=None, help="validate on these labels instead of a split")
    parser.add_argument("--eval", type=Path, default=None, help="labels of held-out prompts for the final report")
    parser.add_argument("--kind", choices=("sparse", "dense"), default="sparse")
    parser.add_argument("--hidden-size", type=positive_int, default=None)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--epochs", type=positive_int, default=30)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="ce",
        help="cross-entropy on B* (the paper); expected-tau, the whole tau vector; normalized-gain, the same with "
        "each temperature's rows weighted alike",
    )
    parser.add_argument("--val-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=positive_int, default=1, help="Ray Train workers")
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--name", default="predictor", help="run name: the same name again resumes the run")
    parser.add_argument("--storage", type=Path, default=None, help="Ray Train storage (default under the home folder)")
    parser.add_argument("--max-failures", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="where the predictor folder goes")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")


def job_from_args(args: argparse.Namespace) -> TrainJob:
    return TrainJob(
        labels=args.labels,
        val=args.val,
        eval=args.eval,
        kind=args.kind,
        hidden_size=args.hidden_size,
        dropout=args.dropout,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        objective=args.objective,
        val_share=args.val_share,
        seed=args.seed,
        workers=args.workers,
        use_gpu=args.use_gpu,
        name=args.name,
        storage=args.storage,
        max_failures=args.max_failures,
        out=args.out,
        track=not args.no_track,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.train_predictor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        outcome = run_train_job(job_from_args(args))
    except (ValueError, FileNotFoundError) as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"predictor": str(outcome.predictor_dir), "model_version": outcome.model_version}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
