"""torchtitan 0.3.0's gpt-oss against ours: its names both ways (``models.gpt_oss.torchtitan``: the
fused, row-interleaved ``mlp1``, q/k rows in HF's order, ``lm_head``) carry a transformers gpt-oss
into our model with transformers' logits, and its routing -- the expert bias added to the softmax
scores to choose, not to the logits -- is what our ``softmax_topk`` router computes. Its DCP
checkpoints (made here with plain ``dcp.save``, as its checkpointer writes them) read as ours, with a
trained bias; ``convert --to torchtitan`` writes them back bitwise; a rank holding some experts
requests only their rows of the fused ``mlp1``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models.common.decoder import Transformer
from models.common.moe import MoEOptions, Router
from models.gpt_oss.torchtitan import GptOssTorchtitanNames
from seedckpt import load_model
from seedckpt.checkpoint import RowWindow
from seedckpt.checkpoint.owned_reads import OwnedFileSystemReader
from seedckpt.cli.convert import convert, diff
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.utils.stored_parts import StoredParts
from tests.test_deepseek_v3 import hf_tensors
from tests.test_gpt_oss import LAYERS, hf_model
from tests.test_moe_interop import _stored

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))


def _titan_state(hf: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """A transformers gpt-oss's tensors as torchtitan 0.3.0's model state holds them (read from the
    installed package): experts ``[E, out, in]``, gate and up interleaved by rows in ``mlp1`` (its
    SwiGLU reads ``x[..., ::2]`` and ``x[..., 1::2]``), q/k in HF's row order (``CosSinRoPE``)."""
    state = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(layers):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        for w, proj in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            for p in ("weight", "bias"):
                state[f"{ours}attention.qkv_linear.{w}.{p}"] = hf[f"{theirs}self_attn.{proj}.{p}"]
        for p in ("weight", "bias"):
            state[f"{ours}attention.wo.{p}"] = hf[f"{theirs}self_attn.o_proj.{p}"]
            state[f"{ours}moe.router.gate.{p}"] = hf[f"{theirs}mlp.router.{p}"]
        state[f"{ours}attention.sinks"] = hf[f"{theirs}self_attn.sinks"]
        state[f"{ours}attention_norm.weight"] = hf[f"{theirs}input_layernorm.weight"]
        state[f"{ours}ffn_norm.weight"] = hf[f"{theirs}post_attention_layernorm.weight"]
        experts = f"{ours}moe.routed_experts.inner_experts."
        state[experts + "mlp1_weight_EGD"] = hf[f"{theirs}mlp.experts.gate_up_proj"].transpose(1, 2)
        state[experts + "mlp1_bias_EG"] = hf[f"{theirs}mlp.experts.gate_up_proj_bias"]
        state[experts + "mlp2_weight_EDF"] = hf[f"{theirs}mlp.experts.down_proj"].transpose(1, 2)
        state[experts + "mlp2_bias_ED"] = hf[f"{theirs}mlp.experts.down_proj_bias"]
        state[f"{ours}moe.expert_bias_E"] = torch.zeros(hf[f"{theirs}mlp.router.bias"].shape)
    return state


