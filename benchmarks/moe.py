"""Benchmark the mixture-of-experts block (``models.common.moe.MoE``): forward + backward with the
grouped GEMM (``torch._grouped_mm``) against the per-expert loop, and against a dense SwiGLU of the
same *active* parameters (width ``top_k x ffn``: what one token computes), on the same tokens, in
the same run. Routing, sorting and the weighted sum are part of both MoE variants.

Prints one JSON line per variant (median seconds of ``--repeats`` timed steps after a warm-up,
tokens per second) and one comparing them.

``--ep N``: instead, the all-to-all's share of a training step under expert parallel -- ``train.py``
on N ranks (dp_shard N x ep N, the debug ``qwen3_moe`` widened by ``--set``), its last step profiled
by torch's profiler on every rank: the time in gloo's (or nccl's) all-to-all calls, forward and
backward, against the step's span in the same trace.

  python benchmarks/moe.py                                    # CPU: 4096 tokens, dim 512, 8 experts, top 2
  python benchmarks/moe.py --device cuda --dtype bfloat16 --tokens 16384 --dim 2048 \\
      --experts 128 --top-k 8 --ffn 768                       # Qwen3-30B-A3B's layer shape
  python benchmarks/moe.py --ep 4                             # the all-to-all's share of an EP step
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, emit, output_dir, parser, run_checked

# The profiler's names for an all-to-all's own time, by backend (the collective as it runs).
ALL_TO_ALL_EVENTS = ("gloo:all_to_all", "nccl:all_to_all")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512, help="each expert's hidden width")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ep", type=int, default=0, help="measure the all-to-all's share of an EP step on N ranks")
    p.add_argument(
        "--set",
        default="--model.n_experts 8 --model.moe_ffn_dim 256 --model.top_k 2",
        help="model overrides of the --ep run (default: 8 experts of width 256, top 2)",
    )
    opts = p.parse_args()
    if opts.ep:
        return all_to_all_share(opts)

    import torch

    sys.path.insert(0, str(ROOT))
    from models.common.moe import MoE, MoEOptions, grouped_mm_applies

    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    torch.manual_seed(0)
    options = MoEOptions(n_experts=opts.experts, top_k=opts.top_k, ffn_dim=opts.ffn)
    moe = MoE(opts.dim, options, init_std=0.02).to(device=device, dtype=dtype)
    dense = torch.nn.ModuleDict(
        {
            "w1": torch.nn.Linear(opts.dim, opts.top_k * opts.ffn, bias=False),
            "w2": torch.nn.Linear(opts.top_k * opts.ffn, opts.dim, bias=False),
            "w3": torch.nn.Linear(opts.dim, opts.top_k * opts.ffn, bias=False),
        }
    ).to(device=device, dtype=dtype)
    with torch.no_grad():
        for w in [*moe.parameters(), *dense.parameters()]:
            w.normal_(0, 0.02)
    x = torch.randn(1, opts.tokens, opts.dim, device=device, dtype=dtype)

    def dense_forward(h):
        return dense["w2"](torch.nn.functional.silu(dense["w1"](h)) * dense["w3"](h))

    def timed(forward) -> list[float]:
        times = []
        for i in range(opts.repeats + 1):  # the first is a warm-up
            h = x.clone().requires_grad_()
            start = time.perf_counter()
            forward(h).float().square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
            moe.routed.clear()
        return times

    shape = {
        "device": opts.device,
        "dtype": opts.dtype,
        "tokens": opts.tokens,
        "dim": opts.dim,
        "experts": opts.experts,
        "top_k": opts.top_k,
        "ffn": opts.ffn,
    }
    results = {}
    variants = [("moe_loop", False), ("dense_same_active", None)]
    if grouped_mm_applies(x, moe.experts.w1, moe.experts.w2):
        variants.insert(0, ("moe_grouped_mm", True))
    for name, grouped in variants:
        if grouped is not None:
            moe.experts.use_grouped_mm = grouped
        seconds = statistics.median(timed(moe if grouped is not None else dense_forward))
        results[name] = seconds
        emit({"variant": name, **shape, "fwd_bwd_s": seconds, "tokens_per_s": opts.tokens / seconds})
    comparison = {"comparison": "moe variants vs dense_same_active", **shape}
    comparison.update(
        {f"{n}_vs_dense": results[n] / results["dense_same_active"] for n in results if n.startswith("moe")}
    )
    if "moe_grouped_mm" in results:
        comparison["grouped_mm_speedup_over_loop"] = results["moe_loop"] / results["moe_grouped_mm"]
    emit(comparison)


def all_to_all_share(opts) -> None:
    """``train.py`` on ``opts.ep`` ranks, dp_shard x ep both ``opts.ep``, 3 steps, the third profiled."""
    device = ["--job.device", opts.device]
    with output_dir(opts.out_dir, "moe-ep-bench-") as work:
        model = ["--config", "configs/debug.toml", "--model.name", "qwen3_moe", *opts.set.split()]
        run_checked(
            [sys.executable, "create_seed_checkpoint.py", *model, "--output", str(work / "seed"), "--quiet"], "seeding"
        )
        layout = ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.expert_parallel_degree", str(opts.ep)]
        run = ["--checkpoint.seed_checkpoint", str(work / "seed"), "--checkpoint.enable", "false"]
        run += ["--job.dump_folder", str(work / "run"), "--training.steps", "3", "--profiling.steps", "3"]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.ep}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run_checked([*launch, "train.py", *model, *layout, *run, *device], "the EP training run", env=env)
        shares = [_share(work / "run" / "traces" / f"step-3-rank{rank}.json") for rank in range(opts.ep)]
    a2a, step = [a for a, _ in shares], [s for _, s in shares]
    emit(
        {
            "measure": "ep_all_to_all_share",
            "device": opts.device,
            "ranks": opts.ep,
            "ep": opts.ep,
            "model": opts.set,
            "all_to_all_s_per_rank": [round(a, 4) for a in a2a],
            "step_s_per_rank": [round(s, 4) for s in step],
            "share_mean": statistics.mean(a / s for a, s in shares),
            "share_max": max(a / s for a, s in shares),
        }
    )


def _share(trace: Path) -> tuple[float, float]:
    """(seconds in all-to-all calls, the profiled step's span) of one rank's Chrome trace."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if "dur" in e]
    a2a = sum(e["dur"] for e in events if e.get("name") in ALL_TO_ALL_EVENTS) / 1e6
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6
    return a2a, span


if __name__ == "__main__":
    main()
