"""Shared measurement helpers for the benchmark scripts.

Deliberately free of torch: on Linux a child's ``ru_maxrss`` starts at its parent's RSS when it is
spawned, so a parent that imported torch (~0.25 GiB) would put a floor under every reading.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DISK_TEST_BYTES = 2 << 30
DISK_BLOCK_BYTES = 64 << 20
# Memory target for a rank that loads its shards: 1.3 x the bytes it owns + 300 MiB (interpreter,
# torch, collective buffers).
RSS_TARGET_RATIO, RSS_TARGET_SLACK_MIB = 1.3, 300


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--flavor`` and ``--out-dir``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B", help="Llama 3 flavor (default: 1B)")
    p.add_argument(
        "--out-dir", help="where checkpoints are written (default: a temp dir under /tmp, removed at the end)"
    )
    return p


def module_options(p: argparse.ArgumentParser, variants, seq_len: int, repeats: int) -> None:
    """The options of a benchmark that times one module's forward + backward per variant, each
    variant in a child process of its own (``--variant``, set by the driver)."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--variant", choices=variants, help="run one variant in this process (used by the driver)")


@contextlib.contextmanager
def output_dir(given: str | None, prefix: str):
    """``given`` (created, kept) or a temporary directory under ``$TMPDIR`` (default /tmp), removed at the end."""
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def measure(cmd: list[str], output: Path, **labels) -> dict:
    """Run ``cmd`` (which writes ``output``) in a fresh process, then ``sync``; time both and read the
    child's own peak RSS (``os.wait4``, unlike ``RUSAGE_CHILDREN``). Writes still in the page cache
    are paid for by whoever made them."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr)  # stdout stays for the JSON lines
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()
    wall_s = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), cmd[:4])
    written = (
        sum(f.stat().st_size for f in output.rglob("*") if f.is_file()) if output.is_dir() else output.stat().st_size
    )
    return {
        **labels,
        "wall_s": wall_s,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # the child's own user + system time, all its threads
        "peak_rss_gib": usage.ru_maxrss / 2**20,  # ru_maxrss: KiB on Linux
        "bytes_written": written,
        "gb_per_s": written / wall_s / 1e9,
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def disk_write_bandwidth(path: Path) -> float:
    """GB/s for writing DISK_TEST_BYTES of incompressible data sequentially to ``path`` and fsyncing."""
    block = os.urandom(DISK_BLOCK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(DISK_TEST_BYTES // DISK_BLOCK_BYTES):
            os.write(fd, block)
        os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return DISK_TEST_BYTES / elapsed / 1e9


def run_checked(cmd: list[str], what: str, env: dict | None = None) -> float:
    """Run ``cmd`` (its stdout to our stderr: stdout is for the JSON lines); return its wall seconds.
    A failure stops the benchmark with one line naming ``what`` (the child's output is above it)."""
    start = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr, env=env).returncode
    if code != 0:
        raise SystemExit(f"benchmark failed: {what} exited with status {code} (its output is above)")
    return time.perf_counter() - start


def torchrun(script: str, ranks: int, report: Path, *args: str) -> tuple[list[dict], float]:
    """Run ``script --report REPORT ARGS`` as a ``torchrun --standalone`` job of ``ranks`` CPU ranks
    (OMP_NUM_THREADS=1: the ranks share this machine's cores; THP_MEM_ALLOC_ENABLE=1 as ``train.py``
    sets it, for every method alike). Each rank writes its record with ``write_rank_report``;
    returns them by rank and the job's wall seconds (launch to exit)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(script),
        "--report",
        str(report),
        *args,
    ]
    wall = run_checked(
        cmd,
        f"the torchrun job `{Path(script).name} {' '.join(args[:2])}`",
        env={**os.environ, "OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1"},
    )
    return [json.loads(Path(f"{report}.rank{rank}").read_text()) for rank in range(ranks)], wall


def write_rank_report(report: str, rank: int, record: dict) -> None:
    Path(f"{report}.rank{rank}").write_text(json.dumps(record))


def proc_fields(name: str) -> dict[str, int]:
    """The numeric fields of ``/proc/self/NAME``: ``io`` (bytes) or ``status`` (sizes in KiB)."""
    fields = {}
    for line in Path(f"/proc/self/{name}").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.split() and value.split()[0].isdigit():
            fields[key] = int(value.split()[0])
    return fields


def within_rss_target(peak_mib: float, owned_mib: float) -> bool:
    return peak_mib <= RSS_TARGET_RATIO * owned_mib + RSS_TARGET_SLACK_MIB


def emit(record: dict) -> None:
    """``record`` as one JSON line, floats to 4 decimals (4 significant digits below 1e-3: a leak of 1e-6)."""
    print(json.dumps({k: _rounded(v) if isinstance(v, float) else v for k, v in record.items()}), flush=True)


def _rounded(value: float) -> float:
    return round(value, 4) if abs(value) >= 1e-3 or not value else float(f"{value:.4g}")


def time_steps(step, repeats: int, device) -> tuple[list[float], object, str, int]:
    """``step()`` once to warm up, then ``repeats`` times: the seconds of each, the last one's result,
    and the peak memory's name and bytes -- CUDA: the timed steps' max allocated; CPU: the process's
    peak RSS growth since before the warm-up. torch is imported here, in the measuring child."""
    import resource

    import torch

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    if cuda:
        return times, result, "peak_alloc_bytes", torch.cuda.max_memory_allocated()
    return (
        times,
        result,
        "peak_rss_growth_bytes",
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024,
    )


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
