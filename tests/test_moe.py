"""Mixtures of experts: grouped GEMM against the per-expert loop, the router's ties, the sequence-wise
auxiliary loss against ``transformers``' formula, its gradient, bias balancing, active-parameter
FLOPs, DeepSeek-V3's and gpt-oss's routing and experts against ``transformers``' modules, the init
recipes, and training under torchrun: every layout's losses and balance statistics within 1e-5 of
one process, bias balancing resumed bitwise."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

import pytest
import torch

from models.common.args import MoEDecoderArgs
from models.common.decoder import DecoderOptions, Transformer
from models.common.moe import (
    GroupedExperts,
    MoE,
    MoEOptions,
    Router,
    grouped_mm_applies,
    moe_modules,
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
        for i, w in enumerate(experts.parameters()):
            w.normal_(0, 0.3, generator=torch.Generator().manual_seed(w.numel() + i))
    return experts


# gpt-oss's experts: biases on the three projections and the clamped SwiGLU (a limit that clamps)
BIASED = MoEOptions(
    n_experts=6, top_k=2, ffn_dim=16, expert_bias_terms=True, activation="clamped_swiglu", swiglu_limit=0.5
)


@pytest.mark.parametrize("options", [OPTIONS, BIASED], ids=["swiglu", "biased_clamped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward(dtype, options):
    experts = _experts(options=options).to(dtype)
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


@pytest.mark.parametrize("options", [OPTIONS, BIASED], ids=["swiglu", "biased_clamped"])
def test_grouped_mm_runs_in_autocasts_dtype_as_the_loop_does(options):
    """Under bf16 autocast the float32 experts' grouped GEMMs take bf16 operands, as the loop's
    ``F.linear`` does (on CUDA bf16 is what the grouped GEMM runs at all), eager and compiled: a
    bf16 output within bf16's precision of the loop's, gradients of the float32 weights."""
    experts = _experts(options=options)
    counts = torch.tensor([5, 0, 9, 1, 0, 3])
    x = torch.randn(int(counts.sum()), 8, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(experts.compute, fullgraph=True, backend="aot_eager")
    results = []
    for grouped, compute in ((True, experts.compute), (True, compiled), (False, experts.compute)):
        experts.use_grouped_mm = grouped
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compute(x, counts, **dict(experts.named_parameters()))
        out.float().sum().backward()
        results.append((out, *(w.grad.clone() for w in experts.parameters())))
        experts.zero_grad()
    for result in results:
        assert result[0].dtype == torch.bfloat16
        for a, b in zip(result, results[-1]):
            assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("options", [OPTIONS, BIASED], ids=["swiglu", "biased_clamped"])
def test_grouped_mm_on_cuda_equals_the_cpus_loop(options):
    """bf16 on the GPU (torch._grouped_mm where the card has it, sm90 and newer) against the fp32
    per-expert loop on the CPU: the output and every gradient within bf16's precision."""
    reference = _experts(options=options)
    counts = torch.tensor([5, 0, 9, 1, 0, 3])
    x = torch.randn(int(counts.sum()), 8, generator=torch.Generator().manual_seed(1))
    results = []
    gpu = _experts(options=options)
    for experts, device, dtype in ((reference, "cpu", torch.float32), (gpu, "cuda", torch.bfloat16)):
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
    rows = torch.arange(2).repeat_interleave(12)
    ours = sequence_balance_loss(scores.reshape(-1, 8), chosen.reshape(-1, 3), rows, rows=2)
    theirs = [load_balancing_loss_func((logits[r],), 8, 3) for r in range(2)]
    assert torch.allclose(ours, sum(theirs), atol=1e-6)


