"""Multi-process stage building on real gloo process groups, real FSDP2 and real DCP files.

The guarantee under test: a tensor's values do not depend on world size or sharding, so a stage
loaded from the seed and the same stage initialized directly on its rank are bitwise equal --
unsharded and FSDP2-sharded -- and both equal the seed itself.
"""

from __future__ import annotations

import torch

from tests.dist import run_distributed

SEED = 0  # the debug_seed fixture's seed


def _fsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    def shard(module):
        for layer in module.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)

    return shard


def _pp_by_fsdp_worker(rank, world_size, seed_path):
    """pp=2 x dp_shard=2: each pipeline rank builds its stage, FSDP2-sharded over its dp group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from seedckpt.checkpoint import DcpCheckpoint
    from seedckpt.checkpoint.owned_reads import OwnedFileSystemReader
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from tests.conftest import tiny_config

    args = tiny_config().model_args()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    specs = plan_rank_stages(args, mesh.get_local_rank("pp"), 2)

    read = []
    original = OwnedFileSystemReader.read_data

    def recording(self, plan, planner):
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    OwnedFileSystemReader.read_data = recording
    [sharded] = build_stages(args, specs, "cpu", checkpoint=seed_path, shard_fn=_fsdp(mesh["dp_shard"]))
    OwnedFileSystemReader.read_data = original
    [direct_sharded] = build_stages(args, specs, "cpu", seed=SEED, shard_fn=_fsdp(mesh["dp_shard"]))
    [unsharded] = build_stages(args, specs, "cpu", checkpoint=seed_path)
    [direct_unsharded] = build_stages(args, specs, "cpu", seed=SEED)

    reader = DcpCheckpoint(seed_path)
    seed_state = {fqn: torch.zeros(i.shape, dtype=i.dtype) for fqn, i in reader.tensors().items()}
    reader.load({k: seed_state[k] for k in unsharded.state_dict()})  # reference, read unsharded

    failures = []
    dp_rank = mesh.get_local_rank("dp_shard")
    for fqn, t in sharded.state_dict().items():
        assert isinstance(t, DTensor)
        rows = seed_state[fqn].chunk(2, dim=0)[dp_rank] if seed_state[fqn].dim() else seed_state[fqn]
        checks = {
            "seed-loaded shard == seed slice": torch.equal(t.to_local(), rows),
            "direct-init shard == seed-loaded shard": torch.equal(
                direct_sharded.state_dict()[fqn].to_local(), t.to_local()
            ),
            "gathered shard == seed": torch.equal(t.full_tensor(), seed_state[fqn]),
            "unsharded load == seed": torch.equal(unsharded.state_dict()[fqn], seed_state[fqn]),
            "unsharded direct init == seed": torch.equal(direct_unsharded.state_dict()[fqn], seed_state[fqn]),
        }
        failures += [f"{fqn}: {name}" for name, ok in checks.items() if not ok]
    dist.barrier()
    return {
        "failures": failures,
        "owned": sorted(unsharded.state_dict()),
        "read": sorted(set(read)),
        "stage": specs[0].stage_id,
    }


def test_pp2_by_fsdp2_seed_load_equals_direct_init(debug_seed):
    results = run_distributed(_pp_by_fsdp_worker, 4, str(debug_seed))
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["read"] == r["owned"], f"rank {rank} read tensors it does not own"
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    stage0, stage1 = set(results[0]["owned"]), set(results[2]["owned"])
    assert not stage0 & stage1 and "tok_embeddings.weight" in stage0 and "output.weight" in stage1


def _fsdp_forward_worker(rank, world_size, seed_path):
    """dp_shard=2 over the whole model: loading and training-ready forward agree with one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from tests.conftest import tiny_config

    args = tiny_config().model_args()
    mesh = init_device_mesh("cpu", (2,))
    specs = plan_rank_stages(args, 0, 1)
    [model] = build_stages(args, specs, "cpu", checkpoint=seed_path, shard_fn=_fsdp(mesh))
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return model(tokens).detach()


def test_fsdp2_sharded_stage_computes_the_same_logits(debug_seed):
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from tests.conftest import tiny_config

    args = tiny_config().model_args()
    [model] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=debug_seed)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = model(tokens)
    for logits in run_distributed(_fsdp_forward_worker, 2, str(debug_seed)):
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def _hf_stage_worker(rank, world_size, hf_dir, dcp_dir):
    """pp=2 x dp_shard=2 stages loaded from an HF directory equal those loaded from its DCP copy."""
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages

    args = open_model_checkpoint(dcp_dir).args
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    specs = plan_rank_stages(args, mesh.get_local_rank("pp"), 2)
    [from_hf] = build_stages(args, specs, "cpu", checkpoint=hf_dir, shard_fn=_fsdp(mesh["dp_shard"]))
    [from_dcp] = build_stages(args, specs, "cpu", checkpoint=dcp_dir, shard_fn=_fsdp(mesh["dp_shard"]))
    expected = from_dcp.state_dict()
    return [fqn for fqn, t in from_hf.state_dict().items() if not torch.equal(t.to_local(), expected[fqn].to_local())]


def test_fsdp2_stages_load_straight_from_hf(tmp_path, debug_seed):
    from seedckpt.cli.convert import convert

    convert(debug_seed, tmp_path / "hf", "hf", progress=False)
    for rank, mismatched in enumerate(run_distributed(_hf_stage_worker, 4, str(tmp_path / "hf"), str(debug_seed))):
        assert mismatched == [], f"rank {rank}: {mismatched}"
