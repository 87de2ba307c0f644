"""Expert parallelism on real gloo groups: the layouts train with one process's losses, a rank's
experts load by their rows (direct init bitwise the seed's), checkpoints resume bitwise and across
EP degrees with the expert bias, a layer with every routing and expert option runs under EP and TP as
in one process, and layout mistakes are one line before any rendezvous."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.distributed.tensor import Shard

from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.test_moe import MOE, moe_seed  # noqa: F401 (a fixture)
from tests.test_owned_reads import stock_tensors
from tests.test_train import losses, model_state, torchrun

ONE = ["--parallelism.pipeline_parallel_degree", "1"]
AC = ["--activation_checkpoint.mode"]
EVERY = ["--activation_checkpoint.selective_every", "1"]


def ep(degree: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(degree)]


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}, step {step}: {a} vs {b}"


def _load_worker(rank, world_size, seed_path):
    """Per layout: the seed loaded and initialized directly into this rank's expert-parallel stage;
    (tensors not bitwise the seed's, tensors where direct init differs from the load, the rows of
    ``layers.1.moe.experts.w1`` this rank holds)."""
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.data_parallel import make_data_parallel
    from seedckpt.parallel.parallelize import ParallelDims, parallelize_stage
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local, local_rows

    expected = stock_tensors(seed_path)
    layouts = {"dp_shard4 x ep2": (4, 1, 2), "dp_shard2 x tp2 x ep4": (2, 2, 4)}  # (dp_shard, tp, ep)
    results = {}
    for name, (shard, tp, degree) in layouts.items():
        cfg = tiny_config(
            "--model.name", "qwen3_moe", *ONE, "--parallelism.tensor_parallel_degree", str(tp), *ep(degree)
        )
        args, dims = cfg.model_args(), ParallelDims(1, 1, shard, tp, degree)
        mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
        data_parallel = make_data_parallel(cfg, dims, mesh, expert_mesh)

        def parallelize(module):
            parallelize_stage(module, cfg, dims, mesh, data_parallel.shard_on_meta, expert_mesh)

        specs = plan_rank_stages(args, 0, 1)
        [loaded] = build_stages(args, specs, "cpu", checkpoint=seed_path, shard_fn=parallelize)
        [direct] = build_stages(args, specs, "cpu", seed=0, shard_fn=parallelize)
        direct_state = direct.state_dict()
        wrong, differs = [], []
        for fqn, t in loaded.state_dict().items():
            if not torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, expected[fqn]):
                wrong.append(fqn)
            if not torch.equal(local(t), local(direct_state[fqn])):
                differs.append(fqn)
        results[name] = (wrong, differs, local_rows(loaded.get_parameter("layers.1.moe.experts.w1")))
    return results


def test_expert_parallel_stages_load_by_rows_and_init_directly_bitwise(moe_seed):
    """An expert DTensor is ``Shard(0)`` over the EP ranks with FSDP's shards inside each EP block
    (dp_shard4 x ep2: 4 experts per EP rank, 2 per rank), or whole per EP rank (tp2 x ep4)."""
    results = run_distributed(_load_worker, 4, str(moe_seed))
    for rank, by_layout in enumerate(results):
        for name, (wrong, differs, _) in by_layout.items():
            assert wrong == [] and differs == [], f"rank {rank} {name}: {wrong} {differs}"
        assert by_layout["dp_shard4 x ep2"][2] == (rank % 2 * 4 + rank // 2 * 2, rank % 2 * 4 + rank // 2 * 2 + 2)
        assert by_layout["dp_shard2 x tp2 x ep4"][2] == (2 * rank, 2 * rank + 2)


def _routed_layer():
    """An MoE layer with every routing and expert option at once: sigmoid scores in 4 groups of 2
    (2 kept), the correction bias, a router bias, 3.0 route scale, one shared expert, expert biases,
    the clamped SwiGLU; parameters and buffers seeded, the same on every rank."""
    from models.common.moe import MoE, MoEOptions

    options = MoEOptions(
        n_experts=8,
        top_k=3,
        ffn_dim=12,
        score_func="sigmoid",
        route_scale=3.0,
        n_group=4,
        topk_group=2,
        router_bias=True,
        n_shared_experts=1,
        expert_bias_terms=True,
        activation="clamped_swiglu",
        swiglu_limit=1.0,
        load_balance="bias",
    )
    layer = MoE(8, options, init_std=0.02)
    generator = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for t in [*layer.parameters(), *layer.buffers()]:
            t.normal_(0, 0.3, generator=generator)
    return layer


def _routed_worker(rank, world_size):
    """This rank's share of a batch through the layer with its experts over EP (each rank its own
    rows, as data parallelism gives them), on the grouped GEMM and the per-expert loop, against the
    whole batch through one unsplit layer: (output, input gradient, the router's, shared experts'
    and expert bias terms' gradients summed over the ranks, this rank's experts' gradients)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.parallel.expert_parallel import apply_expert_parallel
    from seedckpt.utils.tensors import local

    x = torch.randn(world_size * 2, 10, 8, generator=torch.Generator().manual_seed(22))
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(23))  # a loss with varied gradients
    mine = slice(2 * rank, 2 * rank + 2)
    owned = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)

    def run(layer, inputs, weights):
        inputs = inputs.clone().requires_grad_()
        out = layer(inputs)
        (out * weights).sum().backward()
        shared = [p.grad for p in (layer.router.gate.weight, layer.router.gate.bias, layer.shared_experts.w2.weight)]
        experts = [local(p.grad) for p in layer.experts.parameters()]
        return out.detach(), inputs.grad, shared, experts

    reference = _routed_layer()
    layer = _routed_layer()
    apply_expert_parallel(layer, init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)), None)
    gaps = {}
    for grouped in (True, False):
        for module in (reference, layer):
            module.zero_grad()
            module.experts.use_grouped_mm = grouped
        want = run(reference, x, probe)
        out, grad, shared, experts = run(layer, x[mine], probe[mine])
        for g in shared:
            dist.all_reduce(g)
        pairs = [(out, want[0][mine]), (grad, want[1][mine]), *zip(shared, want[2])]
        pairs += [(a, b[owned]) for a, b in zip(experts, want[3])]
        gaps[grouped] = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    counts = [c.tolist() for c, _ in layer.routed]
    return gaps, counts, _tensor_parallel_gap(world_size)


