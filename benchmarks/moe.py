"""Benchmark the mixture-of-experts block (``models.common.moe.MoE``): forward + backward with the
grouped GEMM (``torch._grouped_mm``) against the per-expert loop, and against a dense SwiGLU of the
same *active* parameters (width ``top_k x ffn``: what one token computes), on the same tokens, in
the same run. Routing, sorting and the weighted sum are part of both MoE variants. Compiled
(``torch.compile(..., fullgraph=True)``, as ``training.compile`` compiles a block): the MoE layer
(``moe_compiled``) and the dense SwiGLU (``dense_same_active_compiled``); ``--no-compile`` leaves
them out. Where ``torchtitan`` (0.3.0) is importable, its own MoE layer of the same shape holding
the same weights (so routing the same tokens alike), called the same way, eager and compiled
(``torchtitan_moe``, ``torchtitan_moe_compiled``); elsewhere one line says it was skipped.

Prints one JSON line per variant (median seconds of ``--repeats`` rounds over every variant after a
warm-up round -- where the compiled variants compile -- tokens per second) and one comparing them:
``compiled_speedup_over_eager``, ``moe_compiled_vs_dense_compiled`` and, with torchtitan,
``speedup_over_torchtitan_eager`` / ``_compiled`` (its time over ours: above 1, ours is faster) and
``torchtitan_output_gap`` (the largest difference of the two layers' outputs over ours).

``--ep N``: instead, the all-to-all's share of a training step under expert parallel -- ``train.py``
on N ranks (dp_shard N x ep N, the debug ``qwen3_moe`` widened by ``--set``), its last step profiled
by torch's profiler on every rank: the time in gloo's (or nccl's) all-to-all calls, forward and
backward, against the step's span in the same trace.

``--train FLAVOR``: instead, ``train.py`` on ``qwen3_moe`` of that flavor (cut to ``--train-layers``
layers) with ``training.compile`` against the bare compiled loop over the same modules, both by
``benchmarks/throughput.py`` (its ``bare_eager`` baseline first) from a config written here; a last
line gives ``train_compiled_vs_bare_compiled`` (tokens/s over tokens/s).

  python benchmarks/moe.py                                    # CPU: 4096 tokens, dim 512, 8 experts, top 2
  python benchmarks/moe.py --device cuda --dtype bfloat16 --tokens 16384 --dim 2048 \\
      --experts 128 --top-k 8 --ffn 768                       # Qwen3-30B-A3B's layer shape
  python benchmarks/moe.py --ep 4                             # the all-to-all's share of an EP step
  python benchmarks/moe.py --train debug                      # CPU: train.py compiled vs the bare loop
  python benchmarks/moe.py --train 30B-A3B                    # GPU: two of Qwen3-30B-A3B's layers
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
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
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled variants")
    p.add_argument("--ep", type=int, default=0, help="measure the all-to-all's share of an EP step on N ranks")
    p.add_argument(
        "--set",
        default="--model.n_experts 8 --model.moe_ffn_dim 256 --model.top_k 2",
        help="model overrides of the --ep run (default: 8 experts of width 256, top 2)",
    )
    p.add_argument("--train", metavar="FLAVOR", help="train.py compiled vs the bare compiled loop, qwen3_moe FLAVOR")
    p.add_argument("--train-layers", type=int, default=2, help="the --train model's layers (default 2)")
    opts = p.parse_args()
    if opts.ep:
        return all_to_all_share(opts)
    if opts.train:
        return train_vs_bare_loop(opts)

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

    def timed(grouped, forward) -> float:
        """Seconds of one forward + backward."""
        if grouped is not None:
            moe.experts.use_grouped_mm = grouped
        h = x.clone().requires_grad_()
        start = time.perf_counter()
        forward(h).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        moe.routed.clear()
        return time.perf_counter() - start

    shape = {
        "device": opts.device,
        "dtype": opts.dtype,
        "tokens": opts.tokens,
        "dim": opts.dim,
        "experts": opts.experts,
        "top_k": opts.top_k,
        "ffn": opts.ffn,
    }
    compile_whole = (lambda fn: torch.compile(fn, fullgraph=True)) if not opts.no_compile else None
    # (name, the grouped GEMM on or off for our layer's variants (None: not ours), the forward)
    variants = [("moe_loop", False, moe), ("dense_same_active", None, dense_forward)]
    if grouped_mm_applies(x, moe.experts.w1, moe.experts.w2):
        variants.insert(0, ("moe_grouped_mm", True, moe))
        if compile_whole:
            variants.append(("moe_compiled", True, compile_whole(moe)))
    if compile_whole:
        variants.append(("dense_same_active_compiled", None, compile_whole(dense_forward)))
    titan, reason = torchtitan_layer(moe, opts)
    if titan is None:
        emit({"variant": "torchtitan_moe", **shape, "skipped": True, "reason": reason})
    else:
        with torch.no_grad():
            ours = moe(x)
            shape["torchtitan_output_gap"] = float((titan(x) - ours).abs().max() / ours.abs().max())
        variants.append(("torchtitan_moe", None, titan))
        if compile_whole:
            variants.append(("torchtitan_moe_compiled", None, compile_whole(titan)))
    for _, grouped, forward in variants:  # the warm-up round, where the compiled variants compile
        timed(grouped, forward)
    times = {name: [] for name, _, _ in variants}
    for _ in range(opts.repeats):  # round-robin: a shared machine's load drifts alike for every variant
        for name, grouped, forward in variants:
            times[name].append(timed(grouped, forward))
    results = {name: statistics.median(seconds) for name, seconds in times.items()}
    for name, seconds in results.items():
        emit({"variant": name, **shape, "fwd_bwd_s": seconds, "tokens_per_s": opts.tokens / seconds})
    emit({"comparison": "moe variants vs dense_same_active", **shape, **ratios(results)})


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    """The comparison line's figures, of the variants that ran (a time over a time)."""
    pairs = {f"{n}_vs_dense": (n, "dense_same_active") for n in seconds if n.startswith("moe")}
    pairs["grouped_mm_speedup_over_loop"] = ("moe_loop", "moe_grouped_mm")
    pairs["compiled_speedup_over_eager"] = ("moe_grouped_mm", "moe_compiled")
    pairs["moe_compiled_vs_dense_compiled"] = ("moe_compiled", "dense_same_active_compiled")
    pairs["speedup_over_torchtitan_eager"] = ("torchtitan_moe", "moe_grouped_mm")
    pairs["speedup_over_torchtitan_compiled"] = ("torchtitan_moe_compiled", "moe_compiled")
    return {key: seconds[a] / seconds[b] for key, (a, b) in pairs.items() if a in seconds and b in seconds}


