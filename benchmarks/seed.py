"""Benchmark seed checkpoint creation: seedckpt vs the naive torchtitan-style path.

Run from the repository root:

    python benchmarks/seed.py --flavor 1B
    python benchmarks/seed.py --flavor 70B --skip-baseline --out-dir /big/disk/bench

Three measurements, each printed as one JSON line on stdout:

* ``disk_write``: the sequential write bandwidth of the output disk -- 2 GiB written with
  ``os.write`` in 64 MiB blocks, then fsynced -- the ceiling any checkpoint writer can reach.
* ``seedckpt``: the product, ``create_seed_checkpoint.py --config ... --output DIR --force --quiet``.
  Its line includes ``fraction_of_disk_bw`` (its GB/s over the disk's) and ``fraction_of_dd``.
* ``dd``: ``dd if=/dev/zero of=FILE bs=64M conv=fsync`` of as many bytes as the seed wrote (rounded
  up to 64 MiB), right after it, into the same directory, timed as the seed is (the process, then a
  ``sync``): the yardstick anyone can rerun. The seed's line has ``fraction_of_dd``, its GB/s over
  dd's, start-up included.
* ``seed_workers`` (with ``--workers-sweep``): the product with ``--workers 1, 2, 4, ...`` up to the
  usable cores, each pinned to that many cores with ``taskset``, and ``speedup_vs_1_worker``
  against the 1-worker run of the same sweep.
* ``seed_layers`` (with ``--n-layers 2,4``): the product on ``--model``'s flavor cut to each layer
  count (``--model.n_layers``), and a last line with the peak RSS's growth from the first count to
  the last against the bytes'. ``--model qwen3_moe --flavor 235B-A22B --n-layers 2,4 --dtype
  bfloat16``: a mixture of experts whose every expert weight is one 3.2 GB tensor per layer (in
  fp32), whose seed must stream within tensors.
* ``rng_rate``: the recipe's generator on one core (``generate_flat`` of a normal and of a
  truncated normal cut at 3 std, as Llama's output projection, into a reused buffer, in a pinned
  subprocess): the fp32 GB/s one core draws. The ``seedckpt`` line then has ``bound_gb_per_s``,
  min(the disk, the usable cores x the normal's rate), and ``fraction_of_bound``.
* ``seed_startup`` (with ``--workers-sweep``): the seed of a one-layer debug model, one worker on
  one core -- interpreter, torch and DCP imports, the model on ``meta``, the manifest: the serial
  part that no worker count shortens. Each ``seed_workers`` line then has
  ``amdahl_ceiling``, the speedup its core count allows with that part serial and the rest
  divided evenly (``(S + W) / (S + W / n)``, W the 1-worker run less S), and ``cpu_s`` (user +
  system of the run): equal across counts when more workers add no work.
* ``seed_plan`` (with ``--plan-workers N``): the global plan of ``--model``'s blocks at N workers'
  block size, planned in one process by the seed's planner (``checkpoint/block_plan.py``) and by
  DCP's own ``DefaultSavePlanner``, alternated on the same local plan (best of 2 each):
  ``--model deepseek_v3 --flavor 671B --plan-workers 16 --dtype bfloat16 --skip-baseline``.
* ``--set KEY=VALUE`` (repeatable): a config override for every seed run, e.g. ``--model deepseek_v3
  --flavor 671B --n-layers 4 --set model.n_experts=32 --dtype bfloat16``: DeepSeek-V3's layers
  (three dense, then MoE) with 32 of its experts, each expert weight 32 x 2048 x 7168, 1.9 GB in
  fp32 -- larger than the 1.5 GiB the seed's peak RSS must stay under.
* ``naive_baseline``: what torchtitan does -- build the full model on CPU (paying for the default
  ``nn.Linear`` init), run the same per-tensor recipe over it (``seedckpt.materialize.init_recipe.init_model``) and
  save ``model.state_dict()`` with stock ``torch.distributed.checkpoint.save``. Skip it with
  ``--skip-baseline`` for flavors whose full model does not fit in RAM.

Each checkpoint is written by its own fresh subprocess, so ``wall_s`` includes interpreter and
torch start-up (and a final ``sync``), and ``peak_rss_gib`` is that process's own peak resident
memory (from ``os.wait4``; this script does not import torch, see ``common.py``).
``bytes_written`` sums the files in the output directory; ``gb_per_s`` is that over the wall time
(GB = 1e9 bytes).

A last line compares the two: ``speedup_vs_baseline`` (baseline wall time / seedckpt wall time)
and ``rss_ratio_vs_baseline`` (seedckpt peak RSS / baseline peak RSS). The CPU count and
OMP_NUM_THREADS (left as the caller set it) are recorded on every checkpoint line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import common
from common import DISK_TEST_BYTES, disk_write_bandwidth, emit, measure, output_dir, remove

SEED = 0
DD_BLOCK_BYTES = 64 << 20

# The naive baseline, run as `python -c NAIVE_BASELINE FLAVOR DTYPE SEED OUTPUT`.
NAIVE_BASELINE = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from seedckpt.config.job_config import load_config
from seedckpt.materialize.init_recipe import init_model

flavor, dtype, seed, output = sys.argv[1:]
cfg = load_config(None, ["--model.flavor", flavor])
with torch.device("cpu"):
    model = cfg.build_model()
init_model(model, int(seed))
state = {fqn: t.to(getattr(torch, dtype)) for fqn, t in model.state_dict().items()}
dcp.save(state, checkpoint_id=output, no_dist=True)
"""


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--skip-baseline",
        action="store_true",
        help="do not run the naive baseline (for flavors that do not fit in RAM)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="llama3", help="model family (default: llama3)")
    parser.add_argument(
        "--n-layers", help="comma-separated layer counts: seed the flavor cut to each (no naive baseline)"
    )
    parser.add_argument(
        "--workers-sweep",
        action="store_true",
        help="also time --workers 1, 2, 4, ... (each pinned to as many cores with taskset)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, repeatable")
    parser.add_argument("--plan-workers", type=int, help="also time planning the blocks at this worker count")
    opts = parser.parse_args()
    with output_dir(opts.out_dir, "seedckpt-bench-") as out_dir:
        run_all(opts, out_dir)


