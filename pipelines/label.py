"""Labeling on Ray Data: the block-size sweep of every (prompt, temperature), written to Parquet.

    ray job submit --runtime-env ray_job.yaml -- python -m pipelines.label --prompts gsm8k \\
        --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 --out /data/labels --num-gpus-per-actor 1
    blockpilot label --prompts zoo:$ZOO --target $ZOO/target --drafter $ZOO/drafter --out labels/   # locally

Prompts are read on the driver (an unknown source fails here, before anything starts); tasks already in
`--out` are skipped, so a rerun adds no duplicate and a stopped job labels only what is missing. Ray Data
shards the tasks over an actor pool (models loaded once per actor), each actor runs the library's sweep,
and `write_parquet` streams the rows out as blocks finish.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blockpilot.data.labels import labeled_keys, read_labels, rows_to_table
from blockpilot.data.sources import PromptRecord, load_prompts
from blockpilot.labeling import LabelSettings, LabelSummary, summarize, task_keys


@dataclass
class LabelJob:
    prompts: str
    target: str
    drafter: str
    out: Path
    settings: LabelSettings = field(default_factory=LabelSettings)
    actors: int = 1
    num_gpus_per_actor: float = 0.0
    num_cpus_per_actor: float = 1.0
    batch_size: int = 4
    limit: int | None = None
    device: str | None = None
    dtype: str | None = None
    track: bool = True


class SweepActor:
    """One Ray Data actor: loads the models once, then labels batches of tasks."""

    def __init__(
        self, target: str, drafter: str, settings: LabelSettings, device: str | None, dtype: str | None, threads: int
    ) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from blockpilot.labeling import Labeler
        from blockpilot.models.loading import load_models

        hf_logging.disable_progress_bar()
        torch.set_num_threads(max(1, threads))
        self.labeler = Labeler(load_models(target, drafter, device=device, dtype=dtype), settings)

    def __call__(self, batch: Any) -> Any:
        rows: list[dict[str, Any]] = []
        for task in batch.to_pylist():
            record = PromptRecord(task["id"], task["source"], tuple(task["turns"] or ()), task["error"])
            rows.extend(self.labeler.label(record, task["temperature"]))
        return rows_to_table(rows)


def pending_tasks(records: list[PromptRecord], temperatures: tuple[float, ...], out: Path) -> list[dict[str, Any]]:
    """Tasks whose rows are not all under `out` yet (unreadable, half-written files do not count)."""
    done = labeled_keys(out)
    return [
        {"id": r.id, "source": r.source, "turns": list(r.turns), "error": r.error, "temperature": float(t)}
        for r in records
        for t in temperatures
        if not all(key in done for key in task_keys(r, t))
    ]


def run_label_job(job: LabelJob) -> LabelSummary:
    """Label what is missing under `job.out`, then summarize every row there (and log it to MLflow)."""
    records = load_prompts(job.prompts, job.limit)
    job.out.mkdir(parents=True, exist_ok=True)
    tasks = pending_tasks(records, job.settings.temperatures, job.out)
    total = len(records) * len(job.settings.temperatures)
    print(
        f"[label] {len(records)} prompts x {len(job.settings.temperatures)} temperatures: "
        f"{total - len(tasks)} already labeled, {len(tasks)} to do",
        flush=True,
    )
    started = time.perf_counter()
    if tasks:
        _run_ray_data(job, tasks)
    elapsed = time.perf_counter() - started
    table = read_labels(job.out)
    summary = summarize(table.to_pylist(), new_rows=len(tasks), seconds=elapsed)
    print(summary.format(), flush=True)
    _track(job, summary, table)
    return summary


def _run_ray_data(job: LabelJob, tasks: list[dict[str, Any]]) -> None:
    import ray

    from pipelines.ray_runtime import ensure_ray

    ensure_ray()
    threads = max(1, int(job.num_cpus_per_actor)) if job.num_gpus_per_actor == 0 else 1
    dataset = ray.data.from_items(tasks, override_num_blocks=max(1, math.ceil(len(tasks) / job.batch_size)))
    labeled = dataset.map_batches(
        SweepActor,
        fn_constructor_kwargs={
            "target": job.target,
            "drafter": job.drafter,
            "settings": job.settings,
            "device": job.device,
            "dtype": job.dtype,
            "threads": threads,
        },
        batch_size=job.batch_size,
        batch_format="pyarrow",
        concurrency=job.actors,
        num_cpus=job.num_cpus_per_actor,
        num_gpus=job.num_gpus_per_actor or None,
    )
    labeled.write_parquet(str(job.out))


def _track(job: LabelJob, summary: LabelSummary, table: Any) -> None:
    from blockpilot.tracking import NullTracker, start_run

    with start_run(
        "blockpilot-labels", f"label-{Path(job.out).name}", enabled=job.track, tags={"stage": "label"}
    ) as tracker:
        tracker.log_params(
            {
                "prompts": job.prompts,
                "target": job.target,
                "drafter": job.drafter,
                "out": str(job.out),
                "actors": job.actors,
                "num_gpus_per_actor": job.num_gpus_per_actor,
                "limit": job.limit,
                **{f"settings.{k}": v for k, v in asdict(job.settings).items()},
            }
        )
        tracker.log_metrics(
            {
                "rows": summary.rows,
                "errors": summary.errors,
                "new_rows": summary.new_rows,
                "prompts_per_s": summary.prompts_per_s,
                "seconds": summary.seconds,
                **{f"mean_tau_b{b}": t for b, t in summary.mean_tau.items()},
                **{f"best_block_size_count_b{b}": n for b, n in summary.best_block_size_histogram.items()},
            }
        )
        if summary.candidates and not isinstance(tracker, NullTracker):
            for name, figure in label_figures(summary).items():
                tracker.log_figure(figure, name)


def label_figures(summary: LabelSummary) -> dict[str, Any]:
    """The B* histogram and the tau-vs-b curve, as matplotlib figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histogram, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(b) for b in summary.best_block_size_histogram], list(summary.best_block_size_histogram.values()))
    ax.set_xlabel("B* (best block size)")
    ax.set_ylabel("prompts")
    histogram.tight_layout()
    curve, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(list(summary.mean_tau), list(summary.mean_tau.values()), marker="o")
    ax.set_xlabel("block size b")
    ax.set_ylabel("mean tau")
    curve.tight_layout()
    return {"best_block_size_histogram.png": histogram, "tau_vs_block_size.png": curve}