def test_padded_rows_balance_loss_is_transformers_formula_with_attention_mask():
    """Rows padded to one length: the loss over each row's real tokens alone is HF's
    ``load_balancing_loss_func`` given the row's attention mask (which leaves padding out)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 10, 8, generator=generator)
    real = torch.tensor([10, 6, 1])  # tokens per row; the rest is padding
    mask = torch.arange(10)[None] < real[:, None]
    token_ids = mask.flatten().nonzero().squeeze(1)
    scores = logits.reshape(-1, 8)[token_ids].softmax(-1)
    ours = sequence_balance_loss(scores, scores.topk(2, dim=-1).indices, token_ids // 10, rows=3)
    theirs = [load_balancing_loss_func((logits[r],), 8, 2, mask[r : r + 1].long()) for r in range(3)]
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
            (0.25 * sequence_balance_loss(scores, chosen, torch.arange(2).repeat_interleave(5), rows=2)).backward()
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


def _debug_moe(seed: int) -> Transformer:
    """The debug Qwen3-MoE with the real init recipe."""
    from seedckpt.materialize.init_recipe import init_model

    model = Transformer(get_family("qwen3_moe").flavors["debug"])
    init_model(model, seed)
    return model


def _padded_moe_step(aux_loss_scale: float):
    """One forward and backward of the debug Qwen3-MoE on two packed rows ending in padding (id 3,
    document -1, no labels), the pad token's embedding row zero as in a released HF checkpoint:
    the model, its per-layer expert counts and the gradient norm."""
    args = get_family("qwen3_moe").flavors["debug"]
    model = _debug_moe(seed=0)
    with torch.no_grad():
        model.tok_embeddings.weight[3] = 0
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, args.vocab_size, (2, 24), generator=generator)
    documents = torch.tensor([[0] * 10 + [1] * 8 + [-1] * 6, [0] * 15 + [-1] * 9])
    tokens[documents < 0] = 3
    labels = torch.where(documents < 0, -100, tokens.roll(-1, 1))
    positions = torch.cat([torch.arange(10), torch.arange(8), torch.arange(6), torch.arange(15), torch.arange(9)])
    for layer in moe_modules(model):
        layer.aux_loss_scale = aux_loss_scale
    loss = model(tokens, positions=positions.view(2, 24), document_ids=documents, labels=labels)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return model, [layer.routed[-1][0] for layer in moe_modules(model)], norm


def test_padding_reaches_no_expert_and_trains_no_weight():
    """Padding (document id -1) is routed nowhere: the experts' counts are the 33 real tokens' top_k
    choices, the pad row gets no gradient, and the auxiliary loss barely moves the gradient norm (on
    a zero pad row, routing it gave a norm 100-2800x the model's, all of it on that row)."""
    model, counts, with_aux = _padded_moe_step(aux_loss_scale=0.01)
    top_k = get_family("qwen3_moe").flavors["debug"].top_k
    assert all(int(c.sum()) == 33 * top_k for c in counts)
    assert torch.count_nonzero(model.tok_embeddings.weight.grad[3]) == 0
    _, _, without_aux = _padded_moe_step(aux_loss_scale=0.0)
    assert with_aux <= 1.5 * without_aux


def test_padding_changes_no_real_tokens_output():
    """The real tokens' logits of a padded row are the same whether its padding is routed or not."""
    args = get_family("qwen3_moe").flavors["debug"]
    model = _debug_moe(seed=1)
    tokens = torch.randint(0, args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(8))
    padded = model(tokens, document_ids=torch.tensor([[0] * 11 + [-1] * 5]))
    alone = model(tokens[:, :11])
    torch.testing.assert_close(padded[:, :11], alone, atol=1e-5, rtol=0)


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


# --- DeepSeek-V3 and gpt-oss against transformers' modules ------------------------------------------
def _seeded(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Every parameter and buffer of ``module`` drawn from a normal of its own seed (biases non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.normal_(0, std, generator=generator)


def _deepseek_v3(**overrides):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = dict(hidden_size=8, moe_intermediate_size=12, n_routed_experts=16, num_experts_per_tok=4)
    config.update(n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    config.update(overrides)
    theirs = DeepseekV3MoE(DeepseekV3Config(**config)).float()
    _seeded(theirs, 11)
    c = theirs.config
    options = MoEOptions(
        n_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok,
        ffn_dim=c.moe_intermediate_size,
        score_func="sigmoid",
        norm_topk_prob=c.norm_topk_prob,
        route_scale=c.routed_scaling_factor,
        n_group=c.n_group,
        topk_group=c.topk_group,
        n_shared_experts=c.n_shared_experts,
        load_balance="bias",
    )
    ours = MoE(c.hidden_size, options, init_std=0.02)
    ffn = c.moe_intermediate_size
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.w1.copy_(theirs.experts.gate_up_proj[:, :ffn])
        ours.experts.w3.copy_(theirs.experts.gate_up_proj[:, ffn:])
        ours.experts.w2.copy_(theirs.experts.down_proj)
        for mine, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            getattr(ours.shared_experts, mine).weight.copy_(getattr(theirs.shared_experts, hf).weight)
    return ours, theirs


def _by_expert(chosen: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts in index order, and their weights in that order."""
    order = chosen.argsort(-1)
    return chosen.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("overrides", [{}, {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}])
def test_grouped_sigmoid_routing_and_shared_experts_are_deepseek_v3s(overrides):
    """``DeepseekV3TopkRouter`` with a non-zero correction bias: the same experts, weights within
    1e-6 (from the uncorrected sigmoid scores, renormalized, times the scaling factor); the whole
    ``DeepseekV3MoE`` (shared experts 2 x 12 wide) within 1e-5, on the grouped GEMM and the loop."""
    ours, theirs = _deepseek_v3(**overrides)
    x = torch.randn(3, 40, 8, generator=torch.Generator().manual_seed(12))
    _, their_weights, their_chosen = theirs.gate(x)
    _, chosen, weights = ours.router(x.reshape(-1, 8), ours.expert_bias)
    mine, theirs_sorted = _by_expert(chosen, weights), _by_expert(their_chosen, their_weights)
    assert torch.equal(mine[0], theirs_sorted[0])
    assert torch.allclose(mine[1], theirs_sorted[1], atol=1e-6, rtol=0)
    if theirs.config.n_group > 1:  # the groups did restrict the choice
        free = Router(8, dataclasses.replace(ours.options, n_group=1, topk_group=1))
        free.load_state_dict(ours.router.state_dict())
        assert not torch.equal(free(x.reshape(-1, 8), ours.expert_bias)[1].sort(-1).values, mine[0])
    want = theirs(x)
    for grouped in (True, False):
        ours.experts.use_grouped_mm = grouped
        assert torch.allclose(ours(x), want, atol=1e-5, rtol=1e-5)


def test_grouped_routing_breaks_group_ties_by_index():
    """Every score equal: the first ``topk_group`` groups are kept, their first experts chosen."""
    router = Router(4, MoEOptions(n_experts=8, top_k=3, ffn_dim=8, score_func="sigmoid", n_group=4, topk_group=2))
    with torch.no_grad():
        router.gate.weight.zero_()
    _, chosen, _ = router(torch.randn(5, 4))
    assert chosen.tolist() == [[0, 1, 2]] * 5
    with torch.no_grad():
        router.gate.weight[7] = 1.0  # group 3's expert 7 wins outright: group 3, then group 0 (index order)
    _, chosen, _ = router(torch.ones(2, 4))
    assert chosen.tolist() == [[7, 0, 1]] * 2


def _gpt_oss(limit: float):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=8, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2)
    config.swiglu_limit = limit
    theirs = GptOssMLP(config).float()
    _seeded(theirs, 13)
    options = MoEOptions(
        n_experts=6,
        top_k=2,
        ffn_dim=12,
        score_func="softmax_topk",
        router_bias=True,
        expert_bias_terms=True,
        activation="clamped_swiglu",
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=limit,
    )
    ours = MoE(8, options, init_std=0.02)
    experts = theirs.experts
    with torch.no_grad():  # HF's gate/up are interleaved along the last dim of [E, D, 2F]
        ours.router.gate.weight.copy_(theirs.router.weight)
        ours.router.gate.bias.copy_(theirs.router.bias)
        ours.experts.w1.copy_(experts.gate_up_proj[..., ::2].transpose(1, 2))
        ours.experts.w3.copy_(experts.gate_up_proj[..., 1::2].transpose(1, 2))
        ours.experts.b1.copy_(experts.gate_up_proj_bias[:, ::2])
        ours.experts.b3.copy_(experts.gate_up_proj_bias[:, 1::2])
        ours.experts.w2.copy_(experts.down_proj.transpose(1, 2))
        ours.experts.b2.copy_(experts.down_proj_bias)
    return ours, theirs


def test_softmax_topk_routing_biases_and_clamped_swiglu_are_gpt_oss():
    """``GptOssTopKRouter`` (a bias, top-k of the logits, softmax over the k): the same experts and
    weights within 1e-6; ``GptOssMLP`` (expert biases, the clamped SwiGLU, a limit low enough to
    clamp) within 1e-5 forward, and its gradients, on the grouped GEMM and the per-expert loop."""
    ours, theirs = _gpt_oss(limit=0.5)
    x = torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(14))
    _, their_weights, their_chosen = theirs.router(x.reshape(-1, 8))
    scores, chosen, weights = ours.router(x.reshape(-1, 8))
    assert torch.equal(chosen, their_chosen)
    assert torch.allclose(weights, their_weights, atol=1e-6, rtol=0)
    assert torch.allclose(scores.sum(-1), torch.ones(60))  # the aux loss sees all experts' softmax
    gate = x.reshape(-1, 8) @ ours.experts.w1[0].T + ours.experts.b1[0]
    assert (gate > 0.5).any() and (gate.abs() > 0.5).any()  # the clamps bite
    inputs = x.clone().requires_grad_()
    want = theirs(inputs)[0]
    want.square().sum().backward()
    want_grads = (inputs.grad, theirs.router.weight.grad, theirs.experts.down_proj_bias.grad)
    assert grouped_mm_applies(x, ours.experts.w1, ours.experts.w2)
    for grouped in (True, False):
        ours.zero_grad()
        ours.experts.use_grouped_mm = grouped
        inputs = x.clone().requires_grad_()
        out = ours(inputs)
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)
        out.square().sum().backward()
        got = (inputs.grad, ours.router.gate.weight.grad, ours.experts.b2.grad)
        for a, b in zip(got, want_grads):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_moe_init_recipes():
    """torchtitan 0.3's: DeepSeek-V3's router at the layer's depth-scaled std, experts' w1 and the
    shared experts' w1 at 0.02, w2/w3 depth-scaled; gpt-oss's every expert tensor (biases too)
    depth-scaled, its router bias zero. HF's (``normal``): expert biases zero, the router's bias
    normal. Each expert's slice is a fixed range of the whole tensor's values."""
    from seedckpt.materialize.init_recipe import init_model

    depth = 0.02 / 6**0.5  # layer 2
    deepseek = MoEOptions(n_experts=4, top_k=2, ffn_dim=8, n_shared_experts=1, router_depth_init=True)
    specs = init_model(MoE(8, deepseek, init_std=depth), seed=0, materialize=False)
    stds = {fqn: (spec.kind, spec.std) for fqn, spec in specs.items()}
    assert stds == {
        "router.gate.weight": ("trunc_normal", depth),
        "experts.w1": ("trunc_normal", 0.02),
        "experts.w2": ("trunc_normal", depth),
        "experts.w3": ("trunc_normal", depth),
        "shared_experts.w1.weight": ("trunc_normal", 0.02),
        "shared_experts.w2.weight": ("trunc_normal", depth),
        "shared_experts.w3.weight": ("trunc_normal", depth),
    }
    gpt_oss = dict(n_experts=4, top_k=2, ffn_dim=8, router_bias=True, expert_bias_terms=True)
    layer = MoE(8, MoEOptions(**gpt_oss, router_depth_init=True, expert_depth_init=True), init_std=depth)
    specs = init_model(layer, seed=0, materialize=False)
    assert specs["router.gate.bias"].kind == "zeros"
    assert {fqn: s.std for fqn, s in specs.items() if fqn.startswith("experts.")} == {
        f"experts.{n}": depth for n in ("w1", "w2", "w3", "b1", "b2", "b3")
    }
    hf = init_model(MoE(8, MoEOptions(**gpt_oss, init="normal"), init_std=depth), seed=0, materialize=False)
    assert [hf[f"experts.{n}"].kind for n in ("b1", "b2", "b3")] == ["zeros"] * 3
    assert (hf["router.gate.bias"].kind, hf["router.gate.bias"].std) == ("normal", 0.02)
    init_model(layer, seed=0)
    wider = MoE(8, MoEOptions(**{**gpt_oss, "n_experts": 8}, expert_depth_init=True), init_std=depth)
    init_model(wider, seed=0)
    for name in ("w1", "b1", "b2"):  # the first four experts of eight are the four experts' values
        assert torch.equal(getattr(wider.experts, name)[:4], getattr(layer.experts, name)), name


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n_group": 3}, "n_group = 3 must be >= 1 and divide n_experts = 8"),
        ({"n_group": 8}, "n_group = 8 leaves one expert per group"),
        ({"n_group": 4, "topk_group": 5}, "topk_group = 5; it must be between 1 and n_group = 4"),
        ({"n_group": 4, "topk_group": 1, "top_k": 3}, "top_k = 3 exceeds the experts of topk_group = 1 groups (2)"),
        ({"score_func": "sparsemax"}, "score_func = 'sparsemax'; choose one of softmax, sigmoid, softmax_topk"),
        ({"activation": "gelu"}, "activation = 'gelu'; choose one of silu, gelu_tanh, clamped_swiglu"),
    ],
)
def test_moe_options_refuse_what_the_block_cannot_run(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MoEOptions(**{"n_experts": 8, "top_k": 2, "ffn_dim": 8, **fields})


@dataclass
class RoutedArgs(MoEDecoderArgs):
    """The shared decoder with every option of the MoE block on (grouped sigmoid routing, the
    correction and router biases, two shared experts, expert biases, the clamped SwiGLU)."""

    @property
    def decoder_options(self) -> DecoderOptions:
        moe = self.moe_options(
            "torchtitan",
            0.02,
            "sigmoid",
            n_group=4,
            topk_group=2,
            route_scale=2.0,
            router_bias=True,
            n_shared_experts=2,
            expert_bias_terms=True,
            activation="clamped_swiglu",
        )
        return DecoderOptions(moe=moe, moe_layers=self.moe_layers)


ROUTED_ARGS = RoutedArgs(
    dim=16,
    n_layers=3,
    n_heads=2,
    ffn_dim=32,
    vocab_size=64,
    max_seq_len=64,
    n_experts=8,
    top_k=2,
    moe_ffn_dim=8,
    load_balance="bias",
)


def test_flops_count_shared_experts_and_expert_biases_as_active():
    """Shared experts run for every token: active; each idle routed expert's biases are idle too."""
    from models.common import moe_flops_per_token
    from models.family import decoder_flops_per_token

    args = ROUTED_ARGS
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    idle = sum(p[2:].numel() for block in model.layers.values() for p in block.moe.experts.parameters())
    shared = sum(p.numel() for block in model.layers.values() for p in block.moe.shared_experts.parameters())
    assert shared == 3 * 3 * 16 * 16  # 3 layers of w1, w2, w3 of 2 x 8 wide
    assert moe_flops_per_token(args, 32) == decoder_flops_per_token(Transformer, args, 32, total - idle)


def test_tensor_parallel_divides_the_shared_experts_width():
    from models.common.tensor_parallel import tensor_parallel_sizes

    sizes = tensor_parallel_sizes(ROUTED_ARGS)
    assert sizes["the shared experts' width (n_shared_experts x moe_ffn_dim)"] == 2 * 8
    assert "the shared experts' width (n_shared_experts x moe_ffn_dim)" not in tensor_parallel_sizes(
        get_family("qwen3_moe").flavors["debug"]
    )


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
