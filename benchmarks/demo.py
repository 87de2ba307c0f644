"""The figures the README states about ``make demo``, from a run of it: its wall time and each phase's
loss curve (pretraining, SFT, OSFT) with OSFT's leak into the frozen directions.

    python benchmarks/demo.py          # runs `make demo` (its output goes to stderr), then reads outputs/demo

One JSON line per phase (``phase``: ``steps``, ``first_loss``, ``last_loss``; OSFT also
``max_osft_leak``), then one with the demo's ``wall_s``. The loss of a phase's first and last step is
that step's mean over the ranks' label tokens, as ``metrics.jsonl`` records it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from common import ROOT, emit

DEMO = ROOT / "outputs" / "demo"
PHASES = {
    "pretrain": DEMO / "metrics.jsonl",
    "sft": DEMO / "sft" / "metrics.jsonl",
    "osft": DEMO / "osft" / "metrics.jsonl",
}


def phase_figures(name: str, rows: list[dict]) -> dict:
    record = {"phase": name, "steps": rows[-1]["step"], "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
    leaks = [row["osft_leak"] for row in rows if row.get("osft_leak") is not None]
    if leaks:
        record["max_osft_leak"] = max(leaks)
    return record


def main() -> None:
    start = time.perf_counter()
    subprocess.run(["make", "demo"], cwd=ROOT, check=True, stdout=sys.stderr)
    wall = time.perf_counter() - start
    for name, path in PHASES.items():
        emit(phase_figures(name, [json.loads(line) for line in path.read_text().splitlines()]))
    emit({"measure": "demo", "wall_s": round(wall, 1)})


if __name__ == "__main__":
    main()
