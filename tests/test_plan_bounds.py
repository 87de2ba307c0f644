"""`seedckpt plan` on absurd sizes answers in bounded memory and time: a plan, or one line naming the key.

The absurd cases run in one child process whose address space is capped (``RLIMIT_AS``), so a
regression that builds 10**8 layers fails here with a MemoryError instead of eating the machine.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from seedckpt.cli.main import main
from seedckpt.config.job_config import MAX_LAYERS

REPO = Path(__file__).resolve().parents[1]
ADDRESS_SPACE = 2 * 2**30  # a debug plan peaks near 0.7 GB of address space, torch's libraries included
SECONDS = 300  # the cases take seconds; minutes even on a crowded machine mean a regression

# Each case's CLI arguments, run by one child: [exit code, stdout, stderr] per case, as JSON.
CHILD = """
import contextlib, io, json, sys
from seedckpt.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""

PLAN = ["plan", "--config", "configs/debug.toml", "--json"]
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debug"]
CASES = {
    "n_layers": [*PLAN, "--model.n_layers", str(10**8)],
    "dim": [*PLAN, "--model.dim", str(10**12)],  # pp 2: the config check's split builds the model
    "dim, one stage": [*PLAN, "--model.dim", str(10**12), "--parallelism.pipeline_parallel_degree", "1"],
    "vocab_size past int64": [*PLAN, "--model.vocab_size", str(10**19)],
    "vocab_size": [*PLAN, "--model.vocab_size", str(10**15)],
    "n_experts": [*PLAN, *MOE, "--model.n_experts", str(10**9)],
    # the seed builds the model on meta too; refused before anything is written
    "seed n_layers": ["seed", "--config", "configs/debug.toml", "--output", "{out}", "--model.n_layers", str(10**8)],
    "seed dim": ["seed", "--config", "configs/debug.toml", "--output", "{out}", "--model.dim", str(10**12)],
}


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture(scope="module")
def seed_output(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("absurd") / "seed"


@pytest.fixture(scope="module")
def answers(seed_output) -> dict[str, tuple[int, str, str]]:
    cases = [[str(seed_output) if a == "{out}" else a for a in argv] for argv in CASES.values()]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SECONDS,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
        preexec_fn=_cap_address_space,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return dict(zip(CASES, json.loads(child.stdout)))


@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("n_layers", "model.n_layers = 100000000: "),
        ("dim", "model.dim = 1000000000000: "),
        ("dim, one stage", "model.dim = 1000000000000: "),
        ("vocab_size past int64", "model.vocab_size = 10000000000000000000: "),
    ],
)
def test_sizes_that_cannot_be_planned_are_refused_in_one_line(answers, case, line):
    code, out, err = answers[case]
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith(f"seedckpt plan: error: {line}"), err


@pytest.mark.parametrize(
    ("case", "line"), [("seed n_layers", "model.n_layers = 100000000: "), ("seed dim", "model.dim = ")]
)
def test_a_seed_of_absurd_size_is_refused_in_one_line_before_writing(answers, seed_output, case, line):
    code, out, err = answers[case]
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"seedckpt seed: error: {line}"), err
    assert not seed_output.exists() and not list(seed_output.parent.iterdir())


def test_a_huge_vocabulary_is_planned(answers):
    code, out, err = answers["vocab_size"]
    assert code == 0, err
    plan = json.loads(out)
    embedding = 10**15 * plan["args"]["dim"]
    assert plan["stages"][0]["params"] > embedding and plan["stages"][-1]["params"] > embedding


def test_a_billion_experts_are_planned(answers):
    code, out, err = answers["n_experts"]
    assert code == 0, err
    assert json.loads(out)["experts"] == 10**9


def test_one_layer_past_the_limit_is_refused(capsys):
    argv = [*PLAN, "--model.n_layers", str(MAX_LAYERS + 1)]
    assert main(argv) == 2
    assert f"model.n_layers = {MAX_LAYERS + 1}: at most {MAX_LAYERS} layers" in capsys.readouterr().err


def test_parameters_are_counted_apart_from_persistent_buffers(capsys):
    """DeepSeek-V3-671B has 671,026,404,352 parameters as transformers counts them; its 58 MoE
    layers' fp32 ``expert_bias`` buffers (256 each) are state, not parameters."""
    assert main(["plan", "--config", "configs/deepseek_v3_671b.toml", "--world-size", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_params"] == 671_026_404_352
    assert plan["buffer_bytes"] == sum(rank["buffer_bytes"] for rank in plan["ranks"]) == 58 * 256 * 4
