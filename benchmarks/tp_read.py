"""Bytes read against bytes owned when a checkpoint loads into sharded layouts (tensor parallel,
FSDP2, a dim-0 slice of the experts), with checksums checked and not, beside the row-sharded
layout without TP as the baseline of the same run.

Run from the repository root:

    python benchmarks/tp_read.py                      # Llama 3.2 1B shapes (a 4.6 GB fp32 seed first)
    python benchmarks/tp_read.py --flavor debug       # a quick check of the harness
    python benchmarks/tp_read.py --flavor debug --set dim=512 --set n_layers=8 --layouts "dp4,tp2 x dp2"
    python benchmarks/tp_read.py --model qwen3_moe --flavor debug --set moe_ffn_dim=256 \\
        --layouts dp4 --sources seed,step,hf         # each rank holds 2 of the 8 experts

Each rank builds the model on ``meta``, applies the family's TP plan (and FSDP2 over the
data-parallel ranks), materializes and loads the checkpoint through ``build_stages``. Layouts on 4
ranks (pp, dp_shard, tp): ``dp4`` (1, 4, 1), ``tp2`` (1, 1, 2, each of 2 replicas), ``tp2 x dp2``
(1, 2, 2), ``pp2 x tp2`` (2, 1, 2), ``tp4`` (1, 1, 4). Sources: ``seed``; ``step``, the model
state as 2 FSDP2 shards x 2 replicas save it (``write_checkpoint``), so a ``dp4`` rank reads half
of a written shard; ``hf``, the seed converted to a Hugging Face directory (experts one tensor
each; no checksums).

Two counts of the bytes read: the reader's own counters (``OwnedReads.bytes_read`` +
``bytes_read_to_check``), and the process's ``rchar`` from ``/proc/self/io`` (every byte through
``read``/``pread``) while the stages load, each over the bytes the rank's local shards hold (a tied
matrix once); opening the checkpoint (the manifest, ``.metadata``, safetensors headers) is counted
apart (``open_rchar_kib``). One JSON line per source, layout and checksum setting: the worst rank's
ratios and the slowest rank's load seconds (opening included).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, output_dir, parser, proc_fields  # noqa: E402

LAYOUTS = {"dp4": (1, 4, 1), "tp2": (1, 1, 2), "tp2 x dp2": (1, 2, 2), "pp2 x tp2": (2, 1, 2), "tp4": (1, 1, 4)}
WORLD = 4


def model_overrides(opts) -> list[str]:
    """``--set KEY=VALUE`` options as the config's ``--model.KEY VALUE`` overrides."""
    pairs = [item.split("=", 1) for item in opts.set]
    return ["--model.name", opts.model, "--model.flavor", opts.flavor, *(f"--model.{k}={v}" for k, v in pairs)]


def _shard_fn(family, mesh, dp: int, tp: int):
    from torch.distributed.fsdp import fully_shard

    def shard(module):
        if tp > 1:
            family.tensor_parallel.apply(module, mesh["tp"], True)
        if dp > 1:
            for block in module.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])

    return shard


