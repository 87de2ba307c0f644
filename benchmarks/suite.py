"""Every figure the docs cite, measured by one command: on a lent GPU within the minutes it allows,
and on the CPU machine the project is developed and tested on.

    make bench-gpu                                    # or: python benchmarks/suite.py
    python benchmarks/suite.py --parts throughput_eager,load --json /tmp/gpu.json
    make bench                                        # or: python benchmarks/suite.py --device cpu

Each part is one benchmark script (or ``pytest -m cuda``) in its own process with its own time cap,
so one slow or failing part cannot take the others down: a part that fails or runs out of time is
recorded with its last line of output, and the suite goes on. The parts' JSON lines -- each script
measures its own baseline in the same run (stock DCP, the bare training loop, the disk's bandwidth)
-- go into one file, ``benchmarks/results/<gpu|cpu>-<date>.json``, with the device, the torch and
CUDA versions, the core count and the date; a table of every figure beside its target follows.

On a machine without CUDA every GPU part prints ``skipped: no CUDA device`` and the command exits 0.

A lent GPU machine has no network and no project venv, only its image's torch: the suite runs with
the Python that starts it (``make bench-gpu`` picks the image's ``python3`` when there is no venv).
The one wheel the project needs beyond the image (``crc32c``) -- and pytest, for the ``cuda`` tests --
are fetched beforehand on a machine with network by ``make bench-gpu-prepare`` into ``.gpu-wheels/``
(git-ignored), which travels with a copy of the working tree; ``--wheels`` installs them from there
into a temporary directory on the children's ``PYTHONPATH`` when they are not importable already.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The label of a JSON line: the first of these fields it has.
LABEL_FIELDS = ("phase", "variant", "method", "mode", "measure", "name", "kind", "comparison")


@dataclass(frozen=True)
class Part:
    name: str
    group: str  # GROUPS: the parts run together (on a lent GPU, in one command)
    argv: list[str]  # after the Python interpreter
    cap_s: int  # the part's wall-clock limit
    target: str  # what the figures should show, as the docs claim it
    needs: tuple[str, ...] = ()  # modules the part imports beyond torch


# A lent machine allows 10 minutes per command, and every GPU part together took about 11 on one H100
# (docs/benchmarks.md): so the GPU parts are split into groups (training, io, moe, moe_train), each
# under 9 minutes of caps (tests/test_suite.py checks), one command each. The caps are the H100
# runs' times plus a margin. throughput.py measures its baseline, the bare eager loop, first in each
# of its two parts. The CPU group has no such limit: its
# caps are a 2-core machine's times with room for a disk several times slower.
GROUPS = {"training": "cuda", "io": "cuda", "moe": "cuda", "moe_train": "cuda", "cpu": "cpu"}  # each group's device
THROUGHPUT = ["benchmarks/throughput.py", "--dtype", "bfloat16", "--steps", "12", "--warmup", "4", "--variants"]
PARTS = [
    Part(
        "cuda_tests",
        "training",
        ["-m", "pytest", "-q", "-m", "cuda", "--durations=20", "tests"],
        120,
        "every cuda-marked test passes",
        ("pytest",),
    ),
    Part(
        "throughput_eager",
        "training",
        [*THROUGHPUT, "bare_eager,hf,train_eager,train_eager_selective,sft,osft"],
        230,  # the first five took 145 s on the H100 (gpu-2026-11-25.json), OSFT's SVDs and steps ~60 s
        "train.py eager within 10 % of the bare eager loop's tokens/s (1B, 4 x 2048, bf16); HF beside it; MFU; "
        "sft (rows packed with ~50-token chats: varlen_attn) at least 0.8x train_eager's tokens/s",
        ("transformers",),
    ),
    Part(
        "throughput_compiled",
        "training",
        [*THROUGHPUT, "bare_compiled,train_compiled,train_compiled_selective"],
        190,
        "train.py compiled within 10 % of the bare compiled loop's tokens/s; MFU",
    ),
    Part(
        "save",
        "io",
        ["benchmarks/save.py", "--mib", "4096", "--saves", "2", "--device", "cuda"],
        80,
        "the async stall a small fraction of the sync save, and no larger than stock dcp.async_save's "
        "(4 GiB of train state on the GPU)",
    ),
    Part(
        "load",
        "io",
        [
            *["benchmarks/load.py", "--device", "cuda", "--ranks", "1", "--skip-cold"],
            *["--methods", "seedckpt,stock_dcp", "--repeats", "1"],  # a 3x gap: one run each fits the cap
        ],
        125,  # 76 s measured on the H100 before load.py's warm-up job (~15 s more)
        "seedckpt at least stock dcp.load's GB/s onto the GPU (1B)",
    ),
    Part("seed", "io", ["benchmarks/seed.py", "--skip-baseline"], 45, "the 1B seed near the disk's write bandwidth"),
    Part(
        "osft",
        "io",
        ["benchmarks/osft.py", "--flavor", "1B", "--n-layers", "2", "--measure", "device"],
        60,
        "OSFT's SVD of each 1B target shape on the GPU against the CPU's 16 cores, the same factors",
    ),
    Part(
        "loss",
        "io",
        ["benchmarks/loss.py", "--device", "cuda", "--tokens", "16384", "--dim", "2048", "--dtype", "bfloat16"],
        40,
        "the chunked loss's peak memory a fraction of the whole logits' (1B head, 16k tokens), the same loss",
    ),
    Part(
        "packed_attention",
        "io",
        [
            "benchmarks/packed_attention.py",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--variants",
            "dense_mask,batched,varlen,flex_sinks",
        ],
        120,  # not yet run on a GPU: 12 processes of ~6 s and flex attention's compile
        "varlen_attn (and flex attention with sinks) faster than one SDPA call per document on ~50-token "
        "chats and no slower on long documents (4 x 2048 tokens), the same outputs",
    ),
    Part(
        "attention",
        "io",
        ["benchmarks/attention.py", "--device", "cuda", "--batch", "4", "--dtype", "bfloat16"],
        40,
        "SDPA's enable_gqa faster and smaller than the K/V copies",
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
        "moe_block",
        "moe",
        [
            *["benchmarks/moe.py", "--device", "cuda", "--dtype", "bfloat16", "--tokens", "16384", "--dim", "2048"],
            *["--experts", "128", "--top-k", "8", "--ffn", "768"],
        ],
        240,  # not yet run on a GPU: the eager rows, then three compilations (ours, dense, torchtitan's)
        "Qwen3-30B-A3B's MoE layer: grouped GEMM faster than the per-expert loop, near a dense FFN of its active "
        "size; compiled at least torchtitan 0.3.0's own layer's speed (where torchtitan is installed)",
    ),
    Part(
        "moe_train",
        "moe_train",
        ["benchmarks/moe.py", "--train", "30B-A3B"],
        540,  # not yet run on a GPU: a 1.9B seed, then three loops (two compiling) of 25 steps
        "train.py compiled on two of Qwen3-30B-A3B's layers at least 0.9x the bare compiled loop's tokens/s",
    ),
    Part(
        "mla_attention",
        "moe",
        [
            *["benchmarks/mla.py", "--device", "cuda", "--dtype", "bfloat16", "--heads", "128"],
            *["--seq-len", "4096", "--repeats", "5"],
        ],
        90,
        "DeepSeek-V3-671B's MLA layer (128 heads, 4k tokens) against plain multi-head attention of its widths",
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


def run_part(part: Part, env: dict, python: str, log: Path | None = None) -> Result:
    """Run one part within its cap; its JSON lines, or why it did not succeed. ``log``: where its whole
    output is kept (a failure's cause is rarely in its last line)."""
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
            [python, *part.argv],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1", "TMPDIR": tmp},  # stdout and stderr in the order written
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=part.cap_s)
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
            status = f"timed out after {part.cap_s} s"
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
    return Result(part.name, status, time.perf_counter() - start, lines, "" if status == "ok" else last)


