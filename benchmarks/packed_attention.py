"""Benchmark attention over packed rows, forward and backward: every kernel
``models.common.packed_attention.packed_attention`` may take, against one SDPA call per document (the
path before it) and a dense ``(seq, seq)`` document mask passed to SDPA (the path before that).

``dense_mask``          one SDPA call over whole rows with a boolean document mask.
``per_document``        one ``causal_attention`` call per document (the reference).
``batched``             the CPU's kernel: documents batched into few SDPA calls by length class.
``varlen``              CUDA, 16-bit: flash attention's ``varlen_attn`` over every row at once.
``*_sinks``             the same three with a sink logit per head (gpt-oss); ``flex_sinks`` (CUDA):
                        flex attention, compiled, under the documents' block mask.

By default the CPU runs the first three and their sinks, CUDA ``per_document`` (with sinks),
``varlen`` and ``flex_sinks``: the paths the model takes on each.

One grouped-query attention of ``--heads`` q heads and ``--kv-heads`` kv heads of 64 dimensions on
``--batch`` rows of ``--seq-lens`` tokens, packed with documents of ``--doc-len`` tokens: a length
or a range ``LO-HI`` drawn uniformly (seeded), several comma-separated (default: ~50-token chats and
a few long documents). ``--window``: a sliding window in every variant. ``Documents`` are built
once per forward in the model and shared by its layers, so outside the timed step here
(``documents_s``: its time). Each (variant, length, documents) runs in its own process, so its peak
(CUDA: max allocated; CPU: peak RSS growth) is its own; the outputs are compared with
``per_document``'s. ``--rounds``: every variant runs that many times, in turn, and each comparison
is the median of the rounds' ratios. One JSON line per variant (its median round), then one
comparison per variant.

``--compiled-model N``: instead, a model of ``--model`` (a family) and ``--flavor`` (e.g. debug)
with ``training.compile``'s blocks over N batches of ``--batch`` rows of ``--seq-lens`` tokens,
each packing other documents of ``--doc-len`` tokens, every step paired with the eager model's on
the same batch (one process): steps/s of each over the N batches (the compiled one's compiling
included; and after its first step, where only a batch of other documents compiles more), the
graphs compiled, and the compiled step against the eager one on batches already seen (the median of the pairs).

  python benchmarks/packed_attention.py                               # CPU: 4 x 2048 tokens, both cases
  python benchmarks/packed_attention.py --device cuda --dtype bfloat16 --heads 32 --kv-heads 8
  python benchmarks/packed_attention.py --compiled-model 6 --flavor debug --batch 2 --seq-lens 256 --doc-len 5-60
  python benchmarks/packed_attention.py --compiled-model 6 --model qwen3_5 --flavor debug --batch 2 --seq-lens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from common import ROOT, emit, parser, time_steps

CPU_VARIANTS = ("dense_mask", "per_document", "batched", "per_document_sinks", "batched_sinks")
# On CUDA the model takes varlen and flex: the dense mask and the CPU's batched calls measure no path
# run there, and each costs a process of ~7 s a case on the H200 (torch's import and CUDA's start).
CUDA_VARIANTS = ("per_document", "per_document_sinks", "varlen", "flex_sinks")
VARIANTS = (*CPU_VARIANTS, "varlen", "flex_sinks")


def document_ids(opts, torch, seed: int = 0):
    """(batch, seq) ids: documents of ``--doc-len`` tokens (or drawn from its range) end to end."""
    lo, _, hi = opts.doc_len.partition("-")
    lo, hi = int(lo), int(hi or lo)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(opts.batch):
        lengths, total = [], 0
        while total < opts.seq_len:
            lengths.append(min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), opts.seq_len - total))
            total += lengths[-1]
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows)


def measure(opts) -> dict:
    """One variant at one length in this process: median forward+backward seconds, peak memory and a
    checksum of the output."""
    import dataclasses
    import time

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from models.common.packed_attention import Documents, packed_attention
    from tests.test_packed_attention import per_document, spans_of

    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    seq, window = opts.seq_len, opts.window
    g = torch.Generator(device=device).manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g, requires_grad=True)

    q, k, v = tensor(opts.batch, opts.heads, seq, 64), *(tensor(opts.batch, opts.kv_heads, seq, 64) for _ in "kv")
    sinks = tensor(opts.heads) if opts.variant.endswith("_sinks") else None
    ids = document_ids(opts, torch).to(device)
    start = time.perf_counter()
    documents = Documents.of(ids, mask_windows={window} if opts.variant == "flex_sinks" else ())
    documents_s = time.perf_counter() - start
    if opts.variant.startswith("batched"):  # the CPU's kernel, also where a GPU would take another
        documents = dataclasses.replace(documents, flash=False, block_masks={})
    spans = spans_of(ids)

    def attend():
        if opts.variant == "dense_mask":
            causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
            causal = causal if window is None else causal.triu(1 - window)
            mask = (ids[:, :, None] == ids[:, None, :]) & causal
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        if opts.variant.startswith("per_document"):
            return per_document(q, k, v, spans, None, window, sinks)
        return packed_attention(q, k, v, documents, None, window, sinks)

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
        "batch": opts.batch,
        "seq_len": seq,
        "doc_len": opts.doc_len,
        "documents": int(documents.cu_seqlens.numel()) - 1,
        "window": window,
        "heads": opts.heads,
        "kv_heads": opts.kv_heads,
        "fwd_bwd_s": statistics.median(times),
        "documents_s": documents_s,
        memory: peak,
        "output_sum": out.float().sum().item(),
    }


def compare(rounds: list[dict], variant: str) -> dict:
    """``variant`` against ``per_document`` (with sinks: ``per_document_sinks``) of the same case: the
    median over the rounds of the ratio within each round (the machine's drift cancels in a pair)."""
    base_name = "per_document_sinks" if variant.endswith("_sinks") else "per_document"
    pairs = [(r[base_name], r[variant]) for r in rounds]
    memory = next(k for k in pairs[0][0] if k.startswith("peak_"))
    base, ours = pairs[0]
    return {
        "comparison": f"{variant} vs {base_name}",
        "seq_len": ours["seq_len"],
        "doc_len": ours["doc_len"],
        "rounds": len(rounds),
        "speedup": statistics.median(b["fwd_bwd_s"] / o["fwd_bwd_s"] for b, o in pairs),
        "peak_ratio": statistics.median(o[memory] / max(b[memory], 1) for b, o in pairs),
        "output_rel_diff": abs(ours["output_sum"] - base["output_sum"]) / max(abs(base["output_sum"]), 1e-12),
    }


def _with_baselines(variants: list[str]) -> list[str]:
    """``per_document`` first (and ``per_document_sinks`` where a sink variant runs), then the rest."""
    bases = ["per_document", *(["per_document_sinks"] if any(v.endswith("_sinks") for v in variants) else [])]
    return bases + [v for v in variants if v not in bases]


def compiled_model(opts) -> dict:
    """``--compiled-model``: the compiled and the eager model, paired step by step on batches of other
    documents, then again on those already seen."""
    import time

    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(ROOT))
    from models.common.decoder import Transformer
    from seedckpt.config.job_config import load_config
    from seedckpt.materialize.init_recipe import init_model
    from seedckpt.parallel.parallelize import apply_compile

    opts.seq_len = int(opts.seq_lens.split(",")[0])
    args = load_config(None, ["--model.name", opts.model, "--model.flavor", opts.flavor]).model_args()
    eager, compiled = Transformer(args), Transformer(args)
    init_model(eager, 0)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq_len), generator=torch.Generator().manual_seed(0))
    batches = [document_ids(opts, torch, seed) for seed in range(opts.compiled_model)]

    def step(model, ids) -> float:
        start = time.perf_counter()
        model(tokens, document_ids=ids, labels=tokens.roll(-1, 1)).backward()
        return time.perf_counter() - start

    first = [(step(compiled, ids), step(eager, ids)) for ids in batches]
    again = [(step(compiled, ids), step(eager, ids)) for ids in batches]
    return {
        "comparison": "compiled model vs eager, batches of other documents",
        "model": opts.model,
        "flavor": opts.flavor,
        "batch": opts.batch,
        "seq_len": opts.seq_len,
        "doc_len": opts.doc_len,
        "batches": len(batches),
        "graphs": counters["stats"]["unique_graphs"],
        "compiled_steps_per_s": len(first) / sum(c for c, _ in first),
        "compiled_after_first_steps_per_s": (len(first) - 1) / sum(c for c, _ in first[1:]),
        "eager_steps_per_s": len(first) / sum(e for _, e in first),
        "seen_speedup": statistics.median(e / c for c, e in again),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seq-lens", default="2048", help="row lengths, comma-separated (default 2048)")
    p.add_argument("--doc-len", default="20-80,300-900", help="tokens per document: N or LO-HI, comma-separated cases")
    p.add_argument("--batch", type=int, default=4, help="packed rows (default 4)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--window", type=int, help="a sliding window in every variant (default: none)")
    p.add_argument("--variants", help="comma-separated (default: every one the device runs)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per run (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every variant, in turn (default 1)")
    p.add_argument("--compiled-model", type=int, metavar="N", help="a compiled model over N batches (see above)")
    p.add_argument("--model", default="llama3", help="--compiled-model's family (default llama3)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run in this process
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(measure(opts)))
        return
    if opts.compiled_model:
        emit(compiled_model(opts))
        return
    variants = opts.variants.split(",") if opts.variants else CUDA_VARIANTS if opts.device == "cuda" else CPU_VARIANTS
    shared = ["--device", opts.device, "--dtype", opts.dtype, "--batch", str(opts.batch)]
    shared += ["--heads", str(opts.heads), "--kv-heads", str(opts.kv_heads), "--repeats", str(opts.repeats)]
    shared += ["--window", str(opts.window)] if opts.window else []
    for seq in map(int, opts.seq_lens.split(",")):
        for doc_len in opts.doc_len.split(","):
            case = ["--seq-len", str(seq), "--doc-len", doc_len, *shared]
            rounds = [{v: run_variant(v, case) for v in _with_baselines(variants)} for _ in range(opts.rounds)]
            for variant in rounds[0]:  # each variant's median round
                emit(sorted((r[variant] for r in rounds), key=lambda run: run["fwd_bwd_s"])[len(rounds) // 2])
            for variant in variants:
                if not variant.startswith("per_document"):
                    emit(compare(rounds, variant))


def run_variant(variant: str, case: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, *case]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