def _load(args, family, layout, source: str, verify: bool, counted: dict):
    """This rank's stages of ``layout`` loaded from ``source``: (bytes the reader counted, rchar of
    the load, rchar of opening the checkpoint, bytes owned, seconds of both)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local

    pp, dp, tp = layout
    mesh = init_device_mesh("cpu", (pp, WORLD // (pp * dp * tp), dp, tp), mesh_dim_names=("pp", "r", "dp", "tp"))
    specs = plan_rank_stages(args, mesh.get_local_rank("pp"), pp)
    counted["bytes"] = 0
    dist.barrier()
    before, start = proc_fields("io")["rchar"], time.perf_counter()
    checkpoint = open_model_checkpoint(source, args, complete=False, verify=verify, model=family.name)
    opened = proc_fields("io")["rchar"]
    modules = build_stages(args, specs, "cpu", checkpoint, shard_fn=_shard_fn(family, mesh, dp, tp))
    seconds, read = time.perf_counter() - start, proc_fields("io")["rchar"] - opened
    # a tied matrix is one tensor under two names: counted once, as it is read once
    shards = {local(t).data_ptr(): local(t).nbytes for m in modules for t in m.state_dict().values()}
    return modules, (counted["bytes"], read, opened - before, sum(shards.values()), seconds)


def _write_step(args, family, seed: str, step: Path) -> None:
    """The model state as 2 FSDP2 shards (x 2 replicas) save it, from a load of the seed: each
    loading rank of ``dp4`` then reads half of a written shard."""
    from seedckpt.checkpoint import make_manifest, write_checkpoint

    modules, _ = _load(args, family, (1, 2, 1), seed, False, {"bytes": 0})
    manifest = make_manifest("train", family.name, None, args.to_dict())
    write_checkpoint(step, modules[0].state_dict(), manifest, force=True)


def _rank(rank: int, init_file: str, paths: dict, overrides: list, layouts: list, results) -> None:
    import torch
    import torch.distributed as dist

    from seedckpt.checkpoint.owned_reads import OwnedReads
    from seedckpt.config.job_config import load_config

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=30)
    )
    try:
        cfg = load_config(None, overrides)
        args, family = cfg.model_args(), cfg.model_family()
        counted = {"bytes": 0}
        run = OwnedReads.run

        def counting(self, items, locate, planner):
            run(self, items, locate, planner)
            counted["bytes"] += self.bytes_read + self.bytes_read_to_check

        OwnedReads.run = counting
        for name in layouts:  # the first load of a layout imports modules (their files count in rchar)
            _load(args, family, LAYOUTS[name], paths["seed"], False, counted)
        if "step" in paths:
            _write_step(args, family, paths["seed"], Path(paths["step"]))
        for source, path in paths.items():
            for name in layouts:
                for verify in (False, True) if source != "hf" else (False,):
                    _, figures = _load(args, family, LAYOUTS[name], path, verify, counted)
                    results.put((rank, source, name, verify, *figures))
    finally:
        dist.destroy_process_group()


def _prepare(opts, out: Path, overrides: list) -> dict[str, str]:
    """The seed (and its HF copy) the ranks load, made by the command line as a user would."""
    paths = {"seed": out / "seed"}
    if not paths["seed"].exists():
        cli = [sys.executable, "-m", "seedckpt.cli.main"]
        subprocess.run(
            [*cli, "seed", "--config", "configs/debug.toml", *overrides, "--output", str(paths["seed"]), "--quiet"],
            cwd=ROOT,
            check=True,
        )
    sources = opts.sources.split(",")
    if "step" in sources:
        paths["step"] = out / "step"
    if "hf" in sources:
        paths["hf"] = out / "hf"
        subprocess.run(
            [sys.executable, "-m", "seedckpt.cli.main", "convert", str(paths["seed"]), str(paths["hf"]), "--to", "hf"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return {source: str(paths[source]) for source in ("seed", "step", "hf") if source in sources}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", default="llama3", help="model family (default: llama3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a model argument, repeatable")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    p.add_argument("--sources", default="seed", help="comma-separated, of: seed, step, hf (default: seed)")
    opts = p.parse_args()
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    overrides, layouts = model_overrides(opts), opts.layouts.split(",")
    with output_dir(opts.out_dir, "tp-read-") as out:
        paths = _prepare(opts, out, overrides)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, str(out / "rendezvous"), paths, overrides, layouts, results))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        loads = sum(len(layouts) * (1 if source == "hf" else 2) for source in paths)
        rows = [results.get(timeout=3600) for _ in range(WORLD * loads)]
        for p in procs:
            p.join()
    report(rows, opts)


def report(rows: list, opts) -> None:
    """One line per source, layout and checksum setting (rows: rank, source, layout, verify, reader
    bytes, rchar of the load, rchar of the opening, owned, seconds)."""
    for source, name, verify in dict.fromkeys(r[1:4] for r in rows):
        mine = [r for r in rows if r[1:4] == (source, name, verify)]
        line = {
            "model": opts.model,
            "flavor": opts.flavor,
            "set": opts.set,
            "source": source,
            "layout": name,
            "checksums": verify,
            "read_over_owned_worst_rank": round(max(r[4] / r[7] for r in mine), 4),
            "rchar_over_owned_worst_rank": round(max(r[5] / r[7] for r in mine), 4),
            "open_rchar_kib": round(max(r[6] for r in mine) / 2**10, 1),  # manifest, .metadata, headers
            "owned_mib_per_rank": round(max(r[7] for r in mine) / 2**20, 3),
            "load_s_slowest_rank": round(max(r[8] for r in mine), 3),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
