"""Predictor training on Ray Train, tracked in MLflow.

    ray job submit --runtime-env ray_job.yaml -- python -m pipelines.train_predictor --labels /data/labels
    blockpilot train --labels labels/ --eval heldout-labels/ --kind sparse        # locally, embedded Ray

prepare: the labels are read and checked on the driver (missing columns, mismatched candidates or zero valid
rows stop here, naming the problem) and split by prompt (or `--val`). fit: a `TorchTrainer`'s workers get
the training columns (converted once, on the driver) and the validation rows through the object store, each
worker a share of the training rows; every epoch rank 0 validates, logs to the MLflow run
and reports a checkpoint; a worker that dies restarts from the last one (`FailureConfig`). report: the driver
scores the predictor on the validation and held-out labels (tau and modeled throughput), logs the figures,
the label sets as the run's inputs and the predictor folder, registers a version of `blockpilot-predictor`
(`blockpilot-shape-predictor` with `--trees`: one over block sizes and tree budgets), and moves its `champion`
alias when the version beats the champion on held-out modeled throughput.

Runs are named uniquely by default. `--name X --resume` continues run X from its last checkpoint, and only if
its fingerprint (labels, kind, sizes, candidates, objective, seed, ...) is this job's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from blockpilot.checks import differing_fields
from blockpilot.home import blockpilot_home
from blockpilot.options import (
    add_options,
    block_size_list,
    fraction_arg,
    from_args,
    non_negative_int_arg,
    option,
    positive_float_arg,
    positive_int_arg,
    share_arg,
)
from blockpilot.predictor.model import PREDICTOR_KINDS
from blockpilot.predictor.training import OBJECTIVES
from blockpilot.scoring import SCORES
from blockpilot.walks import ADAPT_CONFIDENCE, ADAPT_MARGIN

FINGERPRINT_FILE = "blockpilot_job.json"


@dataclass(frozen=True)
class TrainJob:
    labels: Path = option(type=Path, help="label Parquet file or folder")
    val: Path | None = option(None, type=Path, help="validate on these labels instead of a split")
    eval: Path | None = option(None, type=Path, help="labels of held-out prompts for the final report")
    kind: str = option("sparse", choices=PREDICTOR_KINDS, help="sparse (top-k inputs) or dense (the paper's)")
    hidden_size: int | None = option(None, type=positive_int_arg, help="default: 2048 dense, 256 sparse")
    dropout: float = option(0.2, type=float, help="dropout in [0, 1)")
    epochs: int = option(30, type=positive_int_arg, help="training epochs")
    batch_size: int = option(64, type=positive_int_arg, help="rows per step")
    lr: float = option(1e-3, type=positive_float_arg, help="AdamW learning rate")
    objective: str = option(
        "normalized-gain",
        choices=OBJECTIVES,
        help="normalized-gain, the tau expected under the prediction with each temperature's rows weighted alike; "
        "expected-tau, the same unweighted; ce, cross-entropy on B* (the paper's)",
    )
    score: str | None = option(
        None,
        choices=SCORES,
        help="what B* maximizes: tau, or tau / c(b) (needs --cost); default: throughput with --cost, else tau",
    )
    cost: Path | None = option(None, type=Path, help="cost curve (blockpilot calibrate) pricing modeled throughput")
    cost_batch: int = option(
        1, type=positive_int_arg, help="price cycles at this batch size (the nearest measured): the load it is for"
    )
    candidates: tuple[int, ...] | None = option(
        None,
        type=block_size_list,
        help="choose among these of the labels' block sizes (default: all of them, autoregression's b = 1 included; "
        "the paper's: B-2..B+2)",
    )
    trees: bool = option(
        False,
        help="choose among the labels' draft-tree budgets too (a predictor over shapes, registered as "
        "blockpilot-shape-predictor; its trees run on the static engine; throughput needs a cost with tree prices)",
    )
    val_share: float = option(0.2, type=fraction_arg, help="share of prompts held out for validation")
    fixed_choices: bool = option(
        True,
        flag="--no-fixed-choices",
        help="do not give every request at a temperature the fastest single shape of the training rows where, on "
        "the validation rows, the predictor's choices do not surely decode faster (--adapt-confidence; such a "
        "request needs no predictor pass)",
    )
    adapt_confidence: float = option(
        ADAPT_CONFIDENCE,
        type=share_arg,
        help="the predictor's choices serve a temperature only where they decode faster than that fixed shape (by "
        "--adapt-margin) on the validation rows in at least this share of paired bootstrap resamples of their "
        "prompts (0: wherever its modeled throughput there is higher by the margin)",
    )
    adapt_margin: float = option(
        ADAPT_MARGIN,
        type=share_arg,
        help="the predictor's choices serve a temperature only where they decode more than this share faster than "
        "that fixed shape (modeled) on the validation rows, and so in --adapt-confidence of the resamples (a gain the "
        "cost curve cannot tell apart is none)",
    )
    seed: int = option(0, type=int, help="seed of the split, the weights and the shuffles")
    workers: int = option(1, type=positive_int_arg, help="Ray Train workers")
    use_gpu: bool = option(False, help="Ray Train workers take a GPU each")
    name: str | None = option(None, help="run name (default: unique); with --resume, the run to continue")
    resume: bool = option(False, help="continue run --name from its last checkpoint (same fingerprint only)")
    storage: Path | None = option(None, type=Path, help="Ray Train storage (default under the home folder)")
    max_failures: int = option(2, type=non_negative_int_arg, help="worker failures tolerated per run")
    out: Path | None = option(None, type=Path, help="where the predictor folder goes")
    track: bool = option(True, flag="--no-track", help="do not log to MLflow")
    extra_tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.score is None:
            object.__setattr__(self, "score", "throughput" if self.cost is not None else "tau")
        if self.score == "throughput" and self.cost is None:
            raise ValueError("--score throughput needs --cost FILE (a curve from `blockpilot calibrate`)")
        if self.resume and not self.name:
            raise ValueError("--resume needs --name: the run to continue")
        if self.name is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            object.__setattr__(self, "name", f"{self.kind}-{self.objective}-{stamp}-{uuid.uuid4().hex[:6]}")


@dataclass
class Prepared:
    """Checked label tables and what the workers need to build the predictor."""

    train: Any
    val: Any
    evaluation: Any | None
    predictor_config: dict[str, Any]
    cost: Any
    fingerprint: dict[str, Any]


@dataclass
class TrainOutcome:
    predictor_dir: Path
    val_metrics: dict[str, float]
    eval_metrics: dict[str, float] | None
    model_version: str | None
    champion: bool
    run_id: str | None
    first_epoch: int  # where the last attempt started: > 0 when it resumed from a checkpoint
    last_epoch: int


# ----------------------------------------------------------------------------- prepare


def _labels_digest(table: Any) -> str:
    keys = sorted(zip(table["prompt_id"].to_pylist(), table["temperature"].to_pylist(), strict=True))
    return hashlib.sha256(json.dumps([keys, table["tau"].to_pylist()]).encode()).hexdigest()[:16]


def prepare(job: TrainJob) -> Prepared:
    """(train, val, eval) label tables, checked; raises naming what is wrong before anything starts."""
    from blockpilot.cost import load_cost
    from blockpilot.data.labels import read_labels, with_candidates
    from blockpilot.predictor.model import PredictorConfig
    from blockpilot.predictor.training import check_same_candidates, split_by_prompt, valid_rows
    from blockpilot.scoring import candidates_of

    cost = load_cost(job.cost, job.cost_batch)

    def labels(path: Path, what: str) -> Any:
        table = valid_rows(read_labels(path), what=f"{what} {str(path)!r}")
        return with_candidates(table, job.candidates) if job.candidates else table

    table = labels(job.labels, "labels")
    if job.val is not None:
        train, val = table, labels(job.val, "validation labels")
        check_same_candidates(train, val, "the validation labels")
    else:
        train, val = split_by_prompt(table, job.val_share, job.seed)
    evaluation = None
    if job.eval is not None:
        evaluation = labels(job.eval, "evaluation labels")
        check_same_candidates(train, evaluation, "the evaluation labels")
    first = train.slice(0, 1).to_pylist()[0]
    tree_budgets: tuple[int, ...] = ()
    if job.trees:
        from blockpilot.scoring import tree_columns

        for name, labels in (("training", train), ("validation", val), ("evaluation", evaluation)):
            found = tree_columns(labels).get("tree_budgets") if labels is not None else None
            if labels is not None and not found:
                raise ValueError(f"--trees: the {name} labels carry no draft trees (label them with --tree-budgets)")
            tree_budgets = tree_budgets or found
            if labels is not None and found != tree_budgets:
                raise ValueError(f"--trees: the {name} labels' tree budgets {list(found)} are not {list(tree_budgets)}")
        cost.tree(tree_budgets[0])  # a measured curve must price trees: fail here, naming how
    config = PredictorConfig(
        kind=job.kind,
        candidates=candidates_of(train),
        vocab_size=first["vocab_size"],
        top_k=len(first["topk_ids"]),
        hidden_size=job.hidden_size or (2048 if job.kind == "dense" else 256),
        dropout=job.dropout,
        train_block_size=first["train_block_size"],
        target_id=first["target_id"] or "",
        drafter_id=first["drafter_id"] or "",
        extra={"labels": str(job.labels), "objective": job.objective, "score": job.score},
        tree_budgets=tree_budgets,
        temperatures=tuple(train["temperature"].to_pylist()),
    ).to_dict()
    fingerprint = {
        "labels": _labels_digest(train),
        "val": _labels_digest(val),
        "cost": cost.to_dict()["seconds"],
        **{k: v for k, v in config.items() if k != "extra"},
        # Not epochs: a resumed run may be given more of them.
        **{k: getattr(job, k) for k in ("objective", "score", "batch_size", "lr", "seed", "workers")},
    }
    return Prepared(train, val, evaluation, config, cost, json.loads(json.dumps(fingerprint)))


def _check_run_folder(job: TrainJob, prepared: Prepared, storage: Path) -> None:
    """A new run must not land on an old one's checkpoints; a resumed one must be the same job."""
    run_folder = storage / job.name
    recorded = run_folder / FINGERPRINT_FILE
    if job.resume:
        if not recorded.is_file():
            raise ValueError(f"no run {job.name!r} to resume under {storage}")
        found = json.loads(recorded.read_text())
        if found != prepared.fingerprint:
            differing = differing_fields(found, prepared.fingerprint)
            raise ValueError(
                f"run {job.name!r} was another job (differing: {', '.join(differing)}); it cannot be resumed with "
                "these labels and settings"
            )
        return
    from blockpilot.files import write_text_atomic
    from pipelines.train_checkpoints import refuse_existing_run

    refuse_existing_run(storage, job.name, resumable=True)

    write_text_atomic(recorded, json.dumps(prepared.fingerprint, indent=2) + "\n")


