"""The per-step block-size model on Ray Train, tracked in MLflow.

    ray job submit --runtime-env ray_job.yaml -- python -m pipelines.train_step_policy --labels /data/labels \\
        --eval /data/heldout --cost /data/cost.json
    blockpilot train-step --labels labels/train --eval labels/heldout [--cost cost.json]   # locally

prepare: label rows with acceptance tables become (anchor features, regret of every candidate) pairs on the driver
(`blockpilot.predictor.step_data`); rows without tables stop the job here. With a --prior, a first fit leaves a
share of the prompts out and is walked on them beside the prior: where its walks are not surely faster
(`walks.adapts`), the model keeps the prior's b0 for requests at that temperature (`prior_temperatures`). fit: a
`TorchTrainer` worker gets them through the object store and fits every candidate's regret (`regret_loss`),
reporting each epoch (and to the MLflow run) with a checkpoint; a worker that dies restarts from the last one
(`FailureConfig`). report: the driver walks the held-out tables with the model's choices and prints, per
temperature, tau and modeled throughput of fixed B, the best fixed b, the static oracle, the model, the confidence
rule fitted on the same tables (`blockpilot.predictor.confidence`, saved in the model's folder) and the per-step
oracle; the folder and the metrics go to MLflow, the label sets as the run's dataset inputs, and the model is
registered as `blockpilot-step-policy` (its `champion` alias moves when a version beats the champion's held-out
modeled throughput). Generate and serve take `learned-step:FOLDER` or
`learned-step:models:/blockpilot-step-policy@champion`.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from blockpilot.home import blockpilot_home
from blockpilot.options import (
    add_options,
    fraction_arg,
    from_args,
    non_negative_int_arg,
    option,
    positive_float_arg,
    positive_int_arg,
    share_arg,
)
from blockpilot.walks import ADAPT_CONFIDENCE, ADAPT_MARGIN


@dataclass(frozen=True)
class StepTrainJob:
    labels: Path = option(type=Path, help="label Parquet file or folder (replay labels: they carry the tables)")
    eval: Path | None = option(None, type=Path, help="held-out labels for the report (default: --labels)")
    cost: Path | None = option(
        None,
        type=Path,
        help="cost curve (blockpilot calibrate); default: every cycle costs 1. A curve measured at several batch "
        "sizes trains a load-aware model: one head per batch size, reported at each",
    )
    prior: str | None = option(
        None, help="per-request predictor (folder or models:/ URI): its choice drafts the first cycle and is a feature"
    )
    val_share: float = option(
        0.2,
        type=fraction_arg,
        help="with --prior: share of the --labels prompts held out of a first fit, on which its walks and the "
        "prior's are compared per temperature; where the model's walks are not surely faster (--adapt-confidence), "
        "the model (fitted again on every prompt) keeps the prior's b0 for requests at that temperature",
    )
    adapt_confidence: float = option(
        ADAPT_CONFIDENCE,
        type=share_arg,
        help="with --prior: the model chooses every cycle at a temperature only where its walks beat the prior's (by "
        "--adapt-margin) on the held-out share in at least this share of paired bootstrap resamples of its prompts "
        "(0: wherever its modeled throughput there is higher by the margin)",
    )
    adapt_margin: float = option(
        ADAPT_MARGIN,
        type=share_arg,
        help="with --prior: the model chooses every cycle at a temperature only where its walks decode more than this "
        "share faster than the prior's (modeled) on the held-out share, and so in --adapt-confidence of the "
        "resamples (a gain the cost curve cannot tell apart is none)",
    )
    hidden_size: int = option(64, type=positive_int_arg, help="hidden units of the step model")
    epochs: int = option(20, type=positive_int_arg, help="training epochs")
    batch_size: int = option(256, type=positive_int_arg, help="training cycles per step")
    lr: float = option(3e-3, type=positive_float_arg, help="AdamW learning rate")
    seed: int = option(0, type=int, help="seed of the weights and the shuffles")
    max_failures: int = option(2, type=non_negative_int_arg, help="worker failures tolerated per run")
    name: str | None = option(None, help="run name (default: unique)")
    storage: Path | None = option(None, type=Path, help="Ray Train storage (default under the home folder)")
    out: Path | None = option(None, type=Path, help="where the step model folder goes")
    track: bool = option(True, flag="--no-track", help="do not log to MLflow")

    def __post_init__(self) -> None:
        if self.name is None:
            object.__setattr__(self, "name", f"step-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")


@dataclass
class StepOutcome:
    model_dir: Path
    metrics: dict[str, float]
    run_id: str | None


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: the step model fitted on its shard of training cycles, a report and a checkpoint per epoch;
    restarted after a failure, it carries on from the last checkpoint."""
    import numpy as np
    import ray.train
    import torch

    from blockpilot.predictor.step_model import StepModel, StepModelConfig, fit_step_model
    from pipelines.train_checkpoints import report_epoch, restore_fit

    torch.manual_seed(config["seed"])
    # Copies: arrays from the object store are read-only, which torch warns about.
    features, regret = (np.array(values, dtype=np.float32) for values in ray.get(config["cycles"]))
    restored, optimizer_state, first_epoch = restore_fit(lambda folder: StepModel.load(folder / "step"))
    model = restored or StepModel(StepModelConfig.from_dict(config["model"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    rank = ray.train.get_context().get_world_rank()

    def on_epoch(epoch: int, loss: float) -> None:
        if rank == 0 and config["run_id"]:
            from blockpilot.tracking import log_epoch_metrics

            log_epoch_metrics(config["run_id"], {"train/regret_loss": loss}, epoch, config["tracking_uri"])
        metrics = {"epoch": epoch, "train/regret_loss": loss, "train/resumed_from_epoch": first_epoch}
        save = (lambda folder: model.save(folder / "step")) if rank == 0 else None
        report_epoch(metrics, epoch, optimizer, save=save)

    fit_step_model(
        model, features, regret, epochs=config["epochs"], batch_size=config["batch_size"], lr=config["lr"],
        seed=config["seed"], first_epoch=first_epoch, optimizer=optimizer, on_epoch=on_epoch,
    )


def run_step_train_job(job: StepTrainJob) -> StepOutcome:
    import ray
    import torch
    from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from blockpilot.cost import load_cost
    from blockpilot.data.labels import read_labels
    from blockpilot.predictor.confidence import fit_confidence_rule
    from blockpilot.predictor.step_data import (
        evaluate_step_model,
        format_prior_temperatures,
        format_step_metrics,
        prior_temperatures,
        regret_dataset,
        split_step_rows,
        step_rows,
    )
    from blockpilot.predictor.step_model import StepModel, StepModelConfig, fit_step_model
    from blockpilot.predictor.store import load_predictor
    from blockpilot.tracking import (
        STEP_MODEL_NAME,
        champion_context,
        log_label_set,
        log_predictor_model,
        start_run,
        tracking_uri,
    )
    from pipelines.ray_runtime import ensure_ray, train_run_config
    from pipelines.train_checkpoints import refuse_existing_run

    storage = job.storage or blockpilot_home() / "ray_results" / "step"
    refuse_existing_run(storage, job.name, resumable=False)
    cost = load_cost(job.cost)
    loads = tuple(cost.seconds) if len(cost.seconds) > 1 else ()
    prior = load_predictor(job.prior) if job.prior else None
    train_table = read_labels(job.labels)
    train_rows = step_rows(train_table, prior)
    # With a prior, a share of the prompts is held out of the fit to say at which temperatures the prior's b0 kept
    # to the end beats the model's choices (`prior_temperatures`).
    fit_rows, validation_rows = split_step_rows(train_rows, job.val_share, job.seed) if prior else (train_rows, [])
    eval_table = read_labels(job.eval) if job.eval else None
    eval_rows = step_rows(eval_table, prior) if eval_table is not None else train_rows
    first = train_table.slice(0, 1).to_pylist()[0]
    config = StepModelConfig(
        candidates=train_rows[0].tables[0].candidates,
        vocab_size=int(first["vocab_size"]),
        hidden_size=job.hidden_size,
        train_block_size=first["train_block_size"],
        target_id=first["target_id"] or "",
        drafter_id=first["drafter_id"] or "",
        prior=prior is not None,
        loads=loads,
        temperatures=tuple(row.temperature for row in train_rows),
        extra={"labels": str(job.labels), "cost": cost.describe(), "prior": job.prior},
    )
    features, regret = regret_dataset(train_rows, StepModel(config), cost)
    held = f"; first without {len(validation_rows)} held out, to compare it with the prior" if validation_rows else ""
    print(
        f"[step] {job.name}: {len(train_rows)} label rows, {len(features)} training cycles (every candidate's walk)"
        f"{held}; candidates {list(config.candidates)}, cost {cost.describe()}",
        flush=True,
    )
    with start_run("blockpilot-step-policy", job.name, enabled=job.track, tags={"stage": "train-step"}) as tracker:
        tracker.log_params({**asdict(job), "training_cycles": len(features), "candidates": list(config.candidates)})
        ensure_ray()
        kept: tuple[float, ...] = ()
        if validation_rows:  # fitted without them to compare on them, then again on every row
            lone = min(loads) if loads else None  # the model chooses for lone rows; under load the batch does
            # On the driver, as the walks are (a second Ray Train run would cost more to start than this fit), seeded
            # as the worker seeds its own.
            held_out_cycles = regret_dataset(fit_rows, StepModel(config), cost)
            torch.manual_seed(job.seed)
            held_out_fit = fit_step_model(
                StepModel(config), *held_out_cycles, epochs=job.epochs, batch_size=job.batch_size, lr=job.lr,
                seed=job.seed,
            )
            kept, compared = prior_temperatures(
                held_out_fit, validation_rows, cost, lone, job.adapt_confidence, job.adapt_margin
            )
            tracker.log_params({"prior_temperatures": list(kept)})
            tracker.log_metrics({f"validation/{k}": v for k, v in compared.items()})
            print(format_prior_temperatures(kept, compared), flush=True)
        trainer = TorchTrainer(
            _worker,
            train_loop_config={
                # Through the object store, as the predictor's rows (`pipelines.train_predictor.fit_on_ray`): a
                # Ray Dataset added Ray Data's actors to hand over arrays the driver already holds.
                "cycles": ray.put((features, regret)),
                "model": config.to_dict(),
                "epochs": job.epochs,
                "batch_size": job.batch_size,
                "lr": job.lr,
                "seed": job.seed,
                "run_id": tracker.run_id,
                "tracking_uri": tracking_uri() if tracker.run_id else None,
            },
            scaling_config=ScalingConfig(num_workers=1),
            run_config=train_run_config(
                name=job.name,
                storage_path=str(storage),
                failure_config=FailureConfig(max_failures=job.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )
        result = trainer.fit()
        with result.checkpoint.as_directory() as directory:
            model = StepModel.load(Path(directory) / "step")
        model.config = replace(model.config, prior_temperatures=kept)
        out = model.save(job.out or blockpilot_home() / "step-models" / job.name)
        rule = fit_confidence_rule(train_rows, cost)
        rule.save(out)  # beside the model: its folder (or MLflow URI) is the rule's too, `confidence:FOLDER`
        # A load-aware model is reported at each of its loads (`load<n>/...`), and at the largest without a prefix.
        by_load = {load: evaluate_step_model(model, eval_rows, cost, load=load, rule=rule) for load in loads}
        metrics = by_load[max(loads)] if loads else evaluate_step_model(model, eval_rows, cost, rule=rule)
        metrics = metrics | {f"load{load}/{k}": v for load, at_load in by_load.items() for k, v in at_load.items()}
        tracker.log_metrics({f"eval/{k}": v for k, v in metrics.items()})
        for name, source, table in (("train", job.labels, train_table), ("evaluation", job.eval, eval_table)):
            if table is not None:
                log_label_set(tracker, source, table, name)
        tracker.log_artifact(out, "step_model")
        # Crowned only on held-out labels (--eval), against a champion scored in the same context.
        context = champion_context(
            cost=cost,
            batch=max(loads) if loads else None,
            evaluation=eval_table,
            target_id=config.target_id,
            drafter_id=config.drafter_id,
        )
        version, champion = log_predictor_model(tracker, out, metrics["throughput_step"], STEP_MODEL_NAME, context)
    held_out = f"[step] held-out ({'--eval' if job.eval else 'training labels'})"
    if not loads:
        print(format_step_metrics(held_out, metrics))
    for load, at_load in by_load.items():
        print(format_step_metrics(f"{held_out}, priced at batch {load}", at_load))
    registered = f"; registered as models:/{STEP_MODEL_NAME}/{version}" if version else ""
    crowned = " (the new champion)" if champion else ""
    spec = f"learned+step:{job.prior},{out}" if prior is not None else f"learned-step:{out}"
    print(f"[step] saved to {out}{registered}{crowned}; use it with --policy {spec} (or its confidence rule: "
          f"--policy confidence:{out})")
    return StepOutcome(out, metrics, tracker.run_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.train_step_policy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_options(parser, StepTrainJob)
    try:
        run_step_train_job(from_args(StepTrainJob, parser.parse_args(argv)))
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        print(f"train-step: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
