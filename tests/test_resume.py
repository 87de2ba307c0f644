"""Resume you can trust: a damaged newest ``step-N`` is reported with the checkpoint to fall back
to, a resume that would do nothing or changes a setting says so, ``metrics.jsonl`` keeps one row
per step, and training values are refused before any process group. One process (``python
train.py``, a world of one), real DCP checkpoints on disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from seedckpt.checkpoint import DcpCheckpoint
from tests.dist import run_main

REPO = Path(__file__).resolve().parents[1]
BASE = [
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
    "2",
    "--checkpoint.keep_latest_k",
    "0",
]


def train(run: Path, seed: Path, *overrides: str, base: list[str] = BASE) -> subprocess.CompletedProcess:
    """One process of train.py (``tests.dist.run_main``) from ``seed`` into ``run`` (checkpoints in
    ``run/ckpt``) with ``base`` then ``overrides``."""
    argv = [
        "--config",
        "configs/debug.toml",
        "--checkpoint.seed_checkpoint",
        str(seed),
        "--checkpoint.folder",
        str(run / "ckpt"),
        "--job.dump_folder",
        str(run),
        *base,
        *overrides,
    ]
    return run_main(argv, 1, {**os.environ, "OMP_NUM_THREADS": "1"}, REPO)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, debug_seed):
    """A 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("resume") / "run"
    proc = train(run, debug_seed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _copy(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def test_truncated_newest_step_names_the_step_to_fall_back_to(finished, tmp_path, debug_seed):
    run = _copy(finished, tmp_path)
    [data] = (run / "ckpt" / "step-4").glob("*.distcp")
    os.truncate(data, data.stat().st_size - 100)
    proc = train(run, debug_seed, "--training.steps", "6")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "step-4 is incomplete" in err and "move" in err and "resume from step 2" in err, err


@pytest.mark.parametrize("lost", ["seedckpt.json", ".metadata"])
def test_a_newest_step_missing_a_file_stops_the_resume_instead_of_being_skipped(finished, tmp_path, debug_seed, lost):
    """A step-N copied in part (rsync filters hidden files; a copy died before the manifest) is not
    passed over: the run would restart from step 0 and overwrite the metrics rows."""
    run = _copy(finished, tmp_path)
    (run / "ckpt" / "step-4" / lost).unlink()
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = train(run, debug_seed, "--training.steps", "6")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "cannot resume" in err and "step-4" in err and "resume from step 2" in err, err
    assert "that opens is" in err and "seedckpt verify" in err and "intact" not in err, err  # opens, not checked
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_a_corrupt_byte_in_the_newest_step_stops_the_resume_with_the_fallback(finished, tmp_path, debug_seed):
    run = _copy(finished, tmp_path)
    step = run / "ckpt" / "step-4"
    [data] = step.glob("*.distcp")
    info = next(i for idx, i in DcpCheckpoint(step).metadata.storage_data.items() if idx.fqn == "norm.weight")
    with open(data, "r+b") as f:
        f.seek(info.offset + info.length - 200)
        byte = f.read(1)
        f.seek(info.offset + info.length - 200)
        f.write(bytes([byte[0] ^ 0x10]))
    proc = train(run, debug_seed, "--training.steps", "6")
    assert proc.returncode == 2
    assert "norm.weight" in proc.stderr and "corrupt" in proc.stderr and "resume from step 2" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert "Traceback" not in proc.stderr


def test_a_resume_that_would_do_nothing_says_so(finished, tmp_path, debug_seed):
    run = _copy(finished, tmp_path)
    done = train(run, debug_seed)  # training.steps = 4, step-4 exists
    assert done.returncode == 0 and "nothing to train" in done.stdout, done.stdout + done.stderr
    fewer = train(run, debug_seed, "--training.steps", "3")
    assert fewer.returncode == 2 and "beyond training.steps = 3" in fewer.stderr, fewer.stderr
    assert len(rows(run)) == 4


def test_replayed_steps_keep_one_metrics_row_each_and_a_changed_lr_applies(finished, tmp_path, debug_seed):
    """step-4 lost after its rows were logged: the resume from step 2 replays steps 3 and 4, whose rows
    replace the old ones; the changed LR is announced and used."""
    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "ckpt" / "step-4")
    before = rows(run)
    proc = train(run, debug_seed, "--training.lr", "6e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "changed setting, applied from step 3: training.lr 0.003 -> 0.006" in proc.stdout, proc.stdout
    after = rows(run)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    assert after[:2] == before[:2]
    for old, new in zip(before[2:], after[2:]):
        assert new["lr"] == pytest.approx(2 * old["lr"], rel=1e-6)  # same schedule, twice the peak


def test_a_second_run_on_the_same_folder_fails_up_front(finished, tmp_path, debug_seed):
    from seedckpt.checkpoint.atomic import destination_lock

    run = _copy(finished, tmp_path)
    with destination_lock(run / "ckpt"):
        proc = train(run, debug_seed, "--training.steps", "6")
    assert proc.returncode == 2 and f"pid {os.getpid()}" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-2", "step-4"]


def test_a_second_run_on_the_same_dump_folder_fails_up_front(finished, tmp_path, debug_seed):
    """Another checkpoint.folder but the same job.dump_folder: the first run's metrics.jsonl is not replaced."""
    from seedckpt.checkpoint.atomic import destination_lock

    run = _copy(finished, tmp_path)
    metrics = (run / "metrics.jsonl").read_bytes()
    with destination_lock(run / "metrics.jsonl"):
        proc = train(run, debug_seed, "--checkpoint.folder", str(tmp_path / "other"))
    assert proc.returncode == 2 and f"metrics.jsonl is being written by pid {os.getpid()}" in proc.stderr, proc.stderr
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert not list((tmp_path / "other").glob("step-*"))


def train_in_process(run: Path, seed: Path, *overrides: str) -> int:
    """``train.py``'s main in this process: validation fails before any process group exists."""
    from seedckpt.train.trainer import main

    return main(
        [
            "--config",
            "configs/debug.toml",
            "--checkpoint.seed_checkpoint",
            str(seed),
            "--checkpoint.folder",
            str(run / "ckpt"),
            "--job.dump_folder",
            str(run),
            *BASE,
            *overrides,
        ]
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--training.lr", "-1"], "training.lr = -1.0; it must be a finite number > 0"),
        (["--training.lr", "nan"], "training.lr = nan"),
        (["--training.lr", "inf"], "training.lr = inf"),
        (["--training.warmup_steps", "-1"], "training.warmup_steps = -1"),
        (["--training.max_norm", "-0.5"], "training.max_norm = -0.5"),
        (["--training.stop_after_step", "-2"], "training.stop_after_step = -2"),
        (["--parallelism.pipeline_parallel_schedule", "PipelineScheduleSingle"], "this version supports GPipe"),
    ],
)
def test_training_values_are_refused_before_any_rendezvous(
    tmp_path, debug_seed, capsys, monkeypatch, overrides, message
):
    import torch.distributed as dist

    monkeypatch.chdir(REPO)
    assert train_in_process(tmp_path / "run", debug_seed, *overrides) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()


def test_an_unusable_checkpoint_folder_is_refused_before_training(tmp_path, debug_seed, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "file").write_text("not a folder")
    assert train_in_process(tmp_path / "run", debug_seed, "--checkpoint.folder", str(tmp_path / "file")) == 2
    err = capsys.readouterr().err
    assert "checkpoint.folder" in err and "a file is in the way" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_incomplete_seed_is_one_line_before_any_rendezvous(tmp_path, debug_seed, capsys, monkeypatch):
    import torch.distributed as dist

    monkeypatch.chdir(REPO)
    seed = tmp_path / "seed"
    shutil.copytree(debug_seed, seed)
    data = seed / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 1)
    assert train_in_process(tmp_path / "run", seed) == 2
    err = capsys.readouterr().err
    assert "incomplete" in err and data.name in err and len(err.strip().splitlines()) == 1, err
    assert not dist.is_initialized()