def torchtitan_layer(moe, opts):
    """torchtitan 0.3.0's MoE layer (Qwen3-MoE's: softmax scores, the chosen ones renormalized, its
    default bias balancing) of ``moe``'s shape, holding ``moe``'s router and expert weights, on the
    same device and dtype; or None and why not. Its experts cast to bf16 for their grouped GEMMs
    whatever the dtype, as torchtitan's always do."""
    try:
        from torchtitan.models.common import config_utils
    except ImportError as e:  # not installed, or a dependency missing (its EP kernels import triton)
        return None, f"torchtitan is not importable here ({e}); pip install torchtitan==0.3.0 to add its rows"
    import importlib.metadata

    import torch

    router = config_utils.make_router_config(
        dim=opts.dim,
        num_experts=opts.experts,
        gate_param_init={},
        top_k=opts.top_k,
        score_func="softmax",
        route_norm=True,
    )
    experts = config_utils.make_routed_experts_config(
        dim=opts.dim,
        hidden_dim=opts.ffn,
        num_experts=opts.experts,
        top_k=opts.top_k,
        param_init={},
        comm_backend="standard",
    )
    layer = config_utils.make_moe_config(num_experts=opts.experts, router=router, routed_experts=experts).build()
    inner = layer.routed_experts.inner_experts
    pairs = [(layer.router.gate.weight, moe.router.gate.weight)]
    pairs += [(inner.w1_EFD, moe.experts.w1), (inner.w2_EDF, moe.experts.w2), (inner.w3_EFD, moe.experts.w3)]
    layer = layer.to(device=moe.experts.w1.device, dtype=moe.experts.w1.dtype)
    with torch.no_grad():
        for theirs, ours in pairs:
            theirs.copy_(ours)
    print(f"torchtitan {importlib.metadata.version('torchtitan')}: its MoE layer beside ours", file=sys.stderr)
    return layer, None


def train_vs_bare_loop(opts) -> None:
    """``benchmarks/throughput.py``'s bare_eager, bare_compiled and train_compiled on qwen3_moe
    ``opts.train`` cut to ``opts.train_layers`` layers (its JSON lines passed on), then their ratio."""
    with output_dir(opts.out_dir, "moe-train-bench-") as work:
        config = work / "qwen3_moe.toml"
        config.write_text(f'[model]\nname = "qwen3_moe"\nflavor = "{opts.train}"\nn_layers = {opts.train_layers}\n')
        cmd = [sys.executable, "benchmarks/throughput.py", "--config", str(config), "--flavor", opts.train]
        cmd += ["--variants", "bare_compiled,train_compiled", "--out-dir", str(work / "runs")]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for line in lines:
        emit(line)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark failed: benchmarks/throughput.py exited with status {proc.returncode}")
    rate = {line["variant"]: line["tokens_per_s"] for line in lines if "tokens_per_s" in line}
    emit(
        {
            "comparison": "train.py compiled vs the bare compiled loop, qwen3_moe",
            "flavor": opts.train,
            "n_layers": opts.train_layers,
            "train_compiled_vs_bare_compiled": rate["train_compiled"] / rate["bare_compiled"],
            "train_compiled_vs_bare_eager": rate["train_compiled"] / rate["bare_eager"],
        }
    )


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
