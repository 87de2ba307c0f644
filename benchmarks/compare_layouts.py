"""Compare training layouts on one model from one seed: one process, DDP-style replication, manual
FSDP, FSDP2 and pipeline parallel x FSDP2 -- the same global batch, so the same loss curve.

Run from the repository root:

    python benchmarks/compare_layouts.py                     # debug model, 4 ranks, 30 steps
    python benchmarks/compare_layouts.py --steps 10 --png /tmp/layouts.png
    pip install -e ".[bench]"                                 # matplotlib, for the PNG

Each layout is one ``train.py`` run (``torchrun --standalone`` for the distributed ones; CPU,
gloo, OMP_NUM_THREADS=1) of ``--config`` from the same seed checkpoint, with ``--global-batch``
rows of ``--seq-len`` tokens per step and no checkpoints written:

* ``single``: one process (``python train.py``).
* ``ddp``: every rank holds the whole model and gradients are all-reduced -- DDP's memory and
  communication. Run as FSDP2 over a (replicate = RANKS, shard = 1) mesh (``data_parallel_
  replicate_degree = RANKS``), which is what that is; the all-reduce is FSDP2's own and not in the
  collective columns.
* ``manual_fsdp``: ``parallelism.fsdp_impl = "manual"`` (``seedckpt.parallel.manual_fsdp``) over RANKS.
* ``fsdp2``: FSDP2 over RANKS (``data_parallel_shard_degree = RANKS``).
* ``pp_fsdp2``: two pipeline stages (1F1B), each FSDP2 over RANKS / 2.

Output (GB = 1e9): every run's ``metrics.jsonl`` rows, tagged with ``layout``, go to
``--out-dir/layouts.jsonl``; stdout gets one JSON line per layout (``summary``: median step time and
tokens/s over the steps after the first, the busiest rank's peak memory, median all-gather and
reduce-scatter seconds and calls per step, median data wait, final loss, and ``loss_rel_diff``:
the largest relative difference of any step's loss from ``single``'s) and then a table. With
matplotlib, ``--png`` gets the loss curves and step times.

On a machine with fewer cores than ranks (this project's CI: 2 cores, 4 ranks) the ranks share
cores: step times compare the layouts' total work and communication, not their scaling.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from common import ROOT, output_dir, parser, run_checked

LAYOUTS = {
    "single": (1, []),
    "ddp": (
        None,
        ["--parallelism.data_parallel_replicate_degree", "{ranks}", "--parallelism.data_parallel_shard_degree", "1"],
    ),
    "manual_fsdp": (None, ["--parallelism.fsdp_impl", "manual"]),
    "fsdp2": (None, []),
    "pp_fsdp2": (
        None,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatches", "2"],
    ),
}
COLUMNS = (
    "step_time_s",
    "tokens_per_s",
    "peak_mem_mib",
    "all_gather_s",
    "reduce_scatter_s",
    "all_gather_calls",
    "reduce_scatter_calls",
    "data_wait_s",
    "final_loss",
    "loss_rel_diff",
)


def run_layout(name: str, opts, seed: Path, work: Path) -> list[dict]:
    ranks, extra = LAYOUTS[name]
    ranks = ranks or opts.ranks
    pp = 2 if name == "pp_fsdp2" else 1
    dp = ranks // pp
    local = opts.global_batch // dp
    run_dir = work / name
    args = [
        "train.py",
        "--config",
        opts.config,
        "--checkpoint.seed_checkpoint",
        str(seed),
        "--checkpoint.folder",
        str(run_dir / "ckpt"),
        "--checkpoint.interval",
        "0",
        "--job.dump_folder",
        str(run_dir),
        "--training.steps",
        str(opts.steps),
        "--training.global_batch_size",
        str(opts.global_batch),
        "--training.local_batch_size",
        str(local),
        "--training.seq_len",
        str(opts.seq_len),
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--metrics.collective_timing",
        "on",  # FSDP2's too (off by default): the table compares them
        *[a.format(ranks=ranks) for a in extra],
    ]
    launcher = (
        [sys.executable]
        if ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1"}
    run_checked([*launcher, *args], f"the {name} run", env=env)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"layout": name, "ranks": ranks, **row} for row in rows]


def summarize(name: str, rows: list[dict], reference: list[dict]) -> dict:
    steady = rows[1:] or rows  # step 1 pays for allocator warm-up and first-touch
    median = {
        k: statistics.median(r.get(k, 0) for r in steady)
        for k in (
            "step_time_s",
            "tokens_per_s",
            "all_gather_s",
            "reduce_scatter_s",
            "all_gather_calls",
            "reduce_scatter_calls",
            "data_wait_s",
        )
    }
    return {
        "layout": name,
        "ranks": rows[0]["ranks"],
        "summary": True,
        **median,
        "peak_mem_mib": max(r["peak_mem_bytes"] for r in rows) / 2**20,
        "final_loss": rows[-1]["loss"],
        "loss_rel_diff": max(abs(r["loss"] - b["loss"]) / abs(b["loss"]) for r, b in zip(rows, reference)),
    }


def table(summaries: list[dict]) -> str:
    head = (
        f"{'layout':<12} {'ranks':>5} {'step ms':>8} {'tok/s':>8} {'peak MiB':>9} {'AG ms':>7} {'RS ms':>7} "
        f"{'AG/RS calls':>11} {'final loss':>10} {'vs single':>9}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        lines.append(
            f"{s['layout']:<12} {s['ranks']:>5} {1e3 * s['step_time_s']:>8.1f} {s['tokens_per_s']:>8,.0f} "
            f"{s['peak_mem_mib']:>9,.0f} {1e3 * s['all_gather_s']:>7.1f} {1e3 * s['reduce_scatter_s']:>7.1f} "
            f"{s['all_gather_calls']:>5.0f}/{s['reduce_scatter_calls']:<5.0f} {s['final_loss']:>10.4f} "
            f"{s['loss_rel_diff']:>9.1e}"
        )
    return "\n".join(lines)


def plot(rows_by_layout: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print(f"no PNG: matplotlib is not installed (pip install -e '.[bench]'); {path} not written", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, times) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in rows_by_layout.items():
        steps = [r["step"] for r in rows]
        losses.plot(steps, [r["loss"] for r in rows], label=name, linewidth=1.2)
        times.plot(steps, [1e3 * r["step_time_s"] for r in rows], label=name, linewidth=1.2)
    losses.set(xlabel="step", ylabel="loss (global-batch mean)", title="loss: the same batch, the same curve")
    times.set(xlabel="step", ylabel="step time (ms)", title="step time", yscale="log")
    losses.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(flavor="debug")
    p.add_argument("--config", default="configs/debug.toml", help="job config (default: configs/debug.toml)")
    p.add_argument("--ranks", type=int, default=4, help="ranks of the distributed layouts (even; default 4)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=16, help="rows per step, every layout (default 16)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument(
        "--png",
        default=str(ROOT / "benchmarks" / "results" / "compare_layouts.png"),
        help="where the loss / step-time plot goes (default: benchmarks/results/compare_layouts.png)",
    )
    opts = p.parse_args()
    layouts = [name for name in opts.layouts.split(",") if name]
    if not layouts or set(layouts) - set(LAYOUTS) or "single" not in layouts:
        p.error(f"--layouts takes a comma list of {', '.join(LAYOUTS)} including single; got {opts.layouts!r}")
    if opts.ranks < 2 or opts.ranks % 2 or opts.global_batch % opts.ranks:
        p.error("--ranks must be even and >= 2, and divide --global-batch")
    with output_dir(opts.out_dir, "layouts-bench-") as work:
        seed = work / "seed"
        run_checked(
            [
                sys.executable,
                "create_seed_checkpoint.py",
                "--config",
                opts.config,
                "--model.flavor",
                opts.flavor,
                "--output",
                str(seed),
                "--force",
                "--quiet",
            ],
            "seeding",
        )
        rows = {name: run_layout(name, opts, seed, work) for name in layouts}
        with open(work / "layouts.jsonl", "w") as f:
            for name in layouts:
                f.writelines(json.dumps(r) + "\n" for r in rows[name])
        summaries = [summarize(name, rows[name], rows["single"]) for name in layouts]
        for summary in summaries:
            print(json.dumps(summary), flush=True)  # unrounded: loss_rel_diff is ~1e-7
        print(table(summaries))
        if plot(rows, Path(opts.png)):
            print(f"wrote {opts.png} and {work / 'layouts.jsonl'}")


if __name__ == "__main__":
    main()
