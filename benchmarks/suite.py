"""Every figure the docs cite, measured by one command: on a lent GPU within the 10 minutes one
command may run, and on the CPU machine the project is developed and tested on.

    make bench-gpu                                    # or: python benchmarks/suite.py
    python benchmarks/suite.py --parts throughput_eager,load --json /tmp/gpu.json
    make bench-check                                  # or: python benchmarks/suite.py --dry-run
    make bench                                        # or: python benchmarks/suite.py --device cpu

Each part is one benchmark script (or ``pytest -m cuda``) in its own process with its own time cap,
so one slow or failing part cannot take the others down: a part that fails or runs out of time is
recorded with its last line of output, and the suite goes on. The parts' JSON lines -- each script
measures its own baseline in the same run (stock DCP, the bare training loop, the disk's bandwidth,
torchtitan's own trainer) -- go into one file, ``benchmarks/results/gpu-<date>T<time>.json`` or
``cpu-<date>.json``, with the device, the torch and CUDA versions, the core count and the date,
rewritten after every part (a call stopped at its limit keeps what it measured), then ``finished``.
Each part's line says its status and headline figures as it ends; a table of every figure beside
its target follows, and the ratios across parts (``RATIOS``: train.py against torchtitan's trainer,
SFT against pretraining).

The GPU parts run in priority order within ``--budget-s`` (570 s; see BUDGET_S for the arithmetic):
a part starts only where its estimate fits in what is left, capped at the rest, and one that does not
fit is recorded as skipped, with why. On a machine without CUDA every GPU part prints ``skipped: no
CUDA device`` and the command exits 0. ``--dry-run`` runs each GPU part's own command on the CPU with
the part's ``tiny`` options appended (a small model, a step or two): a renamed option, a typo or a
missing module fails there, before a lent machine's minutes are spent; exit 1 if one failed.

A lent GPU machine has no network and no project venv, only its image's torch (2.11 when last seen),
transformers and safetensors: the suite runs with the Python that starts it (``make bench-gpu`` picks
the image's ``python3`` when there is no venv). The wheels the project needs beyond the image
(``crc32c``; pytest, for the ``cuda`` tests; torchtitan 0.3.0 and the dependencies the image lacks,
for ``moe_block``'s peer layer) are fetched beforehand on a machine with network by ``make
bench-gpu-prepare`` into ``.gpu-wheels/`` (git-ignored), which travels with a copy of the working
tree; ``--wheels`` installs them from there into a temporary directory first on the children's
``PYTHONPATH``. A row's own wheels, ``.gpu-wheels/<row>/`` (torchtitan 0.2.2 for
``torchtitan_peer``, whose trainer imports on torch 2.11 where 0.3.0's does not), go into a directory
of their own, first on that row's ``PYTHONPATH`` alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# A row's ratios, for its one-line summary
HEADLINE = re.compile(r"ratio|_vs_|speedup|fraction_of")
# The label of a JSON line: the first of these fields it has.
LABEL_FIELDS = ("phase", "variant", "method", "mode", "measure", "name", "kind", "comparison")


@dataclass(frozen=True)
class Part:
    name: str
    device: str  # cuda: a row of `make bench-gpu`; cpu: of `make bench`
    argv: list[str]  # after the Python interpreter
    cap_s: int  # the part's wall-clock limit
    target: str  # what the figures should show, as the docs claim it
    needs: tuple[str, ...] = ()  # modules the part imports beyond torch
    estimate_s: int = 0  # GPU rows: its expected seconds on one H100 / H200 (the budget's arithmetic)
    tiny: tuple[str, ...] = ()  # GPU rows: options appended for --dry-run (the CPU, tiny shapes, a step or two)


# The GPU rows run in one command, in this order: issue 47's priorities first (the loss and train.py
# against the bare loops eager and compiled, packed SFT against pretraining, compiled MoE against
# torchtitan's MoE layer, the save's stall against stock async_save and pinned staging, the seed
# against dd), then torchtitan's own trainer (item 7's peer: the costliest row and the least known,
# so an overrun of its estimate cannot push a priority row out), then the rest. A lent machine
# allows 10 minutes a command: the suite keeps to BUDGET_S from its start, the wheels' install
# included (the rest covers Python's start, the last row's stop and the last write).
# A row starts only where its estimate fits in what is left, and is stopped at its cap or at the
# budget's end, whichever comes first; one that does not fit is recorded as skipped, with why.
#
# Estimates: the H200 / H100 runs of 2026-11-25/26 (benchmarks/results/gpu-2026-11-2*.json) plus a
# margin. throughput.py: ~20 s of probe and 1B seed, then each variant's process (its wall_s on the
# H200: bare_eager 10 s, train_eager 12, sft 31, bare_compiled 38, train_compiled 21, hf 27, osft 39,
# the selective ones 12 and 19), bare_eager first in each part as its baseline. torchtitan_peer (not
# yet run on a GPU): torchtitan 0.2.2's two runs, ~35 s eager and ~45 s compiled (torchrun, its 1B
# init, each block's compile, 12 steps), then throughput.py on the same untied 1B (~20 s of probe
# and seed, bare_eager, train_eager, train_compiled: ~65 s); the MoE layer's three compilations ~20 s
# each. Priority rows, in seconds:
#   loss 20 + throughput_eager 85 + throughput_compiled 95 + moe_block 75 + save 60 + seed 20 = 355,
#   + torchtitan_peer 150 = 505 of the 570: 65 s are left for the rows after them, in order
#   (packed_attention 60, attention 15, load 65, osft 20, mla_attention 30, throughput_more 130,
#   cuda_tests 90, moe_train 330): after the wheels' install (2 s on the loaded 2-core box) and
#   torch's import, the estimates let packed_attention run; the rest waits for `--parts` in a
#   later call (attention first), unless rows finish early. packed_attention's 60: its H200 row of
#   2026-11-26 took 42 s for 6 processes, 7 s each; now 8 (two cases of per_document, with sinks,
#   varlen, flex_sinks) = 56 s, and flex attention's compile (the second case's from the cache).
BUDGET_S = 570
# Figures across the rows of one call, tokens/s over tokens/s: (variant, its same-call baseline)
RATIOS = {
    "train_eager_vs_bare_eager": ("train_eager", "bare_eager"),
    "train_compiled_vs_bare_compiled": ("train_compiled", "bare_compiled"),
    "sft_vs_train_eager": ("sft", "train_eager"),
    # torchtitan 0.2.2 has no tied output: its row runs train.py on the same untied 1B
    "train_eager_untied_vs_torchtitan_eager": ("train_eager_untied", "torchtitan_eager"),
    "train_compiled_untied_vs_torchtitan_compiled": ("train_compiled_untied", "torchtitan_compiled"),
}
THROUGHPUT = ["benchmarks/throughput.py", "--dtype", "bfloat16", "--steps", "12", "--warmup", "4", "--variants"]
# --dry-run: train.py's rows on the debug model, 2 x 32 tokens, float32, 2 steps
TINY_TRAINING = ("--config", "configs/debug.toml", "--flavor", "debug", "--batch", "2", "--seq-len", "32")
TINY_TRAINING += ("--dtype", "float32", "--steps", "2", "--warmup", "1")
PARTS = [
    Part(
        "loss",
        "cuda",
        ["benchmarks/loss.py", "--device", "cuda", "--tokens", "16384", "--dim", "2048", "--dtype", "bfloat16"],
        45,
        "the default loss at most 1.15x the whole logits' time at a fraction of its peak memory (1B head, 16k "
        "tokens), the same loss",
        estimate_s=20,
        tiny=("--device", "cpu", "--tokens", "256", "--dim", "64", "--dtype", "float32", "--repeats", "1"),
    ),
    Part(
        "throughput_eager",
        "cuda",
        [*THROUGHPUT, "bare_eager,train_eager,sft"],
        150,
        "train.py eager at least 0.95x the bare eager loop's tokens/s (1B, 4 x 2048, bf16); "
        "sft (rows packed with ~50-token chats) at least 0.8x train_eager's tokens/s",
        estimate_s=85,
        tiny=TINY_TRAINING,
    ),
    Part(
        "throughput_compiled",
        "cuda",
        [*THROUGHPUT, "bare_compiled,train_compiled"],
        150,
        "train.py compiled at least 0.95x the bare compiled loop's tokens/s (bare_eager again: its baseline)",
        estimate_s=95,
        tiny=TINY_TRAINING,
    ),
    Part(
        "moe_block",
        "cuda",
        [
            *["benchmarks/moe.py", "--device", "cuda", "--dtype", "bfloat16", "--tokens", "16384", "--dim", "2048"],
            *["--experts", "128", "--top-k", "8", "--ffn", "768"],
        ],
        150,  # eager in 9 s on the H200; now three compilations (ours, the dense FFN, torchtitan's)
        "Qwen3-30B-A3B's MoE layer compiled at least torchtitan 0.3.0's own layer's speed (where torchtitan "
        "imports); grouped GEMM faster than the per-expert loop, near a dense FFN of its active size",
        estimate_s=75,
        tiny=(
            *("--device", "cpu", "--dtype", "float32", "--tokens", "256", "--dim", "64", "--experts", "4"),
            *("--top-k", "2", "--ffn", "32", "--repeats", "1"),
        ),
    ),
    Part(
        "save",
        "cuda",
        ["benchmarks/save.py", "--mib", "4096", "--saves", "2", "--device", "cuda"],
        90,
        "the async save's stall no longer than stock dcp.async_save's or torchtitan's async_with_pinned_mem "
        "(4 GiB of train state on the GPU)",
        estimate_s=60,
        tiny=("--mib", "64", "--saves", "1", "--device", "cpu"),
    ),
    Part(
        "seed",
        "cuda",
        ["benchmarks/seed.py", "--skip-baseline"],
        45,
        "the 1B seed at least 0.8 of dd's write bandwidth on the machine's 16 cores, dd in the same run",
        estimate_s=20,
        tiny=("--flavor", "debug"),
    ),
    Part(
        "torchtitan_peer",
        "cuda",
        ["benchmarks/torchtitan_peer.py", "--steps", "12", "--warmup", "4"],
        240,
        "train.py at least 1.0x torchtitan 0.2.2's own trainer's tokens/s, eager and compiled, both on Llama 3.2 "
        "1B's shape untied (4 x 2048, bf16)",
        estimate_s=150,
        tiny=(
            *("--flavor", "debugmodel", "--batch", "2", "--seq-len", "64", "--dtype", "float32", "--steps", "2"),
            *("--warmup", "1"),
        ),
    ),
    Part(
        "packed_attention",
        "cuda",
        [
            *["benchmarks/packed_attention.py", "--device", "cuda", "--dtype", "bfloat16"],
            *["--heads", "32", "--kv-heads", "8"],
        ],
        120,  # not yet run on a GPU in this form: 8 processes of ~7 s (the H200's) and flex attention's compile
        "varlen_attn (and flex attention with sinks) faster than one SDPA call per document on ~50-token "
        "chats and no slower on long documents (4 x 2048 tokens), the same outputs",
        estimate_s=60,
        tiny=(
            *("--device", "cpu", "--dtype", "float32", "--heads", "4", "--kv-heads", "2", "--seq-lens", "128"),
            *("--doc-len", "32", "--variants", "dense_mask,batched", "--repeats", "1"),
        ),
    ),
    Part(
        "attention",
        "cuda",
        ["benchmarks/attention.py", "--device", "cuda", "--batch", "4", "--dtype", "bfloat16"],
        40,
        "SDPA's enable_gqa faster and smaller than the K/V copies",
        estimate_s=15,
        tiny=("--device", "cpu", "--flavor", "debug", "--batch", "1", "--dtype", "float32", "--seq-len", "64"),
    ),
    Part(
        "load",
        "cuda",
        [
            *["benchmarks/load.py", "--device", "cuda", "--ranks", "1", "--skip-cold"],
            *["--methods", "seedckpt,stock_dcp", "--repeats", "1"],  # a 3x gap: one run each fits the cap
        ],
        110,  # 63 s on the H200, 76 s on the H100
        "seedckpt at least stock dcp.load's GB/s onto the GPU (1B)",
        estimate_s=65,
        tiny=("--device", "cpu", "--flavor", "debug"),
    ),
    Part(
        "osft",
        "cuda",
        ["benchmarks/osft.py", "--flavor", "1B", "--n-layers", "2", "--measure", "device"],
        60,
        "OSFT's SVD of each 1B target shape on the GPU against the CPU's 16 cores, the same factors",
        estimate_s=20,
        tiny=("--flavor", "debug", "--measure", "svd", "--ranks", ""),
    ),
    Part(
        "mla_attention",
        "cuda",
        [
            *["benchmarks/mla.py", "--device", "cuda", "--dtype", "bfloat16", "--heads", "128"],
            *["--seq-len", "4096", "--repeats", "5"],
        ],
        90,
        "DeepSeek-V3-671B's MLA layer (128 heads, 4k tokens) against plain multi-head attention of its widths",
        estimate_s=30,
        tiny=("--device", "cpu", "--dtype", "float32", "--heads", "2", "--seq-len", "64", "--repeats", "1"),
    ),
    Part(
        "throughput_more",
        "cuda",
        [*THROUGHPUT, "hf,train_eager_selective,osft,train_compiled_selective"],
        180,
        "HF transformers' Llama beside the bare loop; selective activation checkpointing's cost, eager and "
        "compiled; OSFT's step beside SFT's",
        ("transformers",),
        estimate_s=130,
        tiny=TINY_TRAINING,
    ),
    Part(
        "cuda_tests",
        "cuda",
        ["-m", "pytest", "-q", "-m", "cuda", "--durations=20", "tests"],
        120,
        "every cuda-marked test passes",
        ("pytest",),
        estimate_s=90,
        tiny=("--collect-only",),
    ),
    Part(
        "moe_train",
        "cuda",
        ["benchmarks/moe.py", "--train", "30B-A3B"],
        540,  # not yet run on a GPU: a 1.9B seed, then three loops (two compiling) of 25 steps
        "train.py compiled on two of Qwen3-30B-A3B's layers at least 0.9x the bare compiled loop's tokens/s",
        estimate_s=330,
        tiny=("--train", "debug", "--train-layers", "1"),
    ),
    Part(
        "demo",
        "cpu",
        ["benchmarks/demo.py"],
        600,
        "make demo in 1.5-3.5 minutes; loss ~6.2 -> ~2.3 (pretraining, 100 steps), ~10 -> ~0.75 (SFT, 60), "
        "~10 -> ~2.0 (OSFT, 60) with osft_leak ~1e-6",
    ),
    Part(
        "seed",
        "cpu",
        ["benchmarks/seed.py", "--flavor", "1B"],
        400,
        "the 1B seed at the disk's write bandwidth; faster than the naive seed at a fraction of its memory",
    ),
    Part(
        "seed_8b",
        "cpu",
        ["benchmarks/seed.py", "--flavor", "8B", "--skip-baseline"],
        900,
        "the 8B seed at the disk's write bandwidth in under 1 GiB of RSS",
    ),
    Part("save", "cpu", ["benchmarks/save.py"], 300, "the async save's stall a small fraction of the sync save's"),
    Part(
        "load",
        "cpu",
        ["benchmarks/load.py", "--skip-cold", "--methods", "seedckpt,seedckpt_unverified,stock_dcp"],
        900,
        "a 1B seed into FSDP2 on 4 ranks faster than stock dcp.load, each rank reading what it owns; "
        "checking every byte a few percent",
    ),
    Part(
        "sft_start",
        "cpu",
        ["benchmarks/sft_start.py"],
        600,
        "an SFT start from an HF directory faster than rank 0 loading and broadcasting, in 1.3 x owned + 300 MiB",
    ),
    Part("convert", "cpu", ["benchmarks/convert.py"], 900, "DCP <-> HF of the 1B near cp -r's speed in bounded RSS"),
    Part("tp_read", "cpu", ["benchmarks/tp_read.py"], 900, "each tensor-parallel rank reads about what it owns"),
    Part(
        "quantized_read",
        "cpu",
        ["benchmarks/quantized_read.py"],
        900,
        "an FP8 / MXFP4 directory reads in at most 1.5x the time of the same model in bf16",
    ),
    Part(
        "osft_svd",
        "cpu",
        ["benchmarks/osft.py", "--ranks", "2", "--measure", "svd,forward"],
        1500,
        "the cost-balanced SVD split near sum / N and faster than contiguous blocks (8B block); "
        "OSFT's factorized layer beside the dense one",
    ),
    Part(
        "osft_train",
        "cpu",
        ["benchmarks/osft.py", "--flavor", "1B", "--n-layers", "2", "--measure", "train", "--seq-len", "256"],
        900,
        "OSFT's step <= 1.5x and its memory <= 1.2x SFT's on the same layout",
    ),
    Part(
        "osft_train_4_rows",
        "cpu",
        [
            *["benchmarks/osft.py", "--flavor", "1B", "--n-layers", "2", "--measure", "train", "--seq-len", "256"],
            *["--local-batch-size", "4"],
        ],
        1200,
        "OSFT's extra step time a smaller share with 4 rows a step than with one (the projection is per step)",
    ),
    Part(
        "compare_layouts",
        "cpu",
        ["benchmarks/compare_layouts.py"],
        900,
        "every layout the same loss curve (within 1e-6 relative)",
    ),
    Part(
        "throughput_ablation",
        "cpu",
        [
            "benchmarks/throughput.py",
            "--variants",
            "bare_eager,train_eager",
            "--ablation",
            "--batch",
            "2",
            "--seq-len",
            "64",
            "--steps",
            "40",
            "--warmup",
            "5",
        ],
        900,
        "where train.py's eager step time goes beside the bare loop's, rung by rung",
    ),
    Part(
        "throughput_compile",
        "cpu",
        ["benchmarks/throughput.py", "--variants", "bare_eager,train_eager,train_compiled"],
        900,
        "train.py compiled: its first step compiles in seconds per rank, its later steps near eager's",
    ),
    Part(
        "init_rates",
        "cpu",
        ["benchmarks/init_rates.py"],
        300,
        "the recipe's normal ~200 M elements/s a core; its truncated normal several times torch's trunc_normal_",
    ),
    Part(
        "checksums",
        "cpu",
        ["benchmarks/checksums.py"],
        300,
        "CRC32C at several GB/s on one core, a few times zlib.crc32; verify checks a 1B seed at GB/s",
    ),
    Part(
        "tokenize",
        "cpu",
        ["benchmarks/tokenizing.py"],
        1200,  # 7.5 and 12.5 min on the 2-core machine while others ran (32 MiB, 2 repeats)
        "seedckpt tokenize at least 0.8x tokenizers' own encode_batch's MB/s on the same text and cores "
        "(start-up apart)",
    ),
    Part(
        "mla_attention",
        "cpu",
        ["benchmarks/mla.py"],
        300,
        "MLA of the 671B's widths (16 heads, 512 tokens) against plain multi-head attention: time, params, peak",
    ),
    Part(
        "moe_ep_share",
        "cpu",
        ["benchmarks/moe.py", "--ep", "4"],
        300,
        "the all-to-all's share of a dp_shard 4 x ep 4 step (gloo, profiled), the same trace's span",
    ),
    Part(
        "moe_block",
        "cpu",
        ["benchmarks/moe.py"],
        300,
        "the MoE block's grouped GEMM at least the loop's speed; its cost against a dense FFN of its active size, "
        "eager and compiled",
    ),
    Part(
        "moe_train",
        "cpu",
        ["benchmarks/moe.py", "--train", "debug"],
        600,
        "train.py compiled on the debug Qwen3-MoE near the bare compiled loop's tokens/s",
    ),
    Part(
        "plan_405b",
        "cpu",
        [
            *["-m", "seedckpt.cli.main", "plan", "--config", "configs/llama3_70b.toml", "--model.flavor", "405B"],
            *["--parallelism.pipeline_parallel_degree", "16", "--world-size", "1024", "--json"],
        ],
        120,
        "the 405B plan in seconds, computed on meta (the part's seconds)",
    ),
    Part(
        "loss",
        "cpu",
        ["benchmarks/loss.py"],
        300,
        "the chunked loss's peak a fraction of the whole logits', the same loss",
    ),
    Part(
        "loss_train",
        "cpu",
        ["benchmarks/loss.py", "--train"],
        900,  # four train.py runs of 3 steps: 8 minutes on 2 busy cores
        "the default loss's train.py step at most 1.15x the whole logits' at 0.5x its peak RSS or less "
        "(2 layers, vocabulary 65 536, 8192 tokens), the same losses",
    ),
    Part(
        "packed_attention",
        "cpu",
        ["benchmarks/packed_attention.py"],
        300,
        "documents batched into few SDPA calls faster than one call per document on ~50-token chats and "
        "as fast on long documents; the dense document mask slower than both",
    ),
    Part(
        "attention_sinks",
        "cpu",
        ["benchmarks/attention_sinks.py"],
        300,
        "sinks through one SDPA call faster than the eager softmax with a sink column; a window no slower",
    ),
    Part(
        "sft_batches",
        "cpu",
        ["benchmarks/sft_batches.py"],
        300,
        "batches by token budget: less padding, more label tokens per second than fixed-count batches",
    ),
    Part(
        "data_rss",
        "cpu",
        ["benchmarks/data_rss.py"],
        900,
        "a rank's peak RSS flat in a text corpus's size; ~115 bytes a conversation for chat",
    ),
]


@dataclass
class Result:
    name: str
    status: str  # ok, failed, timed out, skipped: <why>
    seconds: float = 0.0
    lines: list[dict] = field(default_factory=list)  # the part's JSON lines
    last_line: str = ""  # of its output, when it did not succeed


def run_part(
    part: Part, env: dict, python: str, log: Path | None = None, cap_s: int | None = None, extra: tuple = ()
) -> Result:
    """Run one part within its cap (``cap_s``, default the part's own), ``extra`` after its options;
    its JSON lines, or why it did not succeed. ``log``: where its whole output is kept (a failure's
    cause is rarely in its last line)."""
    cap_s = part.cap_s if cap_s is None else cap_s
    missing = [m for m in part.needs if importlib.util.find_spec(m) is None and not _on_path(m, env)]
    if missing:
        return Result(part.name, f"skipped: {', '.join(missing)} not installed")
    start = time.perf_counter()
    # Its own TMPDIR, removed after it: a part stopped at its cap cannot clean up its own temporary
    # checkpoints, and they would fill the disk under the next part.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryDirectory(prefix=f"bench-{part.name}-") as tmp:
        # Its own session: a part over its cap is stopped with every process it started (torchrun
        # workers included), so none holds the GPU while the next part runs.
        proc = subprocess.Popen(
            [python, *part.argv, *extra],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1", "TMPDIR": tmp},  # stdout and stderr in the order written
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=cap_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            # SIGTERM first: a torchrun agent passes it to its workers, which run in sessions of their own
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {cap_s} s"
        out.seek(0)
        text = out.read()
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    lines, other = [], []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        (lines if isinstance(record, dict) else other).append(record if isinstance(record, dict) else line)
    last = next((line for line in reversed(other) if line.strip()), "")
    if status == "ok" and lines and all(line.get("skipped") for line in lines):
        status = f"skipped: {lines[0].get('reason', 'the script measured nothing here')}"
    return Result(part.name, status, time.perf_counter() - start, lines, "" if status == "ok" else last)


def _on_path(module: str, env: dict) -> bool:
    return any((Path(p) / module).exists() for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)


def install_wheels(wheels: Path, env: dict, python: str, target: Path, fill_gaps: bool = True) -> str:
    """``wheels/*.whl`` installed (no index, no dependencies) into ``target`` (a temporary directory,
    its caller's to remove: see ``wheel_site``) put first on the children's ``PYTHONPATH``; a line
    saying what was done. ``fill_gaps``: a wheel of a project
    ``python`` already has is left out, so the GPU image's own pytest (its plugins loaded by its
    version), packaging and pygments are not shadowed by the carried ones, which are for an image
    without them. Where pip refuses the lot (a wheel of another Python, two versions of one), each
    is installed alone and the refused are named: the rows that need none of them still run."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"no wheels in {wheels} (make bench-gpu-prepare fetches them): using what is installed"
    kept = installed(python, [project(f) for f in files], env) if fill_gaps else set()
    files = [f for f in files if project(f) not in kept]
    said = f"; kept the installed {', '.join(sorted(kept))}" if kept else ""
    if not files:
        return f"every wheel in {wheels} is installed already{said}"
    pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target)]
    refused = []
    if subprocess.run([*pip, *map(str, files)], capture_output=True).returncode != 0:
        refused = [f.name for f in files if subprocess.run([*pip, str(f)], capture_output=True).returncode != 0]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
    names = ", ".join(project(f) for f in files if f.name not in refused)
    said = f"installed {names} from {wheels} into {target}{said}"
    return said + (f"; pip refused {', '.join(refused)}" if refused else "")


def project(wheel: Path) -> str:
    """The project a wheel's file name holds, as it names it (``docstring_parser-0.18.0-...``)."""
    return wheel.name.split("-")[0]


def installed(python: str, projects: list[str], env: dict) -> set[str]:
    """Those of ``projects`` that ``python`` has under ``env`` (its site-packages and ``PYTHONPATH``)."""
    code = (
        "import importlib.metadata as m, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n        m.distribution(name)\n        print(name)\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    out = subprocess.run([python, "-c", code, *projects], env=env, capture_output=True, text=True).stdout
    return set(out.split())


def wheel_site():
    """A temporary directory for ``install_wheels``, removed when its ``with`` block ends, however it
    ends: each call's and each row's install (torchtitan and its dependencies, a few MB) would
    otherwise stay in /tmp."""
    return tempfile.TemporaryDirectory(prefix="seedckpt-gpu-site-")


@contextlib.contextmanager
def row_env(part: Part, env: dict, wheels: Path | None):
    """``env`` for ``part``: with its own wheels (``wheels/<part name>/``, a version the other rows
    must not see) installed and first on its ``PYTHONPATH``, the line saying so printed; their
    directory removed when the row ends."""
    own = None if wheels is None else wheels / part.name
    if own is None or not own.is_dir():
        yield env
        return
    env = dict(env)
    with wheel_site() as site:
        # its own version, installed whatever else is
        print(f"{part.name}: {install_wheels(own, env, sys.executable, Path(site), fill_gaps=False)}", flush=True)
        yield env


def label(line: dict) -> str:
    return next((str(line[f]) for f in LABEL_FIELDS if isinstance(line.get(f), str)), "-")


def figures(line: dict, limit: int = 4) -> str:
    """A line's numbers, ``key=value``, at most ``limit`` of them."""
    numbers = [(k, v) for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return "  ".join(f"{k}={v:.4g}" for k, v in numbers[:limit])


def table(report: dict) -> str:
    """Every part's status and every figure beside the part's target."""
    cuda = f" | CUDA {report['cuda']}" if report.get("cuda") else ""
    rows = [f"{report['device']} | torch {report['torch']}{cuda} | {report['cores']} cores | {report['date']}"]
    for part in report["parts"]:
        rows.append(f"\n{part['name']}: {part['status']} ({part['seconds']:.0f} s) -- target: {part['target']}")
        if part["last_line"]:
            rows.append(f"  last line: {part['last_line'][-200:]}")
        rows += [f"  {label(line):<28} {figures(line)}" for line in part["lines"]]
    if report.get("ratios"):
        rows.append("\nacross rows: " + "  ".join(f"{k}={v:.3g}" for k, v in report["ratios"].items()))
    return "\n".join(rows)


def write_report(report: dict, path: Path) -> Path:
    """``report`` as JSON at ``path``, written to a temporary name and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(partial, path)
    return path


def device_report(torch, device: str) -> dict:
    cuda = device == "cuda" and torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else cpu_name() if device == "cpu" else "no CUDA device",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_name() -> str:
    """The processor's model name, as /proc/cpuinfo gives it (``platform.processor()`` is often empty)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    return f"cpu: {platform.machine()}"


def headline(lines: list[dict], most: int = 10) -> str:
    """A row's figures in one line, at most ``most``: every ratio its lines give (``*ratio*``,
    ``*_vs_*``, ``*speedup*``, ``fraction_of*``), then each variant's ``vs_baseline`` (or tokens/s);
    else its last line's numbers."""
    found, variants = [], []
    for line in lines:
        numbers = {k: v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        found += [f"{k}={v:.3g}" for k, v in numbers.items() if HEADLINE.search(k)]
        if "variant" in line and "vs_baseline" in numbers:
            variants.append(f"{line['variant']} {numbers['vs_baseline']:.3g}x")
        elif "variant" in line and "tokens_per_s" in numbers:
            variants.append(f"{line['variant']} {numbers['tokens_per_s']:.4g} tokens/s")
    found += variants
    return ", ".join(found[:most]) if found else figures(lines[-1]) if lines else ""


def ratios(report: dict) -> dict[str, float]:
    """RATIOS of the variants measured so far in this call (each variant's first tokens/s)."""
    rate: dict[str, float] = {}
    for part in report["parts"]:
        for line in part["lines"]:
            if isinstance(line.get("tokens_per_s"), (int, float)) and "variant" in line:
                rate.setdefault(line["variant"], line["tokens_per_s"])
    return {name: rate[a] / rate[b] for name, (a, b) in RATIOS.items() if a in rate and b in rate}


def cap_within(part: Part, left_s: float, budget_s: int) -> tuple[int | None, str]:
    """The cap ``part`` runs under with ``left_s`` of the call's budget left, or None and why it is
    skipped (its estimate does not fit)."""
    if part.estimate_s > left_s:
        return None, f"skipped: needs ~{part.estimate_s} s, {max(0.0, left_s):.0f} s left of the {budget_s} s budget"
    return min(part.cap_s, int(left_s)), ""


def select(p: argparse.ArgumentParser, opts) -> list[Part]:
    """The parts of ``opts.device`` that ``opts.parts`` names (default: all of them), in PARTS' order."""
    mine = [part for part in PARTS if part.device == opts.device]
    if not opts.parts:
        return mine
    wanted = opts.parts.split(",")
    unknown = sorted(set(wanted) - {part.name for part in mine})
    if unknown:
        p.error(f"unknown {opts.device} parts {unknown}; choose from {', '.join(part.name for part in mine)}")
    return [part for part in mine if part.name in wanted]


def dry_run(parts: list[Part], env: dict, logs: str | None, wheels: Path | None = None) -> int:
    """Each GPU row's command with its ``tiny`` options on the CPU: a typo, a renamed option or a
    missing module fails here, not on the lent machine. Exit 1 if one failed."""
    env = {**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    failed = 0
    for part in parts:
        log = Path(logs) / f"{part.name}.log" if logs else None
        with row_env(part, env, wheels) as part_env:
            result = run_part(part, part_env, sys.executable, log, 300, part.tiny)
        failed += result.status.startswith(("failed", "timed out"))
        print(f"{part.name}: {result.status} in {result.seconds:.0f} s {result.last_line[-200:]}".rstrip(), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="which figures (default: cuda)")
    p.add_argument("--parts", help="comma list of parts (default: all of the device's)")
    p.add_argument("--wheels", help="wheels to install first (default .gpu-wheels on a GPU; none in --dry-run)")
    p.add_argument("--json", help="where the results go (default: benchmarks/results/<gpu|cpu>-<date>.json)")
    p.add_argument("--logs", help="a folder for each part's whole output, <part>.log (default: not kept)")
    p.add_argument("--budget-s", type=int, default=BUDGET_S, help=f"the GPU call's seconds (default {BUDGET_S})")
    p.add_argument("--dry-run", action="store_true", help="each GPU row's set-up on the CPU, tiny, one step or two")
    opts = p.parse_args(argv)
    if opts.dry_run and opts.device != "cuda":
        p.error("--dry-run checks the GPU rows: leave out --device cpu")
    parts = select(p, opts)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with wheel_site() as site:
        return run_suite(opts, parts, env, Path(site), started)


def run_suite(opts, parts: list[Part], env: dict, site: Path, started: float) -> int:
    """``main``'s parts run (or dry-run), the call's wheels installed into ``site``; the exit status."""
    import torch

    if opts.dry_run:
        if opts.wheels:
            print(install_wheels(Path(opts.wheels), env, sys.executable, site), flush=True)
        return dry_run(parts, env, opts.logs, Path(opts.wheels) if opts.wheels else None)
    if opts.device == "cuda" and not torch.cuda.is_available():
        for part in parts:
            print(f"{part.name}: skipped: no CUDA device (would measure: {part.target})")
        return 0
    report = {**device_report(torch, opts.device), "parts": []}
    prefix = "gpu" if opts.device == "cuda" else "cpu"
    # GPU files to the minute: two calls of a day keep both
    stamp = report["date"][:16].replace(":", "") if opts.device == "cuda" else report["date"][:10]
    path = Path(opts.json) if opts.json else RESULTS / f"{prefix}-{stamp}.json"
    budget = opts.budget_s if opts.device == "cuda" else None  # the CPU suite has no lender's limit
    if opts.device == "cuda":
        report["budget_s"] = budget
        print(install_wheels(Path(opts.wheels or ROOT / ".gpu-wheels"), env, sys.executable, site), flush=True)
    deadline = None if budget is None else (budget, started + budget)
    for part in parts:
        run_one(part, report, env, opts, deadline)
        write_report(report, path)  # after every row: a call stopped at its limit keeps what it measured
    report["finished"] = True
    write_report(report, path)
    print(table(report))
    print(f"\nwrote {path}")
    return 0


def run_one(part: Part, report: dict, env: dict, opts, budget: tuple[int, float] | None) -> None:
    """Run ``part`` within what is left of ``budget`` (seconds, the monotonic deadline) and add its
    result to ``report``, with the call's RATIOS so far; one line says what it measured."""
    cap, why = (part.cap_s, "") if budget is None else cap_within(part, budget[1] - time.monotonic(), budget[0])
    if cap is None:
        result = Result(part.name, why)
    else:
        print(f"{part.name}: running (cap {cap} s)", flush=True)
        wheels = Path(opts.wheels or ROOT / ".gpu-wheels") if part.device == "cuda" else None
        log = Path(opts.logs) / f"{part.name}.log" if opts.logs else None
        with row_env(part, env, wheels) as part_env:
            result = run_part(part, part_env, sys.executable, log, cap)
    report["parts"].append({**result.__dict__, "target": part.target})
    report["ratios"] = ratios(report)
    print(f"{part.name}: {result.status} in {result.seconds:.0f} s -- {headline(result.lines)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
