"""Benchmark loading a checkpoint into an FSDP2-sharded model: seedckpt vs stock ``dcp.load`` vs a
rank-0 broadcast, cold and warm page cache.

Run from the repository root:

    python benchmarks/load.py                             # Llama-3 1B, fp32, 4 gloo ranks, all methods
    python benchmarks/load.py --flavor debug --ranks 2    # a quick check of the harness
    python benchmarks/load.py --methods seedckpt,stock_dcp --skip-cold
    python benchmarks/load.py --device cuda --ranks 1 --flavor 8B --skip-cold   # onto one GPU

The seed checkpoint of ``--flavor`` (fp32) is made first with ``create_seed_checkpoint.py``. Each
method then loads those weights in its own ``torchrun --standalone --nproc-per-node RANKS`` job
(CPU, gloo, OMP_NUM_THREADS=1; with ``--device cuda`` one GPU per rank, nccl) into the same model:
Llama 3, fp32, FSDP2 ``fully_shard`` per block
and root over a 1-D mesh of all ranks (dp_shard = RANKS, pp = 1; ``seedckpt.parallel.parallelize.apply_fsdp``).

* ``seedckpt``: ``build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=SEED,
  shard_fn=apply_fsdp)`` -- built on ``meta``, sharded, materialized; each rank reads only the rows
  it owns, then every tensor is checked to have a value.
* ``seedckpt_unverified``: the same with ``verify=False``: the CRC32C checks of every byte read
  (``seedckpt.checkpoint.integrity``) skipped -- the baseline of their cost.
* ``stock_dcp``: the model built on ``meta``, sharded, ``to_empty``, then stock
  ``torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=STOCK)``. STOCK is written
  once, before the runs, by stock ``dcp.save(full_state_dict, no_dist=True)`` from the seed's
  tensors: a checkpoint as stock tools write it (its reader reads each stored tensor whole).
* ``broadcast`` (Mini Trainer's recipe): rank 0 reads the whole seed into a full CPU state dict, all
  ranks build on ``meta``, shard and ``to_empty``, then ``set_model_state_dict(model, full,
  StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``.

A tied output projection is stored once, under the embedding's name, and every method reads it once.

Cache. ``cold``: before the job the parent syncs, drops the checkpoint files' pages with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (allowed unprivileged, for clean pages) and tries ``echo 1 >
/proc/sys/vm/drop_caches`` (root only; it drops torch's libraries too, which slows the job's start
but not ``ready_s``, measured after the imports). ``warm``: the same job right after, with what the
cold run read still cached. ``--skip-cold`` runs warm only, after reading the files once (no
drops, no ``disk_read`` line).

JSON lines on stdout (GB = 1e9 bytes, MiB = 2**20):

* ``benchmark: disk_read`` (first): ``gb_per_s``, the disk's sequential read bandwidth -- the
  seed's files, largest first, read cold in 64 MiB blocks, up to 2 GiB (``bytes``; a small flavor's
  seed is too small to measure more than latency); ``disk_read_mib`` (``read_bytes`` of
  ``/proc/self/io``, what came from the disk itself: proof the drop worked); ``fadvise`` and
  ``drop_caches``: whether each drop worked (cold lines carry them too).
* one per (method, cache, repeat, rank): ``ready_s``, from just before building the model to the model
  loaded on that rank (on CUDA: its copies done; ranks start together after a barrier; interpreter,
  imports and rendezvous excluded); ``since_launch_s``, the same end from the job's launch (start-up included);
  ``read_mib``, ``rchar`` of ``/proc/self/io`` over the load (every byte the rank read with a
  syscall, page-cache hits included; ~0.6 MiB of it is Python source torch reads while sharding,
  which only matters for tiny flavors); ``disk_read_mib``, ``read_bytes`` over the load (after
  ``drop_caches`` it includes torch's library pages faulted back in); ``owned_mib``,
  the rank's parameter shards; ``gb_per_s``, owned bytes / ``ready_s``; ``peak_rss_mib``, the rank's
  ``VmHWM`` (unlike ``ru_maxrss`` it does
  not start at the torchrun agent's RSS); ``read_over_owned``; ``within_read_target`` (read <= 1.05 x
  owned: a rank reads what it owns, not the model); ``within_rss_target`` (peak RSS <= 1.3 x owned
  + 300 MiB: no rank ever holds the full model).
* one per (method, cache, repeat) with ``summary``: ``ready_s`` (the slowest rank), ``job_wall_s`` (the
  torchrun job from launch to exit), ``gb_per_s`` (every rank's owned bytes / ``ready_s``),
  ``max_peak_rss_mib``, ``max_read_mib``, ``total_read_mib``,
  ``total_disk_read_mib``, ``checkpoint_mib`` (the checkpoint's files), ``all_within_read_target``,
  ``all_within_rss_target``; warm: ``within_wall_target`` (ready_s <= 4 s); cold:
  ``over_disk_time`` (ready_s over the checkpoint's bytes / the ``disk_read`` bandwidth: 1.0 is
  reading the checkpoint once at the disk's speed) and ``within_disk_target`` (<= 1.2).
* one per (baseline, cache) with ``comparison``, from each method's median run (``--repeats``,
  default 3, interleaved, after a first job that is not compared, ``repeat`` -1): ``speedup``
  (the baseline's ready_s / seedckpt's),
  ``max_rss_ratio`` and ``rank0_rss_ratio`` (seedckpt's peak RSS / the baseline's),
  ``max_read_ratio`` (seedckpt's largest per-rank read / the baseline's), ``same_values`` (every
  rank's shards sum to exactly the same float64 value under both: the same weights were loaded).
* one per cache with ``verification``: ``cost`` (seedckpt's ready_s over seedckpt_unverified's, minus 1)
  and ``within_verify_target`` (<= 0.10: checking every byte costs under 10 % of a load).

The parent does not import torch (see ``common.py``). Checkpoints are written under ``--out-dir``,
else a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import common
from common import DISK_BLOCK_BYTES, DISK_TEST_BYTES, emit, output_dir, proc_fields, remove, run_checked

METHODS = ("seedckpt", "seedckpt_unverified", "stock_dcp", "broadcast")
READ_TARGET_RATIO, WALL_TARGET_S, DISK_TARGET_RATIO, VERIFY_TARGET = 1.05, 4.0, 1.2, 0.10
SCRIPT = str(Path(__file__).resolve())


def stored_names(model) -> dict[str, str]:
    """Each state-dict FQN -> the name its tensor is stored under: tied tensors once, first name."""
    first: dict[int, str] = {}
    return {fqn: first.setdefault(id(t), fqn) for fqn, t in model.state_dict(keep_vars=True).items()}


def make_stock(seed_dir: str, out: str) -> None:
    """The seed's tensors, whole, written by stock ``dcp.save`` from one process."""
    import torch
    import torch.distributed.checkpoint as dcp

    from models.common.decoder import Transformer
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    seed = open_model_checkpoint(seed_dir)
    with torch.device("meta"):
        model = Transformer(seed.args)
    names = dict.fromkeys(stored_names(model).values())
    dcp.save({fqn: seed.read_tensor(fqn) for fqn in names}, checkpoint_id=out, no_dist=True)


