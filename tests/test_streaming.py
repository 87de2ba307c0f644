"""The streaming seed writer: same tensors as the naive path, stock-readable, bounded memory,
and crash-safe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from seedckpt.checkpoint import DcpCheckpoint, LazySavePlanner, make_manifest, write_checkpoint
from seedckpt.checkpoint.writer import BlockPool
from seedckpt.materialize.init_recipe import CHUNK_NUMEL, TensorInit, generate, generate_flat, init_model
from seedckpt.materialize.seed import BLOCK_NUMEL, block_numel, block_rows, blocks, create_seed_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from seedckpt.utils.errors import SeedckptError
from tests.conftest import stock_load, tiny_config
from tests.dist import HANG_S

REPO = Path(__file__).resolve().parents[1]


def test_block_rows_cover_whole_generator_chunks():
    assert block_rows(torch.Size([128256, 2048])) * 2048 == BLOCK_NUMEL
    rows = block_rows(torch.Size([4096, 14336]))  # Llama-3 8B w2: 14336 = 7 * 2048
    assert (rows * 14336) % CHUNK_NUMEL == 0 and rows * 14336 <= BLOCK_NUMEL
    assert block_rows(torch.Size([10, 4097])) >= 1  # no alignment possible: still a valid block
    # Qwen3-235B-A22B's w1: two experts a block; DeepSeek-V3's with 16 workers' block size (8 Mi
    # elements, an expert is 14 Mi): half an expert, 7 whole chunks
    assert blocks(torch.Size([128, 1536, 4096]))[1] == ([2, 0, 0], [2, 1536, 4096])
    assert block_numel(16) == 8 * CHUNK_NUMEL
    assert blocks(torch.Size([256, 2048, 7168]), block_numel(16))[:3] == [
        ([0, 0, 0], [1, 1024, 7168]),
        ([0, 1024, 0], [1, 1024, 7168]),
        ([1, 0, 0], [1, 1024, 7168]),
    ]


def test_streaming_seed_equals_naive_full_model_seed(tmp_path):
    # Several blocks per tensor: make the embedding larger than one block.
    cfg = tiny_config("--model.vocab_size", str(2 * BLOCK_NUMEL // 128 + 300), "--model.n_layers", "2")
    streamed = create_seed_checkpoint(cfg, tmp_path / "streamed", seed=5, progress=False)
    reader = DcpCheckpoint(streamed)
    assert len(reader.metadata.state_dict_metadata["tok_embeddings.weight"].chunks) == 3
    model = cfg.build_model()  # the naive path: whole model in memory + stock dcp.save
    init_model(model, seed=5)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "naive"), no_dist=True)
    naive = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(naive, checkpoint_id=str(tmp_path / "naive"), no_dist=True)
    got = stock_load(streamed)
    assert got.keys() == naive.keys()
    for fqn in naive:
        assert torch.equal(got[fqn], naive[fqn]), fqn


def test_unaligned_blocks_equal_the_naive_seed(tmp_path, monkeypatch):
    # Blocks far smaller than a generator chunk cannot start on chunk boundaries: every block then
    # shares a chunk with its neighbours, and must still see exactly the chunk's values.
    import seedckpt.materialize.seed as seed_module

    monkeypatch.setattr(seed_module, "BLOCK_NUMEL", 1000)
    cfg = tiny_config("--model.n_layers", "1")
    streamed = create_seed_checkpoint(cfg, tmp_path / "seed", seed=2, progress=False)
    assert len(DcpCheckpoint(streamed).metadata.state_dict_metadata["tok_embeddings.weight"].chunks) > 50
    model = cfg.build_model()
    init_model(model, seed=2)
    got = stock_load(streamed)
    for fqn, t in model.state_dict().items():
        assert torch.equal(got[fqn], t), fqn


def test_block_buffers_are_reused_whatever_their_size_and_bounded_in_number():
    pool = BlockPool(slot_bytes=4000, keep=2)
    block = pool.take(1000, torch.float32)
    address = block.data_ptr()
    pool.give(block)
    again = pool.take(250, torch.bfloat16)  # a smaller block in another dtype reuses the slot...
    assert again.data_ptr() == address and again.shape == (250,)
    assert again.untyped_storage().nbytes() == 500  # ...over exactly its bytes (torch.save writes them all)
    assert pool.take(1000, torch.float32).data_ptr() != address  # in use: another slot
    assert pool.take(1001, torch.float32).untyped_storage().nbytes() == 4004  # larger than a slot: its own
    pool.give(torch.zeros(10))  # not from the pool: ignored
    assert pool.idle == []
    for block in [pool.take(100, torch.float32) for _ in range(3)]:  # at most `keep` slots stay idle
        pool.give(block)
    assert len(pool.idle) == 2


def test_a_tensor_many_times_the_block_budget_is_written_in_blocks_within_it(tmp_path):
    """A grouped expert weight whose every expert is 4x the block budget (the whole tensor 12x): the
    writer is handed, and writes, blocks of at most the budget, cut within the experts, each
    generated into a buffer of its own size; stock ``dcp.load`` reads back ``generate``'s tensor."""
    budget, shape, spec = 1000, torch.Size([3, 40, 100]), TensorInit("trunc_normal", std=0.02, cutoff=3.0)
    allocated = []

    def allocate(numel, dtype):
        allocated.append(numel)
        return torch.empty(numel, dtype=dtype)

    def produce(fqn, start, stop):
        return generate_flat(spec, 7, fqn, shape.numel(), start, stop, allocate=allocate)

    state = {"layers.0.moe.experts.w1": torch.empty(shape, device="meta")}
    planner = LazySavePlanner(produce, lambda s: blocks(s, budget))
    path = write_checkpoint(tmp_path / "experts", state, make_manifest("seed", "qwen3_moe", None, {}), planner=planner)
    chunks = DcpCheckpoint(path).metadata.state_dict_metadata["layers.0.moe.experts.w1"].chunks
    assert sorted((c.offsets[0], c.offsets[1]) for c in chunks) == [(e, r) for e in range(3) for r in range(0, 40, 10)]
    assert {tuple(c.sizes) for c in chunks} == {(1, 10, 100)}
    written = [nbytes for entries in DcpCheckpoint(path).manifest["raw_items"].values() for _, _, nbytes in entries]
    assert sorted(written) == [4 * budget] * 12 and allocated == [budget] * 12
    got = stock_load(path)["layers.0.moe.experts.w1"]
    assert torch.equal(got, generate(spec, shape, 7, "layers.0.moe.experts.w1"))