def run_all(opts: argparse.Namespace, out_dir: Path) -> None:
    disk_gb_per_s = disk_write_bandwidth(out_dir / "disk_write.bin")
    emit({"benchmark": "disk_write", "gb_per_s": disk_gb_per_s, "bytes": DISK_TEST_BYTES})
    rng = rng_rate()
    emit(rng)
    bound_gb_per_s = min(disk_gb_per_s, len(os.sched_getaffinity(0)) * rng["normal_gb_per_s"])

    if opts.plan_workers:
        emit(plan_times(opts))
    if opts.n_layers:
        seed_layers(opts, out_dir / "layers")
        return
    labels = {"benchmark": "seed", "flavor": opts.flavor, "dtype": opts.dtype}
    seedckpt_dir = out_dir / "seedckpt"
    product = measure(seed_command(opts, seedckpt_dir), seedckpt_dir, **labels, impl="seedckpt")
    dd = dd_write(out_dir / "dd.bin", product["bytes_written"])
    emit(dd)
    product["fraction_of_disk_bw"] = product["gb_per_s"] / disk_gb_per_s
    product["fraction_of_dd"] = product["gb_per_s"] / dd["gb_per_s"]
    product["bound_gb_per_s"] = bound_gb_per_s
    product["fraction_of_bound"] = product["gb_per_s"] / bound_gb_per_s
    emit(product)
    if opts.workers_sweep:
        sweep_workers(opts, out_dir / "sweep", disk_gb_per_s)

    if opts.skip_baseline:
        return
    baseline_dir = out_dir / "naive_baseline"
    remove(baseline_dir)
    baseline = measure(
        [sys.executable, "-c", NAIVE_BASELINE, opts.flavor, opts.dtype, str(SEED), str(baseline_dir)],
        baseline_dir,
        **labels,
        impl="naive_baseline",
    )
    emit(baseline)
    emit(
        {
            **labels,
            "speedup_vs_baseline": baseline["wall_s"] / product["wall_s"],
            "rss_ratio_vs_baseline": product["peak_rss_gib"] / baseline["peak_rss_gib"],
        }
    )