def worker(opts: argparse.Namespace) -> None:
    """One rank of a torchrun job: load the weights with ``opts.worker``'s method, then report."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from models.common.decoder import Transformer
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.parallelize import apply_fsdp
    from seedckpt.parallel.pipeline import plan_rank_stages

    device = opts.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    seed = open_model_checkpoint(opts.seed)

    def shard(module):
        apply_fsdp(module, mesh, torch.float32, torch.float32, True)

    dist.barrier()
    before, start = proc_fields("io"), time.perf_counter()
    if opts.worker.startswith("seedckpt"):
        [model] = build_stages(
            seed.args,
            plan_rank_stages(seed.args, 0, 1),
            device,
            checkpoint=opts.ckpt,
            shard_fn=shard,
            verify=opts.worker == "seedckpt",
        )
    else:
        with torch.device("meta"):
            model = Transformer(seed.args)
        stored = stored_names(model)
        shard(model)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty replaced the shared parameter one module at a time
        model.init_buffers()
        if opts.worker == "stock_dcp":
            dcp.load({k: t for k, t in model.state_dict().items() if stored[k] == k}, checkpoint_id=opts.ckpt)
        else:
            full = {}
            for fqn, name in stored.items() if rank == 0 else ():
                full[fqn] = full[name] if name != fqn else seed.read_tensor(fqn)
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            del full
    if device == "cuda":
        torch.cuda.synchronize()  # copies may still run on a side stream
    ready, since_launch = time.perf_counter() - start, time.time() - opts.launched
    after, peak_kib = proc_fields("io"), proc_fields("status")["VmHWM"]
    shards = [p.to_local() for p in model.parameters()]
    common.write_rank_report(
        opts.report,
        rank,
        {
            "rank": rank,
            "ready_s": ready,
            "since_launch_s": since_launch,
            "read_mib": (after["rchar"] - before["rchar"]) / 2**20,
            "disk_read_mib": (after["read_bytes"] - before["read_bytes"]) / 2**20,
            "owned_mib": sum(t.nbytes for t in shards) / 2**20,
            "gb_per_s": sum(t.nbytes for t in shards) / ready / 1e9,
            "peak_rss_mib": peak_kib / 1024,
            "device": device,
            "checksum": repr(sum(t.sum(dtype=torch.float64).item() for t in shards)),
        },
    )
    dist.destroy_process_group()


def files_of(path: Path) -> list[Path]:
    """The checkpoint's files, largest first."""
    return sorted((f for f in path.rglob("*") if f.is_file()), key=lambda f: -f.stat().st_size)