# ----------------------------------------------------------------------------- fit on Ray Train


def _worker(config: dict[str, Any]) -> None:
    """The training loop of one Ray Train worker."""
    import ray
    import ray.train
    import ray.train.torch
    import torch

    from blockpilot.predictor.evaluation import evaluate_predictor
    from blockpilot.predictor.model import BlockSizePredictor, PredictorConfig
    from blockpilot.predictor.training import fit_epochs, make_optimizer, shuffled_batches
    from blockpilot.scoring import label_arrays
    from pipelines.train_checkpoints import report_epoch, restore_fit

    train_config, dense = config["train"], config["dense"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(train_config.seed)
    restored, optimizer_state, start_epoch = restore_fit(lambda folder: BlockSizePredictor.load(folder / "predictor"))
    predictor = restored or BlockSizePredictor(PredictorConfig.from_dict(config["predictor"]))
    model = ray.train.torch.prepare_model(predictor)
    optimizer = make_optimizer(model, train_config)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    # This worker's share of the training rows (every world_size-th), shuffled anew each epoch.
    world = ray.train.get_context().get_world_size()
    shard = {name: column[rank::world] for name, column in ray.get(config["train_columns"]).items()}
    val = None
    if rank == 0:
        val = label_arrays(
            ray.get(config["val_rows"]), dense, config["cost"], config["score"], over_shapes=config["over_shapes"]
        )

    def on_epoch(epoch: int, loss: float) -> None:
        metrics = {"epoch": epoch, "train/loss": loss, "train/resumed_from_epoch": start_epoch}
        if rank != 0:
            report_epoch(metrics, epoch, optimizer, save=None)
            return
        unwrapped = model.module if hasattr(model, "module") else model
        scores = evaluate_predictor(unwrapped, val)
        metrics |= {f"val/{k}": v for k, v in scores.items() if "/" not in k}
        if config["run_id"]:
            from blockpilot.tracking import log_epoch_metrics

            logged = {k: v for k, v in metrics.items() if k != "epoch"}
            log_epoch_metrics(config["run_id"], logged, epoch, config["tracking_uri"])
        every = max(1, train_config.epochs // 5)  # about five progress lines a run, the last epoch always
        if (epoch + 1) % every == 0 or epoch + 1 == train_config.epochs:
            print(
                f"[predictor] epoch {epoch + 1}/{train_config.epochs} loss {loss:.4f} "
                f"val tau {metrics['val/tau_pred']:.3f} throughput {metrics['val/throughput_pred']:.3f}",
                flush=True,
            )
        report_epoch(metrics, epoch, optimizer, save=lambda folder: unwrapped.save(folder / "predictor"))

    batches = shuffled_batches(shard, train_config.batch_size, train_config.seed)
    fit_epochs(model, optimizer, range(start_epoch, train_config.epochs), batches, train_config, on_epoch)


def fit_on_ray(job: TrainJob, prepared: Prepared, run_id: str | None) -> tuple[Any, int, int]:
    """(trained predictor, first epoch of the last attempt, last epoch) from a `TorchTrainer` run."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from blockpilot.predictor.model import BlockSizePredictor
    from blockpilot.predictor.training import PredictorTrainConfig, training_columns
    from blockpilot.scoring import label_columns
    from blockpilot.tracking import tracking_uri
    from pipelines.ray_runtime import ensure_ray, train_run_config

    storage = job.storage or blockpilot_home() / "ray_results" / "predictor"
    _check_run_folder(job, prepared, storage)
    ensure_ray()
    dense = job.kind == "dense"
    scored = [c for c in label_columns(dense) if c in prepared.train.column_names and not c.startswith("table_")]
    columns = {"dense": dense, "cost": prepared.cost, "score": job.score, "over_shapes": job.trees}
    val_columns = [c for c in label_columns(dense) if c in prepared.val.column_names]
    trainer = TorchTrainer(
        _worker,
        train_loop_config={
            # The rows go to the workers through the object store, converted once: as Ray Datasets they added
            # Ray Data's stats actor, its split coordinator and the conversion's tasks, each a worker process,
            # to hand over a table the driver already holds (`train --epochs 1` on 16 rows, 2 cores: 96.6 s and
            # 127 s of CPU as Datasets, 65.3 s and 77 s this way).
            "train_columns": ray.put(training_columns(prepared.train.select(scored).to_pydict(), **columns)),
            "val_rows": ray.put(prepared.val.select(val_columns)),
            "predictor": prepared.predictor_config,
            "train": PredictorTrainConfig(job.epochs, job.batch_size, job.lr, objective=job.objective, seed=job.seed),
            "dense": dense,
            "cost": prepared.cost,
            "score": job.score,
            "over_shapes": job.trees,
            "run_id": run_id,
            "tracking_uri": tracking_uri() if run_id else None,
        },
        scaling_config=ScalingConfig(num_workers=job.workers, use_gpu=job.use_gpu),
        run_config=train_run_config(
            name=job.name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=job.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    with result.checkpoint.as_directory() as directory:
        predictor = BlockSizePredictor.load(Path(directory) / "predictor")
    return predictor, int(result.metrics.get("train/resumed_from_epoch", 0)), int(result.metrics.get("epoch", job.epochs - 1))


# ----------------------------------------------------------------------------- report


def report(job: TrainJob, prepared: Prepared, predictor: Any, tracker: Any) -> tuple[Path, dict, dict | None, str | None, bool]:
    """Score, save and log the trained predictor; register it (and maybe crown it champion)."""
    from blockpilot.predictor.evaluation import (
        evaluate_predictor,
        fixed_choices,
        format_fixed_choices,
        predictor_figures,
    )
    from blockpilot.scoring import format_metrics, label_arrays
    from blockpilot.tracking import (
        PREDICTOR_MODEL_NAME,
        SHAPE_PREDICTOR_MODEL_NAME,
        champion_context,
        log_figures,
        log_label_set,
        log_predictor_model,
    )

    dense = job.kind == "dense"
    out = job.out or blockpilot_home() / "predictors" / job.name
    val_arrays = label_arrays(prepared.val, dense, prepared.cost, job.score, over_shapes=job.trees)
    if job.fixed_choices:
        train_arrays = label_arrays(prepared.train, dense, prepared.cost, job.score, over_shapes=job.trees)
        fixed, comparison = fixed_choices(
            predictor, train_arrays, val_arrays, job.adapt_confidence, job.adapt_margin
        )
        predictor.config = replace(predictor.config, fixed_at=fixed)
        tracker.log_params({"fixed_at": [list(pair) for pair in fixed]})
        tracker.log_metrics({f"fixed_choices/{k}": v for k, v in comparison.items()})
        print(format_fixed_choices(predictor, comparison), flush=True)
    predictor.save(out)
    val_metrics = evaluate_predictor(predictor, val_arrays)
    eval_arrays = None
    if prepared.evaluation is not None:
        eval_arrays = label_arrays(prepared.evaluation, dense, prepared.cost, job.score, over_shapes=job.trees)
    eval_metrics = None if eval_arrays is None else evaluate_predictor(predictor, eval_arrays)
    tracker.log_metrics({f"final_val/{k}": v for k, v in val_metrics.items()})
    if eval_metrics is not None:
        tracker.log_metrics({f"eval/{k}": v for k, v in eval_metrics.items()})
    for name, table in (("train", prepared.train), ("validation", prepared.val), ("evaluation", prepared.evaluation)):
        if table is not None:
            source = job.eval if name == "evaluation" else job.val if name == "validation" and job.val else job.labels
            log_label_set(tracker, source, table, name)
    if tracker.enabled:
        log_figures(tracker, predictor_figures(predictor, eval_arrays or val_arrays))
    tracker.log_artifact(out, "predictor")
    heldout = (eval_metrics or val_metrics)["throughput_pred"]
    scored_on = prepared.evaluation if prepared.evaluation is not None else prepared.val
    first = scored_on.slice(0, 1).to_pylist()[0]
    context = champion_context(
        cost=prepared.cost,
        batch=job.cost_batch,
        evaluation=scored_on,
        target_id=first.get("target_id") or "",
        drafter_id=first.get("drafter_id") or "",
    )
    registered_name = SHAPE_PREDICTOR_MODEL_NAME if job.trees else PREDICTOR_MODEL_NAME
    version, champion = log_predictor_model(tracker, out, heldout, registered_name, context=context)
    print(format_metrics("[predictor] validation", val_metrics))
    if eval_metrics is not None:
        print(format_metrics("[predictor] evaluation (held-out labels)", eval_metrics))
    registered = f"; registered as models:/{registered_name}/{version}" if version else ""
    crowned = " (the new champion)" if champion else ""
    print(f"[predictor] saved to {out}{registered}{crowned}")
    return out, val_metrics, eval_metrics, version, champion


def run_train_job(job: TrainJob) -> TrainOutcome:
    from blockpilot.tracking import start_run

    prepared = prepare(job)
    print(
        f"[predictor] {job.name}: {job.kind}, {prepared.train.num_rows} training rows, {prepared.val.num_rows} "
        f"validation rows, candidates {prepared.predictor_config['candidates']}, cost {prepared.cost.describe()}",
        flush=True,
    )
    tags = {"stage": "train", "kind": job.kind, "objective": job.objective, **job.extra_tags}
    with start_run("blockpilot-predictor", job.name, enabled=job.track, tags=tags) as tracker:
        tracker.log_params(
            {
                **{k: v for k, v in asdict(job).items() if k != "extra_tags"},
                "predictor": prepared.predictor_config,
                "train_rows": prepared.train.num_rows,
                "val_rows": prepared.val.num_rows,
            }
        )
        predictor, first_epoch, last_epoch = fit_on_ray(job, prepared, tracker.run_id)
        out, val_metrics, eval_metrics, version, champion = report(job, prepared, predictor, tracker)
    return TrainOutcome(out, val_metrics, eval_metrics, version, champion, tracker.run_id, first_epoch, last_epoch)


# ----------------------------------------------------------------------------- command line


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, TrainJob)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.train_predictor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        outcome = run_train_job(from_args(TrainJob, args))
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"predictor": str(outcome.predictor_dir), "model_version": outcome.model_version}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
