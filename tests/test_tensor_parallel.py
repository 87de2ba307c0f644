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
from tests.test_direct_read import stock_tensors
from tests.test_train import losses, torchrun

TP = ["--parallelism.tensor_parallel_degree", "2"]


def _tp_load_worker(rank, world_size, seed_path):
    """Load the seed in three TP layouts; per layout: tensors not bitwise the seed's, and the bytes
    read against the bytes owned, with checksums off and on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models.common.tensor_parallel import parallelize_decoder
    from seedckpt.checkpoint.direct import DirectReads
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local

    args = tiny_config().model_args()
    expected = stock_tensors(seed_path)
    read = {"bytes": 0, "to_check": 0}
    run = DirectReads.run

    def counting_run(self, items, locate, planner):
        run(self, items, locate, planner)
        read["bytes"] += self.bytes_read
        read["to_check"] += self.bytes_read_to_check

    DirectReads.run = counting_run
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


def test_tp_is_validated_before_any_rendezvous():
    from seedckpt.config.resolve import resolve

    cases = {
        ("--parallelism.tensor_parallel_degree", "3"): "does not divide model.n_heads = 8",
        ("--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"): "not divisible by 2",
        ("--parallelism.tensor_parallel_degree", "2", "--parallelism.fsdp_impl", "manual"): "fsdp_impl = 'manual'",
    }
    for overrides, message in cases.items():
        with pytest.raises(SeedckptError, match=message):
            resolve(tiny_config("--parallelism.pipeline_parallel_degree", "1", *overrides), 6)
    with pytest.raises(SeedckptError, match="x tensor_parallel_degree = 1 x 1 x 2"):
        resolve(tiny_config("--parallelism.pipeline_parallel_degree", "1", *TP), 3)
    run = resolve(tiny_config("--parallelism.pipeline_parallel_degree", "2", *TP), 8)
    assert (run.dims.pp, run.dims.dp_shard, run.dims.tp) == (2, 2, 2)


@pytest.mark.slow
def test_tp_layouts_train_like_one_process_resume_bitwise_and_reshard(tmp_path, debug_seed):
    """One process against tp2, tp2 x dp_shard2 and pp2 x tp2 over 10 steps (losses within 1e-5); a
    tp2 x dp_shard2 run stopped at step 5 resumes bitwise, and the same step-5 resumes on dp_shard4."""
    one = ["--parallelism.pipeline_parallel_degree", "1"]
    torchrun(tmp_path / "single", debug_seed, 1, *one)
    reference = losses(tmp_path / "single")
    tp_dp = [*one, *TP, "--training.local_batch_size", "4"]
    layouts = {
        "tp2": (2, [*one, *TP]),
        "tp2_dp2": (4, tp_dp),
        "pp2_tp2": (4, [*TP, "--parallelism.data_parallel_shard_degree", "1"]),
    }
    for name, (nproc, overrides) in layouts.items():
        torchrun(tmp_path / name, debug_seed, nproc, *overrides)
        got = losses(tmp_path / name)
        assert len(got) == 10
        for step, (a, b) in enumerate(zip(got, reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"

    stopped = tmp_path / "stopped"
    torchrun(stopped, debug_seed, 4, *tp_dp, "--training.stop_after_step", "5")
    shutil.copytree(stopped, tmp_path / "resharded")
    torchrun(stopped, debug_seed, 4, *tp_dp)
    assert losses(stopped) == losses(tmp_path / "tp2_dp2")  # bitwise
    torchrun(tmp_path / "resharded", debug_seed, 4, *one, "--training.local_batch_size", "2")
    got = losses(tmp_path / "resharded")
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"dp_shard4 from tp2 x dp_shard2, step {step}: {a} vs {b}"
