"""``make bench-gpu`` and ``make bench`` (``benchmarks/suite.py``): on a machine without CUDA the GPU
suite says what it would measure and exits 0; each part runs within its own cap and what is left of
the call's budget (or is skipped, saying why), a failing or slow part is recorded with its last line
while the others go on; the JSON file and the table carry every figure; ``--dry-run`` runs each GPU
row's command with its tiny options on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

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
    assert [line.split(":")[0] for line in lines] == [p.name for p in suite.PARTS if p.device == "cuda"]
    assert all(": skipped: no CUDA device (would measure: " in line for line in lines), lines


def test_the_priority_rows_fit_one_command_and_every_gpu_row_has_a_budget_and_a_dry_run_form():
    gpu = [part for part in suite.PARTS if part.device == "cuda"]
    assert suite.BUDGET_S <= 600 - 30  # a lent machine's command limit, less make, the wheels, the last write
    priority = [p.name for p in gpu[:7]]
    # issue 47's priorities, then the peer: an overrun of its estimate can push no priority row out
    assert priority == ["loss", "throughput_eager", "throughput_compiled", "moe_block", "save", "seed"] + [
        "torchtitan_peer"
    ]
    assert sum(part.estimate_s for part in gpu[:7]) <= suite.BUDGET_S - 60  # a minute's room for the estimates
    for part in gpu:
        assert 0 < part.estimate_s <= part.cap_s and part.tiny, part.name


def test_a_row_runs_capped_at_what_is_left_of_the_budget_or_is_skipped_with_why(capsys):
    part = suite.Part("row", "cuda", ["-c", "pass"], 150, "-", estimate_s=100)
    assert suite.cap_within(part, 400.0, 570) == (150, "")
    assert suite.cap_within(part, 120.4, 570) == (120, "")
    assert suite.cap_within(part, 90.0, 570) == (None, "skipped: needs ~100 s, 90 s left of the 570 s budget")

    opts = argparse.Namespace(logs=None, wheels="/nonexistent")
    report = {"parts": []}
    rate = 'import json; print(json.dumps({"variant": "%s", "tokens_per_s": %d}))'
    ours = suite.Part("ours", "cuda", ["-c", rate % ("train_eager_untied", 40000)], 30, "-", estimate_s=1)
    peer = suite.Part("peer", "cuda", ["-c", rate % ("torchtitan_eager", 50000)], 30, "-", estimate_s=1)
    late = suite.Part("late", "cuda", ["-c", "pass"], 30, "-", estimate_s=60)
    deadline = (570, time.monotonic() + 30)
    for row in (ours, peer, late):
        suite.run_one(row, report, {"PATH": "/usr/bin:/bin"}, opts, deadline)
    assert [(p["name"], p["status"].split(":")[0]) for p in report["parts"]] == [
        ("ours", "ok"),
        ("peer", "ok"),
        ("late", "skipped"),
    ]
    assert report["ratios"] == {"train_eager_untied_vs_torchtitan_eager": 0.8}
    summaries = [line for line in capsys.readouterr().out.splitlines() if " in " in line]
    assert summaries[1].startswith("peer: ok in ") and summaries[1].endswith(" s -- torchtitan_eager 5e+04 tokens/s")
    assert summaries[2].startswith("late: skipped: needs ~60 s, ")
    assert summaries[2].endswith(" s left of the 570 s budget in 0 s -- ")


def test_the_dry_run_runs_each_row_with_its_tiny_options_on_the_cpu_and_fails_if_one_fails(tmp_path, capsys):
    echo = "import json, os, sys; print(json.dumps({'args': sys.argv[1:], 'gpus': os.environ['CUDA_VISIBLE_DEVICES']}))"
    ok = suite.Part("ok", "cuda", ["-c", echo, "--tokens", "16384"], 30, "-", estimate_s=1, tiny=("--tokens", "8"))
    broken = suite.Part("broken", "cuda", ["-c", "raise SystemExit('no such option')"], 30, "-", tiny=("--x",))
    assert suite.dry_run([ok], {"PATH": "/usr/bin:/bin"}, str(tmp_path)) == 0
    assert json.loads((tmp_path / "ok.log").read_text()) == {"args": ["--tokens", "16384", "--tokens", "8"], "gpus": ""}
    assert suite.dry_run([ok, broken], {"PATH": "/usr/bin:/bin"}, None) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "broken: failed (exit 1) in 0 s no such option"


def test_a_part_that_fails_or_overruns_is_recorded_and_the_rest_still_run(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    figures = 'import json; print(json.dumps({"method": "ours", "gb_per_s": 2.5})); print("done")'
    skipped = 'import json; print(json.dumps({"variant": "peer", "skipped": True, "reason": "torch too old"}))'
    parts = {
        "ok": suite.Part("ok", "cuda", ["-c", figures], 30, "fast"),
        "failed": suite.Part("failed", "cuda", ["-c", "print('reading...'); raise SystemExit('disk gone')"], 30, "-"),
        "slow": suite.Part("slow", "cuda", ["-c", "import time; print('started', flush=True); time.sleep(30)"], 1, "-"),
        "absent": suite.Part("absent", "cuda", ["-c", "pass"], 30, "-", ("no_such_module_here",)),
        "unmeasured": suite.Part("unmeasured", "cuda", ["-c", skipped], 30, "-"),
    }
    logs = tmp_path / "logs"
    results = {name: suite.run_part(part, env, sys.executable, logs / f"{name}.log") for name, part in parts.items()}
    failed_log = (logs / "failed.log").read_text()
    assert "reading..." in failed_log and "disk gone" in failed_log  # the whole output, not only the last line
    assert results["ok"].status == "ok" and results["ok"].lines == [{"method": "ours", "gb_per_s": 2.5}]
    assert results["failed"].status == "failed (exit 1)" and results["failed"].last_line == "disk gone"
    assert results["slow"].status == "timed out after 1 s" and results["slow"].last_line == "started"
    assert results["absent"].status == "skipped: no_such_module_here not installed"
    assert results["unmeasured"].status == "skipped: torch too old"

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


def test_the_cpu_suite_names_the_processor_and_refuses_a_gpu_part():
    import torch

    report = {**suite.device_report(torch, "cpu"), "parts": []}
    assert report["device"].startswith("cpu: ") and report["cores"] == os.cpu_count()
    assert suite.table(report).splitlines()[0] == (
        f"{report['device']} | torch {torch.__version__} | {report['cores']} cores | {report['date']}"
    )
    for args, message in (
        (["--device", "cpu", "--dry-run"], "--dry-run checks the GPU rows: leave out --device cpu"),
        (["--device", "cpu", "--parts", "cuda_tests"], "unknown cpu parts ['cuda_tests']; choose from demo, seed"),
    ):
        proc = subprocess.run(
            [sys.executable, "benchmarks/suite.py", *args], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_gpu_call_rewrites_its_json_after_every_row_and_removes_its_wheels_install(tmp_path, monkeypatch):
    import tempfile

    import torch

    results = tmp_path / "gpu.json"
    seen = f"import json; print(json.dumps({{'seen': [p['name'] for p in json.load(open('{results}'))['parts']]}}))"
    first = suite.Part("first", "cuda", ["-c", "pass"], 30, "-", estimate_s=1)
    second = suite.Part("second", "cuda", ["-c", seen], 30, "-", estimate_s=1)
    monkeypatch.setattr(suite, "PARTS", [first, second])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine = {"device": "a GPU", "torch": "2.11", "cores": 16, "date": "2026-11-28T03:00:00+00:00"}
    monkeypatch.setattr(suite, "device_report", lambda torch, device: machine)
    tiny_wheel(tmp_path / "wheels")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert suite.main(["--json", str(results), "--wheels", str(tmp_path / "wheels")]) == 0
    report = json.loads(results.read_text())
    assert report["parts"][1]["lines"] == [{"seen": ["first"]}]  # the file as the first row left it
    assert report["finished"] and report["budget_s"] == suite.BUDGET_S
    assert not list((tmp_path / "tmp").iterdir())  # tinypkg's install, gone with the call


def tiny_wheel(wheels: Path) -> None:
    """``wheels/tinypkg-1.0-py3-none-any.whl``: one module, ``VALUE = 7``."""
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "tinypkg-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("tinypkg.py", "VALUE = 7\n")
        whl.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        whl.writestr("tinypkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("tinypkg-1.0.dist-info/RECORD", "")


def test_a_wheel_pip_refuses_is_named_one_of_an_installed_project_is_left_out_the_others_install(tmp_path):
    """A project the interpreter has is left out: the GPU image's own pytest (its plugins' version)
    is not shadowed by the carried one. A row's own wheels install whatever is installed."""
    wheels = tmp_path / "wheels"
    tiny_wheel(wheels)
    (wheels / "other-1.0-cp27-cp27m-win32.whl").write_bytes(b"not for this machine")
    (wheels / "pytest-0.0-py3-none-any.whl").write_bytes(b"pip would refuse this one too")
    env, site = {"PYTHONPATH": "/elsewhere"}, tmp_path / "site"
    said = suite.install_wheels(wheels, env, sys.executable, site)
    refused = "pip refused other-1.0-cp27-cp27m-win32.whl"
    assert said == f"installed tinypkg from {wheels} into {site}; kept the installed pytest; {refused}"
    assert env["PYTHONPATH"] == os.pathsep.join([str(site), "/elsewhere"])
    assert (site / "tinypkg.py").read_text() == "VALUE = 7\n"
    said = suite.install_wheels(wheels, {}, sys.executable, tmp_path / "site2", fill_gaps=False)
    assert said.endswith(f"; {refused}, pytest-0.0-py3-none-any.whl")


def test_a_rows_own_wheels_go_first_on_its_path_alone_and_are_removed_when_it_ends(tmp_path, capsys):
    """``.gpu-wheels/<row>/``: a version only that row sees (torchtitan 0.2.2 for torchtitan_peer),
    its directory gone once the row ends, as it ends."""
    tiny_wheel(tmp_path / "wheels" / "mine")
    mine, other = (suite.Part(name, "cuda", ["-c", "pass"], 30, "-", estimate_s=1) for name in ("mine", "other"))
    env = {"PYTHONPATH": "/elsewhere"}
    for part, wheels in ((other, tmp_path / "wheels"), (mine, None)):
        with suite.row_env(part, env, wheels) as row:
            assert row is env
    with pytest.raises(RuntimeError), suite.row_env(mine, env, tmp_path / "wheels") as row:
        site, rest = row["PYTHONPATH"].split(os.pathsep)
        assert (Path(site) / "tinypkg.py").is_file() and rest == "/elsewhere" and env == {"PYTHONPATH": "/elsewhere"}
        raise RuntimeError("the row failed")
    assert not Path(site).exists()
    assert capsys.readouterr().out.startswith(f"mine: installed tinypkg from {tmp_path / 'wheels' / 'mine'} into ")
