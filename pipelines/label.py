"""Labeling on Ray Data: the block-size sweep of every (prompt, temperature), written to Parquet.

    ray job submit --runtime-env ray_job.yaml -- python -m pipelines.label --prompts gsm8k \\
        --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 --out /data/labels --num-gpus-per-actor 1
    blockpilot label --prompts zoo:$ZOO --target $ZOO/target --drafter $ZOO/drafter --out labels/   # locally

Prompts are read on the driver (an unknown source fails here, before anything starts). The output folder
holds the job's fingerprint (`_job.json`: target, drafter, settings): a rerun with other settings is refused,
a rerun with the same ones labels only what is missing, and an advisory lock keeps two jobs off one folder.
Ray Data shards the tasks over an actor pool (models loaded once per actor; each actor sweeps its batch of
prompts together), and the driver writes each finished batch as its own Parquet file (staged, then renamed
into place), with one progress bar.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockpilot.checks import differing_fields
from blockpilot.cost import load_cost
from blockpilot.data.labels import LABEL_SCHEMA_VERSION, labeled_keys, read_label_files, write_label_file
from blockpilot.data.sources import PromptRecord, load_prompts
from blockpilot.files import write_text_atomic
from blockpilot.labeling import (
    SUMMARY_COLUMNS,
    LabelSettings,
    LabelSummary,
    label_headroom,
    summarize,
    task_keys,
    turn_ids,
)
from blockpilot.options import (
    add_options,
    from_args,
    model_ref,
    nested,
    non_negative_float_arg,
    option,
    positive_float_arg,
    positive_int_arg,
)

# The folder's own files start with "_" or ".", which Parquet readers (pandas, pyarrow, Ray Data, Spark, DuckDB)
# skip: the folder reads as one dataset as it is.
FINGERPRINT_FILE = "_job.json"
OLD_FINGERPRINT_FILE = "job.json"  # where versions before the label schema's version kept it
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class LabelJob:
    prompts: str = option(
        help="gsm8k, mt-bench, ..., jsonl:PATH, txt:PATH, parquet:PATH, zoo:DIR[:heldout|corpus]; "
        "comma-separated for several"
    )
    target: str = option(type=model_ref, help="target model folder or hub id")
    drafter: str = option(type=model_ref, help="DFlash drafter folder or hub id")
    out: Path = option(type=Path, help="folder of label Parquet files (appended to)")
    settings: LabelSettings = nested(LabelSettings)
    actors: int = option(1, type=positive_int_arg, help="Ray Data actors (each loads the models once)")
    num_gpus_per_actor: float = option(0.0, type=non_negative_float_arg, help="GPUs per actor")
    num_cpus_per_actor: float = option(1.0, type=positive_float_arg, help="CPUs per actor")
    batch_size: int = option(8, type=positive_int_arg, help="tasks per actor call, swept together (one file each)")
    limit: int | None = option(None, type=positive_int_arg, help="at most this many prompts per source")
    cost: Path | None = option(None, type=Path, help="a cost curve (blockpilot calibrate) that prices the summary")
    device: str | None = option(None, help="cpu, cuda, ... (default: cuda when present)")
    dtype: str | None = option(None, help="float32, bfloat16, ... (default: bf16 on cuda, fp32 on cpu)")
    track: bool = option(True, flag="--no-track", help="do not log to MLflow")
    restart: bool = option(
        False, help="move the labels already under --out (and its job file) aside to OUT.replaced-TIME, label anew"
    )

    def fingerprint(self) -> dict[str, Any]:
        """What must match for rows of two runs to sit in one folder (flat: the settings beside the models)."""
        return {"target": self.target, "drafter": self.drafter, **self.settings.fingerprint()}


class SweepActor:
    """One Ray Data actor: loads the models once, then labels batches of tasks."""

    def __init__(self, job: LabelJob, threads: int) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from blockpilot.labeling import Labeler
        from blockpilot.models.loading import load_models

        hf_logging.disable_progress_bar()
        torch.set_num_threads(max(1, threads))
        models = load_models(job.target, job.drafter, device=job.device, dtype=job.dtype)
        self.labeler = Labeler(models, job.settings, max_batch=job.batch_size)

    def __call__(self, batch: Any) -> Any:
        from blockpilot.data.labels import rows_to_table
        from blockpilot.labeling import DeviceFailure

        tasks = [
            (PromptRecord(t["id"], t["source"], tuple(t["turns"] or ()), t["error"]), t["temperature"])
            for t in batch.to_pylist()
        ]
        try:
            rows = self.labeler.label_many(tasks)
        except DeviceFailure as failure:
            restart_after(failure)
        return rows_to_table([row for task_rows in rows for row in task_rows])


def restart_after(failure: BaseException) -> None:
    """A failed device poisons this process (a CUDA device assert cannot be cleared): exit, so that Ray Data
    restarts the actor and retries its batch (actor pools restart and retry by default). Nothing of the batch
    was written."""
    print(f"[label] the device failed ({failure}); restarting this labeling actor", file=sys.stderr, flush=True)
    os._exit(1)


def pending_tasks(records: list[PromptRecord], temperatures: tuple[float, ...], out: Path) -> list[dict[str, Any]]:
    """Tasks whose rows are not all under `out` yet (unreadable, half-written files do not count)."""
    done = labeled_keys(out)
    return [
        {"id": r.id, "source": r.source, "turns": list(r.turns), "error": r.error, "temperature": float(t)}
        for r in records
        for t in temperatures
        if not all(key in done for key in task_keys(r, t))
    ]


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """An advisory lock on the output folder for the job's lifetime: a second job on it fails at once."""
    handle = open(out / LOCK_FILE, "w")  # noqa: SIM115 - held for the whole job
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another labeling job is writing to {str(out)!r}; wait for it or pick another --out") from None
        yield
    finally:
        handle.close()


