"""``make bench-gpu`` and ``make bench`` (``benchmarks/suite.py``): on a machine without CUDA the GPU
suite says what it would measure and exits 0; each part runs within its own cap, a failing or slow
part is recorded with its last line while the others go on; the JSON file and the table carry every
figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist import HANG_S

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import suite  # noqa: E402 -- a script of benchmarks/, imported as its test would


def test_without_cuda_every_part_says_skipped_and_the_suite_exits_0():
    proc = subprocess.run(
        [sys.executable, "benchmarks/suite.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [p.name for p in suite.PARTS if suite.GROUPS[p.group] == "cuda"]
    assert all(": skipped: no CUDA device (would measure: " in line for line in lines), lines


def test_each_gpu_groups_caps_fit_one_command_on_a_lent_machine():
    assert {part.group for part in suite.PARTS} == set(suite.GROUPS)
    for group in (g for g, device in suite.GROUPS.items() if device == "cuda"):
        assert sum(part.cap_s for part in suite.PARTS if part.group == group) <= 9 * 60, group


def test_a_part_that_fails_or_overruns_is_recorded_and_the_rest_still_run(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    figures = 'import json; print(json.dumps({"method": "ours", "gb_per_s": 2.5})); print("done")'
    parts = {
        "ok": suite.Part("ok", "io", ["-c", figures], 30, "fast"),
        "failed": suite.Part("failed", "io", ["-c", "print('reading...'); raise SystemExit('disk gone')"], 30, "-"),
        "slow": suite.Part("slow", "io", ["-c", "import time; print('started', flush=True); time.sleep(30)"], 1, "-"),
        "absent": suite.Part("absent", "io", ["-c", "pass"], 30, "-", ("no_such_module_here",)),
    }
    logs = tmp_path / "logs"
    results = {name: suite.run_part(part, env, sys.executable, logs / f"{name}.log") for name, part in parts.items()}
    failed_log = (logs / "failed.log").read_text()
    assert "reading..." in failed_log and "disk gone" in failed_log  # the whole output, not only the last line
    assert results["ok"].status == "ok" and results["ok"].lines == [{"method": "ours", "gb_per_s": 2.5}]
    assert results["failed"].status == "failed (exit 1)" and results["failed"].last_line == "disk gone"
    assert results["slow"].status == "timed out after 1 s" and results["slow"].last_line == "started"
    assert results["absent"].status == "skipped: no_such_module_here not installed"

    report = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "cuda": "12.8",
        "cores": 16,
        "python": "3.12.3",
        "date": "2026-11-25T07:00:00+00:00",
        "parts": [{**r.__dict__, "target": parts[name].target} for name, r in results.items()],
    }
    path = suite.write_report(report, tmp_path / "results" / "gpu-2026-11-25.json")
    assert json.loads(path.read_text()) == report and not list(path.parent.glob(".*partial"))
    table = suite.table(report)
    assert (
        table.splitlines()[0]
        == "NVIDIA H100 80GB HBM3 | torch 2.11.0 | CUDA 12.8 | 16 cores | 2026-11-25T07:00:00+00:00"
    )
    assert "ok: ok (0 s) -- target: fast" in table and "ours" in table and "gb_per_s=2.5" in table
    assert "failed: failed (exit 1)" in table and "last line: disk gone" in table
    assert "slow: timed out after 1 s" in table


def test_the_cpu_suite_names_the_processor_and_refuses_a_gpu_group():
    import torch

    report = {**suite.device_report(torch, "cpu"), "parts": []}
    assert report["device"].startswith("cpu: ") and report["cores"] == os.cpu_count()
    assert suite.table(report).splitlines()[0] == (
        f"{report['device']} | torch {torch.__version__} | {report['cores']} cores | {report['date']}"
    )
    for args, message in (
        (["--device", "cpu", "--group", "io"], "--group io measures cuda: add --device cuda"),
        (["--device", "cpu", "--parts", "cuda_tests"], "unknown cpu parts ['cuda_tests']; choose from demo, seed"),
    ):
        proc = subprocess.run(
            [sys.executable, "benchmarks/suite.py", *args], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