def _on_path(module: str, env: dict) -> bool:
    return any((Path(p) / module).exists() for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)


def install_wheels(wheels: Path, env: dict, python: str) -> str:
    """``wheels/*.whl`` installed (no index, no dependencies) into a temporary directory put first on
    the children's ``PYTHONPATH``; a line saying what was done."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"no wheels in {wheels} (make bench-gpu-prepare fetches them): using what is installed"
    target = Path(tempfile.mkdtemp(prefix="seedckpt-gpu-site-"))
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), *map(str, files)],
        check=True,
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
    return f"installed {', '.join(f.name.split('-')[0] for f in files)} from {wheels} into {target}"


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="which figures (default: cuda)")
    p.add_argument("--group", choices=(*GROUPS, "all"), default="all", help="the parts of one group (default: all)")
    p.add_argument("--parts", help="comma list of parts (default: those of --group)")
    p.add_argument("--wheels", default=str(ROOT / ".gpu-wheels"), help="wheels to install first (default .gpu-wheels)")
    p.add_argument("--json", help="where the results go (default: benchmarks/results/<gpu|cpu>-<date>.json)")
    p.add_argument("--logs", help="a folder for each part's whole output, <part>.log (default: not kept)")
    opts = p.parse_args(argv)
    if opts.group != "all" and GROUPS[opts.group] != opts.device:
        p.error(f"--group {opts.group} measures {GROUPS[opts.group]}: add --device {GROUPS[opts.group]}")
    mine = [part for part in PARTS if GROUPS[part.group] == opts.device]
    wanted = opts.parts.split(",") if opts.parts else [p.name for p in mine if opts.group in ("all", p.group)]
    unknown = sorted(set(wanted) - {part.name for part in mine})
    if unknown:
        p.error(f"unknown {opts.device} parts {unknown}; choose from {', '.join(part.name for part in mine)}")
    parts = [part for part in mine if part.name in wanted]
    import torch

    report = {**device_report(torch, opts.device), "parts": []}
    if opts.device == "cuda" and not torch.cuda.is_available():
        for part in parts:
            print(f"{part.name}: skipped: no CUDA device (would measure: {part.target})")
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if opts.device == "cuda":
        print(install_wheels(Path(opts.wheels), env, sys.executable), flush=True)
    for part in parts:
        print(f"{part.name}: running (cap {part.cap_s} s)", flush=True)
        result = run_part(part, env, sys.executable, Path(opts.logs) / f"{part.name}.log" if opts.logs else None)
        report["parts"].append({**result.__dict__, "target": part.target})
        print(f"{part.name}: {result.status} in {result.seconds:.0f} s", flush=True)
    suffix = f"-{opts.group}" if opts.group != "all" and opts.device == "cuda" else ""
    prefix = "gpu" if opts.device == "cuda" else "cpu"
    path = Path(opts.json) if opts.json else RESULTS / f"{prefix}-{report['date'][:10]}{suffix}.json"
    write_report(report, path)
    print(table(report))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
