"""Reading only owned bytes (``seedckpt.checkpoint.owned_reads``): the same values as stock ``dcp.load``,
and no more bytes than the rank owns.

Real gloo process groups, real FSDP2 shards, real DCP files. The model has uneven first dimensions
(vocabulary 250 and FFN width 350 over 4 shards) and the seed is cut into small row blocks, so
blocks straddle shard boundaries and shards straddle blocks.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.test_distributed import _fsdp

UNEVEN = ("--model.vocab_size", "250", "--model.multiple_of", "25")


@pytest.fixture(scope="module")
def uneven_seeds(tmp_path_factory):
    """fp32 and bf16 seeds of the uneven model, written in blocks of ~1000 elements."""
    from seedckpt.materialize import seed as seed

    root = tmp_path_factory.mktemp("uneven")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(seed, "BLOCK_NUMEL", 1000)
        return {
            dtype: seed.create_seed_checkpoint(tiny_config(*UNEVEN), root / dtype, seed=3, dtype=dtype, progress=False)
            for dtype in ("float32", "bfloat16")
        }


def stock_tensors(path) -> dict[str, torch.Tensor]:
    """Every model tensor as stock DCP reads it (``FileSystemReader``: torch.load of whole items)."""
    import torch.distributed.checkpoint as dcp

    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    state = {f: torch.empty(i.shape, dtype=i.dtype) for f, i in open_model_checkpoint(path).infos.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return state


def _layout_worker(rank, world_size, seed_path, resume_path):
    """Build this rank's stages in several layouts; return every mismatch with stock dcp.load and,
    per load, (bytes read directly, bytes owned x stored/loaded itemsize, items read the stock way)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.checkpoint import make_manifest, write_checkpoint
    from seedckpt.checkpoint.owned_reads import OwnedReads
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local, local_rows

    args = tiny_config(*UNEVEN).model_args()
    counts = {"direct": 0, "stock_items": 0}
    run, stock_read = OwnedReads.run, FileSystemReader.read_data

    def counting_run(self, items, locate, planner):
        run(self, items, locate, planner)
        counts["direct"] += self.bytes_read

    def counting_stock(self, plan, planner):
        counts["stock_items"] += len(plan.items)
        return stock_read(self, plan, planner)

    OwnedReads.run, FileSystemReader.read_data = counting_run, counting_stock
    failures, volumes = [], []

    def check(name, modules, path):
        direct, stock_items = counts["direct"], counts["stock_items"]  # the build's reads
        expected = stock_tensors(path)
        stored = next(iter(expected.values())).dtype.itemsize
        owned = 0
        for module in modules:
            for fqn, t in module.state_dict().items():
                lo, hi = local_rows(t) or (0, t.shape[0])
                owned += local(t).numel()
                if not torch.equal(local(t), expected[fqn][lo:hi].to(t.dtype)):
                    failures.append(f"{name}: {fqn}")
        volumes.append((name, direct, owned * stored, stock_items))
        counts.update(direct=0, stock_items=0)

    # name: (pp, dp_replicate, dp_shard); HSDP: each replica group reads its own rows, once per replica.
    layouts = {
        "pp1 x dp1": (1, 1, 1),
        "pp2 x dp1": (2, 1, 1),
        "pp1 x dp4": (1, 1, 4),
        "pp2 x dp2": (2, 1, 2),
        "hsdp 2 x 2": (1, 2, 2),
    }
    for name, (pp, replicate, dp) in layouts.items():
        pp_rank = rank // (world_size // pp)
        specs = plan_rank_stages(args, pp_rank, pp)
        shard_fn = None
        if replicate > 1:
            mesh = init_device_mesh("cpu", (replicate, dp), mesh_dim_names=("replicate", "shard"))
            shard_fn = _fsdp(mesh)
        elif dp > 1:
            mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
            shard_fn = _fsdp(mesh["dp"])
        modules = build_stages(args, specs, "cpu", checkpoint=seed_path, shard_fn=shard_fn)
        check(name, modules, seed_path)
        if name == "pp1 x dp4":  # a training checkpoint written by 4 shards, resumed on pp=2 x dp=2
            with torch.no_grad():
                for t in modules[0].state_dict().values():
                    local(t).mul_(-3).add_(0.25)
            manifest = make_manifest("train", "llama3", "debug", args.to_dict())
            write_checkpoint(resume_path, modules[0].state_dict(), manifest, force=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    modules = build_stages(
        args, plan_rank_stages(args, rank // 2, 2), "cpu", checkpoint=resume_path, shard_fn=_fsdp(mesh["dp"])
    )
    check("resume dp4 -> pp2 x dp2", modules, resume_path)
    dist.barrier()
    return failures, volumes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_owned_rows_are_bitwise_stock_dcp_load_in_every_layout(uneven_seeds, tmp_path, dtype):
    results = run_distributed(_layout_worker, 4, str(uneven_seeds[dtype]), str(tmp_path / "resume"))
    for rank, (failures, volumes) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:5]}"
        assert len(volumes) == 6
        for name, direct, owned, stock_items in volumes:
            assert stock_items == 0, f"rank {rank} {name}: {stock_items} items read the stock way"
            assert direct == owned, f"rank {rank} {name}: read {direct} bytes, owns {owned}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("verify", [True, False])
