"""Where ranks run (``job.device``): the choice and its errors before any rendezvous, the backend
that follows it and, on a machine with a GPU (``cuda`` marker), that the CUDA path computes what the
CPU path does: training losses, a loaded stage, compiled training."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from seedckpt.config.job_config import Training
from seedckpt.config.resolve import choose_device, resolve
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
from tests.test_resume import rows
from tests.test_resume import train as train_from

# One process (python train.py, a world of one), pp = 1: the same run on either device.
ONE_RANK = [
    "--parallelism.pipeline_parallel_degree",
    "1",
    "--training.steps",
    "10",
    "--training.local_batch_size",
    "8",
    "--training.seq_len",
    "32",
    "--data.kind",
    "synthetic",
    "--checkpoint.interval",
    "0",
]


def train(run_dir: Path, seed: Path, *overrides: str) -> subprocess.CompletedProcess:
    return train_from(run_dir, seed, *overrides, base=ONE_RANK)


# -- the choice (CPU) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "requested,local_ranks,gpus,chosen",
    [
        ("auto", 1, 0, "cpu"),
        ("auto", 4, 4, "cuda"),
        ("auto", 2, 8, "cuda"),
        ("cpu", 4, 1, "cpu"),
        ("cuda", 1, 1, "cuda"),
        ("cuda", 0, 0, "cuda"),
        ("auto", 0, 0, "cpu"),
    ],
)
def test_auto_is_cuda_when_a_gpu_is_visible_and_cpu_is_always_possible(requested, local_ranks, gpus, chosen):
    assert choose_device(requested, local_ranks, gpus) == chosen


def test_more_local_ranks_than_gpus_names_both_numbers_and_both_fixes():
    with pytest.raises(SeedckptError) as e:
        choose_device("auto", 4, 1)
    message = str(e.value)
    assert "4 ranks on this machine but only 1 visible GPU" in message and "\n" not in message
    assert "--nproc-per-node 1" in message and "--job.device cpu" in message


def test_resolve_places_torchruns_local_ranks(monkeypatch):
    """``LOCAL_WORLD_SIZE`` (torchrun) is what is checked against the GPUs, not the world size:
    8 ranks on two machines of 4 GPUs each fit."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = tiny_config("--parallelism.pipeline_parallel_degree", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve(cfg, 8).device == "cuda"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(SeedckptError, match="8 ranks on this machine but only 4 visible GPU"):
        resolve(cfg, 8)
    assert resolve(tiny_config("--job.device", "cpu"), 8).device == "cpu"
    assert resolve(cfg, 8, local_world_size=0).device == "cuda"  # seedckpt plan: places no rank


def test_cuda_without_cuda_is_one_line_before_any_rendezvous(tmp_path, debug_seed):
    """The test process sees no GPU (conftest), like a CPU machine."""
    proc = train(tmp_path / "run", debug_seed, "--job.device", "cuda")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "job.device = 'cuda'" in err and "--job.device cpu" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "cpu:gloo,cuda:gloo"),  # gloo for every tensor: torch's name for init_process_group("gloo")
        pytest.param("cuda", "cpu:gloo,cuda:nccl", marks=pytest.mark.cuda),
    ],
)
def test_the_process_group_backend_follows_the_device(device, backend):
    from seedckpt.train.trainer import _init_process_group

    _init_process_group(device)
    try:
        assert dist.get_backend_config() == backend
    finally:
        dist.destroy_process_group()


# -- the CUDA path (one GPU) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, debug_seed):
    """The reference: the one-rank run on the CPU, bf16 parameters like the CUDA runs."""
    run_dir = tmp_path_factory.mktemp("cpu") / "run"
    proc = train(run_dir, debug_seed, "--job.device", "cpu", "--training.mixed_precision_param", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return rows(run_dir)


def assert_close_in_bf16(got: list[dict], reference: list[dict]) -> None:
    """bf16 keeps 8 bits of mantissa (relative spacing 2**-8 = 0.4 %); the two devices sum in different
    orders, and ten steps of AdamW carry the differences on. 2 % of the loss is a few bf16 ulps of
    its inputs, far below what a wrong gradient, schedule or batch would change (step 1 to 10:
    about 30 %)."""
    assert [r["step"] for r in got] == [r["step"] for r in reference] == list(range(1, 11))
    for a, b in zip(got, reference):
        assert abs(a["loss"] - b["loss"]) <= 0.02 * b["loss"], (a["step"], a["loss"], b["loss"])
    assert reference[-1]["loss"] < 0.9 * reference[0]["loss"]  # it learns


@pytest.mark.cuda
def test_one_gpu_trains_what_the_cpu_trains(tmp_path, debug_seed, cpu_run):
    proc = train(tmp_path / "run", debug_seed, "--job.device", "cuda", "--training.mixed_precision_param", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on cuda" in proc.stdout and "AdamW fused" in proc.stdout, proc.stdout
    got = rows(tmp_path / "run")
    assert_close_in_bf16(got, cpu_run)
    name = torch.cuda.get_device_name()
    if any(gpu in name for gpu in ("H100", "H200", "A100", "L40S")):  # the MFU fields: only with a known peak
        assert all(r["tflops"] > 0 and 0 < r["mfu_pct"] < 100 for r in got), got[-1]


@pytest.mark.cuda
def test_compiled_training_on_cuda_matches_the_cpu(tmp_path, debug_seed, cpu_run):
    if "compile" not in {f.name for f in dataclasses.fields(Training)}:
        pytest.skip("training.compile is not a config key in this version")
    proc = train(
        tmp_path / "run",
        debug_seed,
        "--job.device",
        "cuda",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.compile",
        "true",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_in_bf16(rows(tmp_path / "run"), cpu_run)


@pytest.mark.cuda
def test_a_cuda_load_is_bitwise_the_cpu_load(debug_seed):
    """Each pipeline stage of the seed, loaded onto the GPU (read through pinned slots, copied on
    a side stream) and onto the CPU: the same bytes, non-persistent buffers recomputed on either device."""
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages

    args = tiny_config().model_args()
    for rank in range(2):
        specs = plan_rank_stages(args, rank, 2)
        [on_gpu] = build_stages(args, specs, "cuda", checkpoint=debug_seed)
        [on_cpu] = build_stages(args, specs, "cpu", checkpoint=debug_seed)
        gpu_state, cpu_state = on_gpu.state_dict(), on_cpu.state_dict()
        assert gpu_state.keys() == cpu_state.keys() and gpu_state
        for fqn, tensor in gpu_state.items():
            assert tensor.device.type == "cuda", fqn
            assert torch.equal(tensor.cpu(), cpu_state[fqn]), fqn
        assert torch.allclose(on_gpu.freqs_cis.cpu(), on_cpu.freqs_cis, rtol=0, atol=1e-5)
