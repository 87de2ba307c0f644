"""Pretraining runs under torchrun: cross-layout loss parity, exact resume, crash-safe checkpoints,
and up-front validation of the parallel layout."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from seedckpt.checkpoint import DcpCheckpoint, complete_steps
from seedckpt.cli.main import main as seedckpt_main
from seedckpt.utils.errors import SeedckptError
from tests.dist import HANG_S, run_distributed, run_main

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "--training.steps",
    "10",
    "--training.global_batch_size",
    "8",
    "--training.seq_len",
    "32",
    "--data.kind",
    "synthetic",
    "--checkpoint.interval",
    "0",
]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(run_dir: Path, seed: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    """train.py on ``nproc`` ranks, as torchrun starts them (``tests.dist.run_main``)."""
    argv = [
        "--config",
        "configs/debug.toml",
        "--checkpoint.seed_checkpoint",
        str(seed),
        "--checkpoint.folder",
        str(run_dir / "ckpt"),
        "--job.dump_folder",
        str(run_dir),
        *COMMON,
        *overrides,
    ]
    proc = run_main(argv, nproc, _env(), REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def model_state(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    reader = DcpCheckpoint(path)
    state = {
        k: torch.zeros(i.shape, dtype=i.dtype)
        for k, i in reader.tensors().items()
        if k.startswith(prefix) and not k.startswith("rng.")
    }
    reader.load(state)
    return state


LAYOUTS = {
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "dp_shard2": (2, ["--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "4"]),
    "pp2_x_dp_shard2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_microbatches",
            "2",
        ],
    ),
    "pp2_grad_accumulation": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_microbatches",
            "2",
        ],
    ),
    "hsdp_2x2_selective_ac": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "1",
            "--training.local_batch_size",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
        ],
    ),
    "pp2_zbv": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--parallelism.pipeline_parallel_stages_per_rank",
            "2",
        ],
    ),
    "pp2_interleaved_full_ac": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_stages_per_rank",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
}


def test_loss_parity_across_layouts(tmp_path, debug_seed):
    torchrun(
        tmp_path / "single",
        debug_seed,
        1,
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--training.local_batch_size",
        "8",
        "--profiling.steps",
        "2",
    )
    reference = losses(tmp_path / "single")
    assert len(reference) == 10
    records = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    for r in records:  # the run-output contract (README, run outputs): these fields, with sane values
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_bytes"] > 100 * 2**20
        assert "tflops" not in r and "mfu_pct" not in r  # no peak to measure against on a CPU: never invented
    assert json.loads((tmp_path / "single" / "traces" / "step-2-rank0.json").read_text())["traceEvents"]
    assert reference[-1] < reference[0] - 1.0 and reference[-1] < math.log(512)  # it learns
    for name, (nproc, overrides) in LAYOUTS.items():
        torchrun(tmp_path / name, debug_seed, nproc, *overrides)
        got = losses(tmp_path / name)
        assert len(got) == 10
        for step, (a, b) in enumerate(zip(got, reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"


def test_auto_adamw_on_the_cpu_computes_what_torchs_default_did():
    """``optimizer.implementation = auto`` is foreach on the CPU, where foreach falls back to per-tensor
    ops: bitwise the for-loop AdamW that torch picks for CPU tensors when not told. Fused is CUDA's
    auto; on a CPU its vectorized kernel may round the update its own way (bitwise equal or not
    depends on the CPU's vector width: both were seen on this project's machines), within 1e-6."""
    from seedckpt.train.optimizer import ADAMW_KERNELS, adamw_implementation

    assert adamw_implementation("auto", "cpu") == "foreach" and adamw_implementation("auto", "cuda") == "fused"
    assert adamw_implementation("for-loop", "cuda") == "for-loop"

    def train(**kernels):
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
            for i, shape in enumerate([(64, 32), (128,), (7, 9)])
        ]
        optimizer = torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, **kernels)
        grads = torch.Generator().manual_seed(10)
        for _ in range(20):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
        return params

    default = train()
    for implementation in ("auto", "for-loop", "fused"):
        got = train(**ADAMW_KERNELS[adamw_implementation(implementation, "cpu")])
        if implementation != "fused":
            assert all(torch.equal(a, b) for a, b in zip(got, default)), implementation
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(got, default)), implementation


@pytest.mark.parametrize(
    "implementation,nproc,layout",
    [
        (
            "auto",
            4,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "4",
                "--parallelism.pipeline_parallel_microbatches",
                "2",
            ],
        ),
        # torch 2.13 has a fused AdamW for the CPU too; FSDP2's sharded parameters and moments on 2 ranks.
        # (for-loop gives auto's bits on the CPU: test_auto_adamw_on_the_cpu_computes_what_torchs_default_did)
        ("fused", 2, LAYOUTS["dp_shard2"][1]),
    ],
)
def test_resume_is_bitwise_identical(tmp_path, debug_seed, implementation, nproc, layout):
    """With each AdamW implementation (``optimizer.implementation``; auto is foreach on the CPU)."""
    layout = [*layout, "--checkpoint.interval", "5", "--optimizer.implementation", implementation]
    straight = torchrun(tmp_path / "straight", debug_seed, nproc, *layout)
    assert f"AdamW {'foreach' if implementation == 'auto' else implementation};" in straight.stdout
    first = torchrun(tmp_path / "resumed", debug_seed, nproc, *layout, "--training.stop_after_step", "5")
    assert "stopping after step 5" in first.stdout
    assert sorted(complete_steps(tmp_path / "resumed" / "ckpt")) == [5]
    second = torchrun(tmp_path / "resumed", debug_seed, nproc, *layout)
    assert "resuming from" in second.stdout and "step-5" in second.stdout
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")  # bitwise, 10 steps
    a = model_state(tmp_path / "straight" / "ckpt" / "step-10")
    b = model_state(tmp_path / "resumed" / "ckpt" / "step-10")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if implementation != "auto":
        return  # direct init does not depend on the optimizer
    # No seed file: every rank initializes its own shards from training.seed -- the same run, bitwise.
    direct = torchrun(tmp_path / "direct", tmp_path / "no-seed-here", 4, *layout, "--checkpoint.init_from", "direct")
    assert "initializing directly from seed 0" in direct.stdout
    assert losses(tmp_path / "direct") == losses(tmp_path / "straight")


def _default_comms_worker(rank, world_size, seed, run):
    """Two FSDP2 steps with the default metrics.collective_timing; which comms each fully_shard-ed
    module runs, and whether manual FSDP on the same mesh would time its own calls."""
    from torch.distributed.fsdp import FSDPModule

    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve
    from seedckpt.parallel.data_parallel import make_data_parallel
    from seedckpt.train.trainer import Trainer

    def config(*overrides):
        return load_config(
            REPO / "configs/debug.toml",
            [
                *COMMON,
                "--training.steps",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "1",
                "--training.local_batch_size",
                "4",
                "--checkpoint.seed_checkpoint",
                seed,
                "--checkpoint.folder",
                str(Path(run) / "ckpt"),
                "--job.dump_folder",
                run,
                *overrides,
            ],
        )

    trainer = Trainer(resolve(config(), world_size).with_start())
    trainer.run()
    comms = [
        (type(group._all_gather_comm).__name__, type(group._reduce_scatter_comm).__name__)
        for module in trainer.modules
        for m in module.modules()
        if isinstance(m, FSDPModule)
        for group in m._get_fsdp_state()._fsdp_param_groups
    ]
    manual = make_data_parallel(config("--parallelism.fsdp_impl", "manual"), trainer.dims, trainer.mesh)
    return {
        "comms": comms,
        "fsdp2_timed": trainer.data_parallel.collectives is not None,
        "manual_timed": manual.collectives is not None,
    }


def test_fsdp2_keeps_its_default_comms_unless_timing_is_asked_for(tmp_path, debug_seed):
    """metrics.collective_timing = auto: FSDP2's collectives are not replaced by timed ones (that
    needs torch's private _fsdp_api), so its rows carry no collective columns; manual FSDP, whose
    timing is free, still times its own calls."""
    [info, _] = run_distributed(_default_comms_worker, 2, str(debug_seed), str(tmp_path))
    assert len(info["comms"]) == 7  # 6 blocks and the root
    assert set(info["comms"]) == {("DefaultAllGather", "DefaultReduceScatter")}
    assert not info["fsdp2_timed"] and info["manual_timed"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert not any(k.startswith(("all_gather", "reduce_scatter")) for r in rows for k in r)


def _killed_mid_checkpoint_worker(rank, world_size, seed, folder, dump, *overrides):
    """Train pp=2 with a checkpoint every 2 steps; rank 0 (which would publish the checkpoint) is
    SIGKILLed while writing step 4, after its data files are written and before ``.metadata``.
    ``overrides``: more config (``--checkpoint.async_mode async``: killed in the background write)."""
    from seedckpt.checkpoint import StreamingFileSystemWriter
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve
    from seedckpt.train.trainer import Trainer

    original = StreamingFileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        result = original(self, plan, planner)
        if rank == 0 and "step-4" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)  # data files written, .metadata not yet
        return result

    StreamingFileSystemWriter.write_data = write_then_die
    cfg = load_config(
        REPO / "configs/debug.toml",
        [
            *COMMON,
            "--checkpoint.interval",
            "2",
            "--checkpoint.seed_checkpoint",
            seed,
            "--checkpoint.folder",
            folder,
            "--job.dump_folder",
            dump,
            "--training.local_batch_size",
            "8",
            *overrides,
        ],
    )
    Trainer(resolve(cfg, world_size).with_start()).run()


def test_sigkill_while_writing_leaves_previous_step_loadable(tmp_path, debug_seed):
    folder = tmp_path / "ckpt"
    with pytest.raises(AssertionError, match=r"died|Connection reset|Connection closed"):
        run_distributed(_killed_mid_checkpoint_worker, 2, str(debug_seed), str(folder), str(tmp_path), timeout=HANG_S)
    assert sorted(complete_steps(folder)) == [2]
    [partial] = folder.glob(".step-4.*.partial")  # rank 0's: .step-4.<its pid>.partial
    # SIGKILL ran no cleanup: the lock file stays, its flock died with rank 0.
    assert {p.name for p in folder.iterdir() if p.name.startswith(".")} == {partial.name, ".step-4.lock"}
    with pytest.raises(SeedckptError, match="interrupted write"):
        DcpCheckpoint(partial)
    assert model_state(folder / "step-2")["layers.0.attention.wq.weight"].abs().sum() > 0
    # The next run resumes from step 2 and cleans up the partial write when it saves step 4 again.
    resumed = torchrun(
        tmp_path / "again",
        debug_seed,
        2,
        "--checkpoint.folder",
        str(folder),
        "--checkpoint.interval",
        "2",
        "--training.steps",
        "4",
        "--training.local_batch_size",
        "8",
    )
    assert "resuming from" in resumed.stdout and "step-2" in resumed.stdout
    assert sorted(complete_steps(folder)) == [2, 4] and not any(p.name.startswith(".") for p in folder.iterdir())


@pytest.mark.parametrize(
    "world,overrides,message",
    [
        (
            4,
            ["--parallelism.pipeline_parallel_degree", "3"],
            "world size 4 is not divisible by pipeline_parallel_degree x data_parallel_replicate_degree = 3 x 1",
        ),
        (4, ["--parallelism.data_parallel_shard_degree", "4"], "= 2 x 1 x 4 = 8, but the world size is 4"),
        (8, ["--parallelism.pipeline_parallel_degree", "8"], "cannot split 6 layers into 8 pipeline stages"),
        (
            4,
            ["--parallelism.pipeline_parallel_microbatches", "1"],
            "microbatches = 1 is less than the 2 pipeline ranks",
        ),
        (
            4,
            ["--parallelism.pipeline_parallel_microbatches", "3"],
            "not divisible by pipeline_parallel_microbatches = 3",
        ),
        (4, ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "pipeline_parallel_stages_per_rank = 2"),
        (
            4,
            ["--parallelism.pipeline_parallel_schedule", "Sideways"],
            "pipeline_parallel_schedule = 'Sideways'; this version supports",
        ),
        (
            4,
            ["--training.global_batch_size", "12"],
            "must be a multiple of local_batch_size x data-parallel degree = 16",
        ),
        (
            1,
            ["--parallelism.pipeline_parallel_degree", "1", "--checkpoint.seed_checkpoint", "/nonexistent/seed"],
            "checkpoint.seed_checkpoint /nonexistent/seed does not exist",
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.pipeline_parallel_stages_per_rank", "2"],
            "pipeline_parallel_stages_per_rank > 1 needs pipeline_parallel_degree > 1",
        ),
        (4, ["--training.seq_len", "4096"], "training.seq_len = 4096 exceeds model.max_seq_len = 512"),
        (4, ["--training.local_batch_size", "0"], "training.local_batch_size = 0; it must be >= 1"),
        (4, ["--finetune.mode", "lora"], "finetune.mode = 'lora'; this version supports none, sft, osft"),
        (4, ["--finetune.mode", "osft"], "finetune.mode = 'osft' needs finetune.pretrained"),
        (4, ["--finetune.mode", "sft"], "finetune.mode = 'sft' needs finetune.pretrained"),
        (
            4,
            [
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.pipeline_parallel_stages_per_rank",
                "2",
                "--activation_checkpoint.mode",
                "full",
            ],
            "which activation checkpointing does not support",
        ),
    ],
)
def test_layout_validation_errors(world, overrides, message, tmp_path, monkeypatch, capsys):
    """``train.py``'s main in this process, as rank 0 of a world of ``world``: every layout mistake
    is one line (exit 2) before any process group exists."""
    from seedckpt.train.trainer import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = [
        "--config",
        "configs/debug.toml",
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.folder",
        str(tmp_path / "ckpt"),
        *overrides,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not dist.is_initialized()


def test_direct_init_refuses_a_configured_seed_made_otherwise(tmp_path, debug_seed):
    """Direct init stands in for the seed made with training.seed; a configured seed made with
    another seed or init recipe is refused, one that matches is accepted."""
    import shutil

    from seedckpt.config.job_config import load_config
    from seedckpt.materialize.start import find_start

    def start(seed_path, seed):
        cfg = load_config(
            None,
            [
                "--checkpoint.init_from",
                "direct",
                "--checkpoint.seed_checkpoint",
                str(seed_path),
                "--training.seed",
                str(seed),
                "--checkpoint.folder",
                str(tmp_path / "ckpt"),
            ],
        )
        return find_start(cfg, cfg.model_args())

    assert start(debug_seed, 0).path is None  # debug_seed was made with seed 0 and the current recipe
    with pytest.raises(SeedckptError, match="made with seed 0"):
        start(debug_seed, 1)
    old = tmp_path / "v1"
    shutil.copytree(debug_seed, old)
    manifest = json.loads((old / "seedckpt.json").read_text())
    manifest["init"]["recipe"] = "seedckpt-init-v1"
    (old / "seedckpt.json").write_text(json.dumps(manifest))
    with pytest.raises(SeedckptError, match="seedckpt-init-v1"):
        start(old, 0)


def _failing_ranks_worker(rank, world_size, case):
    """Rank(s) fail as ``case`` says, then report through ``rank_failures`` on a real gloo group: a
    rank that did not fail meets the failure as a broken barrier, as a training step would."""
    import contextlib
    import io

    from seedckpt.train.failures import report_failure

    failures = {
        "one_rank": {1: SeedckptError("boom")},
        "same_everywhere": {0: SeedckptError("boom"), 1: SeedckptError("boom")},
        "different": {0: SeedckptError("stage 0 is bad"), 1: SeedckptError("stage 1 is bad")},
        "interrupted": {0: KeyboardInterrupt(), 1: KeyboardInterrupt()},
        "bug": {1: ZeroDivisionError("a bug")},
        "left_silently": {1: None},
    }[case]  # as a rank the OOM killer ends: no report
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            if failures.get(rank, "") is None:
                dist.destroy_process_group()
                return "left", ""
            if rank in failures:
                raise failures[rank]
            dist.barrier()  # returns with an error once the failing rank has left the group
            status = 0
        except BaseException as e:
            try:
                status = report_failure(e, rank, "interrupted; resume with the same command")
            except ZeroDivisionError:  # a bug keeps its traceback: it is raised again
                status = "raised"
        if status != 0 and dist.is_initialized():
            dist.destroy_process_group()  # leave the group, as the process would by exiting
    return status, stderr.getvalue()


@pytest.mark.parametrize(
    "case,statuses,lines",
    [
        ("one_rank", [2, 2], ["train.py: stopped: rank 1 failed (its error is above)", "train.py: error: boom"]),
        ("same_everywhere", [2, 2], ["train.py: error: boom"]),
        ("different", [2, 2], ["train.py: error: stage 0 is bad", "train.py: error: stage 1 is bad"]),
        ("interrupted", [130, 130], ["train.py: interrupted; resume with the same command"]),
        ("bug", [2, "raised"], ["train.py: stopped: rank 1 failed (its error is above)"]),
        (
            "left_silently",
            [2, "left"],
            ["train.py: stopped: a peer rank left without reporting an error (killed by a signal, or crashed)"],
        ),
    ],
)
def test_a_failure_is_reported_once_across_ranks(case, statuses, lines):
    results = run_distributed(_failing_ranks_worker, 2, case, timeout=HANG_S)
    assert [status for status, _ in results] == statuses
    assert sorted(line for _, text in results for line in text.splitlines()) == sorted(lines)


def launch(run_dir: Path, seed: Path, nproc: int, *overrides: str, when: str | None = None, act=None):
    """``seedckpt launch`` (torchrun with one-line endings) of train.py; ``act(process)`` once stdout
    shows ``when``. Its own session, so that it can be sent Ctrl-C as a terminal does (to the group)."""
    cmd = [
        sys.executable,
        "-m",
        "seedckpt.cli.main",
        "launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "train.py",
        "--config",
        "configs/debug.toml",
        "--checkpoint.seed_checkpoint",
        str(seed),
        "--checkpoint.folder",
        str(run_dir / "ckpt"),
        "--job.dump_folder",
        str(run_dir),
        *COMMON,
        *overrides,
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out = []
        if when is not None:
            for line in proc.stdout:
                out.append(line)
                if when in line:
                    act(proc)
                    break
        rest, err = proc.communicate(timeout=HANG_S)
        return proc.returncode, "".join(out) + rest, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_launch_reports_a_failing_stage_in_one_line_with_its_exit_status(tmp_path, debug_seed):
    seed = tmp_path / "seed"
    shutil.copytree(debug_seed, seed)
    checkpoint = DcpCheckpoint(seed)
    [(index, info)] = [
        (i, s) for i, s in checkpoint.metadata.storage_data.items() if i.fqn == "layers.4.attention.wq.weight"
    ]  # only the second pipeline stage reads it
    with open(seed / info.relative_path, "r+b") as f:
        f.seek(info.offset + 16)
        byte = f.read(1)
        f.seek(info.offset + 16)
        f.write(bytes([byte[0] ^ 0x24]))
    status, out, err = launch(
        tmp_path, seed, 2, "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"
    )
    assert status == 2, err
    assert [line for line in err.splitlines() if "error" in line] == [
        line for line in err.splitlines() if line.startswith("train.py: error: layers.4.attention.wq.weight in")
    ]
    assert err.count("is corrupt") == 1, err
    assert "Traceback" not in err and "FAILED" not in err, err


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_ctrl_c_stops_every_rank_with_one_line_naming_the_newest_checkpoint(tmp_path, debug_seed, mode):
    # async: a save is in flight at nearly every step; it must finish or vanish, never stay partial.
    status, out, err = launch(
        tmp_path,
        debug_seed,
        2,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        "10000",
        "--checkpoint.interval",
        "2" if mode == "disabled" else "1",
        "--checkpoint.async_mode",
        mode,
        when="saved checkpoint",
        act=lambda proc: os.killpg(proc.pid, signal.SIGINT),
    )
    assert status == 130, err
    newest = max(complete_steps(tmp_path / "ckpt"))
    assert err.strip() == (
        "train.py: interrupted; no checkpoint is left half-written (a save in progress is "
        f"finished or removed); the newest checkpoint is {tmp_path / 'ckpt' / f'step-{newest}'}: the same "
        "command resumes from it"
    ), err
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]  # no partial, no lock


def test_ctrl_c_during_the_final_asynchronous_save_under_launch_is_one_line_and_130(tmp_path):
    """2 ranks, a model whose train state takes a while to write (~1.2 GB), async saves, Ctrl-C to the
    launcher right after the last step is logged -- while its save is in flight: exit 130 with the
    interrupted line, and the step is either published whole or not at all (no partial, no lock)."""
    seed = tmp_path / "seed"
    big = ["--model.dim", "1024", "--model.n_layers", "8"]
    assert seedckpt_main(["seed", "--config", "configs/debug.toml", *big, "--output", str(seed), "--quiet"]) == 0
    status, out, err = launch(
        tmp_path / "run",
        seed,
        2,
        *big,
        "--training.steps",
        "3",
        "--checkpoint.interval",
        "0",
        "--checkpoint.async_mode",
        "async",
        when="step     3/3",
        act=lambda proc: (time.sleep(0.3), os.killpg(proc.pid, signal.SIGINT)),
    )
    assert status == 130, err
    [line] = err.strip().splitlines()
    assert line.startswith("train.py: interrupted; no checkpoint is left half-written"), err
    folder = tmp_path / "run" / "ckpt"
    assert (sorted(p.name for p in folder.iterdir()) if folder.exists() else []) in ([], ["step-3"])
    assert ("step-3: the same command resumes from it" in line) == (folder / "step-3").exists()


def test_launch_names_a_rank_killed_by_a_signal(tmp_path, debug_seed):
    def kill_a_worker(proc):  # the agent runs in the launcher; the workers are its children
        worker = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        os.kill(worker, signal.SIGKILL)

    status, out, err = launch(
        tmp_path,
        debug_seed,
        2,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        "10000",
        when="step     2",
        act=kill_a_worker,
    )
    assert status == 128 + signal.SIGKILL, err
    assert re.search(
        r"^seedckpt launch: rank [01] was killed by SIGKILL \(the out-of-memory killer sends it\); "
        r"the other ranks were stopped$",
        err,
        re.MULTILINE,
    ), err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("after_s", [0.3, 2.5])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(tmp_path, debug_seed, after_s):
    """Ctrl-C while torch loads (0.3 s in) or while the config and checkpoint are read: one line."""
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--config", "configs/debug.toml", "--checkpoint.seed_checkpoint", str(debug_seed)]
        + ["--checkpoint.folder", str(tmp_path / "ckpt"), "--job.dump_folder", str(tmp_path), *COMMON]
        + ["--training.steps", "100000", "--parallelism.pipeline_parallel_degree", "1"],  # not done by then
        cwd=REPO,
        env=_env(),
        # as from a terminal: pytest-xdist's workers ignore SIGINT, and an ignored SIGINT is inherited
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("train.py: interrupted"), err
    assert not list(tmp_path.glob("ckpt/step-*"))


def test_ctrl_c_while_tearing_down_after_the_run_is_one_line_and_exit_130(tmp_path, debug_seed):
    """A Ctrl-C that lands while the process group is torn down, after the last step was saved: one
    line naming that step, exit 130 (was: silent). Injected where it lands, to be deterministic."""
    script = (
        "import sys\n"
        "import torch.distributed as dist\n"
        "from seedckpt.train.trainer import main\n"
        "destroy = dist.destroy_process_group\n"
        "def interrupted_teardown(*args, **kwargs):\n"
        "    destroy(*args, **kwargs)\n"
        "    raise KeyboardInterrupt\n"
        "dist.destroy_process_group = interrupted_teardown\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["--config", "configs/debug.toml", "--checkpoint.seed_checkpoint", str(debug_seed)]
    argv += ["--checkpoint.folder", str(tmp_path / "ckpt"), "--job.dump_folder", str(tmp_path), *COMMON]
    argv += ["--training.steps", "2", "--parallelism.pipeline_parallel_degree", "1"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == (
        "train.py: interrupted; no checkpoint is left half-written (a save in progress is finished or removed); "
        f"the newest checkpoint is {tmp_path / 'ckpt' / 'step-2'}: the same command resumes from it"
    ), proc.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]
