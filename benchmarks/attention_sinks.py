"""Benchmark the attention variants gpt-oss uses: sinks and sliding windows through SDPA; and
Gemma 2's capped scores, which SDPA cannot compute.

Forward and backward of causal attention over ``(batch, heads, seq, head_dim)`` q and GQA k/v
(gpt-oss's head_dim 64, 8 q heads per kv head), per sequence length, each variant in its own
process so that its peak memory (CUDA: max allocated; CPU: peak RSS growth) is its own:

``sdpa``         causal SDPA, no sinks, no window: the floor.
``eager_sinks``  the definition, as ``transformers``' eager gpt-oss attention computes it: explicit
                 scores, the sink as one more softmax column, K/V copied per q head.
``sdpa_sinks``   ``models.common.decoder.causal_attention`` with sinks: one SDPA call with a sink key.
``window``       ``causal_attention`` with a sliding window (``--window``, gpt-oss: 128), no sinks:
                 blocks of queries with the keys their window reaches, once the sequence is long.
``window_sinks`` the same with sinks (gpt-oss's sliding layers).
``capped``       with ``--softcap CAP``: ``causal_attention`` with the scores capped (Gemma 2: 50),
                 the scores written out.
``window_capped`` with ``--softcap CAP``: the same in a window (Gemma 2's sliding layers).

Prints one JSON line per variant and length, then one comparing each sink variant with
``eager_sinks``, ``window`` with ``sdpa`` (windowed against full attention), and each capped variant
with its uncapped one.

  python benchmarks/attention_sinks.py                                # CPU, 1 x 8 heads, 2048 and 4096
  python benchmarks/attention_sinks.py --device cuda --dtype bfloat16 --heads 64 --seq-lens 4096,8192
  python benchmarks/attention_sinks.py --softcap 50                  # and Gemma 2's capped scores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import ROOT, emit, parser, time_steps

VARIANTS = ("sdpa", "eager_sinks", "sdpa_sinks", "window", "window_sinks")
CAPPED = ("capped", "window_capped")  # with --softcap


def _eager_sinks(q, k, v, sinks, scale):
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1).to(scores.dtype)], dim=-1)
    return scores.softmax(-1)[..., :seq] @ v


def run_variant(opts) -> dict:
    import statistics

    import torch

    sys.path.insert(0, str(ROOT))
    from models.common.decoder import causal_attention

    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    gen = torch.Generator(device).manual_seed(0)
    shape = (opts.batch, opts.heads, opts.seq_len, 64)
    kv_shape = (opts.batch, opts.heads // 8, opts.seq_len, 64)
    q, k, v, sinks = (
        torch.randn(s, generator=gen, device=device, dtype=dtype, requires_grad=True)
        for s in (shape, kv_shape, kv_shape, (opts.heads,))
    )
    scale = 64**-0.5
    attend = {
        "sdpa": lambda: causal_attention(q, k, v, scale),
        "eager_sinks": lambda: _eager_sinks(q, k, v, sinks, scale),
        "sdpa_sinks": lambda: causal_attention(q, k, v, scale, None, sinks),
        "window": lambda: causal_attention(q, k, v, scale, opts.window),
        "window_sinks": lambda: causal_attention(q, k, v, scale, opts.window, sinks),
        "capped": lambda: causal_attention(q, k, v, scale, None, None, opts.softcap),
        "window_capped": lambda: causal_attention(q, k, v, scale, opts.window, None, opts.softcap),
    }[opts.variant]

    def step():
        attend().float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, _, memory, peak = time_steps(step, opts.repeats, device)
    return {
        "variant": opts.variant,
        "device": opts.device,
        "dtype": opts.dtype,
        "batch": opts.batch,
        "heads": opts.heads,
        "seq_len": opts.seq_len,
        "window": opts.window if opts.variant.startswith("window") else None,
        "fwd_bwd_s": statistics.median(times),
        memory: peak,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="q heads (a multiple of 8: 8 per kv head)")
    p.add_argument("--seq-lens", default="2048,4096")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--softcap", type=float, help="also the capped variants, the scores capped at this")
    p.add_argument("--variant", choices=VARIANTS + CAPPED, help="run one variant in this process (used by the driver)")
    p.add_argument("--seq-len", type=int, help="with --variant: the one length")
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(run_variant(opts)))
        return
    for seq_len in map(int, opts.seq_lens.split(",")):
        results = {}
        for variant in VARIANTS + (CAPPED if opts.softcap else ()):
            cmd = [sys.executable, __file__, "--variant", variant, "--seq-len", str(seq_len)]
            for name in ("device", "dtype", "batch", "heads", "window", "repeats", "softcap"):
                cmd += [f"--{name}", str(getattr(opts, name))] if getattr(opts, name) is not None else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}).stdout
            results[variant] = json.loads(out.strip().splitlines()[-1])
            emit(results[variant])
        memory = next(k for k in results["sdpa"] if k.startswith("peak_"))
        pairs = [("sdpa_sinks", "eager_sinks"), ("window_sinks", "eager_sinks"), ("window", "sdpa")]
        capped = [("capped", "sdpa"), ("window_capped", "window")] if opts.softcap else []
        for variant, base in pairs + capped:
            emit(
                {
                    "comparison": f"{variant} vs {base}",
                    "seq_len": seq_len,
                    "speedup": results[base]["fwd_bwd_s"] / results[variant]["fwd_bwd_s"],
                    f"{memory}_saved": results[base][memory] - results[variant][memory],
                }
            )


if __name__ == "__main__":
    main()