def test_reads_through_staging_slots_are_bitwise_stock(uneven_seeds, monkeypatch, verify, device):
    """The route of device loads (read into a reusable slot, copy onward): on CUDA as it runs there
    (pinned slots, a side stream), on the CPU through pageable slots. Slots far smaller than a read
    (reused many times) and reads larger than a slot (their own buffer), straight and cast
    destinations, with and without checksums."""
    from seedckpt.checkpoint import owned_reads
    from seedckpt.checkpoint.load import load_state
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    monkeypatch.setattr(owned_reads, "READ_BYTES", 64)
    monkeypatch.setattr(owned_reads, "PIECE_BYTES", 0)  # slots of 64 bytes; a checked unit spans a 1 MiB piece
    for stored in ("float32", "bfloat16"):
        expected = stock_tensors(uneven_seeds[stored])
        checkpoint = open_model_checkpoint(uneven_seeds[stored], verify=verify)
        for dtype in {torch.float32, getattr(torch, stored)}:  # as stored, and widened (a cast)
            state = {f: torch.full(t.shape, float("nan"), dtype=dtype, device=device) for f, t in expected.items()}
            reader = checkpoint.reader()
            reader.reads = owned_reads.OwnedReads(threads=3, stage_all=True)
            load_state(state, reader, checkpoint.path, no_dist=True)
            for fqn, t in state.items():
                assert t.device.type == device and torch.equal(t.cpu(), expected[fqn].to(dtype)), (stored, dtype, fqn)
            assert reader.reads.bytes_read == sum(t.numel() * expected[f].dtype.itemsize for f, t in state.items())


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_read_volume_is_bounded_by_the_rows_asked_for(tmp_path):
    """A checkpoint ~100x larger than the rows requested: the process reads (``rchar``, every byte
    through read/pread) at most 5 % more than it asks for, whatever rows it asks for -- plus, with
    checksums checked, at most the one integrity piece around each end of the request."""
    from seedckpt.checkpoint import RowWindow
    from seedckpt.checkpoint.integrity import PIECE_BYTES
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.materialize.seed import create_seed_checkpoint

    path = create_seed_checkpoint(
        tiny_config("--model.vocab_size", "32768"), tmp_path / "big", seed=0, progress=False
    )  # 35 MiB, mostly embedding and output
    expected = stock_tensors(path)
    g = torch.Generator().manual_seed(0)
    for verify in (False, True):
        checkpoint = open_model_checkpoint(path, verify=verify)
        for trial in range(6):
            fqn = ("tok_embeddings.weight", "output.weight")[trial % 2]
            rows = int(torch.randint(1, 700, (), generator=g))
            start = int(torch.randint(0, 32768 - rows, (), generator=g))
            window = RowWindow(torch.empty(rows, 128), start)
            before = _rchar()
            checkpoint.load({fqn: window})
            read = _rchar() - before
            assert torch.equal(window.dest, expected[fqn][start : start + rows])
            allowed = 1.05 * window.dest.nbytes + (2 * PIECE_BYTES if verify else 0)
            assert read <= allowed, f"verify={verify} rows {start}+{rows}: read {read} for {window.dest.nbytes}"


