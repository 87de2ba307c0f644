"""Benchmark the loss's memory: the whole micro-batch's logits (``training.loss_chunk_tokens = 0``)
against the chunked loss, which projects and scores a chunk of tokens at a time and takes each
chunk's gradients in forward, so no logits are computed twice
(``models.common.decoder.chunked_cross_entropy``).

An output projection of ``--flavor``'s vocabulary (default 1B: 128 256) from ``--dim`` (default 256;
the chunks pay off where the micro-batch's tokens outnumber the model's width, whose weight gradient
both variants hold) on ``--tokens`` tokens, forward and backward of the summed cross-entropy in
float32. Each variant runs in its own process, so its peak (CUDA: max allocated; CPU: peak RSS
growth over the weights and inputs) is its own; the losses of the two are compared too. Prints one
JSON line per variant and one comparing them.

  python benchmarks/loss.py                                  # CPU: 4096 tokens, dim 256, the default's chunks
  python benchmarks/loss.py --device cuda --tokens 32768 --dim 2048 --dtype bfloat16
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import ROOT, emit, parser, time_steps


def measure(opts) -> dict:
    """One variant in this process: median forward+backward seconds, peak memory, the loss."""
    import statistics

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from models.common.decoder import chunked_cross_entropy
    from models.llama3.args import LLAMA3_FLAVORS
    from seedckpt.train.trainer import LOSS_CHUNK_BYTES, LOSS_CHUNK_BYTES_CUDA, loss_chunk_tokens

    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    args = LLAMA3_FLAVORS[opts.flavor]
    budget = LOSS_CHUNK_BYTES_CUDA if device.type == "cuda" else LOSS_CHUNK_BYTES
    chunk = loss_chunk_tokens(opts.chunk_tokens, args.vocab_size, opts.tokens, budget)  # -1: training's default
    torch.manual_seed(0)  # the head's init: the same weights in both processes
    g = torch.Generator(device=device).manual_seed(0)
    head = torch.nn.Linear(opts.dim, args.vocab_size, bias=False, device=device, dtype=dtype)
    h = torch.randn(opts.tokens, opts.dim, device=device, dtype=dtype, generator=g, requires_grad=True)
    labels = torch.randint(0, args.vocab_size, (opts.tokens,), device=device, generator=g)

    def loss() -> torch.Tensor:
        if chunk == 0:
            return F.cross_entropy(head(h).float(), labels, reduction="sum")
        return chunked_cross_entropy(h[None], labels[None], head, chunk, list(head.parameters()))

    def step() -> float:
        value = loss()
        value.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return value.item()

    times, value, memory, peak = time_steps(step, opts.repeats, device)
    return {
        "variant": "chunked" if chunk else "whole_logits",
        "flavor": opts.flavor,
        "device": opts.device,
        "dtype": opts.dtype,
        "tokens": opts.tokens,
        "dim": opts.dim,
        "vocab_size": args.vocab_size,
        "chunk_tokens": chunk,
        "fwd_bwd_s": statistics.median(times),
        "loss": value,
        memory: peak,
        "logits_bytes_fp32": opts.tokens * args.vocab_size * 4,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the micro-batch (default 4096)")
    p.add_argument("--dim", type=int, default=256, help="the hidden size projected (default 256)")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=-1,
        help="the chunked variant's chunk (default -1: training.loss_chunk_tokens' default, sized from the vocabulary)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variant", action="store_true", help="run one variant in this process (used by the driver)")
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(measure(opts)))
        return
    shared = ["--device", opts.device, "--dtype", opts.dtype, "--tokens", str(opts.tokens), "--dim", str(opts.dim)]
    shared += ["--repeats", str(opts.repeats), "--flavor", opts.flavor]
    results = []
    for chunk in (0, opts.chunk_tokens):
        cmd = [sys.executable, __file__, "--variant", *shared, "--chunk-tokens", str(chunk)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        emit(results[-1])
    whole, chunked = results
    memory = next(k for k in whole if k.startswith("peak_"))
    emit(
        {
            "comparison": "chunked vs whole_logits",
            "peak_ratio": chunked[memory] / whole[memory],
            "time_ratio": chunked["fwd_bwd_s"] / whole["fwd_bwd_s"],
            "loss_rel_diff": abs(chunked["loss"] - whole["loss"]) / abs(whole["loss"]),
        }
    )


if __name__ == "__main__":
    main()
