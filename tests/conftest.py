"""Shared fixtures: a tiny debug model config and a seed checkpoint made once per session; every
test not marked ``cuda`` runs on the CPU, also on a machine with GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from seedckpt.checkpoint import MANIFEST_NAME
from seedckpt.config.job_config import load_config
from seedckpt.materialize.seed import create_seed_checkpoint

# What this machine has, asked once before any test hides it (torch caches the device count).
HAS_CUDA = torch.cuda.device_count() > 0  # NVML: no CUDA context in the test process


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """``job.device = auto`` means the CPU in every test not marked ``cuda``: the subprocesses
    (``train.py``, torchrun, ``seedckpt``, spawned ranks) see no GPU, and neither does this process
    (``resolve`` asks ``torch.cuda.device_count``). So the CPU suite -- multi-rank layouts, bitwise
    parity between them -- passes unchanged on a one-GPU machine, where ranks 1..3 would otherwise
    ask for devices it does not have."""
    if request.node.get_closest_marker("cuda"):
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def probe_readings(probe: str, *args: str, timeout: float = 900.0) -> list[int]:
    """The integers ``probe`` (Python source) prints, run with ``args`` in a fresh one-thread
    interpreter at the repository root: peak-RSS readings of a process that held nothing before."""
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return [int(word) for word in proc.stdout.split()]


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


@pytest.fixture(scope="session")
def tied_seed(tmp_path_factory):
    """The debug model with tied embeddings (``output.weight`` is ``tok_embeddings.weight``): its
    seed (seed 0), written once for the session by two workers."""
    path = tmp_path_factory.mktemp("seeds") / "tied"
    create_seed_checkpoint(tiny_config("--model.tie_word_embeddings", "true"), path, seed=0, progress=False, workers=2)
    return path


def check_tied_stock_load(path) -> None:
    """A tied checkpoint stores the matrix once, and ``.metadata`` records ``output.weight`` at the
    embedding's bytes: stock ``dcp.load`` fills a tied model's ``state_dict()`` and an untied-shaped
    one (two tensors) with our reader's values, bitwise; the manifest counts the matrix once."""
    from models.common.decoder import Transformer
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    checkpoint = open_model_checkpoint(path)
    chunks = {
        fqn: [(index.offset, info) for index, info in checkpoint.metadata.storage_data.items() if index.fqn == fqn]
        for fqn in ("tok_embeddings.weight", "output.weight")
    }
    assert chunks["output.weight"] == chunks["tok_embeddings.weight"]  # the same bytes, no second copy
    manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    model = Transformer(checkpoint.args)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in manifest["tensors"]
    assert manifest["num_params"] == sum(t.numel() for t in model.parameters())  # the tied matrix once
    tied = model.state_dict()
    untied = {fqn: torch.zeros_like(t) for fqn, t in tied.items()}
    for state in (tied, untied):
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        for fqn, t in state.items():
            assert torch.equal(t, checkpoint.read_tensor(fqn)), fqn


def stock_load(path) -> dict[str, torch.Tensor]:
    """Read a checkpoint's model tensors with stock DCP only (shapes from its manifest)."""
    manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    state = {fqn: torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"])) for fqn, t in manifest["tensors"].items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state
