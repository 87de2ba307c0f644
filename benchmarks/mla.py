"""Benchmark multi-head latent attention (DeepSeek-V3's) against plain multi-head attention.

One attention module of ``--flavor``'s DeepSeek-V3 shapes (default 671B: dim 7168, q through a
1536-wide latent, k/v through a 512-wide one, q/k heads of 128 + 64, v heads of 128), with
``--heads`` of its heads (the 671B has 128; a CPU run takes fewer), forward and backward on a
``--batch`` x ``--seq-len`` input. The baseline is the shared decoder's attention with the same
heads, dim and q/k head width (192), every head its own k and v projection: MLA's low-rank
projections against full ones, its narrower v and its one shared RoPE key. Each variant runs in its
own process, so its peak memory (CUDA: max allocated; CPU: peak RSS growth) is its own. Prints one
JSON line per variant (parameters, forward+backward seconds, peak memory) and one comparing them.

  python benchmarks/mla.py                                              # CPU, 16 heads, 1 x 512
  python benchmarks/mla.py --device cuda --dtype bfloat16 --heads 128 --batch 2 --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from common import ROOT, emit, module_options, time_steps

VARIANTS = ("mha", "mla")


def build(opts):
    """(the attention module, its RoPE table) of ``opts.variant``, on ``opts.device`` in ``opts.dtype``."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(ROOT))
    from models.common.decoder import Attention, DecoderOptions
    from models.common.rope import rope_frequencies, rope_table
    from models.deepseek_v3 import FLAVORS
    from models.deepseek_v3.attention import MultiHeadLatentAttention

    args = dataclasses.replace(FLAVORS[opts.flavor], n_heads=opts.heads, max_seq_len=opts.seq_len)
    if opts.variant == "mla":
        module, rotated = MultiHeadLatentAttention(args, init_std=0.02), args.qk_rope_head_dim
    else:
        head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        plain = SimpleNamespace(
            dim=args.dim, n_heads=opts.heads, n_kv_heads=opts.heads, head_dim=head_dim, norm_eps=args.norm_eps
        )
        plain.decoder_options = DecoderOptions()
        module, rotated = Attention(plain, init_std=0.02), head_dim
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    freqs, factor = rope_frequencies(rotated, args.rope_theta, args.rope_scaling)
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    return module.to(device, dtype), rope_table(freqs, factor, opts.seq_len, device), args.dim


def run_variant(opts) -> dict:
    """One variant in this process: the median forward+backward time and the peak memory."""
    import torch

    module, freqs_cis, dim = build(opts)
    device = torch.device(opts.device)
    x = torch.randn(opts.batch, opts.seq_len, dim, device=device, dtype=getattr(torch, opts.dtype), requires_grad=True)

    def step():
        module(x, freqs_cis).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, _, memory, peak = time_steps(step, opts.repeats, device)
    return {
        "variant": opts.variant,
        "flavor": opts.flavor,
        "device": opts.device,
        "dtype": opts.dtype,
        "heads": opts.heads,
        "batch": opts.batch,
        "seq_len": opts.seq_len,
        "params": sum(p.numel() for p in module.parameters()),
        "fwd_bwd_s": statistics.median(times),
        memory: peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="671B", help="DeepSeek-V3 flavor (default: 671B)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16; the 671B has 128)")
    module_options(p, VARIANTS, seq_len=512, repeats=2)
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(run_variant(opts)))
        return
    results = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant], check=True, capture_output=True, text=True
        ).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        emit(results[variant])
    mha, mla = results["mha"], results["mla"]
    memory = next(k for k in mla if k.startswith("peak_"))
    emit(
        {
            "comparison": "mla vs mha",
            "time_ratio": mla["fwd_bwd_s"] / mha["fwd_bwd_s"],
            "params_ratio": mla["params"] / mha["params"],
            "peak_ratio": mla[memory] / mha[memory] if mha[memory] else None,
        }
    )


if __name__ == "__main__":
    main()