def dd_write(path: Path, nbytes: int) -> dict:
    """``dd`` writing ``nbytes`` (rounded up to its 64 MiB blocks) to ``path`` and fsyncing, timed as
    ``measure`` times the seed; the file is removed after."""
    blocks = -(-nbytes // DD_BLOCK_BYTES)
    command = ["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK_BYTES}", f"count={blocks}", "conv=fsync"]
    line = measure(command, path, benchmark="dd")
    path.unlink()
    return {key: line[key] for key in ("benchmark", "wall_s", "bytes_written", "gb_per_s")}


def seed_command(opts: argparse.Namespace, output: Path, *extra: str) -> list[str]:
    # Seeding reads only [model]; any config file works once the flavor is overridden.
    return [
        sys.executable,
        "create_seed_checkpoint.py",
        "--config",
        "configs/debug.toml",
        "--model.name",
        opts.model,
        "--model.flavor",
        opts.flavor,
        "--output",
        str(output),
        "--seed",
        str(SEED),
        "--dtype",
        opts.dtype,
        "--force",
        "--quiet",
        *[arg for kv in opts.set for arg in (f"--{kv.partition('=')[0]}", kv.partition("=")[2])],
        *extra,
    ]


# One core's generator rate, as `python -c RNG_RATE`: fp32 GB/s of the recipe's normal and truncated normal.
RNG_RATE = """
import json, time, torch
from seedckpt.materialize.init_recipe import CHUNK_NUMEL, TensorInit, generate_flat
torch.set_num_threads(1)
numel, rates = 64 * CHUNK_NUMEL, {}
buffer = torch.empty(numel)
specs = {"normal": TensorInit("normal", std=0.02), "trunc_normal_3std": TensorInit("trunc_normal", std=0.02, cutoff=3)}
for name, spec in specs.items():
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        generate_flat(spec, 0, "rate", numel, 0, numel, allocate=lambda n, dtype: buffer)
        best = min(best, time.thread_time() - start)
    rates[f"{name}_gb_per_s"] = numel * 4 / best / 1e9
print(json.dumps(rates))
"""


def rng_rate() -> dict:
    """The recipe's fp32 generation rate on one core (the first usable one, pinned when taskset
    exists), in CPU time: the rate each worker draws at when it has its core to itself."""
    pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if shutil.which("taskset") else []
    out = subprocess.run(
        [*pin, sys.executable, "-c", RNG_RATE], cwd=common.ROOT, capture_output=True, text=True, check=True
    )
    return {"benchmark": "rng_rate", "cores": len(os.sched_getaffinity(0)), **json.loads(out.stdout)}


# The seconds of one process's global plan of the seed's blocks, as `python -c PLAN_TIMES MODEL FLAVOR
# WORKERS DTYPE KEY=VALUE...`: the seed's planner and DCP's own, alternated on the same local plan.
PLAN_TIMES = """
import gc, json, sys, time, torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from seedckpt.checkpoint import LazySavePlanner
from seedckpt.config.job_config import load_config
from seedckpt.materialize.seed import block_numel, blocks, meta_build
from seedckpt.utils.tensors import state_tensors
model, flavor, workers, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), getattr(torch, sys.argv[4])
sets = [arg for kv in sys.argv[5:] for arg in ("--" + kv.partition("=")[0], kv.partition("=")[2])]
cfg = load_config(None, ["--model.name", model, "--model.flavor", flavor, *sets])
args = cfg.model_args()
with meta_build(args):
    built = cfg.model_family().model(args)
state = {fqn: torch.empty(t.shape, dtype=dtype, device="meta") for fqn, t in state_tensors(built).items()}
gc.disable()  # as during the seed
planner = LazySavePlanner(None, lambda shape: blocks(shape, block_numel(workers)))
planner.set_up_planner(state, None, True)
local = planner.create_local_plan()
ways = {"seedckpt_s": planner.create_global_plan, "dcp_s": lambda p: DefaultSavePlanner.create_global_plan(planner, p)}
times = {name: [] for name in ways}
for _ in range(2):
    for name, plan in ways.items():
        start = time.perf_counter()
        plan([local])
        times[name].append(time.perf_counter() - start)
print(json.dumps({"blocks": len(local.items), **{name: min(t) for name, t in times.items()}}))
"""


def plan_times(opts: argparse.Namespace) -> dict:
    """``seed_plan``: the seed's one-pass global plan against DCP's own, in one subprocess."""
    command = [sys.executable, "-c", PLAN_TIMES, opts.model, opts.flavor, str(opts.plan_workers), opts.dtype, *opts.set]
    line = json.loads(subprocess.run(command, cwd=common.ROOT, capture_output=True, text=True, check=True).stdout)
    labels = {"model": opts.model, "flavor": opts.flavor, "dtype": opts.dtype, "workers": opts.plan_workers}
    return {"benchmark": "seed_plan", **labels, **line, "speedup_vs_dcp": line["dcp_s"] / line["seedckpt_s"]}


def seed_layers(opts: argparse.Namespace, output: Path) -> None:
    """The seed cut to each of ``--n-layers``: its peak RSS should not grow with the layers."""
    rows = []
    for layers in map(int, opts.n_layers.split(",")):
        line = measure(
            seed_command(opts, output, "--model.n_layers", str(layers)),
            output,
            benchmark="seed_layers",
            model=opts.model,
            flavor=opts.flavor,
            dtype=opts.dtype,
            n_layers=layers,
        )
        rows.append(line)
        emit(line)
        remove(output)
    emit(
        {
            "benchmark": "seed_layers",
            "model": opts.model,
            "flavor": opts.flavor,
            "n_layers": [row["n_layers"] for row in rows],
            "peak_rss_growth": rows[-1]["peak_rss_gib"] / rows[0]["peak_rss_gib"],
            "bytes_growth": rows[-1]["bytes_written"] / rows[0]["bytes_written"],
        }
    )


def sweep_workers(opts: argparse.Namespace, output: Path, disk_gb_per_s: float) -> None:
    """The seed with 1, 2, 4, ... workers, each run pinned to its first that-many usable cores."""
    if shutil.which("taskset") is None:
        emit({"benchmark": "seed_workers", "skipped": "taskset not found (util-linux)"})
        return
    cores = sorted(os.sched_getaffinity(0))
    counts = sorted({1 << k for k in range(len(cores).bit_length()) if 1 << k <= len(cores)} | {len(cores)})
    pinned = ["taskset", "-c", str(cores[0])]
    tiny = ["--model.name", "llama3", "--model.flavor", "debug", "--model.n_layers", "1", "--workers", "1"]
    startup = measure(pinned + seed_command(opts, output, *tiny), output, benchmark="seed_startup")
    emit(startup)
    remove(output)
    serial, first = startup["wall_s"], None
    for workers in counts:
        pinned = ["taskset", "-c", ",".join(map(str, cores[:workers]))]
        line = measure(
            pinned + seed_command(opts, output, "--workers", str(workers)),
            output,
            benchmark="seed_workers",
            flavor=opts.flavor,
            dtype=opts.dtype,
            workers=workers,
        )
        first = first or line["wall_s"]
        divisible = max(first - serial, 0.0)
        emit(
            {
                **line,
                "speedup_vs_1_worker": first / line["wall_s"],
                "amdahl_ceiling": (serial + divisible) / (serial + divisible / workers),
                "fraction_of_disk_bw": line["gb_per_s"] / disk_gb_per_s,
            }
        )
        remove(output)


if __name__ == "__main__":
    main()
