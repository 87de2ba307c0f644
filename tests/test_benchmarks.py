"""Every benchmark ``make bench-gpu`` and ``make bench`` run also runs here in a small form, so a
change that breaks one is caught here, not on the next lent GPU or the next figures' rerun (the first
GPU run found three broken by refactors: a seed option, torch 2.11's stager, temporary checkpoints
filling the disk; the first CPU suite run found the throughput ablation calling a changed function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist import HANG_S
from tests.test_train import REPO

# Each suite part's script with the options that keep it under half a minute here (name: script, args).
SMALL = {
    "throughput": ["throughput", "--variants", "bare_eager,train_eager", "--steps", "3", "--warmup", "1"],
    "throughput_ablation": [
        *["throughput", "--variants", "bare_eager", "--ablation", "--batch", "2", "--seq-len", "32"],
        *["--steps", "3", "--warmup", "1"],
    ],
    "save": ["save", "--mib", "64", "--saves", "1"],
    "load": [
        "load",
        "--flavor",
        "debug",
        "--ranks",
        "1",
        "--skip-cold",
        "--methods",
        "seedckpt,stock_dcp",
        "--repeats",
        "1",
    ],
    "seed": ["seed", "--flavor", "debug", "--skip-baseline", "--plan-workers", "2"],
    "osft": ["osft", "--flavor", "debug", "--n-layers", "2", "--measure", "svd,device,forward", "--ranks", ""],
    "attention": ["attention", "--flavor", "debug", "--seq-len", "128", "--repeats", "1"],
    "loss": ["loss", "--tokens", "256", "--dim", "64", "--chunk-tokens", "100", "--repeats", "1"],
    "loss_train": [
        *["loss", "--train", "--vocab", "1024", "--seq-len", "64"],
        *["--batch", "2", "--steps", "2", "--rounds", "1"],
    ],
    "packed_attention": ["packed_attention", "--seq-lens", "256", "--doc-len", "64", "--repeats", "1"],
    "attention_sinks": ["attention_sinks", "--seq-lens", "128", "--window", "32", "--repeats", "1"],
    "sft_start": ["sft_start", "--flavor", "debug", "--ranks", "2", "--skip-baseline"],
    "convert": ["convert", "--flavor", "debug"],
    "tp_read": ["tp_read", "--flavor", "debug", "--layouts", "pp2 x tp2"],
    "quantized_read": ["quantized_read", "--small", "--repeats", "1"],
    "compare_layouts": ["compare_layouts", "--steps", "2", "--ranks", "2", "--layouts", "single,fsdp2"],
    "sft_batches": ["sft_batches", "--steps", "1"],
    "data_rss": [
        *["data_rss", "--gib", "0.01", "--small-mib", "1", "--steps", "1"],
        *["--conversations", "1000", "--small-conversations", "100"],
    ],
    "init_rates": ["init_rates", "--mi-elements", "2", "--repeats", "1"],
    "checksums": ["checksums", "--flavor", "debug", "--mib", "8"],
    "tokenize": ["tokenizing", "--mib", "0.5", "--vocab", "1000", "--repeats", "1"],
    "mla": ["mla", "--heads", "2", "--seq-len", "64", "--repeats", "1"],
    "moe": ["moe", "--tokens", "256", "--dim", "64", "--ffn", "32", "--repeats", "1"],
    "moe_ep": ["moe", "--ep", "2", "--set", "--model.n_experts 4"],
    # here torchtitan does not import: a skipped line per variant (on a GPU its trainer runs)
    "torchtitan_peer": ["torchtitan_peer", "--flavor", "debugmodel", "--batch", "2", "--seq-len", "64", "--steps", "2"],
}


def test_every_suite_script_has_a_small_form_here():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import suite

    scripts = {part.argv[0].removeprefix("benchmarks/").removesuffix(".py") for part in suite.PARTS}
    # "-m": pytest (the cuda tests) and the seedckpt CLI (the plan); demo: `make demo` itself, minutes
    assert scripts - {"-m", "demo"} == {args[0] for args in SMALL.values()}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALL))
def test_the_benchmark_runs_on_the_cpu_and_prints_its_figures(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{SMALL[script][0]}.py", *SMALL[script][1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines and all(isinstance(line, dict) for line in lines), proc.stdout[-2000:]
