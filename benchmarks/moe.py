"""Benchmark the mixture-of-experts block (``models.common.moe.MoE``): forward + backward with the
grouped GEMM (``torch._grouped_mm``) against the per-expert loop, and against a dense SwiGLU of the
same *active* parameters (width ``top_k x ffn``: what one token computes), on the same tokens, in
the same run. Routing, sorting and the weighted sum are part of both MoE variants.

Prints one JSON line per variant (median seconds of ``--repeats`` timed steps after a warm-up,
tokens per second) and one comparing them.

  python benchmarks/moe.py                                    # CPU: 4096 tokens, dim 512, 8 experts, top 2
  python benchmarks/moe.py --device cuda --dtype bfloat16 --tokens 16384 --dim 2048 \\
      --experts 128 --top-k 8 --ffn 768                       # Qwen3-30B-A3B's layer shape
"""

from __future__ import annotations

import statistics
import sys
import time

from common import ROOT, emit, parser


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
    opts = p.parse_args()

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


if __name__ == "__main__":
    main()
