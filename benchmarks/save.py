"""Benchmark the training loop's stall per checkpoint save: synchronous vs ``checkpoint.async_mode =
"async"`` (``seedckpt.checkpoint.background``) vs stock ``dcp.async_save`` vs torchtitan's
``async_with_pinned_mem``, in the same run, on the same state and disk, the modes taking turns.

Run from the repository root:

    python benchmarks/save.py                     # 1 GiB of fp32 state on the CPU, 3 saves each way
    python benchmarks/save.py --mib 4096 --saves 3 --device cuda --out-dir /mnt/fast/bench
    python benchmarks/save.py --gathered          # the state's tensors made anew before each save
    python benchmarks/save.py --step-ms 500       # a step's compute between the save and its wait

One process, a gloo group of one (the trainer's collectives, trivially). The state is ``--mib`` MiB
of fp32 tensors of 64 MiB each on ``--device`` (about a train state's shape: weights and two AdamW
moments). ``--gathered``: before each save (untimed) the state dict's tensors are made anew, as manual
FSDP gathers its full tensors and ``torch.get_rng_state()`` returns a new one; otherwise the same
tensors are saved each time, as FSDP2's shards are. Round ``k`` saves once in each mode, in turn,
starting from the ``k``-th (a way that always followed another would pay for what that one left).

The stall is what a save adds to the training step that follows it: the time from the save's call
to the point where the optimizer may change the state, less the step timed alone just before.
``--step-ms`` is the step's forward and backward (a fixed number of matmuls, default none): copies
that overlap it are hidden, copies that compete with it for the machine lengthen it.

* ``sync``: ``write_checkpoint`` (checksums, manifest, atomic publish); the stall is the whole write.
* ``async``: seedckpt's ``BackgroundSaver``: the call, the step, then ``wait_for_staging`` (what the
  trainer waits for before the state changes): on CUDA the device-to-host copies into pinned
  buffers, on CPU a staging thread's memory copy; checksums and the write follow in the background.
* ``stock_async``: ``dcp.async_save`` with torch's ``DefaultStager(StagingOptions(pinned, shared
  memory, async staging, non-blocking copies))`` and its thread executor; a plain
  ``FileSystemWriter`` (no checksums, no atomic publish). The call, the step, then the staging
  future's wait (a trainer's before its optimizer step).
* ``torchtitan``: torchtitan's ``async_with_pinned_mem`` as its ``CheckpointManager`` does it: a
  garbage collection, then ``dcp.async_save`` with the same stager over a gloo group, written by
  DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``, started at the first save); timed
  as ``stock_async``.

On CPU pinned memory and non-blocking copies do not apply (torch refuses the latter without an
accelerator): the stock and torchtitan stagers keep shared memory and asynchronous staging. Every
way waits for its previous write before its next save (one in flight, as the trainer does); between
saves this benchmark trains nothing else, so ``background_s`` is the write on an idle machine.
Each checkpoint is deleted once written.

JSON lines on stdout: one per save, then a summary: each mode's ``<mode>_first_stall_s`` (the first
save allocates, and on CUDA pins, its buffers) and ``<mode>_stall_s``, the median stall of the
saves after it; ``stall_ratio`` (async / sync), ``stock_stall_ratio`` (async / stock_async) and
``torchtitan_stall_ratio`` (async / torchtitan).
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, output_dir, parser  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--saves", type=int, default=3, help="saves per mode (default 3)")
    p.add_argument("--device", default="cpu", help="where the state lives: cpu (default) or cuda")
    p.add_argument("--gathered", action="store_true", help="make the state's tensors anew before each save")
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="the next step's forward and backward, in ms of matmuls (default 0)"
    )
    opts = p.parse_args()

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's checkpoint process (torchtitan) meets here
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
    )
    device = torch.device(opts.device)
    block = 16 << 20  # fp32 elements: 64 MiB
    state = {f"t{k}": torch.randn(block, device=device) for k in range(max(1, opts.mib // 64))}
    nbytes = sum(t.nbytes for t in state.values())
    saves = {mode: make(device) for mode, make in MODES.items()}
    step = _step(device, opts.step_ms)
    stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
    with output_dir(opts.out_dir, "seedckpt-save-bench-") as out:
        names = list(saves)
        for k in range(opts.saves):
            for mode in names[k % len(names) :] + names[: k % len(names)]:  # each way first in turn
                step_s = _timed(step, device)  # the step alone, just before: the baseline of this stall
                if opts.gathered:
                    state = {key: t.clone() for key, t in state.items()}
                _synchronize(device)
                record = saves[mode](out / mode / f"step-{k}", state, step)
                for t in state.values():  # the optimizer: the state changes under the background write
                    t.add_(1.0)
                shutil.rmtree(out / mode)  # written and timed: 4 ways x saves of the state would fill a tmpfs
                stall = record["with_step_s"] - step_s
                stalls[mode].append(stall)
                emit(
                    {
                        "benchmark": "save",
                        "mode": mode,
                        "device": opts.device,
                        "gathered": opts.gathered,
                        "save": k,
                        "bytes": nbytes,
                        "stall_s": stall,
                        "step_s": step_s,
                        **record,
                        "gb_per_s": nbytes / 1e9 / (stall + record["background_s"]),
                    }
                )
    emit(_summary(opts, nbytes, stalls, torch.__version__))
    dist.destroy_process_group()


def _summary(opts, nbytes: int, stalls: dict[str, list[float]], torch_version: str) -> dict:
    steady = {mode: statistics.median(values[1:] or values) for mode, values in stalls.items()}
    return {
        "benchmark": "save_summary",
        "device": opts.device,
        "gathered": opts.gathered,
        "step_ms": opts.step_ms,
        "torch": torch_version,
        "bytes": nbytes,
        **{f"{mode}_first_stall_s": values[0] for mode, values in stalls.items()},
        **{f"{mode}_stall_s": value for mode, value in steady.items()},
        "stall_ratio": steady["async"] / steady["sync"],
        "stock_stall_ratio": steady["async"] / steady["stock_async"],
        "torchtitan_stall_ratio": steady["async"] / steady["torchtitan"],
    }


def sync_save(device):
    from seedckpt.checkpoint import write_checkpoint

    def save(path: Path, state: dict, step) -> dict:
        start = time.perf_counter()
        write_checkpoint(path, state, manifest={}, force=True)
        step()
        _synchronize(device)
        return {"with_step_s": time.perf_counter() - start, "background_s": 0.0}

    return save


def async_save(device):
    from seedckpt.checkpoint import write_checkpoint
    from seedckpt.checkpoint.background import BackgroundSaver

    saver = BackgroundSaver(device)

    def save(path: Path, state: dict, step) -> dict:
        start = time.perf_counter()
        saver.save(path, state, functools.partial(write_checkpoint, path, manifest={}, force=True))
        step()
        saver.wait_for_staging()  # what the trainer waits for before the state changes
        _synchronize(device)
        with_step = time.perf_counter() - start
        return {"with_step_s": with_step, "background_s": saver.wait().background_s}

    return save


def stock_async_save(device, process: bool = False):
    """``dcp.async_save`` with ``DefaultStager``; ``process``: torchtitan's ``async_with_pinned_mem``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = device.type == "cuda"
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
    )
    executor = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    group = dist.new_group(backend="gloo") if process else None
    stager = [None]

    def save(path: Path, state: dict, step) -> dict:
        if stager[0] is None or not STAGER_REUSABLE:
            stager[0] = DefaultStager(options)
        start = time.perf_counter()
        if process:
            gc.collect(1)  # torchtitan collects before each asynchronous save
        response = dcp.async_save(
            state,
            checkpoint_id=str(path),
            process_group=group,
            async_checkpointer_type=executor,
            async_stager=stager[0],
        )
        step()
        response.staging_completion.result()  # a trainer's wait before its optimizer step
        _synchronize(device)
        with_step = time.perf_counter() - start
        response.upload_completion.result()
        return {"with_step_s": with_step, "background_s": time.perf_counter() - start - with_step}

    return save


def _step(device, step_ms: float):
    """A training step's forward and backward as ``step_ms`` of matmuls on ``device`` (a fixed
    number, timed alone here: a copy that competes with them for the machine shows as a longer step)."""
    import torch

    if step_ms <= 0:
        return lambda: None
    a = torch.randn(256, 256, device=device)
    out = torch.empty_like(a)

    def matmuls(n: int):
        for _ in range(n):
            torch.mm(a, a, out=out)

    per_matmul = _timed(functools.partial(matmuls, 50), device) / 50
    return functools.partial(matmuls, max(1, round(step_ms / 1e3 / per_matmul)))


def _timed(work, device) -> float:
    start = time.perf_counter()
    work()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    return tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (major, minor)


# torch 2.11 and 2.12's DefaultStager releases its buffers at the end of every stage and cannot stage
# again ("KeyError: <class 'type'>" at the second): there the stock ways take a new stager per save.
STAGER_REUSABLE = _torch_at_least(2, 13)
MODES = {
    "sync": sync_save,
    "async": async_save,
    "stock_async": stock_async_save,
    "torchtitan": functools.partial(stock_async_save, process=True),
}


if __name__ == "__main__":
    main()
