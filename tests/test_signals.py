"""SIGTERM and SIGHUP stop ``seed`` and ``tokenize`` as Ctrl-C does: nothing left behind, one line,
exit 128 + the signal; a partial output a SIGKILLed run left is removed (or named) by the next run;
a stop reaches the seed's writer within a block, not at the end of its files."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from seedckpt.checkpoint import LazySavePlanner, write_checkpoint
from seedckpt.cli.main import main
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.signals import Stopped, how_stopped, stop_on_signals
from tests.dist import HANG_S
from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

REPO = Path(__file__).resolve().parents[1]
# A seed of ~0.7 GB on one worker: seconds of writing, so a signal sent at its first bytes lands mid-run.
BIG_SEED = ["--model.dim", "1024", "--model.n_layers", "16", "--workers", "1", "--quiet"]


def _seed(out: Path, *extra: str) -> list[str]:
    return ["seed", "--config", str(REPO / "configs/debug.toml"), "--output", str(out), *extra]


def _start(argv: list[str]) -> subprocess.Popen:
    """``seedckpt ARGV`` in a session of its own (a process group to signal), with the default action
    for every stop signal whatever this test runner ignores (``nohup``)."""

    def default_signals():
        for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop, signal.SIG_DFL)

    return subprocess.Popen(
        [sys.executable, "-m", "seedckpt.cli.main", *argv],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )


def _when_writing(proc: subprocess.Popen, data: str, folder: Path) -> None:
    """Wait until a file matching ``data`` under ``folder`` holds bytes: the command is mid-write."""
    deadline = time.monotonic() + HANG_S
    while not any(p.stat().st_size for p in folder.glob(data)):
        assert proc.poll() is None and time.monotonic() < deadline, f"nothing written; exit {proc.poll()}"
        time.sleep(0.01)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_seed_stopped_by_sigterm_or_sighup_leaves_nothing_and_says_so(tmp_path, name):
    out = tmp_path / "out"
    proc = _start(_seed(out, *BIG_SEED))
    try:
        _when_writing(proc, ".out.*.partial/*.distcp", tmp_path)
        proc.send_signal(getattr(signal, name))
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + getattr(signal, name)
    assert err == f"seedckpt seed: stopped by {name}; nothing was written to {out}\n"
    assert list(tmp_path.iterdir()) == []  # no partial output, no lock


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny tokenizer and 2.6 MB of plain text (one document): a few seconds of tokenizing here."""
    root = tmp_path_factory.mktemp("corpus")
    docs = corpus_of(make_chats(20, seed=2))
    tokenizer = build_tiny_tokenizer(root / "tokenizer", docs * 3, vocab_size=300)
    words = np.array(sorted({w for d in docs for w in d.split()}))
    rows = np.random.default_rng(0).choice(words, (48_000, 12))
    (root / "lines.txt").write_text("".join(" ".join(row) + "\n" for row in rows))
    return tokenizer, root / "lines.txt"


def test_sigterm_to_tokenize_and_its_workers_leaves_nothing(tmp_path, corpus):
    """SIGTERM to the whole process group (``timeout``, a scheduler): the workers ignore it and the
    parent stops them; one killed while sending a block left the parent waiting forever (seen)."""
    tokenizer, text = corpus
    out = tmp_path / "tokens"
    proc = _start(["tokenize", str(text), "--tokenizer", str(tokenizer), "--output", str(out), "--workers", "2"])
    try:
        _when_writing(proc, ".tokens.*.partial/tokens.bin", tmp_path)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == f"seedckpt tokenize: stopped by SIGTERM; nothing was written to {out}"
    assert list(tmp_path.iterdir()) == []


def test_a_partial_a_sigkilled_seed_left_is_named_beside_it_then_removed_by_the_next_seed(tmp_path):
    out = tmp_path / "out"
    proc = _start(_seed(out, *BIG_SEED))
    try:
        _when_writing(proc, ".out.*.partial/*.distcp", tmp_path)
        proc.kill()  # SIGKILL: nothing of the seed's runs
        proc.wait(timeout=HANG_S)
    finally:
        proc.kill()
        proc.communicate()
    stale = tmp_path / f".out.{proc.pid}.partial"
    assert {p.name for p in tmp_path.iterdir()} == {".out.lock", stale.name}

    named = f"{stale} is the partial output of a write of {out} that was killed; delete it"
    with pytest.warns(UserWarning) as caught:  # another destination beside it: the partial is named, kept
        assert main(_seed(tmp_path / "other", "--quiet")) == 0
    assert [str(w.message) for w in caught] == [named] and stale.is_dir()
    with pytest.warns(UserWarning) as caught:
        assert main(_seed(out, "--quiet")) == 0
    removed = f"removed {stale}, the partial output of an earlier write of {out} that was killed"
    assert [str(w.message) for w in caught] == [removed]
    assert warnings.formatwarning(caught[0].message, UserWarning, "x.py", 1) == f"warning: {removed}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "disk full"])
def test_a_stop_reaches_every_file_of_the_writer_within_a_block(tmp_path, stop):
    """A 64-block tensor written into two files: Ctrl-C or SIGTERM while the third block is made (or
    a full disk, in one file) stops both files at their next block; before, both ran to their ends
    (a 1B seed took 24 s to stop after Ctrl-C)."""
    made, lock = [], threading.Lock()

    def produce(fqn: str, start: int, stop_at: int) -> torch.Tensor:
        with lock:
            made.append(start)
            third = len(made) == 3
        if third and stop == "disk full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if third:
            os.kill(os.getpid(), getattr(signal, stop))  # handled in the main thread, as it waits
        time.sleep(0.01)  # a block's generation takes time
        return torch.zeros(stop_at - start)

    rows = [([r, 0], [1, 1024]) for r in range(64)]
    planner = LazySavePlanner(produce, lambda shape: rows)
    state = {"w": torch.empty(64, 1024, device="meta")}
    expected = {"SIGINT": KeyboardInterrupt, "SIGTERM": Stopped, "disk full": SeedckptError}[stop]
    with stop_on_signals(), pytest.raises((KeyboardInterrupt, SeedckptError)) as raised:
        write_checkpoint(tmp_path / "out", state, {}, planner=planner, lookahead=1, parallel_files=2, resolvers=1)
    assert type(raised.value) is expected and len(made) <= 3 + 2 * 2, len(made)  # two per file in flight at most
    assert list(tmp_path.iterdir()) == []


def test_the_first_stop_signal_raises_and_the_next_are_ignored_while_it_unwinds():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with pytest.raises(Stopped) as raised:
            with stop_on_signals():
                os.kill(os.getpid(), signal.SIGHUP)  # stays ignored
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(1)
                finally:
                    os.kill(os.getpid(), signal.SIGTERM)  # the cleanup runs to its end
                    os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert how_stopped(raised.value) == ("stopped by SIGTERM", 143)
    assert how_stopped(KeyboardInterrupt()) == ("interrupted", 130)
