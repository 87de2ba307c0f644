"""``benchmarks/torchtitan_peer.py``: torchtitan 0.2.2's trainer is run on the shapes, batch and
precision of ``throughput.py``'s train.py rows, ``train.py`` on a config of the same (untied) shape,
and torchtitan's per-step log lines are read back (torchtitan itself is not installed here: the GPU
call, and ``make bench-check`` with its wheels, run it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import throughput  # noqa: E402 -- scripts of benchmarks/, imported as their tests would
import torchtitan_peer  # noqa: E402

# torchtitan 0.2.2's step lines as its MetricsProcessor logs them under torchrun, colors on and off
LOG = """[rank0]:[titan] 2026-11-28 03:00:01,000 - root - INFO - Training starts at step 1
[rank0]:[titan] 2026-11-28 03:00:02,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.25000  \
\x1b[33mgrad_norm:  3.1234  \x1b[34mmemory: 21.05GiB(26.61%)  \x1b[34mtps: 1,234  \
\x1b[36mtflops: 10.15  mfu: 1.03%\x1b[39m
[rank0]:[titan] 2026-11-28 03:00:03,000 - root - INFO - step:  2  loss: 11.50000  grad_norm:  2.0000  \
memory: 22.50GiB(28.44%)  tps: 41,200  tflops: 338.67  mfu: 34.23%
"""

# the peer's torchtitan options for throughput.py's settings
SETTINGS = {
    "batch": "--training.local_batch_size",
    "seq_len": "--training.seq_len",
    "dtype": "--training.mixed_precision_param",
}
# torchtitan 0.2.2's TransformerModelArgs, the fields our config reads: its debugmodel (no KV-head
# count, no FFN multiplier: None) and the 1B the peer registers; their sizes as torchtitan 0.2.2
# counted them (6 163 712; the 1B: 1 235 814 400 tied + the 262 668 288 of an untied output)
ROPE_31 = SimpleNamespace(
    scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
DEBUGMODEL = SimpleNamespace(
    dim=256, n_layers=6, n_heads=16, n_kv_heads=None, vocab_size=2048, multiple_of=256, norm_eps=1e-5,
    ffn_dim_multiplier=None, rope_theta=500000, rope_scaling_args=ROPE_31,
)  # fmt: skip
LLAMA32_1B = SimpleNamespace(
    **{**vars(DEBUGMODEL), "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256}
)
LLAMA32_1B.ffn_dim_multiplier = 1.5
LLAMA32_1B.rope_scaling_args = SimpleNamespace(**{**vars(ROPE_31), "scaling_factor": 32.0})


def test_the_step_lines_of_torchtitans_log_are_read_with_or_without_colors():
    assert torchtitan_peer.parse_steps(LOG) == [
        {"step": 1, "loss": 12.25, "gib": 21.05, "tps": 1234.0},
        {"step": 2, "loss": 11.5, "gib": 22.5, "tps": 41200.0},
    ]


def test_a_run_without_figures_says_its_status_only_where_it_failed():
    steps, size = torchtitan_peer.parse_steps(LOG), torchtitan_peer.SIZE_LINE.search("size: 1,234 total parameters")
    assert torchtitan_peer.failure(1, steps, size) == "exited with status 1"
    assert torchtitan_peer.failure(0, [], size) == "logged no step line"
    assert torchtitan_peer.failure(0, steps, None) == "logged no 'total parameters' line"
    assert torchtitan_peer.failure(0, steps, size) is None


def test_the_peer_runs_the_shapes_batch_and_precision_of_train_pys_gpu_rows(tmp_path):
    opts = argparse.Namespace(flavor="1B", batch=4, seq_len=2048, steps=12, dtype="bfloat16")
    eager = torchtitan_peer.trainer_args(opts, "torchtitan_eager", tmp_path)
    compiled = torchtitan_peer.trainer_args(opts, "torchtitan_compiled", tmp_path)
    settings = {key: eager[eager.index(flag) + 1] for key, flag in SETTINGS.items()}
    expected = {key: str(throughput.CUDA_DEFAULTS[key]) for key in SETTINGS}
    assert settings == expected and eager[eager.index("--model.flavor") + 1] == "1B"
    assert eager[eager.index("--model.name") + 1] == torchtitan_peer.SPEC
    assert "--compile.enable" not in eager and compiled[-1] == "--compile.enable" and len(compiled) == len(eager) + 1


@pytest.mark.parametrize(
    "theirs,n_params,hidden",
    [(DEBUGMODEL, 6_163_712, 768), (LLAMA32_1B, 1_235_814_400 + 262_668_288, 8192)],
    ids=["debugmodel", "1B"],
)
def test_train_py_runs_the_shape_of_torchtitans_flavor_untied(theirs, n_params, hidden, tmp_path):
    from seedckpt.config.job_config import load_config

    config = load_config(str(torchtitan_peer.our_config(theirs, tmp_path / "peer.toml")), ["--model.flavor", "1B"])
    args = config.model_args()
    with torch.device("meta"):
        counted = sum(p.numel() for p in config.model_family().model(args).parameters())
    assert (counted, args.ffn_hidden_dim, args.tie_word_embeddings) == (n_params, hidden, False)
    assert (args.n_kv_heads, args.rope_scaling.factor) == (
        theirs.n_kv_heads or theirs.n_heads,
        theirs.rope_scaling_args.scaling_factor,
    )


def test_a_module_the_peer_never_calls_is_stood_in_only_where_it_does_not_import(monkeypatch):
    """The GPU image may lack ``datasets``' pyarrow and TensorBoard, which torchtitan imports as it
    loads but the peer never calls: stand-ins that refuse use, and only for what does not import."""
    absent = "seedckpt_no_such_package"
    unused = {absent: {absent: ("Dataset",), f"{absent}.distributed": ("split",)}, "json": {"json": ("loads",)}}
    monkeypatch.setattr(torchtitan_peer, "UNUSED", unused)
    loads = sys.modules["json"].loads
    try:
        assert torchtitan_peer.stand_ins() == [absent]
        from seedckpt_no_such_package.distributed import split

        with pytest.raises(RuntimeError, match="stood in for a package it does not use"):
            split("rows", 0, 1)
        assert sys.modules["json"].loads is loads
    finally:
        for name in unused[absent]:
            sys.modules.pop(name, None)
