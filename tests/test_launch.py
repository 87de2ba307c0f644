"""``seedckpt launch`` killed with SIGKILL takes its workers with it: none trains on alone or keeps
writing the checkpoint folder. A real launcher, real workers, a real kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from seedckpt.utils.agent import AGENT_PID_ENV
from tests.dist import HANG_S
from tests.test_train import COMMON, REPO, _env

GONE_WITHIN_S = 5.0


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (any of its threads), from ``/proc``."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()]


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whoever adopted it to collect it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``folder``: its size and modification time (ns)."""
    return {
        str(p.relative_to(folder)): (s.st_size, s.st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and (s := p.stat())
    }


def test_sigkill_of_the_launcher_kills_every_worker_and_the_writes_stop(tmp_path, debug_seed):
    cmd = [sys.executable, "-m", "seedckpt.cli.main", "launch", "--standalone", "--nproc-per-node=2", "train.py"]
    cmd += ["--config", "configs/debug.toml", "--checkpoint.seed_checkpoint", str(debug_seed)]
    cmd += ["--checkpoint.folder", str(tmp_path / "ckpt"), "--job.dump_folder", str(tmp_path), *COMMON]
    # A save at every step, for far more steps than the test lasts: the folder is being written.
    cmd += ["--training.steps", "100000", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]
    launcher = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    hung = threading.Timer(HANG_S, launcher.kill)  # a run that never gets to its first save
    hung.start()
    workers: list[int] = []
    try:
        for line in launcher.stdout:
            if "saved checkpoint" in line:
                break
        else:
            pytest.fail("the run ended before its first save")
        workers = _children(launcher.pid)
        assert len(workers) == 2 and all(_alive(w) for w in workers), workers
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "workers outlived their launcher's SIGKILL"
        before = _snapshot(tmp_path / "ckpt")
        time.sleep(1.0)
        assert _snapshot(tmp_path / "ckpt") == before  # nothing writes the folder any more
    finally:
        hung.cancel()
        launcher.stdout.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for worker in workers:  # the workers run in sessions of their own: not in the launcher's group
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass


_CHILD = """
import ctypes, signal
from seedckpt.utils.agent import die_with_agent
die_with_agent()
asked = ctypes.c_int(0)
ctypes.CDLL(None).prctl(2, ctypes.byref(asked), 0, 0, 0)  # PR_GET_PDEATHSIG
print(signal.Signals(asked.value).name if asked.value else "none")
"""


def _worker_start(**env: str) -> subprocess.CompletedProcess:
    """A process started as the launcher's workers are (its parent: this test), with ``env``."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", AGENT_PID_ENV)}, **env}
    return subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True, text=True)


def test_a_worker_asks_for_sigkill_with_its_agent_and_dies_if_the_agent_is_gone_already():
    agent = {"TORCHELASTIC_RUN_ID": "r", AGENT_PID_ENV: str(os.getpid())}
    assert _worker_start(**agent).stdout.strip() == "SIGKILL"
    assert _worker_start(TORCHELASTIC_RUN_ID="r").stdout.strip() == "SIGKILL"  # plain torchrun
    # The agent it was started by is not its parent any more: it died before the worker asked.
    gone = _worker_start(**{**agent, AGENT_PID_ENV: str(os.getpid() + 10**6)})
    assert gone.returncode == -signal.SIGKILL and gone.stdout == ""
    assert _worker_start().stdout.strip() == "none"  # not started by an agent (python train.py)
