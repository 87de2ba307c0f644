"""Benchmark the training loop's stall per checkpoint save: synchronous vs ``checkpoint.async_mode =
"async"`` (``seedckpt.checkpoint.background``) vs stock ``dcp.async_save``, in the same run, on the same
state and disk.

Run from the repository root:

    python benchmarks/save.py                     # 1 GiB of fp32 state on the CPU, 3 saves each way
    python benchmarks/save.py --mib 4096 --saves 2 --device cuda --out-dir /mnt/fast/bench

One process, a gloo group of one (the trainer's collectives, trivially). The state is ``--mib`` MiB
of fp32 tensors of 64 MiB each on ``--device`` (about a train state's shape: weights and two AdamW
moments). ``sync``: ``write_checkpoint`` (checksums, manifest, atomic publish); the stall is the whole
write. ``async``: the stall is staging (on CUDA: copies into pinned buffers on a side stream, waited for
as the optimizer waits for them; on CPU a memory copy); the write's seconds follow in the background,
waited for before the next save (one in flight), as the trainer does -- between saves this benchmark
trains nothing, so ``background_s`` is the write on an idle machine. ``stock_async``: the baseline,
``dcp.async_save`` with torch's ``DefaultStager`` (pinned, asynchronous staging on CUDA; a plain
``FileSystemWriter``, no checksums or atomic publish); its stall is the call plus the staging wait.
The first save of each way allocates (and pins) its buffers; later ones reuse them where torch does.
JSON lines on stdout: one per save, then a summary with the median stalls and ``stall_ratio`` (async /
sync) and ``stock_stall_ratio`` (async / stock_async).
"""

from __future__ import annotations

import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, output_dir, parser  # noqa: E402
from seedckpt.checkpoint.background import STAGER_REUSABLE  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--saves", type=int, default=3, help="saves per mode (default 3)")
    p.add_argument("--device", default="cpu", help="where the state lives: cpu (default) or cuda")
    opts = p.parse_args()

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
    )
    device = torch.device(opts.device)
    block = 16 << 20  # fp32 elements: 64 MiB
    state = {f"t{k}": torch.randn(block, device=device) for k in range(max(1, opts.mib // 64))}
    nbytes = sum(t.nbytes for t in state.values())
    stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
    with output_dir(opts.out_dir, "seedckpt-save-bench-") as out:
        for mode in MODES:
            save = MODES[mode](device)
            for k in range(opts.saves):
                record = save(out / mode / f"step-{k}", state)
                for t in state.values():  # the next "step": the state changes under the background write's copy
                    t.add_(1.0)
                stalls[mode].append(record["stall_s"])
                seconds = record["stall_s"] + record["background_s"]
                emit(
                    {
                        "benchmark": "save",
                        "mode": mode,
                        "device": opts.device,
                        "save": k,
                        "bytes": nbytes,
                        **record,
                        "gb_per_s": nbytes / 1e9 / seconds,
                    }
                )
    median = {mode: statistics.median(values) for mode, values in stalls.items()}
    emit(
        {
            "benchmark": "save_summary",
            "device": opts.device,
            "bytes": nbytes,
            **{f"{mode}_stall_s": value for mode, value in median.items()},
            "stall_ratio": median["async"] / median["sync"],
            "stock_stall_ratio": median["async"] / median["stock_async"],
        }
    )
    dist.destroy_process_group()


def sync_save(device):
    from seedckpt.checkpoint import write_checkpoint

    def save(path: Path, state: dict) -> dict:
        start = time.perf_counter()
        write_checkpoint(path, state, manifest={}, force=True)
        _synchronize(device)
        return {"stall_s": time.perf_counter() - start, "background_s": 0.0}

    return save


def async_save(device):
    from seedckpt.checkpoint import write_checkpoint
    from seedckpt.checkpoint.background import BackgroundSaver

    saver = BackgroundSaver(device)

    def save(path: Path, state: dict) -> dict:
        start = time.perf_counter()
        saver.save(path, state, functools.partial(write_checkpoint, path, manifest={}, force=True))
        saver.wait_for_staging()  # what the trainer's optimizer step waits for
        stall = time.perf_counter() - start
        return {"stall_s": stall, "background_s": saver.wait().background_s}

    return save


def stock_async_save(device):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda
    )
    stager = [None]

    def save(path: Path, state: dict) -> dict:
        if stager[0] is None or not STAGER_REUSABLE:  # torch < 2.13: one stage per stager
            stager[0] = DefaultStager(options)
        start = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
        response = dcp.async_save(state, checkpoint_id=str(path), async_stager=stager[0])
        staged, upload = (
            (response.staging_completion, response.upload_completion)
            if hasattr(response, "upload_completion")
            else (None, response)
        )
        if staged is not None:
            staged.result()
        stall = time.perf_counter() - start
        upload.result()
        return {"stall_s": stall, "background_s": time.perf_counter() - start - stall}

    return save


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


MODES = {"sync": sync_save, "async": async_save, "stock_async": stock_async_save}


if __name__ == "__main__":
    main()
