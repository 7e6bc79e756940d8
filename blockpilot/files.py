"""File names of saved model folders, and writes that never leave a half-written file or folder behind."""

from __future__ import annotations

import contextlib
import hashlib
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


# The version of the model folders this code writes and reads (its config's `schema_version`). Raise it when a
# folder's meaning changes; an older folder is refused with what to rerun, never guessed at.
# 2: step models always read the block's first tokens, a prior's b0 with its probabilities, loads from the cost.
MODEL_SCHEMA_VERSION = 2


def save_weights_folder(directory: str | Path, config: dict, state: dict) -> Path:
    """A model folder (`CONFIG_NAME` + `WEIGHTS_NAME`, its config stamped with `MODEL_SCHEMA_VERSION`), written
    whole; refuses non-finite weights."""
    import json

    import torch
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if not all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()):
        raise ValueError(f"refusing to save non-finite weights to {str(directory)!r}")
    with atomic_folder(directory) as staging:
        stamped = {**config, "schema_version": MODEL_SCHEMA_VERSION}
        (staging / CONFIG_NAME).write_text(json.dumps(stamped, indent=2) + "\n")
        save_file(state, staging / WEIGHTS_NAME, metadata={"format": "pt"})
    return Path(directory)


def load_weights_folder(directory: str | Path, what: str) -> tuple[dict, dict]:
    """(config without its schema version, state dict) of a folder written by `save_weights_folder`; `what` names
    it in errors. A folder of another schema version is refused, saying what to rerun."""
    import json

    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a {what} folder (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    config = json.loads((directory / CONFIG_NAME).read_text())
    version = config.pop("schema_version", None)
    if version != MODEL_SCHEMA_VERSION:
        rerun = "blockpilot train-step" if config.get("kind") == "step" else "blockpilot train"
        raise ValueError(
            f"{str(directory)!r} holds a {what} of schema version {version or 'before versions'}; this version of "
            f"blockpilot reads {MODEL_SCHEMA_VERSION}: train it again (`{rerun}`)"
        )
    return config, load_file(directory / WEIGHTS_NAME)


def folder_digest(path: str | Path) -> str:
    """`sha256:` and 16 hex digits of a folder's files (their relative names and bytes, in name order): what a
    deployment pins a model folder to."""
    folder = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(file.relative_to(folder).as_posix().encode() + b"\0")
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()[:16]}"
