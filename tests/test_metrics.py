"""Model FLOPs utilization: the FLOPs-per-token formula, the peak table and the row fields (pure
functions; a CPU run's rows carrying none of it is checked in test_train's parity run)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from models.llama3 import LLAMA3
from models.llama3.args import LLAMA3_FLAVORS
from models.registry import get_family
from seedckpt.train.metrics import MetricsLogger, format_duration, format_step, peak_tflops, utilization

ONE_B = LLAMA3_FLAVORS["1B"]


def test_llama_3_2_1b_at_2048_tokens_is_8_2_gflop_per_token():
    """N = 1,235,814,400 (Llama-3.2-1B's 1.24 B, the tied embedding once); 16 layers, 32 heads of 64."""
    assert (ONE_B.n_layers, ONE_B.n_heads, ONE_B.head_dim, ONE_B.tie_word_embeddings) == (16, 32, 64, True)
    flops = LLAMA3.flops_per_token(ONE_B, 2048)
    assert flops == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 2048
    assert round(flops / 1e9, 1) == 8.2


def test_a_tied_matrix_counts_once_and_attention_grows_with_the_sequence():
    untied = dataclasses.replace(ONE_B, tie_word_embeddings=False)
    assert LLAMA3.flops_per_token(untied, 2048) - LLAMA3.flops_per_token(ONE_B, 2048) == 6 * 128256 * 2048
    assert LLAMA3.flops_per_token(ONE_B, 4096) - LLAMA3.flops_per_token(ONE_B, 2048) == 12 * 16 * 32 * 64 * 2048


@pytest.mark.parametrize(
    "name,dtype,tf32,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", False, 989.5),  # SXM
        ("NVIDIA H100 80GB HBM3", "float16", False, 989.5),
        ("NVIDIA H100 80GB HBM3", "float32", False, 67.0),
        ("NVIDIA H100 80GB HBM3", "float32", True, 494.5),
        ("NVIDIA H100 PCIe", "bfloat16", False, 756.5),
        ("NVIDIA H100 NVL", "bfloat16", False, 835.5),
        ("NVIDIA H200", "bfloat16", False, 989.5),
        ("NVIDIA H200 NVL", "float32", False, 60.0),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", False, 312.0),
        ("NVIDIA A100 80GB PCIe", "float32", False, 19.5),
        ("NVIDIA L40S", "bfloat16", False, 362.05),
        ("NVIDIA L40S", "float32", True, 183.0),
        ("NVIDIA GeForce RTX 4090", "bfloat16", False, None),
        ("NVIDIA L4", "bfloat16", False, None),
    ],
)
def test_peak_by_device_name_and_parameter_dtype(name, dtype, tf32, peak):
    assert peak_tflops(name, dtype, tf32) == peak


def test_utilization_per_gpu_and_nothing_without_a_peak():
    """8.2 GFLOP/token x 40 k tokens/s on one H100 SXM: 329 TFLOP/s, a third of its 989.5 peak; the
    same tokens over 4 GPUs is a quarter of that per GPU."""
    flops = LLAMA3.flops_per_token(ONE_B, 2048)
    one = utilization(flops, 40_000.0, 1, 989.5)
    assert one["tflops"] == pytest.approx(flops * 40_000 / 1e12)
    assert one["mfu_pct"] == pytest.approx(100 * one["tflops"] / 989.5) and 30 < one["mfu_pct"] < 35
    assert utilization(flops, 40_000.0, 4, 989.5)["tflops"] == pytest.approx(one["tflops"] / 4)
    assert utilization(flops, 40_000.0, 1, None) == {}


def test_the_step_line_shows_utilization_only_when_the_row_has_it():
    row = {
        "step": 3,
        "steps": 10,
        "loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 40_000.0,
        "step_time_s": 0.2,
        "data_wait_s": 0.001,
        "peak_mem_bytes": 2**30,
    }
    assert "TFLOP/s" not in format_step(row) and "mfu" not in format_step(row)
    assert "329 TFLOP/s  mfu 33.2 %" in format_step({**row, "tflops": 328.8, "mfu_pct": 33.23})


def test_wandb_without_the_package_is_one_line_naming_the_extra(monkeypatch):
    import sys

    import pytest

    from seedckpt.train.metrics import MetricsLogger
    from seedckpt.utils.errors import SeedckptError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import raises ImportError
    with pytest.raises(SeedckptError, match=r"pip install 'seedckpt\[wandb\]'"):
        MetricsLogger.check_wandb()


def test_tensorboard_gets_the_curves_not_the_runs_constants(tmp_path, monkeypatch):
    """``steps`` (the run's length) is the same in every row: a curve of it is noise in TensorBoard."""
    from seedckpt.train.metrics import MetricsLogger

    scalars = []

    class Writer:
        def __init__(self, folder):
            pass

        def add_scalar(self, key, value, step):
            scalars.append((key, step))

        def close(self):
            pass

    monkeypatch.setattr(MetricsLogger, "check_tensorboard", staticmethod(lambda: Writer))
    logger = MetricsLogger(tmp_path, enable_tensorboard=True)
    row = {"step": 3, "steps": 10, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 9.0}
    logger.log({**row, "step_time_s": 0.1, "data_wait_s": 0.0, "peak_mem_bytes": 1, "label_tokens": 8})
    logger.close()
    assert {key for key, _ in scalars} >= {"loss", "lr", "grad_norm"}
    assert not {key for key, _ in scalars} & {"step", "steps"} and {s for _, s in scalars} == {3}


def test_the_step_line_shows_the_remaining_time(tmp_path, monkeypatch):
    """The first row's estimate is its step time times the steps left; later rows use the mean time per
    step since the first row (the start and the first step's compilation left out)."""
    clock = iter([100.0, 130.0])  # the wall clock at the two rows: 3 steps in 30 s
    monkeypatch.setattr("seedckpt.train.metrics.time.perf_counter", lambda: next(clock))
    row = {"steps": 1000, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1.0, "data_wait_s": 0.0}
    row |= {"peak_mem_bytes": 2**30}
    logger = MetricsLogger(tmp_path, False)
    logger.log({**row, "step": 10, "step_time_s": 40.0})
    logger.log({**row, "step": 13, "step_time_s": 9.0})
    logger.close()
    first, second = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first["eta_s"] == 990 * 40.0 and second["eta_s"] == 987 * 10.0
    assert format_step(second).endswith("eta 2h44m")
    assert [format_duration(s) for s in (42.4, 425, 10920)] == ["42s", "7m05s", "3h02m"]


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gpt_oss"])
def test_a_windowed_layer_counts_its_window_not_the_sequence(name):
    """Layers 0 and 2 attend to 16 keys: at 1024 tokens each costs 12·H·Q·(1024 - 16) less than an
    unwindowed block of the same shape, and doubling the sequence adds attention to the other layers
    only."""
    family = get_family(name)
    args = dataclasses.replace(family.flavors["debug"], sliding_window=16, window_layers=[0, 2])
    per_key = 12 * args.n_heads * args.head_dim
    blocks = family.layer_flops(args, 1024).blocks
    assert blocks[1] - blocks[0] == blocks[3] - blocks[2] == per_key * (1024 - 16)
    full_layers = args.n_layers - 2
    assert family.flops_per_token(args, 2048) - family.flops_per_token(args, 1024) == per_key * 1024 * full_layers
