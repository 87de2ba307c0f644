"""The seed's serial start-up: nothing heavy imported on its path, and the lazy marks that keep it
so still do their work where the compiler runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from models.common import moe
from tests.dist import HANG_S

REPO = Path(__file__).resolve().parents[1]

# Imported by nothing a seed needs: torch._dynamo alone was 0.7 s of a tiny seed's 1.6 s (imported
# by a decorator in models/common/moe.py at import time).
HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "tokenizers")

# Seeds a dense family and a mixture of experts (its MoE layers built on meta, their recipes drawn),
# then prints what was imported.
SEED_PROBE = """
import sys
from seedckpt.cli.main import main
for name in ("llama3", "deepseek_v3"):
    args = ["seed", "--config", "configs/debug.toml", "--model.name", name, "--model.flavor", "debug"]
    assert main([*args, "--model.n_layers", "2", "--output", sys.argv[1] + name, "--quiet"]) == 0
print(sorted(m for m in {heavy} if m in sys.modules))
"""


def test_seed_imports_nothing_heavy(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    probe = SEED_PROBE.format(heavy=HEAVY)
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "seed-")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    imported = proc.stdout.strip().splitlines()[-1]
    assert imported == "[]", f"the seed imported {imported}: import it where it is used (-X importtime shows who)"


def test_compiled_code_reads_the_capability_as_a_constant(monkeypatch):
    """``_sm90_or_newer`` carries ``assume_constant_result``'s mark without the decorator: dynamo
    calls it once while tracing and the graph holds its answer. Unmarked, dynamo 2.13 puts the
    capability query in the graph, asked again at every call."""
    asked = []

    def capability(device_index):
        asked.append(device_index)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)

    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return x + 1 if moe._sm90_or_newer(0) else x

    for _ in range(3):
        assert step(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert asked == [0]
