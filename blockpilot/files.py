"""File names of saved model folders, and writes that never leave a half-written file or folder behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

# A saved model folder (drafter or predictor) is a Hugging Face style pair.
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to a unique temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        staging.write_text(text)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Yield a fresh staging folder beside `target`; on success it replaces `target` whole, on failure it is removed.

    Readers see either the old folder or the complete new one, never a mix: concurrent writers each stage
    under a unique name, and the last rename wins.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
    staging.mkdir()
    try:
        yield staging
        if target.exists():
            retired = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.old")
            os.replace(target, retired)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
