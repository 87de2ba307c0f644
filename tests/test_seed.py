"""The seed command: deterministic, stock-DCP readable, atomic, CPU-only, single-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import seedckpt.checkpoint as checkpoint_module
from seedckpt.checkpoint import MANIFEST_NAME, LazySavePlanner, make_manifest, write_checkpoint
from seedckpt.cli.main import main
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.conftest import check_tied_stock_load, stock_load, tiny_config
from tests.dist import HANG_S

REPO = Path(__file__).resolve().parents[1]


def test_same_seed_same_tensors_different_seed_different(tmp_path, debug_seed):
    again = create_seed_checkpoint(tiny_config(), tmp_path / "again", seed=0, progress=False)
    other = create_seed_checkpoint(tiny_config(), tmp_path / "other", seed=1, progress=False)
    a, b, c = stock_load(debug_seed), stock_load(again), stock_load(other)
    assert a.keys() == b.keys() == c.keys()
    for fqn in a:
        assert torch.equal(a[fqn], b[fqn]), fqn
        if "norm" not in fqn:  # norms are ones whatever the seed
            assert not torch.equal(a[fqn], c[fqn]), fqn
        assert not torch.isnan(a[fqn]).any()


def test_manifest_describes_the_checkpoint(debug_seed):
    manifest = json.loads((debug_seed / MANIFEST_NAME).read_text())
    state = stock_load(debug_seed)
    assert manifest["kind"] == "seed" and manifest["seed"] == 0 and manifest["dtype"] == "float32"
    assert manifest["model"]["name"] == "llama3" and manifest["model"]["args"]["n_layers"] == 6
    assert manifest["num_params"] == sum(t.numel() for t in state.values())
    assert manifest["torch_version"] == torch.__version__ and manifest["format_version"] == 2
    assert all(not fqn.startswith("model.") for fqn in state)  # flat FQNs


def test_bfloat16_seed_is_the_fp32_seed_cast_per_tensor(tmp_path, debug_seed):
    bf16 = create_seed_checkpoint(tiny_config(), tmp_path / "bf16", seed=0, dtype="bfloat16", progress=False)
    fp32, low = stock_load(debug_seed), stock_load(bf16)
    for fqn, t in low.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[fqn].to(torch.bfloat16)), fqn


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "seed"
    seed = ["seed", "--config", str(REPO / "configs/debug.toml"), "--output", str(out), "--quiet"]
    assert main(seed) == 0
    before = (out / "seedckpt.json").read_bytes()
    assert main([*seed, "--seed", "1"]) == 2
    assert "--force" in capsys.readouterr().err and (out / "seedckpt.json").read_bytes() == before
    assert main([*seed, "--seed", "1", "--force"]) == 0
    assert json.loads((out / "seedckpt.json").read_text())["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["seed"]  # no .partial / .old / .lock left behind


def test_force_never_replaces_what_is_not_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "seed"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    for force in ([], ["--force"]):
        assert (
            main(["seed", "--config", str(REPO / "configs/debug.toml"), "--output", str(out), "--quiet", *force]) == 2
        )
        assert "is a directory that is not a checkpoint" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    partials = []
    original = checkpoint_module.StreamingFileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        original(self, plan, planner)  # the data files exist in the .partial directory now
        partials.extend(Path(self.path).glob("*.distcp"))
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.StreamingFileSystemWriter, "write_data", write_then_fail)
    with pytest.raises((OSError, SeedckptError), match="disk full"):
        create_seed_checkpoint(tiny_config(), tmp_path / "seed", seed=0, progress=False)
    assert partials and partials[0].parent.name == f".seed.{os.getpid()}.partial"
    assert list(tmp_path.iterdir()) == []


# Blocks of a 4 x 3 tensor that do not tile it, and the words of their refusal.
BAD_BLOCKS = {
    "overlapping": ([([0, 0], [3, 3]), ([2, 0], [2, 3])], "overlap"),
    "gap": ([([0, 0], [1, 3]), ([2, 0], [2, 3])], "leave a gap"),
    "columns": ([([0, 0], [4, 1]), ([0, 1], [4, 2])], "is not a run"),  # no block is consecutive elements
    "out of bounds": ([([0, 0], [2, 3]), ([2, 0], [3, 3])], "is not a run inside"),
}


@pytest.mark.parametrize("case", BAD_BLOCKS)
def test_blocks_that_do_not_tile_their_tensor_are_refused_before_any_is_produced(tmp_path, case):
    """The planner's own one-pass check (``checkpoint.block_plan``, which replaced DCP's pairwise
    one) refuses what DCP refused -- overlapping blocks, blocks out of bounds -- and what a block
    planner must not write either: a gap, a block that is not consecutive elements."""
    blocks, refusal = BAD_BLOCKS[case]
    produced = []

    def produce(fqn, start, stop):
        produced.append(fqn)
        return torch.zeros(stop - start)

    state, manifest = {"w": torch.empty(4, 3, device="meta")}, make_manifest("seed", "llama3", None, {})
    with pytest.raises(SeedckptError, match=f"ValueError: the save plan is invalid: w's chunk.*{refusal}"):
        write_checkpoint(tmp_path / "seed", state, manifest, planner=LazySavePlanner(produce, lambda shape: blocks))
    assert produced == [] and list(tmp_path.iterdir()) == []


def test_refuses_to_run_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SeedckptError, match="not torchrun"):
        create_seed_checkpoint(tiny_config(), tmp_path / "seed", seed=0, progress=False)
    assert not (tmp_path / "seed").exists()


# Runs the seed's entry (argv[1]: the script, or `seedckpt.cli` as `python -m` runs it) and, from an
# exit handler, prints whether it touched CUDA; a SystemExit (the ordinary exit, Python's teardown
# to follow) is printed on its way out.
SCRIPT_PROBE = """
import atexit, os, runpy, sys
def report():
    import torch
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    print("CUDA_VISIBLE_DEVICES=%r initialized=%s" % (hidden, torch.cuda.is_initialized()))
atexit.register(report)
entry, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
try:
    if entry.endswith(".py"):
        runpy.run_path(entry, run_name="__main__")
    else:
        runpy.run_module(entry, run_name="__main__")
