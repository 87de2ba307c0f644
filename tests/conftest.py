"""Shared fixtures: a tiny debug model config and a seed checkpoint made once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from seedckpt.checkpoint import MANIFEST_NAME
from seedckpt.config import load_config
from seedckpt.seed import create_seed_checkpoint


def tiny_config(*overrides: str):
    """The debug flavor with command-line style overrides, e.g. ``tiny_config("--model.n_layers", "8")``."""
    return load_config(None, ["--model.flavor", "debug", *overrides])


@pytest.fixture(scope="session")
def debug_seed(tmp_path_factory):
    """The debug model's seed checkpoint (seed 0), written once for the whole test session by two
    workers (two data files), whatever the machine's core count."""
    path = tmp_path_factory.mktemp("seeds") / "debug"
    create_seed_checkpoint(tiny_config(), path, seed=0, progress=False, workers=2)
    return path


def stock_load(path) -> dict[str, torch.Tensor]:
    """Read a checkpoint's model tensors with stock DCP only (shapes from its manifest)."""
    manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    state = {fqn: torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"])) for fqn, t in manifest["tensors"].items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state
