"""Benchmark seed checkpoint creation: seedckpt vs the naive torchtitan-style path.

Run from the repository root:

    python benchmarks/seed.py --flavor 1B
    python benchmarks/seed.py --flavor 70B --skip-baseline --out-dir /big/disk/bench

Three measurements, each printed as one JSON line on stdout:

* ``disk_write``: the sequential write bandwidth of the output disk -- 2 GiB written with
  ``os.write`` in 64 MiB blocks, then fsynced -- the ceiling any checkpoint writer can reach.
* ``seedckpt``: the product, ``create_seed_checkpoint.py --config ... --output DIR --force --quiet``.
  Its line includes ``fraction_of_disk_bw`` (its GB/s over the disk's).
* ``naive_baseline``: what torchtitan does -- build the full model on CPU (paying for the default
  ``nn.Linear`` init), run the same per-tensor recipe over it (``seedckpt.init.init_model``) and
  save ``model.state_dict()`` with stock ``torch.distributed.checkpoint.save``. Skip it with
  ``--skip-baseline`` for flavors whose full model does not fit in RAM.

Each checkpoint is written by its own fresh subprocess, so ``wall_s`` includes interpreter and
torch start-up, and ``peak_rss_gib`` is that process's own peak resident memory (from
``os.wait4``). ``bytes_written`` sums the files in the output directory; ``gb_per_s`` is that over
the wall time (GB = 1e9 bytes). Both writers fsync their files.

A last line compares the two: ``speedup_vs_baseline`` (baseline wall time / seedckpt wall time)
and ``rss_ratio_vs_baseline`` (seedckpt peak RSS / baseline peak RSS). Torch's thread count and the
CPU count are recorded on every checkpoint line; OMP_NUM_THREADS is left as the caller set it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
DISK_TEST_BYTES = 2 << 30
DISK_BLOCK_BYTES = 64 << 20

# The naive baseline, run as `python -c NAIVE_BASELINE FLAVOR DTYPE SEED OUTPUT`.
NAIVE_BASELINE = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from seedckpt.config import load_config
from seedckpt.init import init_model

flavor, dtype, seed, output = sys.argv[1:]
cfg = load_config(None, ["--model.flavor", flavor])
with torch.device("cpu"):
    model = cfg.build_model()
init_model(model, int(seed))
state = {fqn: t.to(getattr(torch, dtype)) for fqn, t in model.state_dict().items()}
dcp.save(state, checkpoint_id=output, no_dist=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="1B", help="Llama 3 flavor (default: 1B)")
    parser.add_argument("--out-dir", help="where checkpoints are written (default: a temp dir under /tmp, "
                                          "removed at the end)")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not run the naive baseline (for flavors that do not fit in RAM)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    opts = parser.parse_args()

    if opts.out_dir:
        out_dir = Path(opts.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        run_all(opts, out_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="seedckpt-bench-", dir="/tmp") as tmp:
            run_all(opts, Path(tmp))


def run_all(opts: argparse.Namespace, out_dir: Path) -> None:
    disk_gb_per_s = disk_write_bandwidth(out_dir / "disk_write.bin")
    emit({"benchmark": "disk_write", "gb_per_s": disk_gb_per_s, "bytes": DISK_TEST_BYTES})

    seedckpt_dir = out_dir / "seedckpt"
    product = measure(opts, "seedckpt", seedckpt_dir, [
        sys.executable, "create_seed_checkpoint.py",
        # Seeding reads only [model]; any config file works once the flavor is overridden.
        "--config", "configs/debug.toml", "--model.flavor", opts.flavor,
        "--output", str(seedckpt_dir), "--seed", str(SEED), "--dtype", opts.dtype, "--force", "--quiet"])
    product["fraction_of_disk_bw"] = product["gb_per_s"] / disk_gb_per_s
    emit(product)

    if opts.skip_baseline:
        return
    baseline_dir = out_dir / "naive_baseline"
    shutil.rmtree(baseline_dir, ignore_errors=True)
    baseline = measure(opts, "naive_baseline", baseline_dir, [
        sys.executable, "-c", NAIVE_BASELINE, opts.flavor, opts.dtype, str(SEED), str(baseline_dir)])
    emit(baseline)
    emit({"benchmark": "seed", "flavor": opts.flavor, "dtype": opts.dtype,
          "speedup_vs_baseline": baseline["wall_s"] / product["wall_s"],
          "rss_ratio_vs_baseline": product["peak_rss_gib"] / baseline["peak_rss_gib"]})


def disk_write_bandwidth(path: Path) -> float:
    """GB/s for writing DISK_TEST_BYTES sequentially to ``path`` and fsyncing it."""
    block = os.urandom(DISK_BLOCK_BYTES)  # incompressible, so no filesystem can shortcut it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(DISK_TEST_BYTES // DISK_BLOCK_BYTES):
            os.write(fd, block)
        os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return DISK_TEST_BYTES / elapsed / 1e9


def measure(opts: argparse.Namespace, impl: str, output: Path, cmd: list[str]) -> dict:
    """Run ``cmd`` in a fresh process that writes a checkpoint to ``output``; time it and read its peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr)  # keep stdout for the JSON lines
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, unlike RUSAGE_CHILDREN
    wall_s = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd[:2])
    bytes_written = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    return {"benchmark": "seed", "flavor": opts.flavor, "dtype": opts.dtype, "impl": impl,
            "wall_s": wall_s, "peak_rss_gib": usage.ru_maxrss / 2**20,  # ru_maxrss is KiB on Linux
            "bytes_written": bytes_written, "gb_per_s": bytes_written / wall_s / 1e9,
            "torch_num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def emit(record: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), flush=True)


if __name__ == "__main__":
    main()
