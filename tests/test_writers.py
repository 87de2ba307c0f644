"""One writer per destination (a lock taken before any work), per-writer partial outputs that the
next writer cleans up, publishing only what passed its checks, and ``--force`` replacing only an
output of its own kind."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import seedckpt.checkpoint.writer as writer_module
from seedckpt.checkpoint import complete_steps, write_checkpoint
from seedckpt.checkpoint.atomic import atomic_output, check_destination, destination_lock
from seedckpt.cli.convert import convert, diff
from seedckpt.cli.main import main
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
from tests.dist import HANG_S, run_distributed

REPO = Path(__file__).resolve().parents[1]
SEED = ["seed", "--config", str(REPO / "configs/debug.toml"), "--quiet"]
FIX = "; wait for it to finish or choose another destination\n"


def _holder(pid: int) -> str:
    return f"is being written by pid {pid} on host {socket.gethostname()}, `"


def _contents(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by relative name -> SHA-256 of its bytes."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


@pytest.mark.parametrize("to", ["seed", "safetensors", "dcp"])
def test_a_held_lock_stops_another_writer_before_any_work(tmp_path, debug_seed, capsys, to):
    dst = tmp_path / ("m.safetensors" if to == "safetensors" else "out")
    if to == "safetensors":
        convert(debug_seed, dst, "safetensors", progress=False)
    else:
        shutil.copytree(debug_seed, dst)
    before = _contents(dst)
    argv = (
        [*SEED, "--output", str(dst), "--seed", "3"]
        if to == "seed"
        else ["convert", str(debug_seed), str(dst), "--to", to, "--quiet"]
    )
    with destination_lock(dst):
        assert main([*argv, "--force"]) == 2
        assert sorted(os.listdir(tmp_path)) == [f".{dst.name}.lock", dst.name]  # no partial output either
    err = capsys.readouterr().err
    command = "seed" if to == "seed" else "convert"
    assert err.startswith(f"seedckpt {command}: error: {dst} {_holder(os.getpid())}") and err.endswith(FIX)
    assert err.count("\n") == 1
    assert _contents(dst) == before and os.listdir(tmp_path) == [dst.name]  # the lock file left with its holder


def test_a_holder_that_has_not_written_its_name_yet_is_another_process(tmp_path):
    with open(tmp_path / ".out.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(SeedckptError, match=r"out is being written by another process; wait for it to finish"):
            with atomic_output(tmp_path / "out"):
                pass


HOLD = """
import sys, time
from seedckpt.checkpoint.atomic import destination_lock
with destination_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_killed_holder_does_not_block_the_next_writer(tmp_path):
    dst = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(dst)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SeedckptError, match=re.escape(_holder(holder.pid))):
            create_seed_checkpoint(tiny_config(), dst, seed=0, progress=False)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the lock file stays; the kernel drops the flock
        holder.wait()
        holder.stdout.close()
    assert os.listdir(tmp_path) == [".out.lock"]
    create_seed_checkpoint(tiny_config(), dst, seed=0, progress=False)
    assert os.listdir(tmp_path) == ["out"] and open_model_checkpoint(dst).manifest["seed"] == 0


