"""Benchmark attention over packed rows: a dense ``(seq, seq)`` document mask passed to SDPA (how the
model attended before) against one SDPA call per document (``models.common.decoder.
attend_within_documents``), which builds no mask and computes no score across documents.

One grouped-query attention of ``--heads`` q heads and ``--kv-heads`` kv heads of 64 dimensions on
one row of ``--seq-lens`` tokens packed with documents of ``--doc-len`` tokens, forward and backward.
Each (variant, length) runs in its own process, so its peak (CUDA: max allocated; CPU: peak RSS
growth) is its own; the outputs are compared too. One JSON line per run, one comparison per length.

  python benchmarks/packed_attention.py                               # CPU: 2048, 4096, 8192 tokens
  python benchmarks/packed_attention.py --device cuda --dtype bfloat16 --heads 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, emit, parser, time_steps

VARIANTS = ("dense_mask", "per_document")


def measure(opts) -> dict:
    """One variant at one length in this process: median forward+backward seconds, peak memory and a
    checksum of the output."""
    import statistics

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from models.common.decoder import attend_within_documents, document_spans

    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    seq = opts.seq_len
    g = torch.Generator(device=device).manual_seed(0)

    def tensor(heads):
        return torch.randn(1, heads, seq, 64, device=device, dtype=dtype, generator=g, requires_grad=True)

    q, k, v = tensor(opts.heads), tensor(opts.kv_heads), tensor(opts.kv_heads)
    documents = (torch.arange(seq, device=device) // opts.doc_len)[None]

    def attend():
        if opts.variant == "per_document":
            return attend_within_documents(q, k, v, document_spans(documents), None)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        mask = (documents[:, :, None] == documents[:, None, :]) & causal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)

    def step():
        out = attend()
        out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    times, out, memory, peak = time_steps(step, opts.repeats, device)
    return {
        "variant": opts.variant,
        "device": opts.device,
        "dtype": opts.dtype,
        "seq_len": seq,
        "doc_len": opts.doc_len,
        "heads": opts.heads,
        "kv_heads": opts.kv_heads,
        "fwd_bwd_s": statistics.median(times),
        memory: peak,
        "output_sum": out.float().sum().item(),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seq-lens", default="2048,4096,8192", help="row lengths, comma-separated")
    p.add_argument("--doc-len", type=int, default=512, help="tokens per packed document (default 512)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run in this process
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(measure(opts)))
        return
    shared = ["--device", opts.device, "--dtype", opts.dtype, "--doc-len", str(opts.doc_len)]
    shared += ["--heads", str(opts.heads), "--kv-heads", str(opts.kv_heads), "--repeats", str(opts.repeats)]
    for seq in map(int, opts.seq_lens.split(",")):
        runs = {}
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--variant", variant, "--seq-len", str(seq), *shared]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[variant] = json.loads(out.strip().splitlines()[-1])
            emit(runs[variant])
        dense, ours = runs["dense_mask"], runs["per_document"]
        memory = next(k for k in dense if k.startswith("peak_"))
        emit(
            {
                "comparison": "per_document vs dense_mask",
                "seq_len": seq,
                "speedup": dense["fwd_bwd_s"] / ours["fwd_bwd_s"],
                "peak_ratio": ours[memory] / max(dense[memory], 1),
                "output_rel_diff": abs(ours["output_sum"] - dense["output_sum"]) / max(abs(dense["output_sum"]), 1e-12),
            }
        )


if __name__ == "__main__":
    main()
