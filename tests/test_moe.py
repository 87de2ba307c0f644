"""Mixtures of experts: grouped GEMM against the per-expert loop, the router's ties, the sequence-wise
auxiliary loss against ``transformers``' formula, its gradient, bias balancing, active-parameter
FLOPs, and training under torchrun: every layout's losses and balance statistics within 1e-5 of
one process, bias balancing resumed bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from models.common.moe import (
    GroupedExperts,
    MoE,
    MoEOptions,
    Router,
    grouped_mm_applies,
    sequence_balance_loss,
    update_expert_bias,
)
from models.registry import get_family
from seedckpt.checkpoint import complete_steps
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import tiny_config
from tests.test_train import losses, model_state, torchrun

transformers = pytest.importorskip("transformers")

OPTIONS = MoEOptions(n_experts=6, top_k=2, ffn_dim=16)


def _experts(dim: int = 8, options: MoEOptions = OPTIONS) -> GroupedExperts:
    experts = GroupedExperts(dim, options, init_std=0.02)
    with torch.no_grad():
        for w in experts.parameters():
            w.normal_(0, 0.3, generator=torch.Generator().manual_seed(w.numel()))
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward(dtype):
    experts = _experts().to(dtype)
    counts = torch.tensor([5, 0, 9, 1, 0, 3])  # empty experts included
    x = torch.randn(int(counts.sum()), 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert grouped_mm_applies(x, experts.w1, experts.w2)
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        inputs = x.clone().requires_grad_()
        out = experts(inputs, counts)
        out.sum().backward()  # an expanded gradient: the grouped path must make it contiguous
        results.append((out.detach(), inputs.grad, *(w.grad.clone() for w in experts.parameters())))
        experts.zero_grad()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*results):
        assert torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.cuda
def test_grouped_mm_on_cuda_equals_the_cpus_loop():
    """bf16 on the GPU (torch._grouped_mm where the card has it, sm90 and newer) against the fp32
    per-expert loop on the CPU: the output and every gradient within bf16's precision."""
    reference = _experts()
    counts = torch.tensor([5, 0, 9, 1, 0, 3])
    x = torch.randn(int(counts.sum()), 8, generator=torch.Generator().manual_seed(1))
    results = []
    for experts, device, dtype in ((reference, "cpu", torch.float32), (_experts(), "cuda", torch.bfloat16)):
        experts = experts.to(device, dtype)
        experts.use_grouped_mm = device == "cuda"
        inputs = x.to(device, dtype, copy=True).requires_grad_()
        out = experts(inputs, counts.to(device))
        out.sum().backward()
        results.append([t.detach().float().cpu() for t in (out, inputs.grad, *(w.grad for w in experts.parameters()))])
    if torch.cuda.get_device_capability()[0] >= 9:
        assert grouped_mm_applies(x.cuda().bfloat16(), *(w.cuda().bfloat16() for w in (reference.w1, reference.w2)))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=3e-2, rtol=3e-2), (a - b).abs().max()


def test_grouped_mm_is_skipped_where_it_does_not_apply():
    """Rows of 6 floats (24 bytes) are not 16-byte aligned: the loop runs, and gives the answer."""
    experts = _experts(dim=6)
    counts = torch.tensor([2, 2, 0, 0, 1, 1])
    x = torch.randn(6, 6)
    assert not grouped_mm_applies(x, experts.w1, experts.w2)
    expert_of_row = [0, 0, 1, 1, 4, 5]  # the rows are sorted by expert
    silu = torch.nn.functional.silu
    want = torch.stack(
        [silu(experts.w1[e] @ x[i]) * (experts.w3[e] @ x[i]) @ experts.w2[e].T for i, e in enumerate(expert_of_row)]
    )
    assert torch.allclose(experts(x, counts), want, atol=1e-6)