def test_two_racing_seeds_publish_one_whole_checkpoint(tmp_path):
    out = tmp_path / "c"
    big = ["--model.dim", "1024", "--model.n_layers", "8"]  # ~1.5 s of writing: the writes overlap
    procs = {
        seed: subprocess.Popen(
            [sys.executable, "-m", "seedckpt.cli.main", *SEED, "--output", str(out), "--seed", str(seed), *big],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (0, 3)
    }
    results = {seed: (proc.wait(timeout=HANG_S), *proc.communicate()) for seed, proc in procs.items()}
    [winner] = [seed for seed, (code, _, _) in results.items() if code == 0]
    [(code, _, err)] = [result for seed, result in results.items() if seed != winner]
    # the loser found the winner's lock, or (on a fast machine, started after it had finished) its output
    raced = _holder(procs[winner].pid) in err and err.endswith(FIX)
    assert code == 2 and (raced or f"{out} already exists; pass --force" in err), err
    assert f"seed {winner}," in results[winner][1]
    assert open_model_checkpoint(out).manifest["seed"] == winner
    assert main([*SEED, "--output", str(tmp_path / "alone"), "--seed", str(winner), *big]) == 0
    equal, lines = diff(out, tmp_path / "alone")
    assert equal, lines
    assert sorted(os.listdir(tmp_path)) == ["alone", "c"]


def test_force_replaces_only_an_output_of_its_own_kind(tmp_path, debug_seed, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("precious")
    assert main([*SEED, "--output", str(docs), "--force"]) == 2
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main(["convert", str(debug_seed), str(folder), "--to", "safetensors", "--force", "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"seedckpt seed: error: {docs} is a directory that is not a checkpoint (holds 1 entry, e.g. notes.txt); "
        "--force replaces only a checkpoint directory or an empty one: choose another destination or remove it "
        "yourself",
        f"seedckpt convert: error: {folder} is a directory; --force replaces only a file: choose another "
        "destination or remove it yourself",
    ]
    assert (docs / "notes.txt").read_text() == "precious" and folder.is_dir() and not any(folder.iterdir())

    seed = tmp_path / "seed"
    assert main([*SEED, "--output", str(seed), "--seed", "1"]) == 0
    assert main([*SEED, "--output", str(seed), "--seed", "2", "--force"]) == 0
    assert open_model_checkpoint(seed).manifest["seed"] == 2
    # a run that wrote its step-N inside the seed (an old version allowed checkpoint.folder = the seed)
    shutil.copytree(seed, seed / "step-4")
    assert main([*SEED, "--output", str(seed), "--seed", "3", "--force"]) == 2
    assert "holds 1 directory (step-4), which replacing it would delete" in capsys.readouterr().err
    assert open_model_checkpoint(seed / "step-4").manifest["seed"] == 2
    shutil.rmtree(seed / "step-4")
    file = tmp_path / "m.safetensors"
    convert(debug_seed, file, "safetensors", progress=False)
    assert (
        main(
            ["convert", str(debug_seed), str(file), "--to", "safetensors", "--dtype", "bfloat16", "--force", "--quiet"]
        )
        == 0
    )
    assert open_model_checkpoint(file).infos["norm.weight"].dtype == torch.bfloat16
    assert sorted(os.listdir(tmp_path)) == ["docs", "folder", "m.safetensors", "seed"]


def test_what_force_may_replace(tmp_path):
    def make(name: str, *files: str) -> Path:
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("{}")
        return tmp_path / name

    dcp, empty = make("dcp", ".metadata", "__0_0.distcp"), make("empty")
    hf, sharded = (
        make("hf", "config.json", "model.safetensors"),
        make("sharded", "config.json", "model.safetensors.index.json"),
    )
    config_only = make("config_only", "config.json", "a.txt", "b.txt", "c.txt")
    file = tmp_path / "m.safetensors"
    file.write_text("{}")
    (tmp_path / "dir_link").symlink_to(dcp)
    (tmp_path / "file_link").symlink_to(file)
    for path in (dcp, empty, hf, sharded, tmp_path / "dir_link"):
        assert check_destination(path, force=True, directory=True) == path
    for path in (file, tmp_path / "file_link"):
        assert check_destination(path, force=True, directory=False) == path
    refused = {
        (config_only, True): "is a directory that is not a checkpoint (holds 4 entries, e.g. a.txt, b.txt, "
        "c.txt); --force replaces only a checkpoint directory or an empty one",
        (file, True): "is a file; --force replaces only a checkpoint directory or an empty one",
        (dcp, False): "is a directory; --force replaces only a file",
        (tmp_path / "dir_link", False): "is a directory; --force replaces only a file",
    }
    for (path, directory), what in refused.items():
        for force in (True, False):
            with pytest.raises(
                SeedckptError, match=re.escape(f"{path} {what}: choose another destination or remove it yourself")
            ):
                check_destination(path, force, directory)
    with pytest.raises(SeedckptError, match="already exists; pass --force to replace it"):
        check_destination(dcp, False)


def test_stale_partials_are_never_read_and_the_next_write_removes_them(tmp_path, debug_seed):
    stale = [tmp_path / ".out.partial", tmp_path / ".out.123.partial"]
    for partial in stale:
        shutil.copytree(debug_seed, partial)  # even a complete-looking one stays unread
        with pytest.raises(SeedckptError, match="incomplete output of an interrupted write"):
            open_model_checkpoint(partial)
    # one whose destination a live writer holds: wait for it, not delete it (verify and every reader)
    with destination_lock(tmp_path / "out"):
        for partial in stale:
            with pytest.raises(SeedckptError, match=rf"still in progress, by pid {os.getpid()} .*wait for it"):
                open_model_checkpoint(partial)
        assert main(["verify", str(stale[1]), "--quiet"]) == 2
    (tmp_path / ".out.safetensors.123.partial").write_text("")  # another destination's: not ours to remove
    convert(debug_seed, tmp_path / "out", "dcp", progress=False)
    assert sorted(os.listdir(tmp_path)) == [".out.safetensors.123.partial", "out"]

    folder = tmp_path / "run"
    shutil.copytree(debug_seed, folder / "step-2")
    shutil.copytree(debug_seed, folder / ".step-4.123.partial")
    (folder / ".step-4.lock").write_text("")
    assert complete_steps(folder) == {2: folder / "step-2"}


def test_nothing_is_published_when_a_check_fails(tmp_path, monkeypatch):
    out = tmp_path / "out.bin"
    out.write_text("previous")

    def reject(partial: Path) -> None:
        raise SeedckptError(f"{partial.name} is incomplete")

    with pytest.raises(SeedckptError, match=r"^\.out\.bin\.\d+\.partial is incomplete$"):
        with atomic_output(out, force=True, directory=False, check=reject) as partial:
            partial.write_text("new")
    assert out.read_text() == "previous" and os.listdir(tmp_path) == ["out.bin"]

    def missing_file(*args):
        raise SeedckptError("__0_0.distcp is missing")

    monkeypatch.setattr(writer_module, "check_data_files", missing_file)
    with pytest.raises(SeedckptError, match="is missing"):
        create_seed_checkpoint(tiny_config(), tmp_path / "seed", seed=0, progress=False)
    assert os.listdir(tmp_path) == ["out.bin"]


def _write_while_locked(rank, world_size, dst):
    try:
        write_checkpoint(dst, {"w": torch.ones(2)}, {})
    except SeedckptError as e:
        return str(e)
    return "written"


def test_every_rank_fails_at_once_when_rank_0_cannot_start(tmp_path):
    dst = tmp_path / "step-2"
    with destination_lock(dst):
        messages = run_distributed(_write_while_locked, 2, str(dst), timeout=HANG_S)
    assert messages[0].startswith(f"{dst} {_holder(os.getpid())}")
    assert messages[1] == f"rank 0 could not start writing {dst}; its error says why"
    assert os.listdir(tmp_path) == []


def test_convert_never_writes_over_into_or_around_its_input(tmp_path, debug_seed, capsys):
    seed = tmp_path / "seed"
    shutil.copytree(debug_seed, seed)
    before = _contents(seed)
    for dst, why in [
        (seed, "is the input checkpoint"),
        (seed / "inner", "is inside the input checkpoint"),
        (tmp_path, "contains the input checkpoint"),
    ]:
        assert main(["convert", str(seed), str(dst), "--to", "dcp", "--force", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
    assert _contents(seed) == before and sorted(os.listdir(tmp_path)) == ["seed"]


@pytest.mark.parametrize(
    "to, other", [("torch", "notes.txt"), ("safetensors", "model.safetensors"), ("torch", "model.safetensors")]
)
def test_force_replaces_a_file_only_with_one_of_its_own_format(tmp_path, debug_seed, capsys, to, other):
    dst = tmp_path / other
    if other == "notes.txt":
        dst.write_text("precious")
    else:  # a safetensors file: replaceable by a safetensors output, not by a torch.save one
        convert(debug_seed, dst, "safetensors", dtype="bfloat16", progress=False)
    before = _contents(dst)
    code = main(["convert", str(debug_seed), str(dst), "--to", to, "--force", "--quiet"])
    if to == "safetensors":
        assert code == 0 and _contents(dst) != before  # its own format: replaced
        return
    assert code == 2 and _contents(dst) == before
    err = capsys.readouterr().err
    assert f"{dst} is not a file of the format being written" in err and len(err.strip().splitlines()) == 1, err


class _FullDisk:
    """A file whose writes fail with ENOSPC (or are interrupted) once ``room`` bytes are in."""

    def __init__(self, failure: BaseException, room: int = 300):
        self.failure, self.room = failure, room

    def __call__(self, path, mode="r", *args, **kwargs):
        inner = open(path, mode, *args, **kwargs)
        if "w" not in mode:
            return inner
        outer = self

        class File:
            def __getattr__(self, name):
                return getattr(inner, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                inner.close()

            def write(self, data):
                n = memoryview(data).nbytes
                if outer.room < n:
                    raise outer.failure
                outer.room -= n
                return inner.write(data)

        return File()


WRITE_FAILURES = {  # the OSError a write fails with, and the line it becomes
    "disk full": (errno.ENOSPC, "no space left on the device", "free space or choose another destination"),
    "permission denied": (errno.EACCES, "permission denied", "choose a destination you can write"),
}


@pytest.mark.parametrize("failure", [*WRITE_FAILURES, "ctrl-c"])
@pytest.mark.parametrize("to", ["torch", "safetensors", "hf", "dcp", "torchtitan", "seed"])
def test_a_full_disk_a_refused_write_or_ctrl_c_is_one_line_and_leaves_nothing(
    tmp_path, debug_seed, capsys, monkeypatch, to, failure
):
    """A write that fails partway (injected: running as root, no real permission can be refused)."""
    from seedckpt.checkpoint.formats import safetensors_file, torch_file

    code_and_words = WRITE_FAILURES.get(failure)
    error = OSError(code_and_words[0], os.strerror(code_and_words[0])) if code_and_words else KeyboardInterrupt()
    full = _FullDisk(error)
    for module in (torch_file, safetensors_file):
        monkeypatch.setattr(module, "open", full, raising=False)
    raw_write = writer_module._RawStream.write

    def write(stream, data):
        full.room -= memoryview(data).nbytes
        if full.room < 0:
            raise error
        return raw_write(stream, data)

    monkeypatch.setattr(writer_module._RawStream, "write", write)
    dst = tmp_path / ("out.pt" if to == "torch" else "out.safetensors" if to == "safetensors" else "out")
    argv = (
        [*SEED, "--output", str(dst)] if to == "seed" else ["convert", str(debug_seed), str(dst), "--to", to, "--quiet"]
    )
    code = main(argv)
    err = capsys.readouterr().err
    command = "seed" if to == "seed" else "convert"
    if code_and_words:
        _, what, fix = code_and_words
        assert code == 2 and err == (
            f"seedckpt {command}: error: {what} writing {dst}; nothing was written there: {fix} and run again\n"
        )
    else:
        assert code == 130 and err == f"seedckpt {command}: interrupted; nothing was written to {dst}\n"
    assert os.listdir(tmp_path) == []