def _tensor_parallel_gap(world_size: int) -> tuple[float, float]:
    """The decoder with every MoE option (``tests.test_moe.ROUTED_ARGS``) under TP (sequence and
    loss parallel, the shared experts split colwise/rowwise) against one process: (the loss's and
    the worst gradient's relative gap)."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from models.common.decoder import Transformer
    from models.common.tensor_parallel import parallelize_decoder, tensor_parallel_splits
    from seedckpt.materialize.init_recipe import init_model
    from seedckpt.train.trainer import token_cross_entropy
    from tests.test_moe import ROUTED_ARGS

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tokens = torch.arange(64).reshape(2, 32) * 7 % 64
    results = []
    for tp in (False, True):
        model = Transformer(ROUTED_ARGS)
        if tp:
            parallelize_decoder(model, mesh, sequence_parallel=True)
            assert tensor_parallel_splits("layers.1.moe.shared_experts.w2.weight")
            assert model.get_parameter("layers.1.moe.shared_experts.w2.weight").placements == (Shard(1),)
        init_model(model, seed=0)
        with loss_parallel() if tp else contextlib.nullcontext():
            loss = token_cross_entropy(model(tokens), torch.roll(tokens, -1, 1))
            loss.backward()
        grads = {n: p.grad.full_tensor() if tp else p.grad for n, p in model.named_parameters()}
        results.append(((loss.full_tensor() if tp else loss).item(), grads))
    (loss_one, grads_one), (loss_tp, grads_tp) = results
    assert sorted(grads_one) == sorted(grads_tp)
    worst = max(float((grads_tp[n] - grads_one[n]).abs().max() / grads_one[n].abs().max()) for n in grads_one)
    return abs(loss_tp - loss_one) / loss_one, worst


def test_expert_parallel_runs_grouped_routing_shared_experts_and_expert_biases_as_one_process():
    """Each rank's tokens through EP over 2 ranks: outputs and every gradient (expert biases sliced
    with their experts) within 1e-5 of one process, on the grouped GEMM and the loop. In the same
    processes, tp2 of a decoder with these layers: the loss and every gradient within 1e-5."""
    results = run_distributed(_routed_worker, 2)
    for rank, (gaps, counts, tp_gaps) in enumerate(results):
        assert all(gap < 1e-5 for gap in gaps.values()), (rank, gaps)
        assert all(sum(c) == 2 * 10 * 3 for c in counts)  # this rank's tokens, three experts each
        assert all(gap < 1e-5 for gap in tp_gaps), (rank, tp_gaps)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, moe_seed):
    """One process's losses over MOE's 6 steps."""
    run = tmp_path_factory.mktemp("one_process")
    torchrun(run, moe_seed, 1, *MOE, *ONE)
    return losses(run)


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process(tmp_path, moe_seed, one_process):
    """EP with FSDP2 (one expert per rank) and full AC; with PP and selective AC; with TP on attention
    (sequence parallel, EP over the TP ranks); TP with the experts replicated on the TP ranks."""
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    layouts = {
        "dp_shard4_ep4_full_ac": (4, [*ONE, *ep(4), "--training.local_batch_size", "2", *AC, "full"]),
        "pp2_dp_shard2_ep2_selective_ac": (4, [*ep(2), "--training.local_batch_size", "4", *AC, "selective", *EVERY]),
        "dp_shard1_tp2_ep2": (2, [*ONE, *tp2, *ep(2)]),
        "tp2": (2, [*ONE, *tp2]),
    }
    for name, (nproc, layout) in layouts.items():
        proc = torchrun(tmp_path / name, moe_seed, nproc, *MOE, *layout)
        _close(losses(tmp_path / name), one_process, name)
        # no rank prints torch's advice on the gradient norm's reductions (DTensor's _redistribute)
        assert "_redistribute" not in proc.stdout + proc.stderr, name


@pytest.mark.slow
def test_expert_parallel_resumes_bitwise_and_reshards_across_degrees(tmp_path):
    """Bias balancing (its expert_bias moves every step) on dp_shard2 x ep2, saved at step 2: resumed
    there in the same layout, bitwise; on dp_shard4 x ep4 and on one process, its step 3 has the
    uninterrupted run's loss and expert loads (the bias chose the experts)."""
    bias = ["--model.name", "qwen3_moe", "--model.load_balance", "bias", "--model.bias_update_rate", "0.01"]
    seed = create_seed_checkpoint(tiny_config(*bias), tmp_path / "seed", seed=0, progress=False, workers=1)
    run = [*bias, *ONE, "--training.steps", "4"]
    ep2 = [*run, *ep(2), "--training.local_batch_size", "4"]
    straight = tmp_path / "straight"
    torchrun(straight, seed, 2, *ep2, "--checkpoint.interval", "2")
    for name in ("resumed", "ep4", "none"):
        shutil.copytree(straight / "ckpt" / "step-2", tmp_path / name / "ckpt" / "step-2")
    torchrun(tmp_path / "resumed", seed, 2, *ep2)
    assert losses(tmp_path / "resumed") == losses(straight)[2:]
    a, b = model_state(straight / "ckpt" / "step-4"), model_state(tmp_path / "resumed" / "ckpt" / "step-4")
    assert any(a[k].abs().max() > 0 for k in a if k.endswith("moe.expert_bias"))
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    stop = ["--training.stop_after_step", "3"]
    torchrun(tmp_path / "ep4", seed, 4, *run, *ep(4), "--training.local_batch_size", "2", *stop)
    torchrun(tmp_path / "none", seed, 1, *run, *stop)
    for name in ("ep4", "none"):
        assert _step_row(tmp_path / name, 3) == pytest.approx(_step_row(straight, 3), rel=1e-5), name