# ----------------------------------------------------------------------------- command line


def add_label_arguments(parser: argparse.ArgumentParser) -> None:
    from blockpilot.cli import model_ref, positive_int

    parser.add_argument(
        "--prompts",
        required=True,
        help="gsm8k, mt-bench, ..., jsonl:PATH, txt:PATH, parquet:PATH, zoo:DIR[:heldout]; comma-separated for several",
    )
    parser.add_argument("--target", type=model_ref, required=True)
    parser.add_argument("--drafter", type=model_ref, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder of label Parquet files (appended to)")
    parser.add_argument(
        "--candidates",
        type=_int_list,
        default=None,
        help="block sizes, e.g. 6,7,8,9,10 (default: B-2..B+2 around the drafter's training block size)",
    )
    parser.add_argument("--temperatures", type=_float_list, default=(0.0,), help="e.g. 0,1")
    parser.add_argument("--mode", choices=("replay", "live"), default="replay")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--top-k", type=positive_int, default=32, help="prefill distribution entries stored")
    parser.add_argument("--dense", action="store_true", help="also store the whole prefill distribution (fp16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--samples",
        type=positive_int,
        default=1,
        help="at T > 0, generations pooled per row (tau becomes a mean over them)",
    )
    parser.add_argument("--actors", type=positive_int, default=1)
    parser.add_argument("--num-gpus-per-actor", type=float, default=0.0)
    parser.add_argument("--num-cpus-per-actor", type=float, default=1.0)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="tasks per actor call (and per file)")
    parser.add_argument("--limit", type=positive_int, default=None, help="at most this many prompts per source")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, got {text!r}")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers >= 0, got {text!r}")
    return values


def job_from_args(args: argparse.Namespace) -> LabelJob:
    settings = LabelSettings(
        candidates=args.candidates,
        temperatures=args.temperatures,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        dense=args.dense,
        seed=args.seed,
        samples=args.samples,
    )
    return LabelJob(
        prompts=args.prompts,
        target=args.target,
        drafter=args.drafter,
        out=args.out,
        settings=settings,
        actors=args.actors,
        num_gpus_per_actor=args.num_gpus_per_actor,
        num_cpus_per_actor=args.num_cpus_per_actor,
        batch_size=args.batch_size,
        limit=args.limit,
        device=args.device,
        dtype=args.dtype,
        track=not args.no_track,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.label", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_label_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        summary = run_label_job(job_from_args(args))
    except (ValueError, FileNotFoundError) as error:
        print(f"label: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"rows": summary.rows, "errors": summary.errors}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
