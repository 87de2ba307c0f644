"""Every benchmark ``make bench-gpu`` runs also runs on the CPU in a small form, so a change that
breaks one is caught here, not on the next lent GPU (the first GPU run found three broken by
refactors: a seed option, torch 2.11's stager, temporary checkpoints filling the disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_train import REPO

# The suite's scripts with the CPU-sized options that keep each under half a minute here.
SMALL = {
    "throughput": ["--variants", "bare_eager,train_eager", "--steps", "3", "--warmup", "1"],
    "save": ["--mib", "64", "--saves", "1"],
    "load": ["--flavor", "debug", "--ranks", "1", "--skip-cold", "--methods", "seedckpt,stock_dcp", "--repeats", "2"],
    "seed": ["--flavor", "debug", "--skip-baseline"],
    "osft": ["--flavor", "debug", "--n-layers", "2", "--measure", "svd,device,forward", "--ranks", ""],
    "attention": ["--flavor", "debug", "--seq-len", "128", "--repeats", "1"],
    "loss": ["--tokens", "256", "--dim", "64", "--chunk-tokens", "100", "--repeats", "1"],
    "packed_attention": ["--seq-lens", "256", "--doc-len", "64", "--repeats", "1"],
}


def test_every_gpu_suite_script_has_a_small_form_here():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import suite

    gpu_parts = [part for part in suite.PARTS if suite.GROUPS[part.group] == "cuda"]
    scripts = {part.argv[0].removeprefix("benchmarks/").removesuffix(".py") for part in gpu_parts}
    assert scripts - {"-m"} == set(SMALL)  # "-m": pytest, the cuda tests


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALL))
def test_the_benchmark_runs_on_the_cpu_and_prints_its_figures(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", *SMALL[script]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines and all(isinstance(line, dict) for line in lines), proc.stdout[-2000:]