def _step_row(run, step: int) -> tuple[float, float, float]:
    """(loss, max and mean max load per expert) of ``step``'s metrics row."""
    import json

    row = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == step)
    return row["loss"], row["moe_max_load"], row["moe_mean_max_load"]


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ep(3), "parallelism.expert_parallel_degree = 3 does not divide model.n_experts = 8"),
        (4, [*ep(4), "--parallelism.data_parallel_replicate_degree", "2"], "must divide data_parallel_shard_degree"),
        (2, ["--model.name", "llama3", *ep(2)], "model.name = 'llama3' has no experts to split"),
        (2, [*ep(2), "--parallelism.fsdp_impl", "manual"], "parallelism.expert_parallel_degree = 2"),
        (
            2,
            [*ep(2), "--finetune.mode", "osft", "--finetune.pretrained", "{seed}"],
            "finetune.mode = 'osft' does not run under expert parallelism",
        ),
    ],
)
def test_expert_parallel_errors_are_one_line_before_rendezvous(
    world, overrides, message, tmp_path, monkeypatch, capsys, moe_seed
):
    """``train.py``'s main as rank 0 of a world of ``world``: one line, exit 2, no process group."""
    import torch.distributed as dist

    from seedckpt.train.trainer import main
    from tests.test_train import REPO

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    folders = ["--job.dump_folder", str(tmp_path), "--checkpoint.folder", str(tmp_path / "ckpt")]
    overrides = [o.format(seed=moe_seed) for o in overrides]
    assert main(["--config", "configs/debug.toml", *folders, "--model.name", "qwen3_moe", *ONE, *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not dist.is_initialized()
