"""Benchmark grouped-query attention: SDPA's ``enable_gqa`` against the K/V copies it replaced.

One Llama 3 transformer block (``--flavor``'s shapes, default 1B: 32 q heads, 8 kv heads), forward
and backward on a ``--batch`` x ``--seq-len`` input. The baseline is the same block with K and V
expanded to one copy per q head (``repeat_interleave``) before SDPA, as the model did before. Each
variant runs in its own process, so its peak memory (CUDA: max allocated; CPU: peak RSS growth over
the block's weights and input) is its own. Prints one JSON line per variant and one comparing them.

  python benchmarks/attention.py                        # CPU, 1B shapes, 1 x 2048
  python benchmarks/attention.py --device cuda --batch 4 --dtype bfloat16
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import ROOT, emit, module_options, parser, time_steps

VARIANTS = ("repeat_interleave", "enable_gqa")


def run_variant(opts) -> dict:
    """One variant in this process: median forward+backward time of one block and its peak memory."""
    import statistics

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from models.common.decoder import Attention, TransformerBlock, precompute_freqs_cis
    from models.llama3.args import LLAMA3_FLAVORS

    if opts.variant == "repeat_interleave":

        def forward(self, x, freqs_cis, mask=None):  # the attention before enable_gqa
            from models.common.decoder import apply_rotary_emb

            bsz, seqlen, _ = x.shape
            q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
            k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
            v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
            q, k = apply_rotary_emb(q, freqs_cis[:seqlen]), apply_rotary_emb(k, freqs_cis[:seqlen])
            repeats = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

        Attention.forward = forward
    device = torch.device(opts.device)
    dtype = getattr(torch, opts.dtype)
    args = LLAMA3_FLAVORS[opts.flavor]
    torch.manual_seed(0)
    block = TransformerBlock(0, args).to(device=device, dtype=dtype)
    freqs_cis = precompute_freqs_cis(args, device)[: opts.seq_len]
    x = torch.randn(opts.batch, opts.seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)

    def step():
        block(x, freqs_cis).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, _, memory, peak = time_steps(step, opts.repeats, device)
    return {
        "variant": opts.variant,
        "flavor": opts.flavor,
        "device": opts.device,
        "dtype": opts.dtype,
        "batch": opts.batch,
        "seq_len": opts.seq_len,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "fwd_bwd_s": statistics.median(times),
        memory: peak,
    }


def main() -> None:
    p = parser(__doc__)
    module_options(p, VARIANTS, seq_len=2048, repeats=5)
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(run_variant(opts)))
        return
    results = {}
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--device",
            opts.device,
            "--dtype",
            opts.dtype,
            "--batch",
            str(opts.batch),
            "--seq-len",
            str(opts.seq_len),
            "--repeats",
            str(opts.repeats),
            "--flavor",
            opts.flavor,
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        emit(results[variant])
    memory = next(k for k in results["enable_gqa"] if k.startswith("peak_"))
    base, new = results["repeat_interleave"], results["enable_gqa"]
    emit(
        {
            "comparison": "enable_gqa vs repeat_interleave",
            "speedup": base["fwd_bwd_s"] / new["fwd_bwd_s"],
            f"{memory}_saved": base[memory] - new[memory],
        }
    )


if __name__ == "__main__":
    main()
