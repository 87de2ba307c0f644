"""Kill -9 at random points of every writer: the destination is absent or complete and bitwise
correct, the next writer succeeds, and a training run killed anywhere resumes to the losses of an
uninterrupted run.

Writers run in processes forked from a forkserver that imported torch and seedckpt once, so each
trial costs the work itself, not an interpreter start. Kill points are uniform over the measured
duration of an uninterrupted run (fixed seed), so they land in set-up, mid-write and publishing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest

from seedckpt.checkpoint import DcpCheckpoint
from seedckpt.cli.convert import diff
from seedckpt.materialize.model_checkpoint import open_model_checkpoint

REPO = Path(__file__).resolve().parents[1]
KILLS = 10
TRAIN = [
    "--config",
    "configs/debug.toml",
    "--parallelism.pipeline_parallel_degree",
    "1",
    "--training.steps",
    "4",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "32",
    "--data.kind",
    "synthetic",
    "--checkpoint.interval",
    "1",
    "--checkpoint.keep_latest_k",
    "0",
]


def _cli(argv: list[str]) -> None:
    from seedckpt.cli.main import main

    os.chdir(REPO)
    os._exit(main(argv))


def _train(argv: list[str]) -> None:
    from seedckpt.train.trainer import main

    os.chdir(REPO)
    os._exit(main(argv))


@pytest.fixture(scope="module")
def ctx():
    os.environ["OMP_NUM_THREADS"] = "1"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "seedckpt.cli.main", "seedckpt.train.trainer", "seedckpt.cli.convert", "seedckpt.materialize.seed"]
    )
    warm_up = context.Process(target=os._exit, args=(0,))  # starts the server: its imports are not timed
    warm_up.start()
    warm_up.join()
    return context


def run(ctx, target, argv: list[str], kill_after: float | None = None) -> tuple[int | None, float]:
    """Run ``target(argv)`` in a forked process; SIGKILL it after ``kill_after`` seconds. Returns its
    exit code (``-9`` when killed) and how long it ran."""
    start = time.perf_counter()
    process = ctx.Process(target=target, args=(argv,))
    process.start()
    process.join(kill_after)
    if process.is_alive():
        process.kill()
        process.join()
    return process.exitcode, time.perf_counter() - start


def kill_points(duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return sorted(rng.uniform(0.0, duration) for _ in range(KILLS))


def check_killed_writes(ctx, argv_for, destination: Path, reference: Path, seed: int) -> dict[str, int]:
    """Kill ``argv_for(destination)`` at ``KILLS`` random points; after each, the destination is absent
    or equal to ``reference`` (and intact). Then one more write must succeed."""
    code, duration = run(ctx, _cli, argv_for(reference))
    assert code == 0
    print(f"{argv_for(reference)[0]}: uninterrupted run {duration:.2f} s")
    outcomes = {"absent": 0, "complete": 0}
    for point in kill_points(duration, seed):
        code, _ = run(ctx, _cli, argv_for(destination), kill_after=point)
        if destination.exists():
            equal, lines = diff(destination, reference)
            assert equal, f"killed at {point:.3f}s: {lines[-3:]}"
            if destination.is_dir() and (destination / ".metadata").exists():
                assert DcpCheckpoint(destination).verify() == []
            outcomes["complete"] += 1
            _remove(destination)
        else:
            outcomes["absent"] += 1
    print(f"{argv_for(reference)[0]}: {outcomes}")
    code, _ = run(ctx, _cli, argv_for(destination))  # stale partials and lock files do not get in the way
    assert code == 0 and diff(destination, reference)[0]
    return outcomes


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_seed_killed_anywhere_leaves_nothing_or_the_whole_seed(ctx, tmp_path):
    outcomes = check_killed_writes(
        ctx,
        lambda dst: ["seed", "--config", "configs/debug.toml", "--output", str(dst), "--quiet"],
        tmp_path / "seed",
        tmp_path / "reference",
        seed=0,
    )
    assert outcomes["absent"] >= 1, outcomes  # some kills did land before publishing


@pytest.mark.parametrize(
    "target,name",
    [("dcp", "out"), ("torchtitan", "out"), ("hf", "out"), ("safetensors", "out.safetensors"), ("torch", "out.pt")],
)
def test_convert_killed_anywhere_leaves_nothing_or_the_whole_output(ctx, tmp_path, debug_seed, target, name):
    outcomes = check_killed_writes(
        ctx,
        lambda dst: ["convert", str(debug_seed), str(dst), "--to", target, "--quiet"],
        tmp_path / name,
        tmp_path / f"reference-{name}",
        seed=1,
    )
    assert outcomes["absent"] >= 1, outcomes


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_training_killed_anywhere_resumes_to_the_uninterrupted_losses(ctx, tmp_path, debug_seed):
    def argv(run_dir: Path) -> list[str]:
        return [
            *TRAIN,
            "--checkpoint.seed_checkpoint",
            str(debug_seed),
            "--checkpoint.folder",
            str(run_dir / "ckpt"),
            "--job.dump_folder",
            str(run_dir),
        ]

    code, duration = run(ctx, _train, argv(tmp_path / "uninterrupted"))
    assert code == 0
    expected = _losses(tmp_path / "uninterrupted")
    assert sorted(expected) == [1, 2, 3, 4]
    for k, point in enumerate(kill_points(duration, seed=2)):
        run_dir = tmp_path / f"killed-{k}"
        run(ctx, _train, argv(run_dir), kill_after=point)
        for step_dir in sorted((run_dir / "ckpt").glob("step-*")) if (run_dir / "ckpt").exists() else []:
            assert DcpCheckpoint(step_dir).verify() == [], f"killed at {point:.3f}s: {step_dir} damaged"
            open_model_checkpoint(step_dir)
        code, _ = run(ctx, _train, argv(run_dir))
        assert code == 0, f"resume after a kill at {point:.3f}s failed"
        assert _losses(run_dir) == expected, f"killed at {point:.3f}s"


def race(ctx, target, argvs: list[list[str]]) -> list[int]:
    """Start every ``target(argv)`` at once; their exit codes."""
    processes = [ctx.Process(target=target, args=(argv,)) for argv in argvs]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return [process.exitcode for process in processes]


def test_two_concurrent_conversions_publish_one_whole_output(ctx, tmp_path, debug_seed):
    reference = tmp_path / "reference.safetensors"
    assert run(ctx, _cli, ["convert", str(debug_seed), str(reference), "--to", "safetensors", "--quiet"])[0] == 0
    out = tmp_path / "out.safetensors"
    codes = race(ctx, _cli, [["convert", str(debug_seed), str(out), "--to", "safetensors", "--quiet"]] * 2)
    assert sorted(codes) == [0, 2], codes  # the loser: the lock is held, or the output already exists
    assert diff(out, reference)[0]
    assert not list(tmp_path.glob(".out.safetensors*"))


def test_two_training_runs_on_one_folder_one_trains_the_other_fails_up_front(ctx, tmp_path, debug_seed):
    def argv(run_dir: Path) -> list[str]:
        return [
            *TRAIN,
            "--checkpoint.seed_checkpoint",
            str(debug_seed),
            "--checkpoint.folder",
            str(tmp_path / "shared" / "ckpt"),
            "--job.dump_folder",
            str(run_dir),
        ]

    assert (
        run(ctx, _train, [*argv(tmp_path / "alone"), "--checkpoint.folder", str(tmp_path / "alone" / "ckpt")])[0] == 0
    )
    codes = race(ctx, _train, [argv(tmp_path / "first"), argv(tmp_path / "second")])
    assert sorted(codes) == [0, 2], codes
    winner = tmp_path / ("first" if codes[0] == 0 else "second")
    assert _losses(winner) == _losses(tmp_path / "alone")
    assert not (tmp_path / ("second" if codes[0] == 0 else "first") / "metrics.jsonl").exists()
    assert sorted(p.name for p in (tmp_path / "shared" / "ckpt").iterdir()) == [f"step-{k}" for k in range(1, 5)]
    for step in range(1, 5):
        equal, lines = diff(tmp_path / "shared" / "ckpt" / f"step-{step}", tmp_path / "alone" / "ckpt" / f"step-{step}")
        assert equal, lines