def test_router_breaks_ties_by_expert_index_whatever_the_batch():
    router = Router(4, MoEOptions(n_experts=6, top_k=3, ffn_dim=8))
    with torch.no_grad():
        router.gate.weight.zero_()  # every score equal: a pure tie
        router.gate.weight[5] = 1.0  # expert 5 wins outright for positive inputs
    x = torch.ones(3, 4)
    _, chosen, weights = router(x)
    assert chosen.tolist() == [[5, 0, 1]] * 3
    assert torch.allclose(weights.sum(-1), torch.ones(3))
    # the same token routed alone and inside a larger batch picks the same experts
    many = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    router.gate.weight.data.normal_(generator=torch.Generator().manual_seed(4))
    _, batch_choice, _ = router(many)
    alone = torch.cat([router(many[i : i + 1])[1] for i in range(64)])
    assert torch.equal(batch_choice, alone)


def test_sequence_balance_loss_of_one_row_is_transformers_formula():
    """For one sequence and one layer the sequence-wise loss is exactly HF's
    ``load_balancing_loss_func`` (which pools whatever reaches it); per row, then averaged."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 12, 8, generator=generator)  # two rows of 12 tokens, 8 experts
    scores = logits.softmax(-1)
    chosen = scores.topk(3, dim=-1).indices
    ours = sequence_balance_loss(scores.reshape(-1, 8), chosen.reshape(-1, 3), rows=2)
    theirs = [load_balancing_loss_func((logits[r],), 8, 3) for r in range(2)]
    assert torch.allclose(ours, sum(theirs), atol=1e-6)


def test_aux_loss_gradient_reaches_the_router_without_touching_the_output():
    torch.manual_seed(0)
    moe = MoE(8, MoEOptions(n_experts=4, top_k=2, ffn_dim=16), init_std=0.02)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 8)

    def router_grad(scale: float, by_hand: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        moe.zero_grad()
        moe.aux_loss_scale = scale
        out = moe(x)
        if by_hand:  # the loss's gradient alone, computed directly
            scores, chosen, _ = moe.router(x.reshape(-1, 8))
            (0.25 * sequence_balance_loss(scores, chosen, rows=2)).backward()
        else:
            out.sum().backward()
        return out.detach(), moe.router.gate.weight.grad.clone()

    plain, without = router_grad(0.0)
    out, with_aux = router_grad(0.25)
    _, aux_alone = router_grad(0.0, by_hand=True)
    assert torch.equal(out, plain)  # the loss is not added to the output
    assert torch.allclose(with_aux, without + aux_alone, atol=1e-6)
    assert len(moe.routed) == 3  # one record per forward: every token's two choices counted
    assert all(int(counts.sum()) == 10 * 2 for counts, _ in moe.routed)


def test_expert_bias_chooses_but_does_not_weigh():
    router = Router(4, MoEOptions(n_experts=4, top_k=1, ffn_dim=8, norm_topk_prob=False))
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(6))
    scores, chosen, weights = router(x)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 always chosen
    biased_scores, biased, biased_weights = router(x, bias)
    assert torch.equal(biased_scores, scores)
    assert biased.flatten().tolist() == [3] * 16
    assert torch.equal(biased_weights.flatten(), scores[:, 3])  # weighed by its score, not score + bias
    layer = MoE(4, MoEOptions(n_experts=4, top_k=1, ffn_dim=8, load_balance="bias"), init_std=0.02)
    layer.expert_bias.zero_()
    # mean 4: expert 0 over-loaded (-rate), 1 and 2 under-loaded (+rate), 3 even (0); then centered
    update_expert_bias(layer, torch.tensor([10.0, 0.0, 2.0, 4.0]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.00125, 0.00075, 0.00075, -0.00025])


def test_flops_count_the_active_parameters():
    family = get_family("qwen3_moe")
    args = family.flavors["30B-A3B"]
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    active = (family.flops_per_token(args, 4096) - attention) // 6
    # 30,532,122,624 parameters less 48 layers x 120 idle experts x 3 x 2048 x 768: the "A3B"
    assert active == 3_353_032_704


# --- training under torchrun ------------------------------------------------------------------------
MOE = ["--model.name", "qwen3_moe", "--training.steps", "6"]
MOE_LAYOUTS = {
    "pp2_dp_shard2": (4, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "dp_shard2_selective_ac": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "1",
            "--training.local_batch_size",
            "2",
            "--activation_checkpoint.mode",
            "selective",
        ],
    ),
}


@pytest.fixture(scope="module")
def moe_seed(tmp_path_factory):
    path = tmp_path_factory.mktemp("seeds") / "qwen3_moe"
    create_seed_checkpoint(tiny_config("--model.name", "qwen3_moe"), path, seed=0, progress=False, workers=1)
    return path


def _balance(run) -> list[tuple[float, float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["moe_aux_loss"], r["moe_max_load"], r["moe_mean_max_load"]) for r in rows]


def test_moe_layouts_match_one_process(tmp_path, moe_seed):
    torchrun(tmp_path / "single", moe_seed, 1, *MOE, "--parallelism.pipeline_parallel_degree", "1")
    reference, balance = losses(tmp_path / "single"), _balance(tmp_path / "single")
    assert len(reference) == 6 and reference[-1] < reference[0]
    assert all(aux >= 2.0 - 1e-6 for aux, _, _ in balance)  # top-2: the loss is at least k
    for name, (nproc, overrides) in MOE_LAYOUTS.items():
        torchrun(tmp_path / name, moe_seed, nproc, *MOE, *overrides)
        for step, (a, b) in enumerate(zip(losses(tmp_path / name), reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"
        for step, (a, b) in enumerate(zip(_balance(tmp_path / name), balance), start=1):
            assert a == pytest.approx(b, rel=1e-5), f"{name} step {step}"


def test_bias_balancing_trains_and_resumes_bitwise(tmp_path):
    seed = tmp_path / "seed"
    config = tiny_config(
        "--model.name", "qwen3_moe", "--model.load_balance", "bias", "--model.bias_update_rate", "0.01"
    )
    create_seed_checkpoint(config, seed, seed=0, progress=False, workers=1)
    layout = [
        *MOE,
        "--model.load_balance",
        "bias",
        "--model.bias_update_rate",
        "0.01",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.local_batch_size",
        "4",
        "--checkpoint.interval",
        "3",
    ]
    torchrun(tmp_path / "straight", seed, 4, *layout)
    torchrun(tmp_path / "resumed", seed, 4, *layout, "--training.stop_after_step", "3")
    assert sorted(complete_steps(tmp_path / "resumed" / "ckpt")) == [3]
    torchrun(tmp_path / "resumed", seed, 4, *layout)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a = model_state(tmp_path / "straight" / "ckpt" / "step-6")
    b = model_state(tmp_path / "resumed" / "ckpt" / "step-6")
    biases = [k for k in a if k.endswith("moe.expert_bias")]
    assert len(biases) == 3 and any(a[k].abs().max() > 0 for k in biases)  # layer 0 is dense; they moved
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.cuda
def test_one_gpu_trains_the_moe_model_the_cpu_trains(tmp_path, moe_seed):
    """Routing, grouped GEMM, the aux loss and the balance metrics on CUDA: ten bf16 steps of the
    same run on either device, losses within bf16's drift."""
    from tests.test_device import assert_close_in_bf16
    from tests.test_device import train as train_one

    runs = {}
    for device in ("cpu", "cuda"):
        run = tmp_path / device
        proc = train_one(
            run,
            moe_seed,
            "--model.name",
            "qwen3_moe",
            "--job.device",
            device,
            "--training.mixed_precision_param",
            "bfloat16",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[device] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert_close_in_bf16(runs["cuda"], runs["cpu"])
    assert all(r["moe_aux_loss"] >= 2.0 - 1e-2 for r in runs["cuda"])