def drop_page_cache(files: list[Path]) -> dict:
    """Evict ``files`` from the page cache (after a sync: dirty pages cannot be dropped)."""
    os.sync()
    fadvise = True
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            fadvise = False
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        drop_caches = True
    except OSError:
        drop_caches = False
    return {"fadvise": fadvise, "drop_caches": drop_caches}


def read_files(files: list[Path], limit: int | None = None) -> int:
    """Read ``files`` in order, sequentially, up to ``limit`` bytes; return the bytes read."""
    buf, done = bytearray(DISK_BLOCK_BYTES), 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            while (limit is None or done < limit) and (n := os.readv(fd, [buf])):
                done += n
        finally:
            os.close(fd)
    return done


def disk_read_bandwidth(files: list[Path]) -> float:
    """Emit the ``disk_read`` line; return its GB/s."""
    dropped = drop_page_cache(files)
    before, start = proc_fields("io"), time.perf_counter()
    done = read_files(files, DISK_TEST_BYTES)
    gb_per_s = done / (time.perf_counter() - start) / 1e9
    emit(
        {
            "benchmark": "disk_read",
            "gb_per_s": gb_per_s,
            "bytes": done,
            "disk_read_mib": (proc_fields("io")["read_bytes"] - before["read_bytes"]) / 2**20,
            **dropped,
        }
    )
    return gb_per_s


