"""Bytes read against bytes owned when a seed loads into tensor-parallel layouts, with checksums
checked and not, beside the row-sharded layout without TP as the baseline of the same run.

Run from the repository root:

    python benchmarks/tp_read.py                      # Llama 3.2 1B shapes (a 4.6 GB fp32 seed first)
    python benchmarks/tp_read.py --flavor debug       # a quick check of the harness

Each rank builds the model on ``meta``, applies the family's TP plan (and FSDP2 over the
data-parallel ranks), materializes and loads the seed through ``build_stages``; the bytes come
from the reader's own counters (``OwnedReads.bytes_read`` + ``bytes_read_to_check``), the owned
bytes from the local shards. Layouts on 4 ranks (pp, dp_shard, tp): ``dp4`` (1, 4, 1), ``tp2``
(1, 1, 2, each of 2 replicas), ``tp2 x dp2`` (1, 2, 2), ``pp2 x tp2`` (2, 1, 2), ``tp4`` (1, 1, 4).
One JSON line per layout and checksum setting: the worst rank's read/owned ratio and load seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import output_dir, parser  # noqa: E402

LAYOUTS = {"dp4": (1, 4, 1), "tp2": (1, 1, 2), "tp2 x dp2": (1, 2, 2), "pp2 x tp2": (2, 1, 2), "tp4": (1, 1, 4)}


def _rank(rank: int, world: int, init_file: str, seed: str, flavor: str, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models.registry import get_family
    from seedckpt.checkpoint.owned_reads import OwnedReads
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
    )
    try:
        family = get_family("llama3")
        args = family.flavors[flavor]
        counted = {"bytes": 0}
        run = OwnedReads.run

        def counting(self, items, locate, planner):
            run(self, items, locate, planner)
            counted["bytes"] += self.bytes_read + self.bytes_read_to_check

        OwnedReads.run = counting
        for name, (pp, dp, tp) in LAYOUTS.items():
            mesh = init_device_mesh(
                "cpu", (pp, world // (pp * dp * tp), dp, tp), mesh_dim_names=("pp", "r", "dp", "tp")
            )

            def shard(module, mesh=mesh, dp=dp, tp=tp):
                if tp > 1:
                    family.tensor_parallel.apply(module, mesh["tp"], True)
                if dp > 1:
                    for block in module.layers.values():
                        fully_shard(block, mesh=mesh["dp"])
                    fully_shard(module, mesh=mesh["dp"])

            specs = plan_rank_stages(args, mesh.get_local_rank("pp"), pp)
            for verify in (False, True):
                counted["bytes"] = 0
                dist.barrier()
                start = time.perf_counter()
                modules = build_stages(args, specs, "cpu", checkpoint=seed, shard_fn=shard, verify=verify)
                seconds = time.perf_counter() - start
                # a tied matrix is one tensor under two names: counted once, as it is read once
                shards = {local(t).data_ptr(): local(t).nbytes for m in modules for t in m.state_dict().values()}
                owned = sum(shards.values())
                del modules
                results.put((rank, name, verify, counted["bytes"], owned, seconds))
    finally:
        dist.destroy_process_group()


def main() -> None:
    opts = parser(__doc__).parse_args()
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    with output_dir(opts.out_dir, "tp-read-") as out:
        seed = out / f"seed-{opts.flavor}"
        if not seed.exists():
            os.system(
                f"{sys.executable} create_seed_checkpoint.py --config configs/debug.toml "
                f"--model.flavor {opts.flavor} --output {seed} > /dev/null"
            )
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, 4, str(out / "rendezvous"), str(seed), opts.flavor, results))
            for r in range(4)
        ]
        for p in procs:
            p.start()
        rows = [results.get(timeout=3600) for _ in range(4 * len(LAYOUTS) * 2)]
        for p in procs:
            p.join()
    for name in LAYOUTS:
        for verify in (False, True):
            mine = [r for r in rows if r[1] == name and r[2] == verify]
            print(
                json.dumps(
                    {
                        "flavor": opts.flavor,
                        "layout": name,
                        "checksums": verify,
                        "read_over_owned_worst_rank": round(max(r[3] / r[4] for r in mine), 4),
                        "owned_mib_per_rank": round(max(r[4] for r in mine) / 2**20, 1),
                        "load_s_slowest_rank": round(max(r[5] for r in mine), 3),
                    }
                )
            )


if __name__ == "__main__":
    main()