def test_fsdp_shard_reads_only_overlapping_blocks(tmp_path):
    cfg = tiny_config("--model.vocab_size", str(4 * BLOCK_NUMEL // 128), "--model.n_layers", "1")
    seed = create_seed_checkpoint(cfg, tmp_path / "seed", seed=0, progress=False)
    blocks = DcpCheckpoint(seed).metadata.state_dict_metadata["tok_embeddings.weight"].chunks
    assert len(blocks) == 4
    args = cfg.model_args()
    [stage] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=seed)
    assert torch.equal(stage.tok_embeddings.weight, stock_load(seed)["tok_embeddings.weight"])


PEAK_RSS = """
import resource, sys, torch
from seedckpt.config.job_config import load_config
mode, args = sys.argv[1], sys.argv[2:]
if mode == "seed":
    from seedckpt.materialize.seed import create_seed_checkpoint
    create_seed_checkpoint(load_config(None, args[2:]), args[0], seed=0, progress=False, workers=int(args[1]))
elif mode == "convert":
    from seedckpt.cli.convert import convert
    convert(args[0], args[1], args[2], progress=False)
else:
    import seedckpt.cli.convert
    with torch.device("meta"):
        load_config(None, args).build_model()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

BIG = [
    "--model.flavor",
    "debug",
    "--model.dim",
    "512",
    "--model.n_layers",
    "40",
    "--model.vocab_size",
    "2048",
    "--model.multiple_of",
    "256",
]


def _peak_rss(mode: str, *args: str) -> int:
    """Peak RSS of a fresh process that seeds, converts, or only imports and builds on meta."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, mode, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def _big_model_bytes() -> tuple[int, int]:
    """(model bytes, largest tensor bytes) of BIG in fp32: the model is >100x its largest tensor."""
    sizes = [4 * p.numel() for p in tiny_config(*BIG[2:]).build_model().parameters()]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("workers", [1, 8])
def test_peak_memory_is_bounded_by_blocks_not_model(tmp_path, workers):
    model_bytes, largest = _big_model_bytes()
    assert model_bytes > 100 * largest
    baseline = _peak_rss("meta", *BIG)
    seeded = _peak_rss("seed", tmp_path / "seed", workers, *BIG)
    assert (tmp_path / "seed" / ".metadata").is_file()
    # Lookahead blocks (each <= one tensor here) plus writer/allocator slack: far below the model.
    assert seeded - baseline < model_bytes / 4, (seeded - baseline, model_bytes)


def test_conversion_memory_is_two_tensors_not_model(tmp_path):
    model_bytes, largest = _big_model_bytes()
    create_seed_checkpoint(tiny_config(*BIG[2:]), tmp_path / "seed", seed=0, progress=False)
    baseline = _peak_rss("meta", *BIG)
    for src, dst, to in (("seed", "hf", "hf"), ("hf", "back", "dcp")):
        peak = _peak_rss("convert", tmp_path / src, tmp_path / dst, to)
        assert peak - baseline < 2 * largest + 100 * 2**20, (to, peak - baseline, model_bytes)


def test_sigkill_mid_write_leaves_nothing_acceptable(tmp_path):
    out = tmp_path / "seed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "create_seed_checkpoint.py",
            "--config",
            "configs/debug.toml",
            "--model.dim",
            "1024",
            "--model.n_layers",
            "16",
            "--model.vocab_size",
            "8192",
            "--output",
            str(out),
            "--quiet",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = tmp_path / f".seed.{proc.pid}.partial"  # the writer's own partial output
    deadline = time.monotonic() + 120
    while not any(partial.glob("*.distcp")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the writer finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and partial.is_dir()
    for path in (out, partial):
        with pytest.raises(SeedckptError):
            DcpCheckpoint(path)
        result = subprocess.run(
            [sys.executable, "-m", "seedckpt.cli.main", "inspect", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert result.returncode == 2
    args = tiny_config("--model.dim", "1024", "--model.n_layers", "16", "--model.vocab_size", "8192").model_args()
    with pytest.raises(SeedckptError, match="interrupted write"):
        build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=partial)
    # A rerun replaces the leftover and produces a complete seed.
    create_seed_checkpoint(
        tiny_config("--model.dim", "1024", "--model.n_layers", "16", "--model.vocab_size", "8192"),
        out,
        seed=0,
        progress=False,
    )
    assert not partial.exists() and DcpCheckpoint(out).manifest["kind"] == "seed"
    assert [p.name for p in tmp_path.iterdir()] == ["seed"]  # the dead writer's lock file went too


def test_the_writer_threads_skip_torch_saves_zip_crc(tmp_path):
    """torch's serialization settings are per thread: the zip CRC32 must be off in the threads that
    write (our CRC32C covers every byte), not only in the caller's. A data file holds one zip per
    item; ``zipfile`` reads the last one's records, whose CRC fields stay 0 when none was computed."""
    import zipfile

    state = {"a": torch.randn(64, 64), "b": torch.randn(1000)}
    path = write_checkpoint(tmp_path / "ckpt", state, make_manifest("seed", "llama3", None, {}))
    (data_file,) = path.glob("*.distcp")
    records = zipfile.ZipFile(data_file).infolist()
    assert any(r.filename.endswith("/data/0") for r in records)
    assert all(r.CRC == 0 for r in records), [(r.filename, r.CRC) for r in records]
    assert torch.serialization.get_crc32_options()  # the caller's setting is left as it was