def median_run(runs: list[list[dict]]) -> list[dict]:
    """The run (its per-rank records) whose slowest rank's ``ready_s`` is the median of the runs'."""
    return sorted(runs, key=lambda records: max(r["ready_s"] for r in records))[len(runs) // 2]


def run_method(
    opts: argparse.Namespace,
    method: str,
    cache: str,
    ckpt: Path,
    seed: Path,
    work: Path,
    disk_gb_per_s: float | None,
    repeat: int = 0,
) -> list[dict]:
    """One torchrun job; emits its per-rank lines and its summary line; returns the per-rank records."""
    files = files_of(ckpt)
    dropped = drop_page_cache(files) if cache == "cold" else {}
    records, wall = common.torchrun(
        SCRIPT,
        opts.ranks,
        work / f"report-{method}-{cache}-{repeat}",
        "--worker",
        method,
        "--ckpt",
        str(ckpt),
        "--seed",
        str(seed),
        "--device",
        opts.device,
        "--launched",
        repr(time.time()),
    )
    for r in records:
        r["read_over_owned"] = r["read_mib"] / r["owned_mib"]
        r["within_read_target"] = r["read_over_owned"] <= READ_TARGET_RATIO
        r["within_rss_target"] = common.within_rss_target(r["peak_rss_mib"], r["owned_mib"])
        emit({"method": method, "cache": cache, "repeat": repeat, **{k: v for k, v in r.items() if k != "checksum"}})
    ready, ckpt_bytes = max(r["ready_s"] for r in records), sum(f.stat().st_size for f in files)
    summary = {
        "method": method,
        "cache": cache,
        "repeat": repeat,
        "summary": True,
        "flavor": opts.flavor,
        "ranks": opts.ranks,
        "device": opts.device,
        "ready_s": ready,
        "gb_per_s": sum(r["owned_mib"] for r in records) * 2**20 / ready / 1e9,
        "job_wall_s": wall,
        "max_peak_rss_mib": max(r["peak_rss_mib"] for r in records),
        "max_read_mib": max(r["read_mib"] for r in records),
        "total_read_mib": sum(r["read_mib"] for r in records),
        "total_disk_read_mib": sum(r["disk_read_mib"] for r in records),
        "checkpoint_mib": ckpt_bytes / 2**20,
        "all_within_read_target": all(r["within_read_target"] for r in records),
        "all_within_rss_target": all(r["within_rss_target"] for r in records),
        **dropped,
    }
    if cache == "warm":
        summary["within_wall_target"] = ready <= WALL_TARGET_S
    else:
        summary["over_disk_time"] = ready / (ckpt_bytes / (disk_gb_per_s * 1e9))
        summary["within_disk_target"] = summary["over_disk_time"] <= DISK_TARGET_RATIO
    emit({**summary, "cpu_count": os.cpu_count()})
    return records


def compare(ours: list[dict], base: list[dict], **labels) -> None:
    def worst(records, key):
        return max(r[key] for r in records)

    emit(
        {
            "comparison": True,
            **labels,
            "speedup": worst(base, "ready_s") / worst(ours, "ready_s"),
            "max_rss_ratio": worst(ours, "peak_rss_mib") / worst(base, "peak_rss_mib"),
            "rank0_rss_ratio": ours[0]["peak_rss_mib"] / base[0]["peak_rss_mib"],
            "max_read_ratio": worst(ours, "read_mib") / worst(base, "read_mib"),
            "same_values": [r["checksum"] for r in ours] == [r["checksum"] for r in base],
        }
    )


def run_all(opts: argparse.Namespace, methods: list[str], work: Path) -> None:
    seed, stock = work / "seed", work / "stock_dcp"
    run_checked(
        [
            sys.executable,
            "create_seed_checkpoint.py",
            "--config",
            "configs/debug.toml",
            "--model.flavor",
            opts.flavor,
            "--dtype",
            "float32",
            "--output",
            str(seed),
            "--force",
            "--quiet",
        ],
        "seeding",
    )
    if "stock_dcp" in methods:
        remove(stock)
        run_checked(
            [sys.executable, SCRIPT, "--make-stock", str(stock), "--seed", str(seed)],
            "writing the stock DCP checkpoint",
        )
    caches = ["warm"] if opts.skip_cold else ["cold", "warm"]
    disk_gb_per_s = None if opts.skip_cold else disk_read_bandwidth(files_of(seed))
    if opts.skip_cold:
        for ckpt in {stock if method == "stock_dcp" else seed for method in methods}:
            read_files(files_of(ckpt))
    # A first job, not compared (repeat -1): on the 2-core CI machine the first job after seeding
    # measured up to 2x slower than the next ones, whichever method it ran.
    run_method(opts, methods[0], "warm", seed if methods[0] != "stock_dcp" else stock, seed, work, None, -1)
    runs = {}
    for cache in caches:
        for repeat in range(opts.repeats):  # interleaved, so a slow spell of the machine hits every method
            for method in methods:
                ckpt = stock if method == "stock_dcp" else seed
                records = run_method(opts, method, cache, ckpt, seed, work, disk_gb_per_s, repeat)
                runs.setdefault((method, cache), []).append(records)
    results = {key: median_run(records) for key, records in runs.items()}
    for cache in caches:
        for base in methods:
            if "seedckpt" in methods and base != "seedckpt":
                compare(
                    results["seedckpt", cache],
                    results[base, cache],
                    cache=cache,
                    baseline=base,
                    flavor=opts.flavor,
                    ranks=opts.ranks,
                )
        if {"seedckpt", "seedckpt_unverified"} <= set(methods):
            cost = (
                max(r["ready_s"] for r in results["seedckpt", cache])
                / max(r["ready_s"] for r in results["seedckpt_unverified", cache])
                - 1
            )
            emit(
                {
                    "verification": True,
                    "cache": cache,
                    "flavor": opts.flavor,
                    "ranks": opts.ranks,
                    "cost": cost,
                    "within_verify_target": cost <= VERIFY_TARGET,
                }
            )


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks, all in one FSDP2 mesh (default: 4)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)} (default: all)")
    p.add_argument("--skip-cold", action="store_true", help="warm page cache only (no cache drops)")
    p.add_argument(
        "--repeats", type=int, default=3, help="runs per method and cache, interleaved; each compared by its median"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model is loaded (cuda: one GPU per rank; default: cpu)",
    )
    for hidden in ("--worker", "--ckpt", "--seed", "--report", "--make-stock"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        return worker(opts)
    if opts.make_stock:
        return make_stock(opts.seed, opts.make_stock)
    methods = [m for m in opts.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        p.error(f"--methods takes a comma list of {', '.join(METHODS)}; got {opts.methods!r}")
    if opts.ranks < 1:
        p.error("--ranks must be at least 1")
    with output_dir(opts.out_dir, "load-bench-") as work:
        run_all(opts, methods, work)


if __name__ == "__main__":
    main()
