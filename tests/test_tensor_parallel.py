"""Tensor parallelism: the families' TP plans load every tensor bitwise while reading only the bytes
each rank owns, train with the losses of one process, resume bitwise, and reshard to and from
layouts without TP. Real gloo process groups, real DTensors, real FSDP2 and pipeline schedules."""

from __future__ import annotations

import shutil

import pytest
import torch

from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.test_owned_reads import stock_tensors
from tests.test_train import losses, torchrun

TP = ["--parallelism.tensor_parallel_degree", "2"]


def _tp_load_worker(rank, world_size, seed_path):
    """Load the seed in three TP layouts; per layout: tensors not bitwise the seed's, and the bytes
    read against the bytes owned, with checksums off and on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models.common.tensor_parallel import parallelize_decoder
    from seedckpt.checkpoint.owned_reads import OwnedReads
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local

    args = tiny_config().model_args()
    expected = stock_tensors(seed_path)
    read = {"bytes": 0, "to_check": 0}
    run = OwnedReads.run

    def counting_run(self, items, locate, planner):
        run(self, items, locate, planner)
        read["bytes"] += self.bytes_read
        read["to_check"] += self.bytes_read_to_check

    OwnedReads.run = counting_run
    layouts = {"tp2": (1, 2, 2), "tp2 x dp_shard2": (1, 2, 2), "pp2 x tp2": (2, 1, 2)}  # (pp, dp, tp)
    results = {}
    for name, (pp, dp, tp) in layouts.items():
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))

        def shard(module, fsdp=name == "tp2 x dp_shard2"):
            parallelize_decoder(module, mesh["tp"], sequence_parallel=True)
            if fsdp:
                for block in module.layers.values():
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(module, mesh=mesh["dp"])

        specs = plan_rank_stages(args, mesh.get_local_rank("pp"), pp)
        for verify in (False, True):
            read.update(bytes=0, to_check=0)
            modules = build_stages(args, specs, "cpu", checkpoint=seed_path, shard_fn=shard, verify=verify)
            wrong, owned = [], 0
            for module in modules:
                for fqn, t in module.state_dict().items():
                    owned += local(t).numel() * expected[fqn].element_size()
                    if not torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, expected[fqn]):
                        wrong.append(fqn)
            results[name, verify] = (wrong, read["bytes"] + read["to_check"], owned)
    return results


def test_tp_layouts_load_the_seed_bitwise_reading_only_owned_bytes(tmp_path):
    from seedckpt.materialize.seed import create_seed_checkpoint

    seed = create_seed_checkpoint(tiny_config(), tmp_path / "seed", seed=5, progress=False)
    results = run_distributed(_tp_load_worker, 4, str(seed))
    for rank, by_layout in enumerate(results):
        for (name, verify), (wrong, read, owned) in by_layout.items():
            assert wrong == [], f"rank {rank} {name}: {wrong}"
            if not verify:  # column slices of rows (wo, w2) read as segments, not whole rows
                assert read <= 1.05 * owned, f"rank {rank} {name}: read {read} for {owned} owned"
    # `seedckpt plan`'s bytes per GPU for tp2 x dp_shard2 are what the ranks hold (FSDP's uneven shards aside)
    from seedckpt.config.resolve import resolve
    from seedckpt.materialize.memory_plan import make_plan

    plan = make_plan(resolve(tiny_config("--parallelism.pipeline_parallel_degree", "1", *TP), 4, local_world_size=0))
    held = sum(by_layout["tp2 x dp_shard2", False][2] for by_layout in results)
    assert plan["tensor_parallel_degree"] == 2
    assert abs(4 * plan["ranks"][0]["param_bytes_per_dp_shard"] - held) <= 0.01 * held


def test_tp_is_validated_before_any_rendezvous():
    from seedckpt.config.resolve import resolve

    cases = {
        ("--parallelism.tensor_parallel_degree", "3"): "does not divide model.n_heads = 8",
        ("--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"): "not divisible by 2",
        ("--parallelism.tensor_parallel_degree", "2", "--data.kind", "chat", "--data.tokenizer", "tok")
        + ("--training.max_tokens_per_rank", "66", "--training.local_batch_size", "2", "--training.seq_len", "32"): (
            "a row of training.max_tokens_per_rank / local_batch_size = 33 tokens is not divisible by 2"
        ),
        ("--parallelism.tensor_parallel_degree", "2", "--parallelism.fsdp_impl", "manual"): "fsdp_impl = 'manual'",
    }
    for overrides, message in cases.items():
        with pytest.raises(SeedckptError, match=message):
            resolve(tiny_config("--parallelism.pipeline_parallel_degree", "1", *overrides), 6)
    with pytest.raises(SeedckptError, match="x tensor_parallel_degree = 1 x 1 x 2;"):
        resolve(tiny_config("--parallelism.pipeline_parallel_degree", "1", *TP), 3)
    run = resolve(tiny_config("--parallelism.pipeline_parallel_degree", "2", *TP), 8)
    assert (run.dims.pp, run.dims.dp_shard, run.dims.tp) == (2, 2, 2)


@pytest.mark.slow
def test_tp_layouts_train_like_one_process_resume_bitwise_and_reshard(tmp_path, debug_seed):
    """One process against tp2 x dp_shard2 and pp2 x tp2 over 6 steps, and tp2 compiled over 3
    (losses within 1e-5); a tp2 x dp_shard2 run stopped at step 3 resumes bitwise, and the same
    step-3 resumes on dp_shard4; one process's step-3 resumes on tp2 x dp_shard2 (four ranks from
    one). (tp2 alone: every family, in process, above.)"""
    one = ["--parallelism.pipeline_parallel_degree", "1"]
    steps = ["--training.steps", "6"]
    single = tmp_path / "single"
    torchrun(single, debug_seed, 1, *one, *steps, "--training.stop_after_step", "3")
    shutil.copytree(single, tmp_path / "grown")  # its step-3, resumed below on 4 ranks
    torchrun(single, debug_seed, 1, *one, *steps)
    reference = losses(single)
    tp_dp = [*one, *TP, *steps, "--training.local_batch_size", "4"]
    layouts = {
        "tp2_dp2": (4, tp_dp),
        "pp2_tp2": (4, [*TP, *steps, "--parallelism.data_parallel_shard_degree", "1"]),
    }
    for name, (nproc, overrides) in layouts.items():
        torchrun(tmp_path / name, debug_seed, nproc, *overrides)
        got = losses(tmp_path / name)
        assert len(got) == 6
        for step, (a, b) in enumerate(zip(got, reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"

    # compiled under TP: the blocks' attention and feed-forward (tests/test_compile.py: without TP)
    torchrun(tmp_path / "compiled", debug_seed, 2, *one, *TP, "--training.compile", "true", "--training.steps", "3")
    for step, (a, b) in enumerate(zip(losses(tmp_path / "compiled"), reference[:3]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"tp2 compiled, step {step}: {a} vs {b}"

    stopped = tmp_path / "stopped"
    torchrun(stopped, debug_seed, 4, *tp_dp, "--training.stop_after_step", "3")
    shutil.copytree(stopped, tmp_path / "resharded")
    torchrun(stopped, debug_seed, 4, *tp_dp)
    assert losses(stopped) == losses(tmp_path / "tp2_dp2")  # bitwise
    torchrun(tmp_path / "resharded", debug_seed, 4, *one, *steps, "--training.local_batch_size", "2")
    got = losses(tmp_path / "resharded")
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"dp_shard4 from tp2 x dp_shard2, step {step}: {a} vs {b}"
    # the other way, onto more ranks: one process's step-3 resumes on tp2 x dp_shard2 (ranks 1-3 have no
    # saved RNG state: theirs is derived, and said)
    grown = torchrun(tmp_path / "grown", debug_seed, 4, *tp_dp)
    assert "holds no RNG state for this rank" in grown.stdout
    for step, (a, b) in enumerate(zip(losses(tmp_path / "grown"), reference), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"tp2 x dp_shard2 from one process, step {step}: {a} vs {b}"


def _family_worker(rank, world_size, seeds):
    """Per family: the loss and every full gradient of one packed batch under tp2 (sequence parallel,
    loss parallel) and on one process, from the same seed."""
    import contextlib
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from models.common.tensor_parallel import parallelize_decoder
    from models.registry import get_family
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.train.trainer import token_cross_entropy

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tokens = torch.arange(64).reshape(2, 32) * 7 % 500
    labels = torch.roll(tokens, -1, 1)
    positions = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, 32)
    documents = torch.cat([torch.zeros(20, dtype=torch.long), torch.ones(12, dtype=torch.long)]).expand(2, 32)
    out = {}
    for (name, tied), seed in seeds.items():
        args = dataclasses.replace(get_family(name).flavors["debug"], tie_word_embeddings=tied)
        results = []
        for tp in (False, True):
            shard = (lambda m: parallelize_decoder(m, mesh["tp"], sequence_parallel=True)) if tp else None
            [model] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=seed, shard_fn=shard)
            with loss_parallel() if tp else contextlib.nullcontext():
                loss = token_cross_entropy(model(tokens, positions=positions, document_ids=documents), labels)
                loss.backward()
            full = {n: p.grad.full_tensor() if tp else p.grad for n, p in model.named_parameters()}
            results.append((float(loss.full_tensor() if tp else loss), full))
        (loss_one, grads_one), (loss_tp, grads_tp) = results
        worst = max((grads_tp[n] - grads_one[n]).abs().max().item() for n in grads_one)
        out[name, tied] = (loss_one, loss_tp, worst, sorted(grads_one) == sorted(grads_tp))
    return out


def test_every_family_under_tp_matches_one_process_tied_and_packed(tmp_path):
    """Qwen3's per-head q/k norms, Qwen2's q/k/v biases, Granite's multipliers and tied embeddings
    (Qwen3's small flavors, Llama 3.2's) under tp2: the loss of a packed batch within 1e-5 of one
    process, and every gradient within 1e-5. (A grown vocabulary under TP: tests/test_sft.py.)"""
    from seedckpt.materialize.seed import create_seed_checkpoint

    cases = [("llama3", False), ("llama3", True), ("qwen3", True), ("qwen2", False), ("granite", False)]
    seeds = {
        (name, tied): str(
            create_seed_checkpoint(
                tiny_config("--model.name", name, "--model.tie_word_embeddings", str(tied).lower()),
                tmp_path / f"{name}-{tied}",
                seed=1,
                progress=False,
            )
        )
        for name, tied in cases
    }
    results = run_distributed(_family_worker, 2, seeds)
    for case in cases:
        loss_one, loss_tp, worst, same_names = results[0][case]
        assert same_names, case
        assert abs(loss_tp - loss_one) <= 1e-5 * loss_one, (case, loss_tp, loss_one)
        assert worst <= 1e-5, (case, worst)


def _column_slices_worker(rank, world_size, path, corrupt):
    """This rank's columns (``Shard(1)`` over 4 ranks) of a 16 MiB matrix with checksums checked:
    (bytes read, bytes owned, bitwise -- read directly and through staging slots --, the error if any)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from seedckpt.checkpoint import DcpCheckpoint
    from seedckpt.checkpoint.owned_reads import OwnedReads
    from seedckpt.utils.errors import SeedckptError

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)
    wanted = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)], src_data_rank=None)
    read = {}
    run = OwnedReads.run

    def counting_run(self, items, locate, planner):
        run(self, items, locate, planner)
        read["bytes"] = self.bytes_read + self.bytes_read_to_check

    OwnedReads.run = counting_run
    try:
        DcpCheckpoint(path, verify=True).load({"w": wanted})
    except SeedckptError as e:
        return None, None, None, str(e)
    finally:
        OwnedReads.run = run
    mine = wanted.to_local()
    same = torch.equal(mine, full[:, rank * 1024 : (rank + 1) * 1024])
    # the path a CUDA destination takes (through staging slots), run on the CPU: the same values
    staged = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)], src_data_rank=None)
    defaults = OwnedReads.__init__.__defaults__
    OwnedReads.__init__.__defaults__ = (defaults[0], True)
    try:
        DcpCheckpoint(path, verify=True).load({"w": staged})
    finally:
        OwnedReads.__init__.__defaults__ = defaults
    return read["bytes"], mine.nbytes, same and torch.equal(staged.to_local(), mine), None