except SystemExit:
    print("SystemExit")
    raise
"""


@pytest.mark.parametrize("entry", [["create_seed_checkpoint.py"], ["seedckpt.cli", "seed"]])
def test_seed_entries_are_cpu_only_report_progress_and_skip_teardown(tmp_path, entry):
    """The script and the ``seedckpt seed`` command hide GPUs and show their progress to the end;
    both exit through ``run``, which skips Python's teardown (``exit_now``) but still runs the exit
    handlers and flushes what they print."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT_PROBE, *entry, "--config", "configs/debug.toml", "--output", str(tmp_path / "s")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert "CUDA_VISIBLE_DEVICES='' initialized=False" in proc.stdout
    assert "SystemExit" not in proc.stdout
    assert "100.0%" in proc.stderr  # the progress line reached the end
    assert (tmp_path / "s" / ".metadata").is_file()


def test_workers_write_one_file_each_and_the_same_tensors(tmp_path, debug_seed):
    """More workers change the file layout only: one data file per worker, every tensor bitwise
    the 2-worker seed's, checksums intact, stock ``dcp.load`` reads it."""
    from seedckpt.checkpoint import DcpCheckpoint

    out = create_seed_checkpoint(tiny_config(), tmp_path / "three", seed=0, progress=False, workers=3)
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert DcpCheckpoint(out).verify() == []
    mine, reference = stock_load(out), stock_load(debug_seed)
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


def test_blocks_in_flight_stay_bounded_whatever_the_worker_count():
    from seedckpt.materialize.seed import BLOCK_NUMEL, IN_FLIGHT_BYTES, block_numel

    assert block_numel(1) == block_numel(2) == BLOCK_NUMEL
    for workers in (16, 64, 128):  # two fp32 blocks per worker
        assert 2 * workers * block_numel(workers) * 4 <= IN_FLIGHT_BYTES
    with pytest.raises(SeedckptError, match="--workers 0"):
        create_seed_checkpoint(tiny_config(), "unused", seed=0, progress=False, workers=0)


def test_a_tied_seed_stores_the_matrix_once_where_stock_dcp_load_finds_both_names(tied_seed):
    check_tied_stock_load(tied_seed)


def test_a_tied_checkpoint_from_before_metadata_recorded_the_output_still_loads(tmp_path, tied_seed):
    """Written without the ``output.weight`` entry (as before it was recorded): our reader still
    reads the output as the embedding, from the tying the manifest's model implies."""
    manifest = json.loads((tied_seed / MANIFEST_NAME).read_text())
    old = open_model_checkpoint(write_checkpoint(tmp_path / "old", stock_load(tied_seed), manifest))
    assert "output.weight" not in old.metadata.state_dict_metadata
    state = {fqn: torch.zeros(old.infos[fqn].shape) for fqn in ("tok_embeddings.weight", "output.weight")}
    old.load(state)
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])
    assert torch.equal(state["output.weight"], open_model_checkpoint(tied_seed).read_tensor("output.weight"))


