"""Run a function in N real processes joined by a gloo process group (CPU).

Rendezvous uses a ``file://`` store in a temp dir, so parallel test runs cannot collide on ports.
Every worker tears its process group down in ``finally``, the parent kills all workers when the
deadline passes, and a worker's traceback is re-raised in the test, so a failing or hanging rank
cannot hang CI.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(fn, rank, world_size, init_file, results, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        # Plain pickle: torch's queue pickler would share tensors through memory that dies with us.
        results.put((rank, None, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
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
