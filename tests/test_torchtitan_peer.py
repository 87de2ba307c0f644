"""``benchmarks/torchtitan_peer.py``: torchtitan's trainer is run on the shapes, batch and precision of
``throughput.py``'s train.py rows, and its per-step log lines are read back (torchtitan itself is not
installed here: the GPU call runs it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import throughput  # noqa: E402 -- scripts of benchmarks/, imported as their tests would
import torchtitan_peer  # noqa: E402

# torchtitan 0.3.0's step lines as its MetricsProcessor logs them under torchrun, colors on and off
LOG = """[rank0]:[titan] 2026-11-28 03:00:01,000 - root - INFO - Training starts at step 1
[rank0]:[titan] 2026-11-28 03:00:02,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.25000  \
\x1b[33mgrad_norm:  3.1234  \x1b[34mmemory: 21.05GiB(26.61%)  \x1b[34mtps: 1,234  \
\x1b[36mtflops: 10.15  mfu: 1.03%\x1b[39m
[rank0]:[titan] 2026-11-28 03:00:03,000 - root - INFO - step:  2  loss: 11.50000  grad_norm:  2.0000  \
memory: 22.50GiB(28.44%)  tps: 41,200  tflops: 338.67  mfu: 34.23%
"""


# the peer's torchtitan options for throughput.py's settings
SETTINGS = {
    "batch": "--training.local-batch-size",
    "seq_len": "--training.seq-len",
    "dtype": "--training.mixed-precision-param",
}


def test_the_step_lines_of_torchtitans_log_are_read_with_or_without_colors():
    assert torchtitan_peer.parse_steps(LOG) == [
        {"step": 1, "loss": 12.25, "gib": 21.05, "tps": 1234.0},
        {"step": 2, "loss": 11.5, "gib": 22.5, "tps": 41200.0},
    ]


def test_the_peer_runs_the_shapes_batch_and_precision_of_train_pys_gpu_rows(tmp_path):
    opts = argparse.Namespace(flavor="1B", batch=4, seq_len=2048, steps=12, dtype="bfloat16")
    eager = torchtitan_peer.trainer_command(opts, "torchtitan_eager", tmp_path)
    compiled = torchtitan_peer.trainer_command(opts, "torchtitan_compiled", tmp_path)
    settings = {key: eager[eager.index(flag) + 1] for key, flag in SETTINGS.items()}
    expected = {key: str(throughput.CUDA_DEFAULTS[key]) for key in SETTINGS}
    assert settings == expected and eager[eager.index("--config") + 1] == "llama3_1B"
    assert "--compile.enable" not in eager and compiled[-1] == "--compile.enable" and len(compiled) == len(eager) + 1