def test_a_load_hands_its_row_windows_back(debug_seed):
    """``dcp.load`` writes its own value back into the dict it loads for every entry that is no
    tensor -- None for a ``RowWindow`` --, and the destinations of a tied pair of windows (a grown
    tied vocabulary) are copied from the source's window after the load: the window stays."""
    from seedckpt.checkpoint import RowWindow
    from seedckpt.checkpoint.load import load_state
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    checkpoint = open_model_checkpoint(debug_seed)
    window = RowWindow(torch.empty(3, 128), 5)
    state = {"tok_embeddings.weight": window}
    load_state(state, checkpoint.reader(), debug_seed, no_dist=True)
    assert state["tok_embeddings.weight"] is window
    assert torch.equal(window.dest, stock_tensors(debug_seed)["tok_embeddings.weight"][5:8])


def test_foreign_checkpoint_loads_the_stock_way(tmp_path, debug_seed):
    """A checkpoint written by stock dcp.save (no recorded positions) still loads, bitwise."""
    import torch.distributed.checkpoint as dcp

    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages

    expected = stock_tensors(debug_seed)
    dcp.save(expected, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    args = tiny_config().model_args()
    [model] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=tmp_path / "stock")
    for fqn, t in model.state_dict().items():
        assert torch.equal(t, expected[fqn]), fqn


def test_damaged_positions_and_truncated_files_are_errors(tmp_path, debug_seed):
    import json
    import shutil

    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.utils.errors import SeedckptError

    args = tiny_config().model_args()
    state = {f: torch.empty(i.shape) for f, i in open_model_checkpoint(debug_seed).infos.items()}
    lying = tmp_path / "lying"
    shutil.copytree(debug_seed, lying)
    manifest = json.loads((lying / "seedckpt.json").read_text())
    for entries in manifest["raw_items"].values():
        for entry in entries:
            entry[1] += 10**9  # points past its item
    (lying / "seedckpt.json").write_text(json.dumps(manifest))
    with pytest.raises(SeedckptError, match="raw position .* does not fit"):
        open_model_checkpoint(lying, args).load(dict(state))
    short = tmp_path / "short"
    shutil.copytree(debug_seed, short)
    data = short / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(SeedckptError, match="truncated"):
        open_model_checkpoint(short, args).load(dict(state))


def test_a_tied_matrix_is_read_once_for_both_destinations(tied_seed, monkeypatch):
    """A rank holding the embedding and a separate output copy (a V schedule's first and last stage)
    reads the matrix once, through the name that stores it, though ``.metadata`` has both names."""
    from seedckpt.checkpoint.owned_reads import OwnedReads
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    checkpoint = open_model_checkpoint(tied_seed)
    assert "output.weight" in checkpoint.metadata.state_dict_metadata
    info = checkpoint.infos["tok_embeddings.weight"]
    state = {fqn: torch.zeros(info.shape) for fqn in ("tok_embeddings.weight", "output.weight")}
    read, run = [], OwnedReads.run

    def counting(self, items, locate, planner):
        run(self, items, locate, planner)
        read.append(self.bytes_read)

    monkeypatch.setattr(OwnedReads, "run", counting)
    checkpoint.load(state)
    assert sum(read) == info.nbytes
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"]) and state["output.weight"].any()
