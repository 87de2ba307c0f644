"""Shared fixtures: a tiny debug model config and a seed checkpoint made once per session."""

from __future__ import annotations

import pytest

from seedckpt.config import load_config
from seedckpt.seed import create_seed_checkpoint


def tiny_config(*overrides: str):
    """The debug flavor with command-line style overrides, e.g. ``tiny_config("--model.n_layers", "8")``."""
    return load_config(None, ["--model.flavor", "debug", *overrides])


@pytest.fixture(scope="session")
def debug_seed(tmp_path_factory):
    """The debug model's seed checkpoint (seed 0), written once for the whole test session."""
    path = tmp_path_factory.mktemp("seeds") / "debug"
    create_seed_checkpoint(tiny_config(), path, seed=0, progress=False)
    return path
