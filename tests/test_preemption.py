"""Preemption (``checkpoint.save_on_signals``): a scheduler's signal makes every rank finish its
step, save ``step-N`` and exit with 128 + the signal, and the same command resumes bit for bit.
Four gloo ranks (pp 2 x dp 2) under ``seedckpt launch``, real DCP checkpoints."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from seedckpt.checkpoint import complete_steps
from tests.test_train import launch, torchrun

LAYOUT = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def stopped_line(err: str, name: str, folder: Path) -> int:
    """The step the one stop line names, checked against what the folder holds."""
    lines = re.findall(
        rf"^train.py: stopped by {name} \(checkpoint.save_on_signals\) after step (\d+): saved (\S+); "
        r"the same command resumes from it$",
        err,
        re.MULTILINE,
    )
    assert len(lines) == 1, err
    step, path = int(lines[0][0]), lines[0][1]
    assert path == str(folder / f"step-{step}") and max(complete_steps(folder)) == step, err
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], err  # no partial save, no lock
    return step


def test_sigterm_to_the_launcher_saves_the_step_and_the_same_command_resumes_bitwise(tmp_path, debug_seed):
    """Kubernetes and Slurm send SIGTERM to the job's process: the agent passes it to the workers."""
    overrides = [*LAYOUT, "--training.steps", "6", "--checkpoint.interval", "0"]
    run = tmp_path / "run"
    status, out, err = launch(
        run, debug_seed, 4, *overrides, when="step     2/6", act=lambda proc: proc.send_signal(signal.SIGTERM)
    )
    assert status == 128 + signal.SIGTERM, err
    step = stopped_line(err, "SIGTERM", run / "ckpt")
    assert 2 <= step < 6 and "Traceback" not in err, err

    # the same train.py command (ranks started as torchrun would, without its agent: cheaper)
    resumed = torchrun(run, debug_seed, 4, *overrides)
    assert f"resuming from {run / 'ckpt' / f'step-{step}'}" in resumed.stdout, resumed.stdout
    torchrun(tmp_path / "uninterrupted", debug_seed, 4, *overrides)
    assert losses(run) == losses(tmp_path / "uninterrupted")


def test_signals_to_every_worker_during_asynchronous_saves_leave_a_complete_step(tmp_path, debug_seed):
    """Slurm's ``--signal=USR1@90`` reaches every process of the step; here twice, while a
    background save is in flight (one per step): the save completes and nothing is half-written."""

    def signal_workers_twice(proc):
        workers = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        for _ in range(2):
            for worker in workers:
                os.kill(worker, signal.SIGUSR1)
            time.sleep(0.05)

    run = tmp_path / "run"
    overrides = [*LAYOUT, "--training.steps", "10000", "--checkpoint.interval", "1", "--checkpoint.async_mode", "async"]
    status, out, err = launch(run, debug_seed, 4, *overrides, when="saved checkpoint", act=signal_workers_twice)
    assert status == 128 + signal.SIGUSR1, err
    stopped_line(err, "SIGUSR1", run / "ckpt")
    assert "Traceback" not in err and "exited with status" not in err, err