def _ours(names: GptOssTorchtitanNames, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` in our names and row order, as a reader does with the adapter; each stored tensor
    is asserted to come back bitwise from ours (``to_stored``, ``join``, ``to_stored_rows``)."""
    ours = {}
    for key, tensor in state.items():
        fqn = names.from_stored(key)
        if isinstance(fqn, StoredParts):
            parts = fqn.split(tensor)
            assert torch.equal(fqn.join(parts), tensor) and {names.to_stored(f) for f in fqn.fqns} == {key}
            ours |= dict(zip(fqn.fqns, parts))
            continue
        assert names.to_stored(fqn) == key, (key, fqn)
        groups = names.row_groups(fqn)
        ours[fqn] = names.from_stored_rows(tensor, groups) if groups else tensor
        assert torch.equal(names.to_stored_rows(fqn, ours[fqn]), tensor)
    return ours


def test_torchtitans_names_carry_a_transformers_gpt_oss_with_its_logits(tmp_path):
    """transformers' gpt-oss (every bias and sink non-zero) laid out as torchtitan's model state and
    read through the adapter: every tensor of our model, and transformers' logits within 1e-5 (past
    the window); a model balanced by the bias reads ``expert_bias_E`` as its own."""
    path = hf_model(tmp_path / "hf")
    args = open_model_checkpoint(path).args
    state = _titan_state(hf_tensors(path), args.n_layers)
    for load_balance in ("aux_loss", "bias"):
        model_args = args.__class__(**(args.to_dict() | {"load_balance": load_balance}))
        names = GptOssTorchtitanNames(model_args)
        ours = _ours(names, state)
        if load_balance != "bias":  # the Qwen3-MoE rule: kept only at zero, written as zeros
            assert names.unkept_unless_zero("layers.0.moe.expert_bias") is not None
            assert set(names.zero_filled()) == {f"layers.{i}.moe.expert_bias_E" for i in range(args.n_layers)}
            ours = {k: v for k, v in ours.items() if not k.endswith("expert_bias")}
        model = Transformer(model_args)
        model.load_state_dict(ours, strict=True)
        with torch.no_grad():
            want = transformers.GptOssForCausalLM.from_pretrained(path).eval()(TOKENS).logits
            assert (model(TOKENS) - want).abs().max().item() <= 1e-5, load_balance


def test_softmax_topk_routing_adds_the_expert_bias_to_the_softmax_scores():
    """torchtitan's gpt-oss router (``TokenChoiceTopKRouter``, softmax, ``route_norm``): the experts
    whose softmax score plus bias is highest, weighed by their softmax scores renormalized. Ours
    chooses the same experts with the same weights, and a bias on the logits instead would choose
    others for some tokens; without a bias the choice is by the logits, as transformers' is."""
    options = MoEOptions(n_experts=8, top_k=3, ffn_dim=8, score_func="softmax_topk", router_bias=True)
    router = Router(16, options)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(0, 0.5, generator=generator)
    x = torch.randn(200, 16, generator=generator)
    bias = torch.linspace(-0.15, 0.15, 8)
    logits = router.gate(x)
    scores = logits.softmax(-1)
    want_chosen = (scores + bias).topk(3, dim=-1).indices
    want_weights = scores.gather(-1, want_chosen)
    want_weights = want_weights / want_weights.sum(-1, keepdim=True)
    _, chosen, weights = router(x, bias)
    order = want_chosen.sort(-1).indices, chosen.sort(-1).indices  # the same set, in any order
    assert torch.equal(want_chosen.gather(-1, order[0]), chosen.gather(-1, order[1]))
    assert torch.allclose(weights.gather(-1, order[1]), want_weights.gather(-1, order[0]), atol=1e-6)
    on_logits = (logits + bias).topk(3, dim=-1).indices.sort(-1).values
    assert not torch.equal(on_logits, chosen.sort(-1).values)
    _, unbiased, _ = router(x)
    assert torch.equal(unbiased.sort(-1).values, logits.topk(3, dim=-1).indices.sort(-1).values)


# A trained-looking bias per layer (torchtitan's moves by 1e-3 a step), large enough to change choices.
BIAS = torch.tensor([[0.3, -0.2, 0.1, -0.25], [-0.3, 0.25, -0.1, 0.15]])
MLP1 = "layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD"


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """A transformers gpt-oss, and its weights as torchtitan 0.3.0's checkpointer saves them (its
    names, gate and up fused in ``mlp1``) with the trained ``BIAS``."""
    root = tmp_path_factory.mktemp("titan")
    path = hf_model(root / "hf")
    state = _titan_state(hf_tensors(path), LAYERS)
    for i in range(LAYERS):
        state[f"layers.{i}.moe.expert_bias_E"] = BIAS[i].clone()
    dcp.save(state, checkpoint_id=str(root / "titan"), no_dist=True)
    args = dataclasses.replace(open_model_checkpoint(path).args, load_balance="bias")
    return path, root / "titan", args


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def test_a_torchtitan_checkpoint_reads_with_the_logits_its_bias_chooses(titan):
    """Every stored tensor lands on one of ours (each ``mlp1`` on two); the logits are those of the
    transformers model's weights given that bias in our router, which the bias moves off
    transformers' own."""
    hf_dir, path, args = titan
    opened = open_model_checkpoint(path, args, model="gpt_oss")
    assert set(opened.infos) == set(opened.layout.shapes)
    model = load_model(path, model="gpt_oss", args=args)
    assert all(torch.equal(model.layers[str(i)].moe.expert_bias, BIAS[i]) for i in range(LAYERS))
    want = Transformer(args).eval()
    biases = {f"layers.{i}.moe.expert_bias": BIAS[i] for i in range(LAYERS)}
    want.load_state_dict(load_model(hf_dir).state_dict() | biases, strict=True)
    assert torch.equal(_logits(model), _logits(want))
    with torch.no_grad():
        theirs = transformers.GptOssForCausalLM.from_pretrained(hf_dir).eval()(TOKENS).logits
    moved = (_logits(model) - theirs).abs().max() / theirs.abs().max()
    assert moved > 0.01, f"the bias moved the logits by {moved:.3%} only: it chooses nothing here"


def test_ours_to_torchtitan_and_back_is_bitwise_in_its_fused_layout(titan, tmp_path):
    """torchtitan -> ours -> torchtitan gives back every stored tensor bitwise under its name (gate
    and up interleaved in ``mlp1`` again), and ours -> torchtitan -> ours is bitwise."""
    _, path, args = titan
    ours = convert(path, tmp_path / "ours", "dcp", progress=False, args=args, model="gpt_oss")
    assert "layers.0.moe.experts.w1" in _stored(ours)
    back = convert(ours, tmp_path / "titan", "torchtitan", progress=False)
    original, written = _stored(path), _stored(back)
    assert written.keys() == original.keys() and all(torch.equal(t, original[k]) for k, t in written.items())
    equal, lines = diff(ours, convert(back, tmp_path / "again", "dcp", progress=False))
    assert equal, lines


def test_a_rank_holding_some_experts_requests_only_their_rows_of_mlp1(titan, monkeypatch):
    """Experts [1, 3) of the gate, up and their biases (as an expert-parallel rank holds them): the
    fused tensors are asked for those rows only, and split into the checkpoint's values."""
    _, path, args = titan
    opened = open_model_checkpoint(path, args, model="gpt_oss")
    fqns = [f"layers.1.moe.experts.{w}" for w in ("w1", "w3", "b1", "b3")]
    windows = {fqn: RowWindow(torch.empty(2, *opened.infos[fqn].shape[1:]), 1) for fqn in fqns}
    asked, read_data = [], OwnedFileSystemReader.read_data
    monkeypatch.setattr(
        OwnedFileSystemReader,
        "read_data",
        lambda self, plan, planner: asked.extend(plan.items) or read_data(self, plan, planner),
    )
    opened.load(dict(windows))
    rows = {(i.storage_offsets[0], i.storage_offsets[0] + i.lengths[0]) for i in asked if i.storage_index.fqn == MLP1}
    assert rows == {(1, 3)}, f"{MLP1}: rows {rows} asked for"
    assert all(0 < i.storage_offsets[0] and i.storage_offsets[0] + i.lengths[0] <= 3 for i in asked)
    for fqn, window in windows.items():
        assert torch.equal(window.dest, opened.read_tensor(fqn)[1:3]), fqn