def test_a_column_slice_is_checked_reading_only_its_bands(tmp_path):
    """Band checksums: each TP rank's columns of every row are checked while reading 1.0x the bytes
    it owns (with 1 MiB pieces alone: the whole matrix, 4x); a flipped byte in rank 2's columns is
    found by rank 2, naming the rows and band."""
    from seedckpt.checkpoint import make_manifest, write_checkpoint
    from seedckpt.checkpoint.formats.dcp import DcpCheckpoint

    full = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)
    path = write_checkpoint(tmp_path / "ckpt", {"w": full}, make_manifest("train", "llama3", None, {}))
    assert DcpCheckpoint(path).checksums.items  # recorded
    for read, owned, same, error in run_distributed(_column_slices_worker, 4, str(path), False):
        assert error is None and same and read <= 1.05 * owned, (read, owned, error)
    from torch.distributed.checkpoint import FileSystemReader

    [item] = [i for index, i in FileSystemReader(str(path)).read_metadata().storage_data.items() if index.fqn == "w"]
    data = path / item.relative_path
    raw = bytearray(data.read_bytes())
    at = item.offset + item.length - full.nbytes + 700 * 4096 * 4 + 2 * 1024 * 4 + 5  # row 700, column 2048+
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    results = run_distributed(_column_slices_worker, 4, str(path), True)
    # the load is collective: every rank stops with the error of the rank that read the band (rank 2)
    for _, _, _, error in results:
        assert "is corrupt: rows 640..768 x column band 4 of" in error, error


def test_verify_checks_every_tile(tmp_path):
    """`verify` reads every byte: a band checksum that does not match the bytes (a damaged manifest,
    which would stop a TP load) is reported like a damaged piece."""
    import json

    from seedckpt.checkpoint import make_manifest, write_checkpoint
    from seedckpt.checkpoint.formats.dcp import DcpCheckpoint
    from seedckpt.checkpoint.manifest import MANIFEST_NAME

    path = write_checkpoint(
        tmp_path / "ckpt", {"w": torch.randn(512, 1024)}, make_manifest("train", "llama3", None, {})
    )
    assert DcpCheckpoint(path).verify() == []
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    [entry] = [e for entries in manifest["checksums"]["bands"].values() for e in entries]
    entry[-1][3] ^= 1
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    [problem] = DcpCheckpoint(path).verify()
    assert "column band 3" in problem and "corrupt" in problem
