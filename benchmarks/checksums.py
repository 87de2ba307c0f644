"""What checking a checkpoint's bytes costs: the checksum's speed on one core, and ``seedckpt verify``.

    python benchmarks/checksums.py                          # a 1B seed under $TMPDIR
    python benchmarks/checksums.py --out-dir /dev/shm/ck    # on tmpfs: the disk out of it (kept)

JSON lines: ``checksum`` per function (CRC32C from the ``crc32c`` package, which the checkpoints
record, against the standard library's ``zlib.crc32``) -- GB/s over ``--mib`` MiB of random bytes on
one thread, best of 3; then ``verify``: a float32 seed of ``--flavor`` is written and ``seedckpt
verify`` checks every byte of it in a fresh process, which reports its own reading-and-checking time
and GB/s (start-up and opening the checkpoint apart).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import zlib

import crc32c
from common import ROOT, emit, output_dir, parser, run_checked

# verify's closing line: "intact: PATH: N items, X GiB; reading and checking them took S s (R GB/s), ..."
INTACT = re.compile(r"reading and checking them took ([\d.]+) s \(([\d.]+) GB/s\), the whole command ([\d.]+) s")


def checksum_rates(mib: int) -> None:
    data = os.urandom(mib << 20)
    for name, function in (("crc32c", crc32c.crc32c), ("zlib.crc32", zlib.crc32)):
        best = min(_seconds(function, data) for _ in range(3))
        emit({"checksum": name, "mib": mib, "threads": 1, "gb_per_s": len(data) / best / 1e9})


def _seconds(function, data: bytes) -> float:
    start = time.perf_counter()
    function(data)
    return time.perf_counter() - start


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=256, help="bytes checksummed per measurement, in MiB (default 256)")
    opts = p.parse_args()
    checksum_rates(opts.mib)
    with output_dir(opts.out_dir, "seedckpt-verify-bench-") as work:
        seed = work / "seed"
        run_checked(
            [
                *[sys.executable, "create_seed_checkpoint.py", "--config", "configs/debug.toml"],
                *["--model.flavor", opts.flavor, "--output", str(seed), "--force", "--quiet"],
            ],
            "create_seed_checkpoint.py",
        )
        out = subprocess.run(  # -m from the repository root: this tree's seedckpt
            [sys.executable, "-m", "seedckpt.cli.main", "verify", str(seed)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        found = INTACT.search(out)
        if found is None:
            raise SystemExit(f"benchmark failed: verify printed no closing line:\n{out[-2000:]}")
        seconds, rate, whole = map(float, found.groups())
        emit(
            {
                "measure": "verify",
                "flavor": opts.flavor,
                "bytes": sum(f.stat().st_size for f in seed.rglob("*") if f.is_file()),
                "check_s": seconds,
                "gb_per_s": rate,
                "command_s": whole,
                "cpu_count": os.cpu_count(),
            }
        )


if __name__ == "__main__":
    main()