def move_labels_aside(out: Path) -> Path | None:
    """Everything under `out` but the job's lock, moved into a new sibling `OUT.replaced-TIME` (returned; None when
    there was nothing): a restarted job starts from an empty folder, and nothing of the old one is lost."""
    moving = [path for path in out.iterdir() if path.name != LOCK_FILE]
    if not moving:
        return None
    name = f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, suffix = out.with_name(name), 0
    while aside.exists():  # two restarts in one second
        suffix += 1
        aside = out.with_name(f"{name}-{suffix}")
    aside.mkdir()
    for path in moving:
        path.rename(aside / path.name)
    return aside


def check_fingerprint(job: LabelJob) -> None:
    """Refuse to mix rows of differently configured jobs in one folder; record the fingerprint otherwise. With
    `job.restart`, the folder's labels are moved aside first (`move_labels_aside`)."""
    if job.restart:
        aside = move_labels_aside(job.out)
        if aside is not None:
            print(f"[label] --restart: the labels that were in {job.out} are in {aside} now", flush=True)
    path = job.out / FINGERPRINT_FILE
    if (job.out / OLD_FINGERPRINT_FILE).is_file():
        raise ValueError(
            f"{str(job.out)!r} holds labels of an older version of blockpilot ({OLD_FINGERPRINT_FILE}); this version "
            f"reads label schema version {LABEL_SCHEMA_VERSION} only: label again into a new --out"
        )
    wanted = json.loads(json.dumps(job.fingerprint()))  # as JSON would give it back (tuples -> lists)
    if path.is_file():
        found = json.loads(path.read_text())
        if found != wanted:
            raise ValueError(
                f"{str(job.out)!r} holds labels of another job (differing: {', '.join(differing_fields(found, wanted))}); "
                "label into a new --out, or pass --restart to move these labels aside and label anew"
            )
        return
    write_text_atomic(path, json.dumps(wanted, indent=2) + "\n")


def check_budget(job: LabelJob) -> None:
    """Refuse, before any prompt is read or row written, a max_new_tokens the target's context cannot hold beside a
    prompt (the actors' engines would refuse it one by one)."""
    from transformers import AutoConfig

    from blockpilot.labeling import label_prompt_limit

    config = AutoConfig.from_pretrained(job.target).get_text_config()
    label_prompt_limit(getattr(config, "max_position_embeddings", None), job.settings.max_new_tokens)


