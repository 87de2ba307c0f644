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

``--train``: the loss inside a ``train.py`` step instead (one process, float32, no seed file:
``checkpoint.init_from = direct``): ``configs/debug.toml``'s model cut to ``--n-layers`` (2) with a
``--vocab`` (65 536) vocabulary, ``--batch`` (4) rows of ``--seq-len`` (2048) tokens,
``training.loss_chunk_tokens``'s default (-1) against 0 (the whole logits), ``--rounds`` of each in
turn (whole, default, default, whole, ...) so a machine's drifting load weighs on both. Per
variant: the median step time after each run's first step, the median of the runs' peak RSS
(``VmHWM``), the runs' CPU seconds, the first run's losses; then a line comparing the default to the
whole logits of the same call (on 2 quiet cores: 0.64x the step, 0.17x the peak RSS, the losses
within 1e-7).

  python benchmarks/loss.py                                  # CPU: 4096 tokens, dim 256, the default's chunks
  python benchmarks/loss.py --device cuda --tokens 32768 --dim 2048 --dtype bfloat16
  python benchmarks/loss.py --train                          # CPU: a train.py step, 8192 tokens, vocabulary 65 536
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, emit, output_dir, parser, time_steps

# --train's variants: training.loss_chunk_tokens of each
TRAIN_VARIANTS = {"whole_logits": 0, "default": -1}


def measure(opts) -> dict:
    """One variant in this process: median forward+backward seconds, peak memory, the loss."""
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
    p.add_argument("--train", action="store_true", help="time train.py steps with each loss (above)")
    p.add_argument("--vocab", type=int, default=65536, help="--train: the vocabulary (default 65 536)")
    p.add_argument("--n-layers", type=int, default=2, help="--train: the model's layers (default 2)")
    p.add_argument("--batch", type=int, default=4, help="--train: rows per step (default 4)")
    p.add_argument("--seq-len", type=int, default=2048, help="--train: tokens per row (default 2048)")
    p.add_argument("--steps", type=int, default=3, help="--train: steps per run, the first not timed (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="--train: runs of each variant (default 2)")
    opts = p.parse_args()
    if opts.variant:
        print(json.dumps(measure(opts)))
        return
    if opts.train:
        with output_dir(opts.out_dir, "seedckpt-loss-") as work:
            compare_train_steps(opts, work)
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


def train_run(opts, chunk: int, run_dir: Path) -> dict:
    """One ``train.py`` run (a world of one) with ``training.loss_chunk_tokens = chunk``: its
    metrics rows and its CPU seconds (the process's own user + system)."""
    cmd = [sys.executable, "train.py", "--config", "configs/debug.toml", "--checkpoint.init_from", "direct"]
    cmd += ["--checkpoint.enable", "false", "--checkpoint.folder", str(run_dir / "checkpoints")]
    cmd += ["--job.dump_folder", str(run_dir), "--metrics.log_freq", "1"]
    cmd += ["--model.vocab_size", str(opts.vocab), "--model.n_layers", str(opts.n_layers)]
    cmd += ["--model.max_seq_len", str(opts.seq_len), "--training.seq_len", str(opts.seq_len)]
    cmd += ["--training.local_batch_size", str(opts.batch), "--training.global_batch_size", "-1"]
    cmd += ["--training.steps", str(opts.steps), "--training.loss_chunk_tokens", str(chunk)]
    cmd += ["--parallelism.pipeline_parallel_degree", "1", "--data.kind", "synthetic"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr)  # stdout stays for the JSON lines
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"benchmark failed: train.py with loss_chunk_tokens {chunk} exited with status {code}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "cpu_s": usage.ru_utime + usage.ru_stime}


def compare_train_steps(opts, work: Path) -> None:
    """Each variant's ``train_run`` in turn, ``--rounds`` times (the order flips every round); one
    line per variant, then the default against the whole logits."""
    runs = {name: [] for name in TRAIN_VARIANTS}
    for round_ in range(opts.rounds):
        names = list(TRAIN_VARIANTS) if round_ % 2 == 0 else list(reversed(TRAIN_VARIANTS))
        for name in names:
            runs[name].append(train_run(opts, TRAIN_VARIANTS[name], work / f"{name}-{round_}"))
    lines = {name: train_line(opts, name, done) for name, done in runs.items()}
    for line in lines.values():
        emit(line)
    whole, default = lines["whole_logits"], lines["default"]
    losses = zip(whole["losses"], default["losses"])
    emit(
        {
            "comparison": "train.py step: default loss vs whole_logits",
            "time_ratio": default["step_time_s"] / whole["step_time_s"],
            "time_ratio_per_round": [  # each round's two runs, next to each other in time
                statistics.median(d) / statistics.median(w)
                for d, w in zip(default["step_times_s"], whole["step_times_s"])
            ],
            "peak_ratio": default["peak_rss_bytes"] / whole["peak_rss_bytes"],
            "cpu_ratio": default["cpu_s"] / whole["cpu_s"],
            "loss_rel_diff": max(abs(a - b) / abs(a) for a, b in losses),
        }
    )


def train_line(opts, name: str, runs: list[dict]) -> dict:
    per_run = [[row["step_time_s"] for row in run["rows"][1:]] for run in runs]  # the first step not timed
    return {
        "benchmark": "loss_train_step",
        "variant": name,
        "loss_chunk_tokens": TRAIN_VARIANTS[name],
        "vocab_size": opts.vocab,
        "n_layers": opts.n_layers,
        "tokens": opts.batch * opts.seq_len,
        "runs": len(runs),
        "step_time_s": statistics.median(t for run in per_run for t in run),
        "step_times_s": per_run,
        "peak_rss_bytes": statistics.median(max(row["peak_mem_bytes"] for row in run["rows"]) for run in runs),
        "cpu_s": statistics.median(run["cpu_s"] for run in runs),
        "losses": [row["loss"] for row in runs[0]["rows"]],
    }


if __name__ == "__main__":
    main()
