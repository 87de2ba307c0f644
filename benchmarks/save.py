"""Benchmark the training loop's stall per checkpoint save: synchronous vs ``checkpoint.async_mode =
"async"`` (``seedckpt.checkpoint.background``), in the same run, on the same state and disk.

Run from the repository root:

    python benchmarks/save.py                     # 1 GiB of fp32 state, 3 saves each way
    python benchmarks/save.py --mib 4096 --saves 2 --out-dir /mnt/fast/bench

One process, a gloo group of one (the trainer's collectives, trivially). The state is ``--mib`` MiB
of fp32 tensors of 64 MiB each (about a train state's shape: weights and two AdamW moments). Each
save writes ``step-N`` through ``write_checkpoint`` (checksums, manifest, atomic publish). ``sync``:
the stall is the whole write. ``async``: the stall is staging (a memory copy on CPU); the write's
seconds follow in the background, waited for before the next save (one in flight), as the trainer
does -- between saves this benchmark trains nothing, so ``background_s`` is the write on an idle
machine. JSON lines on stdout: one per save, then a summary with ``stall_ratio`` (async / sync,
medians).
"""

from __future__ import annotations

import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import output_dir, parser  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--saves", type=int, default=3, help="saves per mode (default 3)")
    opts = p.parse_args()

    import torch
    import torch.distributed as dist

    from seedckpt.checkpoint import write_checkpoint
    from seedckpt.checkpoint.background import BackgroundSaver

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
    )
    block = 16 << 20  # fp32 elements: 64 MiB
    state = {f"t{k}": torch.randn(block) for k in range(max(1, opts.mib // 64))}
    nbytes = sum(t.nbytes for t in state.values())
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    with output_dir(opts.out_dir, "seedckpt-save-bench-") as out:
        saver = BackgroundSaver(torch.device("cpu"))
        for mode in ("sync", "async"):
            for k in range(opts.saves):
                path = out / mode / f"step-{k}"
                write = functools.partial(write_checkpoint, path, manifest={}, force=True)
                start = time.perf_counter()
                if mode == "sync":
                    write(state)
                    record = {"stall_s": time.perf_counter() - start, "background_s": 0.0}
                else:
                    saver.save(path, state, write)
                    stall = time.perf_counter() - start
                    saved = saver.wait()
                    record = {"stall_s": stall, "background_s": saved.background_s}
                for t in state.values():  # the next "step": the state changes under the background write's copy
                    t.add_(1.0)
                stalls[mode].append(record["stall_s"])
                print(
                    json.dumps(
                        {
                            "benchmark": "save",
                            "mode": mode,
                            "save": k,
                            "bytes": nbytes,
                            **record,
                            "gb_per_s": nbytes / 1e9 / (record["stall_s"] + record["background_s"]),
                        }
                    ),
                    flush=True,
                )
    sync, asyn = statistics.median(stalls["sync"]), statistics.median(stalls["async"])
    print(
        json.dumps(
            {
                "benchmark": "save_summary",
                "bytes": nbytes,
                "sync_stall_s": sync,
                "async_stall_s": asyn,
                "stall_ratio": asyn / sync,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