def run_label_job(job: LabelJob) -> LabelSummary:
    """Label what is missing under `job.out`, then summarize every row there (and log it to MLflow)."""
    check_budget(job)
    records = load_prompts(job.prompts, job.limit)
    job.out.mkdir(parents=True, exist_ok=True)
    with exclusive(job.out):
        check_fingerprint(job)
        tasks = pending_tasks(records, job.settings.temperatures, job.out)
        total = len(records) * len(job.settings.temperatures)
        print(
            f"[label] {len(records)} prompts x {len(job.settings.temperatures)} temperatures: "
            f"{total - len(tasks)} already labeled, {len(tasks)} to do",
            flush=True,
        )
        already = read_label_files(job.out, columns=["prompt_id"])[0].num_rows
        started = time.perf_counter()
        written = _run_ray_data(job, tasks, records) if tasks else 0
        elapsed = time.perf_counter() - started
    table, _ = read_label_files(job.out, columns=SUMMARY_COLUMNS)
    summary = summarize(table.to_pylist(), new_rows=written, seconds=elapsed, already_labeled=already)
    summary.headroom = label_headroom(job.out, load_cost(job.cost))
    print(summary.format(), flush=True)
    _track(job, summary)
    return summary


NO_PROGRESS_TIMEOUT_S = 1800.0
BATCH_RETRIES = 3


def _run_ray_data(job: LabelJob, tasks: list[dict[str, Any]], records: list[PromptRecord]) -> int:
    """Sweep `tasks` on an actor pool; the driver writes each finished batch. Returns the rows written."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext
    from tqdm import tqdm

    from pipelines.ray_runtime import ensure_ray, quiet_ray_data

    ensure_ray()
    quiet_ray_data()  # one bar of our own below, not Ray Data's block every 10 s
    # An actor's first batch loads the models and builds the engine's compiled cycle (a minute or more a shape on a
    # GPU): Ray Data's default of 120 s without progress would fail the job while it compiles.
    DataContext.get_current().execution_no_progress_timeout_s = NO_PROGRESS_TIMEOUT_S
    turns = {r.id: len(turn_ids(r)) for r in records}
    expected = sum(turns[t["id"]] for t in tasks)
    threads = max(1, int(job.num_cpus_per_actor)) if job.num_gpus_per_actor == 0 else 1
    dataset = ray.data.from_items(tasks, override_num_blocks=max(1, math.ceil(len(tasks) / job.batch_size)))
    with warnings.catch_warnings():
        # Ray 2.60 names no parameter for an actor's restarts: they go as remote arguments, which it calls deprecated.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        labeled = dataset.map_batches(
            SweepActor,
            fn_constructor_kwargs={"job": job, "threads": threads},
            batch_size=job.batch_size,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=job.actors),
            num_cpus=job.num_cpus_per_actor,
            num_gpus=job.num_gpus_per_actor or None,
            # A batch that crashes its actor is retried a few times on a restarted one, not without bound.
            max_restarts=BATCH_RETRIES,
            max_task_retries=BATCH_RETRIES,
        )
    written = 0
    with tqdm(total=expected, desc="[label] rows", unit="row", dynamic_ncols=True, mininterval=2.0) as bar:
        for block in labeled.iter_batches(batch_size=None, batch_format="pyarrow"):
            if block.num_rows == 0:
                continue
            write_label_file(block, job.out / f"part-{uuid.uuid4().hex}.parquet")
            written += block.num_rows
            bar.update(block.num_rows)
    return written


def _track(job: LabelJob, summary: LabelSummary) -> None:
    from dataclasses import asdict

    from blockpilot.tracking import start_run

    with start_run(
        "blockpilot-labels", f"label-{Path(job.out).name}", enabled=job.track, tags={"stage": "label"}
    ) as tracker:
        if not tracker.enabled:
            return
        job_params = {k: v for k, v in asdict(job).items() if k != "settings"}
        tracker.log_params({**job_params, **{f"settings.{k}": v for k, v in asdict(job.settings).items()}})
        tracker.log_metrics(
            {
                "label/rows": summary.rows,
                "label/errors": summary.errors,
                "label/new_rows": summary.new_rows,
                "label/prompts_per_s": summary.prompts_per_s,
                "label/seconds": summary.seconds,
                **{f"label/mean_tau_b{b}": t for b, t in summary.mean_tau.items()},
                **{f"label/best_block_size_count_b{b}": n for b, n in summary.best_block_size_histogram.items()},
                **{f"headroom/{k}": v for k, v in (summary.headroom or {}).items() if "source/" not in k},
            }
        )
        if summary.candidates:
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
    add_options(parser, LabelJob)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.label", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_label_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        summary = run_label_job(from_args(LabelJob, args))
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"label: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"rows": summary.rows, "errors": summary.errors}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