def test_interval_zero_saves_only_the_last_step(tmp_path, debug_seed):
    """``checkpoint.interval = 0`` means "only at the end", as its help says: not "never"."""
    proc = train(tmp_path / "run", debug_seed, "--checkpoint.interval", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").glob("step-*")) == ["step-4"]


def test_a_diverging_run_stops_at_that_step_and_saves_nothing_non_finite(tmp_path, debug_seed):
    """``lr 1e6`` without clipping: the run stops with one line at the first non-finite gradient norm,
    naming the step and the newest checkpoint, and every step-N it left holds finite values."""
    run = tmp_path / "run"
    proc = train(
        run,
        debug_seed,
        "--training.steps",
        "8",
        "--training.lr",
        "1e6",
        "--training.max_norm",
        "0",
        "--training.warmup_steps",
        "0",
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"step (\d+): the (gradient norm|loss) is (nan|inf)", err), err
    steps = sorted(run.glob("ckpt/step-*"))
    assert steps and f"the newest checkpoint is {steps[-1]}" in err, err
    for step in steps:
        checkpoint = DcpCheckpoint(step)
        for fqn in checkpoint.infos:
            assert torch.isfinite(checkpoint.read_tensor(fqn)).all(), (step, fqn)


@pytest.mark.parametrize("where", ["the seed", "inside the seed", "around the seed"])
def test_a_checkpoint_folder_overlapping_the_seed_is_refused(tmp_path, debug_seed, capsys, monkeypatch, where):
    """step-N inside the seed would be deleted by the next ``seed --force``; a folder holding the
    seed would prune or replace it."""
    monkeypatch.chdir(REPO)
    seed = tmp_path / "seeds" / "debug"
    shutil.copytree(debug_seed, seed)
    folder = {"the seed": seed, "inside the seed": seed / "ckpt", "around the seed": tmp_path / "seeds"}[where]
    assert train_in_process(tmp_path / "run", seed, "--checkpoint.folder", str(folder)) == 2
    err = capsys.readouterr().err
    assert "overlap" in err and "choose a checkpoint.folder apart from it" in err and len(err.splitlines()) == 1
    assert not list(seed.glob("step-*")) and not (seed / "ckpt").exists()


def test_a_resume_with_another_model_shape_names_the_cause_not_a_fallback(finished, tmp_path, debug_seed):
    """A config that does not match the step is no damage: the message says what differs, and never
    advises starting again from the seed (which would throw the run away)."""
    run = _copy(finished, tmp_path)
    proc = train(run, debug_seed, "--training.steps", "6", "--model.n_layers", "4")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert err == (
        f"train.py: error: checkpoint.folder = {run / 'ckpt'} holds step-4 of another job (another model: n_layers "
        "6, this run's 4); give this run a checkpoint.folder of its own (or move those steps away to start this job "
        "there)"
    )
