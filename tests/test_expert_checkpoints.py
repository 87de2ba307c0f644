"""Mixtures of experts at checkpoint scale: an expert's slice is a function of (seed, FQN, its
position), so a rank holding experts [a, b) initializes them directly, bitwise the seed's, and
reads only them -- from a seed, a step-N and a Hugging Face directory of per-expert tensors, within
1.05x its bytes unchecked and 1.25x checked (``/proc/self/io``'s ``rchar``), never asking for an
expert it does not own.

The model is the qwen3_moe debug flavor widened so the experts dominate (experts 256 wide: 9 of
its 11.5 MiB); the loading ranks are FSDP2 shards over 4 gloo ranks, each holding 2 of 8 experts.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from seedckpt.checkpoint import RowWindow
from seedckpt.materialize import init_recipe
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import stock_load, tiny_config
from tests.dist import run_distributed
from tests.test_distributed import _fsdp

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")

WIDE = ("--model.name", "qwen3_moe", "--model.moe_ffn_dim", "256")
SEED = 3
W1 = "layers.1.moe.experts.w1"
UNCHECKED, CHECKED = 1.05, 1.25


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The widened model's seed and its HF directory (one tensor per expert)."""
    from seedckpt.cli.convert import convert

    root = tmp_path_factory.mktemp("experts")
    seed = create_seed_checkpoint(tiny_config(*WIDE), root / "seed", seed=SEED, progress=False, workers=1)
    convert(seed, root / "hf", "hf", progress=False)
    return {"seed": seed, "hf": root / "hf"}


