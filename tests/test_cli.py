"""The `seedckpt` command line: inspect, plan, help examples and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from seedckpt.cli.main import main
from tests.dist import HANG_S

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "seedckpt.cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


def test_inspect_json_lists_tensors_and_manifest(debug_seed, capsys):
    assert main(["inspect", str(debug_seed), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["manifest"]["kind"] == "seed"
    assert out["num_tensors"] == 57 and len(out["tensors"]) == 57
    wq = out["tensors"]["layers.0.attention.wq.weight"]
    assert wq == {"shape": [128, 128], "dtype": "float32", "bytes": 128 * 128 * 4}
    assert out["total_bytes"] == sum(t["bytes"] for t in out["tensors"].values())


def test_inspect_text(debug_seed, capsys):
    assert main(["inspect", str(debug_seed)]) == 0
    out = capsys.readouterr().out
    assert "kind seed  model llama3 debug  seed 0" in out
    assert "layers.5.feed_forward.w2.weight" in out and "57 tensors" in out


def test_inspect_counts_a_tied_matrix_once(tied_seed, capsys):
    from models.common.decoder import Transformer
    from tests.conftest import tiny_config

    cfg = tiny_config("--model.tie_word_embeddings", "true")
    assert main(["inspect", str(tied_seed), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tied"] == {"output.weight": "tok_embeddings.weight"} and "output.weight" not in out["tensors"]
    numel = sum(math.prod(t["shape"]) for t in out["tensors"].values())
    assert numel == out["manifest"]["num_params"] == sum(p.numel() for p in Transformer(cfg.model_args()).parameters())
    assert main(["inspect", str(tied_seed)]) == 0
    assert "output.weight: tied, not stored (reads tok_embeddings.weight)" in capsys.readouterr().out


def test_plan_405b_on_meta(capsys):
    code = main(
        [
            "plan",
            "--config",
            str(REPO / "configs/llama3_70b.toml"),
            "--model.flavor",
            "405B",
            "--parallelism.pipeline_parallel_degree",
            "16",
            "--parallelism.pipeline_parallel_stages_per_rank",
            "1",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--world-size",
            "1024",
            "--json",
        ]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_params"] == 405_853_388_800
    assert plan["data_parallel_shard_degree"] == 64
    assert sum(s["params"] for s in plan["stages"]) == plan["total_params"]
    assert [layer for s in plan["stages"] for layer in s["layers"]] == list(range(126))
    assert plan["stages"][0]["has_embeddings"] and plan["stages"][-1]["has_output"]
    rank0 = plan["ranks"][0]
    assert rank0["param_bytes_per_dp_shard"] == -(-rank0["param_bytes"] // 64)


def test_plan_counts_what_manual_fsdp_does_not_shard(capsys):
    """FSDP2: 16 B/param over dp_shard. Manual FSDP (bf16 params, fp32 reduce): 2 + 4 B/param whole on
    every rank, the 12 B of master copy and moments over dp_shard."""

    def plan(*overrides):
        assert (
            main(
                [
                    "plan",
                    "--config",
                    str(REPO / "configs/debug.toml"),
                    "--parallelism.pipeline_parallel_degree",
                    "1",
                    "--world-size",
                    "4",
                    "--json",
                    *overrides,
                ]
            )
            == 0
        )
        return json.loads(capsys.readouterr().out)["ranks"][0]

    fsdp2 = plan()
    manual = plan("--parallelism.fsdp_impl", "manual", "--training.mixed_precision_param", "bfloat16")
    params = fsdp2["params"]
    assert fsdp2["train_state_bytes_per_gpu"] == -(-params * 16 // 4)
    assert manual["train_state_bytes_per_gpu"] == params * 6 + -(-params * 12 // 4)


def test_plan_text_for_interleaved_stages(capsys):
    assert (
        main(
            [
                "plan",
                "--config",
                str(REPO / "configs/debug.toml"),
                "--parallelism.pipeline_parallel_stages_per_rank",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--world-size",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "pp=2 x 2 stage(s)/rank, dp_shard=2" in out
    assert "[0, 2]" in out and "[1, 3]" in out


@pytest.mark.parametrize("command", ["seed", "inspect", "plan", "convert", "diff"])
def test_help_shows_examples(command):
    proc = _run(command, "--help")
    assert proc.returncode == 0
    assert "examples:" in proc.stdout and f"seedckpt {command} " in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--config", "nope.toml"], "config file nope.toml not found"),
        (["plan", "--config", "configs/debug.toml", "--training.stpes", "3"], "did you mean 'steps'"),
        (["plan", "--config", "configs/debug.toml", "--training.steps", "many"], "training.steps expects int"),
        (["plan", "--config", "configs/debug.toml", "--model.flavor", "7B"], "unknown model.flavor '7B'"),
        (
            ["plan", "--config", "configs/debug.toml", "--parallelism.pipeline_parallel_degree", "8"],
            "cannot split 6 layers into 8 pipeline stages",
        ),
        (["inspect", "/nonexistent/ckpt"], "no checkpoint at /nonexistent/ckpt"),
        (["seed", "--config", "configs/debug.toml", "--output", "/tmp/x", "--dtype", "float8"], "--dtype float8"),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, message):
    proc = _run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _listed_config_keys(help_text: str) -> dict[str, set[str]]:
    """``{section: {key, ...}}`` as the config reference at the end of a --help lists them."""
    listed, section = {}, None
    for line in help_text.splitlines():
        if header := re.match(r"\[(\w+)\]  \S", line):
            section = header.group(1)
            listed[section] = set()
        elif section and (setting := re.match(r"  (\w+) = \S", line)):
            listed[section].add(setting.group(1))
    return listed


@pytest.mark.parametrize(
    "command,epilog",
    [
        (["-m", "seedckpt.cli.main"], "run `seedckpt COMMAND --help`"),
        (["-m", "seedckpt.cli.main", "seed"], "examples:"),
        (["-m", "seedckpt.cli.main", "plan"], "examples:"),
        (["train.py"], "examples:"),
    ],
    ids=["seedckpt", "seedckpt seed", "seedckpt plan", "train.py"],
)
def test_help_lists_every_config_key(command, epilog):
    """Listed from the dataclasses: a key added to a section shows up, and needs a doc (test_config).
    The commands that take ``--section.key value`` list them in their own help, as its text says."""
    from models.llama3.args import ModelArgs
    from seedckpt.config.job_config import JobConfig

    proc = subprocess.run(
        [sys.executable, *command, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.index(epilog) < proc.stdout.index("config keys")  # the reference follows the usual help
    sections = {f.name: f.default_factory for f in dataclasses.fields(JobConfig) if not f.name.startswith("_")}
    assert _listed_config_keys(proc.stdout) == {
        name: {f.name for f in dataclasses.fields(cls) if f.metadata.get("toml_key", True)}
        for name, cls in sections.items()
    }
    model_section = proc.stdout[proc.stdout.index("[model]") : proc.stdout.index("[training]")]
    assert all(re.search(rf"\b{f.name}\b", model_section) for f in dataclasses.fields(ModelArgs))
    assert 'mixed_precision_param = "float32"' in proc.stdout and '"bfloat16"' in proc.stdout  # default, choices


@pytest.mark.parametrize("world", ["0", "-4"])
def test_plan_refuses_a_world_without_ranks(capsys, world):
    assert main(["plan", "--config", "configs/debug.toml", "--world-size", world]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--world-size {world}: it must be >= 1" in err and len(err.splitlines()) == 1, err


def test_a_bad_launch_option_is_one_line():
    proc = _run("launch", "--nproc-per-node", "two", "train.py")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "seedckpt launch: Unsupported nproc_per_node value: two; see seedckpt launch --help"
