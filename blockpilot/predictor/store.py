"""Where a saved predictor (per-request or per-step) comes from: a folder, or an MLflow model URI downloaded to one."""

from __future__ import annotations

from pathlib import Path

import torch

from blockpilot.predictor.model import BlockSizePredictor

MODEL_URI_PREFIXES = ("models:/", "runs:/")


def resolve_predictor_dir(path_or_uri: str | Path, artifact: str = "predictor") -> Path:
    """A predictor folder, or an MLflow model URI (`models:/blockpilot-predictor/3`,
    `models:/blockpilot-step-policy@champion`) downloaded to one. The registered model is a pyfunc whose artifacts hold the folder; only that folder is read
    (safetensors + JSON), nothing is unpickled."""
    text = str(path_or_uri)
    if text.startswith(MODEL_URI_PREFIXES):
        from blockpilot.tracking import download_model_folder

        return download_model_folder(text, artifact)
    directory = Path(text).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(
            f"predictor {text!r} is neither a folder nor an MLflow model URI (models:/NAME/VERSION or "
            "models:/NAME@ALIAS)"
        )
    return directory


def load_predictor(path_or_uri: str | Path, device: str | torch.device = "cpu") -> BlockSizePredictor:
    return BlockSizePredictor.load(resolve_predictor_dir(path_or_uri), device=device)