def test_a_seed_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    from collections import namedtuple

    from seedckpt.cli.main import main
    from seedckpt.utils import resources

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    out = tmp_path / "deep" / "seed"  # its parents do not exist yet: the nearest one's free space counts
    assert main(["seed", "--config", "configs/debug.toml", "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"the seed needs 4.7 MiB at {out}, but {tmp_path} has 1.0 MiB free" in err, err
    assert "--dtype bfloat16" in err and len(err.splitlines()) == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) in ([], ["deep"])


def test_a_seed_reads_only_the_model_of_its_config(tmp_path):
    """Fine-tuning's source, the data, the tokenizer and the parallel layout are a run's, not a seed's:
    none of them need exist or fit for ``seedckpt seed`` (which resolved them all before)."""
    from seedckpt.checkpoint import DcpCheckpoint

    cfg = tiny_config(
        *["--finetune.mode", "sft", "--finetune.pretrained", str(tmp_path / "no-such-model")],
        *["--data.kind", "chat", "--data.path", str(tmp_path / "no-such.jsonl")],
        *["--data.tokenizer", str(tmp_path / "no-such-tokenizer")],
        *["--parallelism.pipeline_parallel_degree", "5"],  # 6 layers do not split over 5 stages
    )
    path = create_seed_checkpoint(cfg, tmp_path / "seed", seed=0, progress=False, workers=1)
    assert DcpCheckpoint(path).verify() == []


def test_a_mixture_of_experts_seed_too_large_for_the_disk_is_refused_naming_its_size(tmp_path, capsys):
    """DeepSeek-V3 671B (2.5 TiB in float32) against the real free space of the test's disk: refused
    before a byte is written, the size named, with the real family and flavor (no size forged)."""
    out = tmp_path / "671b"
    assert main(["seed", "--config", "configs/debug.toml", "--output", str(out), "--quiet",
                 "--model.name", "deepseek_v3", "--model.flavor", "671B"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert f"the seed needs 2,499.77 GiB at {out}, but {tmp_path} has " in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


# Seeds a two-layer qwen3_moe whose expert tensors hold 8 experts of MOE_FFN_DIM x 128 (one expert
# 4x a 1M-element block), small then 8x larger, in one process; prints the peak RSS after each.
PEAK_RSS_PROBE = """
import resource, sys
import seedckpt.materialize.seed as seed
from tests.conftest import tiny_config
seed.BLOCK_NUMEL = seed.CHUNK_NUMEL  # blocks of 4 MiB: both models' expert tensors are many blocks
for moe_ffn_dim in (4096, 32768):
    cfg = tiny_config("--model.name", "qwen3_moe", "--model.n_layers", "2", "--model.moe_ffn_dim", str(moe_ffn_dim))
    seed.create_seed_checkpoint(cfg, f"{sys.argv[1]}/{moe_ffn_dim}", seed=0, progress=False, workers=1)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_peak_memory_does_not_grow_with_the_expert_tensors(tmp_path):
    """Expert tensors of 16 MiB, then 128 MiB (336 MiB more written): the process's peak RSS grows by
    less than a quarter of one large tensor, so no tensor (nor expert) is ever held whole."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_PROBE, str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    small, large = map(int, proc.stdout.split())
    assert large - small < 32 << 20, f"peak RSS {small / 2**20:.0f} MiB -> {large / 2**20:.0f} MiB"
    written = sum(f.stat().st_size for f in (tmp_path / "32768").glob("*.distcp"))
    assert written > 3 * (128 << 20)  # the three expert tensors, 128 MiB each


def test_the_seeds_meta_build_runs_none_of_torchs_default_inits(monkeypatch):
    """``nn.Embedding`` and ``nn.Linear`` draw their defaults in their constructors: on ``meta`` that
    is a Python meta kernel (``normal_`` imports ``torch._dynamo``) for values no meta tensor holds."""
    from seedckpt.materialize.seed import meta_build

    calls = []
    for name in ("_no_grad_normal_", "_no_grad_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, lambda *args, name=name: calls.append(name))
    with meta_build(None):
        embedding, linear = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 8)
    assert embedding.weight.is_meta and linear.weight.shape == (8, 8) and linear.bias.is_meta
    assert calls == []
    with torch.device("meta"):
        torch.nn.Embedding(32, 8)
    assert calls == ["_no_grad_normal_"]  # the spy sees what a plain meta build runs
