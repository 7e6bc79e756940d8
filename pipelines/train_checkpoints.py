"""One epoch's Ray Train checkpoint, written and read back the same way by every fit: the model's folder (saved
by the fit's own `save`), the optimizer's state and the epoch. A worker that Ray Train restarts after a
failure, or a run continued with --resume, carries on from the epoch after the last one reported."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

TRAINER_STATE = "trainer_state.pt"

Model = TypeVar("Model")


def restore_fit(load: Callable[[Path], Model]) -> tuple[Model | None, dict | None, int]:
    """(model, optimizer state, first epoch to run) from the run's latest checkpoint; (None, None, 0) without one.
    `load` reads the model from the checkpoint's folder."""
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None, None, 0
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / TRAINER_STATE, weights_only=True)
        return load(Path(directory)), state["optimizer"], state["epoch"] + 1


def report_epoch(
    metrics: dict[str, float], epoch: int, optimizer: Any, save: Callable[[Path], Any] | None
) -> None:
    """`ray.train.report` of one epoch, with a checkpoint when `save` is given (on the rank that writes them):
    `save(folder)` writes the model, this the optimizer's state and the epoch beside it."""
    import ray.train
    import torch

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if save is not None:
            save(Path(directory))
            torch.save({"optimizer": optimizer.state_dict(), "epoch": epoch}, Path(directory) / TRAINER_STATE)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report({k: float(v) for k, v in metrics.items()}, checkpoint=checkpoint)


def refuse_existing_run(storage: Path, name: str, resumable: bool) -> None:
    """A new run must not land on an old one's checkpoints: Ray Train would carry on from them."""
    if (storage / name).exists():
        how = "pass --resume to continue it, or another --name" if resumable else "pass another --name"
        raise ValueError(f"run {name!r} already exists under {storage}: {how}")
