"""The one folder that holds every artifact this project writes (zoo, labels, runs, MLflow store)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "BLOCKPILOT_HOME"


def blockpilot_home() -> Path:
    """`$BLOCKPILOT_HOME`, or `~/.cache/blockpilot` when unset. Not created here."""
    configured = os.environ.get(HOME_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "blockpilot"
