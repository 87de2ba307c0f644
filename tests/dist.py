"""Run a function, or ``train.py``'s main, in N real processes joined by a gloo process group (CPU).

The processes are forked from a server that has imported torch and the trainer once (Python's
``forkserver`` start method, with those modules preloaded): a fresh interpreter per rank would
import them again, about 3 s of CPU each, which on a 2-core machine made start-up most of the
suite's time. Each rank is still its own process with its own process group, files and exit.

``run_distributed`` rendezvouses through a ``file://`` store in a temp dir, so parallel test runs
cannot collide on ports. Every worker tears its process group down in ``finally``, the parent kills
all workers when the deadline passes, and a worker's traceback is re-raised in the test, so a
failing or hanging rank cannot hang CI. ``run_main`` is ``torchrun train.py`` without the agent:
the same environment variables, each rank's output captured; tests of the launcher itself (its
signals and endings) run the real torchrun.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How long a test waits on processes before calling them hung. Only a hang may fail a test: this is
# far above what any test's processes take (the slowest measured under a minute on a busy 2-core
# machine), so a slow machine cannot fail a test that a fast one passes.
HANG_S = 900.0

# Imported once by the fork server; every rank forked from it starts with them loaded.
PRELOAD = ["torch", "torch.distributed.fsdp", "seedckpt.train.trainer", "transformers", "tests.dist"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(fn, rank, world_size, init_file, results, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=HANG_S),
        )
        # Every rank connected before any runs ``fn``: a rank that fails at once and leaves would
        # otherwise close its end of a pair another rank is still setting up (gloo: "Connection
        # closed by peer" inside that rank's init_process_group).
        dist.barrier()
        # Plain pickle: torch's queue pickler would share tensors through memory that dies with us.
        results.put((rank, None, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = HANG_S) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, init_file, results, args)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out, errors = {}, []
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size and not errors:
                try:
                    rank, err, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                    if dead:
                        errors.append(
                            f"ranks {dead} died without reporting (exit codes {[procs[r].exitcode for r in dead]})"
                        )
                    elif time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
                    continue
                if err:
                    errors.append(f"rank {rank}:\n{err}")  # others may now hang in a collective
                else:
                    out[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=10 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def _main_worker(argv, rank, world_size, port, env, cwd, logs) -> None:
    """One rank of ``run_main``: torchrun's environment, stdout and stderr into ``logs``, the exit
    status main returns."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    for fd, name in ((1, "out"), (2, "err")):
        with open(Path(logs) / f"{name}.{rank}", "w") as f:
            os.dup2(f.fileno(), fd)
    status = 1
    try:
        from seedckpt.train.trainer import main

        status = main(list(argv))
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_main(argv: list[str], nproc: int, env: dict, cwd: Path, timeout: float = HANG_S):
    """``torchrun --standalone --nproc-per-node NPROC train.py ARGV``, with the ranks forked from the
    preloaded server: a ``CompletedProcess`` with each rank's stdout and stderr (rank 0 first) and
    the first failing rank's status (0 when every rank returned 0)."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as logs:
        port = _free_port()
        procs = [
            ctx.Process(target=_main_worker, args=(argv, r, nproc, port, dict(env), str(cwd), logs))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            timed_out = any(p.is_alive() for p in procs)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        logged = [Path(logs) / f"{name}.{r}" for name in ("out", "err") for r in range(nproc)]
        text = [path.read_text() if path.exists() else "" for path in logged]
        out, err = "".join(text[:nproc]), "".join(text[nproc:])
    status = next((p.exitcode for p in procs if p.exitcode != 0), 0)
    if timed_out:
        raise subprocess.TimeoutExpired(["train.py", *argv], timeout, out, err)
    return subprocess.CompletedProcess(["train.py", *argv], status, out, err)