def test_an_expert_slice_draws_only_its_chunks_bitwise_the_seeds_and_reads_only_its_bytes(sources, monkeypatch):
    """Experts [3, 5) of 8, one process: drawn alone (only the generator chunks they span), they
    are the seed's rows; read as a row window, they cost their bytes (checked: and the pieces
    around them, sized to the tensor)."""
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint

    seed = stock_load(sources["seed"])[W1]
    with torch.device("meta"):
        model = tiny_config(*WIDE).build_model()
    spec = init_recipe.init_model(model, SEED, materialize=False)[W1]
    width = seed[0].numel()
    drawn, chunk_generator = [], init_recipe.chunk_generator
    monkeypatch.setattr(init_recipe, "chunk_generator", lambda s, fqn, c: drawn.append(c) or chunk_generator(s, fqn, c))
    experts = init_recipe.generate_flat(spec, SEED, W1, seed.numel(), 3 * width, 5 * width).view(2, *seed.shape[1:])
    assert torch.equal(experts, seed[3:5])
    assert drawn == list(range(3 * width // init_recipe.CHUNK_NUMEL, -(-5 * width // init_recipe.CHUNK_NUMEL)))
    for verify, bound in ((False, UNCHECKED), (True, CHECKED)):
        checkpoint = open_model_checkpoint(sources["seed"], verify=verify)
        window = RowWindow(torch.empty_like(experts), 3)
        before = _rchar()
        checkpoint.load({W1: window})
        assert _rchar() - before <= bound * window.dest.nbytes, verify
        assert torch.equal(window.dest, seed[3:5])


def _expert_shards_worker(rank, world_size, seed_path, hf_path, step_path):
    """FSDP2 over 4 ranks (2 experts each): direct init against the seed, and per source and
    checking, (rchar / bytes owned, loaded == direct, the experts requested from the HF files)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.checkpoint import make_manifest, write_checkpoint
    from seedckpt.checkpoint.owned_reads import OwnedHFReader
    from seedckpt.materialize.model_checkpoint import open_model_checkpoint
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local, local_rows

    args = tiny_config(*WIDE).model_args()
    specs = plan_rank_stages(args, 0, 1)
    dp4 = _fsdp(init_device_mesh("cpu", (4,)))
    [direct] = build_stages(args, specs, "cpu", seed=SEED, shard_fn=dp4)
    mine = {fqn: local(t) for fqn, t in direct.state_dict().items()}
    seed = stock_load(seed_path)
    rows = {fqn: local_rows(t) or (0, t.shape[0]) for fqn, t in direct.state_dict().items()}
    failures = [f"direct {fqn}" for fqn, t in mine.items() if not torch.equal(t, seed[fqn][slice(*rows[fqn])])]

    # a step-N written by 2 FSDP shards x 2 replicas: each loading rank reads half of a written shard
    hsdp = _fsdp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    [written] = build_stages(args, specs, "cpu", seed=SEED, shard_fn=hsdp)
    write_checkpoint(step_path, written.state_dict(), make_manifest("train", "qwen3_moe", None, args.to_dict()))

    requested, read_data = [], OwnedHFReader.read_data
    OwnedHFReader.read_data = lambda self, plan, planner: (
        requested.extend(i.storage_index.fqn for i in plan.items) or read_data(self, plan, planner)
    )
    volumes = {}
    for source, path in (("seed", seed_path), ("step", step_path), ("hf", hf_path)):
        for verify in (False, True) if source != "hf" else (False,):
            opened = open_model_checkpoint(path, args, complete=False, verify=verify)
            before = _rchar()
            [loaded] = build_stages(args, specs, "cpu", opened, shard_fn=dp4)
            volumes[source, verify] = (_rchar() - before) / sum(t.nbytes for t in mine.values())
            state = loaded.state_dict()
            failures += [f"{source} {fqn}" for fqn, t in mine.items() if not torch.equal(local(state[fqn]), t)]
    experts = {int(m[1]) for m in (re.search(r"experts\.(\d+)\.", n) for n in requested) if m}
    dist.barrier()
    return failures, volumes, experts, rows[W1]


def test_expert_shards_init_directly_as_the_seed_and_read_only_their_experts(sources, tmp_path):
    results = run_distributed(
        _expert_shards_worker, 4, str(sources["seed"]), str(sources["hf"]), str(tmp_path / "step-4")
    )
    for rank, (failures, volumes, experts, (lo, hi)) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:5]}"
        assert (lo, hi) == (2 * rank, 2 * rank + 2)
        assert experts == {lo, lo + 1}, f"rank {rank} asked the HF files for experts {sorted(experts)}"
        for (source, verify), ratio in volumes.items():
            assert ratio <= (CHECKED if verify else UNCHECKED), f"rank {rank} {source} checked={verify}: {ratio:.3f}x"


@pytest.mark.parametrize(
    "config, world_size, stored",
    [("configs/qwen3_moe_30b_a3b.toml", 64, 2), ("configs/qwen3_moe_235b_a22b.toml", 256, 1)],
)
def test_the_moe_configs_plan_each_gpus_experts_as_their_shapes_say(capsys, config, world_size, stored):
    """The shipped layouts (ep 8, FSDP2 over the rest): each GPU stores ``stored`` experts' rows of
    every MoE layer of its stage, three matrices of ``moe_ffn_dim x dim`` each (fp32 on the GPU)."""
    import json

    from seedckpt.cli.main import main

    assert main(["plan", "--config", config, "--world-size", str(world_size)]) == 0
    assert "16 per EP rank" in capsys.readouterr().out
    assert main(["plan", "--config", config, "--world-size", str(world_size), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    args, ep = plan["args"], plan["expert_parallel_degree"]
    assert args["mlp_only_layers"] == [] and args["decoder_sparse_step"] == 1  # every layer a MoE layer
    assert (plan["experts"], plan["experts_per_ep_rank"], plan["expert_rows_per_gpu"]) == (128, 128 // ep, stored)
    expert = 3 * args["moe_ffn_dim"] * args["dim"]  # w1, w2, w3 of one expert
    for stage, rank in zip(plan["stages"], plan["ranks"], strict=True):
        assert stage["expert_params"] == len(stage["layers"]) * 128 * expert
        assert rank["expert_bytes_per_gpu"] == len(stage["layers"]) * stored * expert * 4
