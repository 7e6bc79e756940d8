"""Session fixtures: tiny models built here, in a temporary BLOCKPILOT_HOME, with no hub."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True, scope="session")
def isolated_home(tmp_path_factory: pytest.TempPathFactory):
    """Every artifact of the session under one temporary BLOCKPILOT_HOME; nothing in the real home."""
    home = tmp_path_factory.mktemp("blockpilot-home")
    previous = os.environ.get("BLOCKPILOT_HOME")
    os.environ["BLOCKPILOT_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("BLOCKPILOT_HOME", None)
    else:
        os.environ["BLOCKPILOT_HOME"] = previous


@pytest.fixture(scope="session")
def random_zoo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`blockpilot zoo random` output: target/ (with tokenizer) and drafter/ folders."""
    from blockpilot.zoo.random_models import write_random_zoo

    return write_random_zoo(tmp_path_factory.mktemp("random-zoo"), seed=0)


@pytest.fixture(scope="session")
def random_models(random_zoo):
    from blockpilot.models import load_models

    return load_models(random_zoo["target"], random_zoo["drafter"], device="cpu")
