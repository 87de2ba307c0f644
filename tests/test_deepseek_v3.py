"""DeepSeek-V3 against ``transformers``' ``DeepseekV3ForCausalLM`` (the released shapes' parameter
counts: ``tests/test_families.py``): MLA's FLOPs, ``config.json`` both ways (the hub's own file),
logits both ways on awkward configs (low-rank or plain q, RoPE rows interleaved or halves, groups,
shared experts, YaRN's two mscales, a non-zero correction bias), the multi-token-prediction layer
skipped in one line, torchtitan 0.3.0's names, an FP8 directory, and MLA under TP, PP, FSDP2 and EP."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from models.common.decoder import Transformer
from models.deepseek_v3 import FLAVORS, attention_flops
from models.deepseek_v3.hf import args_from_config, config
from models.registry import family_of, get_family
from seedckpt import load_model
from seedckpt.cli.convert import convert
from seedckpt.cli.main import main as cli
from seedckpt.materialize.init_recipe import TensorInit, init_model
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.quantizers import quantize_directory, reference_fp8
from tests.test_convert import our_logits
from tests.test_moe_interop import _stored
from tests.test_sft import PP2_DP2, chat_inputs, sft  # noqa: F401 (chat_inputs: a fixture)
from tests.test_train import losses, model_state, torchrun

transformers = pytest.importorskip("transformers")

FAMILY = get_family("deepseek_v3")
TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))

# deepseek-ai/DeepSeek-V3's config.json as published (less auto_map), FP8 table included.
HUB_671B = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# Awkward tiny configs, each a different path through MLA, routing and the names.
CASES = {
    # low-rank q, 4 groups of 2 experts (2 kept), one shared expert, YaRN with unequal mscales
    "low_rank_q_groups_yarn": dict(
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    # plain q, HF's halves-rotated RoPE rows, two shared experts, no renormalization, no dense layer
    "plain_q_halves_two_shared": dict(
        q_lora_rank=None,
        rope_interleave=False,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
    ),
    # no shared experts (transformers stores empty ones), two dense layers of three, tied embeddings
    "no_shared_tied": dict(n_shared_experts=0, first_k_dense_replace=2, tie_word_embeddings=True),
}


# A tiny DeepSeek-V3: two MoE layers after a dense one, low-rank q, unequal head widths
TINY_FIELDS = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,
)


def hf_config(**changes) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(**(TINY_FIELDS | changes))


def hf_model(path: Path, **changes) -> Path:
    """A random ``DeepseekV3ForCausalLM`` saved at ``path``: every tensor random, norms too, and the
    correction bias large enough to change which experts tokens pick."""
    torch.manual_seed(4)
    model = transformers.DeepseekV3ForCausalLM(hf_config(**changes))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.eval().save_pretrained(path)
    return path


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        out.update(load_file(file))
    return out


def test_config_both_ways_the_hub_config_and_mla_flops():
    """Every sigmoid-routed flavor's config.json reads back as the flavor (their parameter counts
    against transformers': ``tests/test_families.py``; the softmax-routed ones, written as DeepSeek-V2:
    ``tests/test_deepseek_v2.py``); the hub's config.json reads as the 671B flavor, YaRN and its
    softmax scale included. FLOPs: attention grows by 6·L·H·(qk_nope + qk_rope + v) per token of
    context, and a dense layer costs about what an MoE layer does (its 9 active experts' width is
    the dense width)."""
    for name in ("debug", "671B"):
        assert args_from_config(config(FLAVORS[name], torch.bfloat16)) == FLAVORS[name], name
    args = args_from_config(HUB_671B)
    assert FAMILY.flavor_of(args) == "671B" and args.softmax_scale == FLAVORS["671B"].softmax_scale
    big = FLAVORS["671B"]
    grown = FAMILY.flops_per_token(big, 8192) - FAMILY.flops_per_token(big, 4096)
    assert grown == 61 * 6 * 128 * (128 + 64 + 128) * 4096 == big.n_layers * attention_flops(big, 0, 4096)
    costs = FAMILY.layer_flops(big, 4096).blocks
    assert costs[0] == costs[2] and 1.0 < costs[3] / costs[0] < 1.01  # dense 0-2, MoE 3-60


# torchtitan 0.3.0's DeepSeek-V3 init (``torchtitan/models/deepseek_v3/__init__.py``): every linear
# trunc_normal_(std) at its default absolute bounds +-2; std 0.02, or the layer's depth-scaled std
# 0.02 / sqrt(2 (layer + 1)) for these (the router's gate among them).
DEPTH_SCALED = ("attention.wo", "feed_forward.w2", "feed_forward.w3", "moe.router.gate")
DEPTH_SCALED += ("moe.experts.w2", "moe.experts.w3", "moe.shared_experts.w2", "moe.shared_experts.w3")


def _torchtitan_recipe(fqn: str, dim: int) -> TensorInit:
    if fqn == "tok_embeddings.weight":
        return TensorInit("normal", std=1.0)
    if fqn == "output.weight":
        return TensorInit("trunc_normal", std=dim**-0.5, cutoff=3.0)
    if fqn.endswith("norm.weight"):
        return TensorInit("ones")
    if fqn.endswith("expert_bias"):
        return TensorInit("zeros")
    layer, name = fqn.split(".", 2)[1:]
    std = 0.02 / math.sqrt(2 * (int(layer) + 1)) if name.removesuffix(".weight") in DEPTH_SCALED else 0.02
    return TensorInit("trunc_normal", std=std, cutoff=2.0 / std)


@pytest.mark.parametrize("q_lora_rank", [64, 0])
def test_the_init_recipe_is_torchtitans_per_tensor(q_lora_rank):
    """Every tensor of the debug model (low-rank q and plain) is initialized once, with torchtitan's
    DeepSeek-V3 recipe for it, read on ``meta``."""
    args = dataclasses.replace(FLAVORS["debug"], q_lora_rank=q_lora_rank)
    with torch.device("meta"):
        model = Transformer(args)
    specs = init_model(model, seed=0, materialize=False)
    assert set(specs) == set(model.state_dict())
    assert {fqn: _torchtitan_recipe(fqn, args.dim) for fqn in specs} == specs


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("num_key_value_heads", 2, "num_key_value_heads = 2"),
        ("scoring_func", "softmax", "scoring_func = 'softmax'"),
        ("topk_method", "greedy", "topk_method = 'greedy'"),
        ("attention_bias", "yes", "attention_bias = 'yes'"),
        ("moe_layer_freq", 2, "moe_layer_freq = 2"),
        ("n_group", 3, "n_group = 3"),
    ],
)
def test_config_fields_not_computed_are_refused_in_one_line(field, value, named):
    with pytest.raises(ValueError) as refused:
        args_from_config({**HUB_671B, field: value})
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(tmp_path, case):
    """HF -> DCP -> our model, HF -> our pp=2 stages directly (a fine-tuning start's load),
    ``load_model``, and DCP -> HF that ``transformers`` loads: logits within 1e-5 of
    ``DeepseekV3ForCausalLM``'s each way, the correction bias non-zero, on 40 positions (past YaRN's
    original 16); the HF tensors written back are bitwise the originals (empty shared experts aside).
    The bias changes the logits: it is computed, not dropped."""
    path = hf_model(tmp_path / "hf", **CASES[case])
    hf, want = assert_both_ways(path, transformers.DeepseekV3ForCausalLM, TOKENS, tmp_path)
    with torch.no_grad():
        for layer in hf.model.layers[hf.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert (hf(TOKENS).logits - want).abs().max().item() > 1e-3


def assert_both_ways(path: Path, model_class, tokens: torch.Tensor, tmp_path: Path):
    """HF -> DCP -> our model, HF -> our pp=2 stages directly (a fine-tuning start's load),
    ``load_model``, and DCP -> HF that ``model_class`` loads: logits within 1e-5 of its own each way;
    the HF tensors written back are bitwise the originals (empty ones aside). Returns the
    ``transformers`` model and its logits."""
    hf = model_class.from_pretrained(path).eval()
    with torch.no_grad():
        want = hf(tokens).logits
        convert(path, tmp_path / "dcp", "dcp", progress=False)
        for source, pp in ((tmp_path / "dcp", 1), (path, 2)):
            assert (our_logits(source, tokens, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        assert (load_model(path)(tokens) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        original = {k: t for k, t in hf_tensors(path).items() if t.numel()}
        assert hf_tensors(tmp_path / "back").keys() == original.keys()
        assert all(torch.equal(t, original[k]) for k, t in hf_tensors(tmp_path / "back").items())
        back = model_class.from_pretrained(tmp_path / "back").eval()
        assert (back(tokens).logits - want).abs().max().item() <= 1e-5
    return hf, want


def convert_with_extra_layer(path: Path, tensors: dict[str, torch.Tensor], dst: Path) -> list:
    """``tensors`` (a layer past the last: a multi-token-prediction module) added to the HF directory
    ``path`` in a file of their own, listed in its index; then ``seedckpt convert`` to DCP at ``dst``,
    which must succeed: the warnings it gave about multi-token prediction."""
    index = {"metadata": {}, "weight_map": dict.fromkeys(hf_tensors(path), "model.safetensors")}
    save_file(tensors, path / "mtp.safetensors")
    index["weight_map"] |= dict.fromkeys(tensors, "mtp.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.warns(UserWarning) as caught:
        assert cli(["convert", str(path), str(dst), "--to", "dcp", "--quiet"]) == 0
    return [w.message for w in caught if "multi-token" in str(w.message)]


def test_the_multi_token_prediction_layer_is_skipped_in_one_line(tmp_path):
    """A hub-like directory whose files hold one more layer (``model.layers.3``: the MTP module's
    own tensors and a layer's) converts with one warning line naming it, and the model computes
    transformers' logits."""
    path = hf_model(tmp_path / "hf")
    mtp = {f"model.layers.3.{n}": torch.randn(64, 64) for n in ("eh_proj.weight", "self_attn.o_proj.weight")}
    mtp |= {"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.shared_head.norm.weight": torch.ones(64)}
    notes = convert_with_extra_layer(path, mtp, tmp_path / "dcp")
    said = [str(note) for note in notes]
    assert said == [
        "model.layers.3 and up (DeepSeek-V3's multi-token-prediction module) are skipped: this model, like "
        "transformers', predicts the next token only"
    ]
    # the command prints it as one line, like its errors
    assert warnings.formatwarning(notes[0], UserWarning, "x.py", 1) == f"warning: {said[0]}\n"
    with torch.no_grad():
        want = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        assert (load_model(tmp_path / "dcp")(TOKENS) - want).abs().max().item() <= 1e-5


# torchtitan 0.3.0's DeepSeek-V3 state dict (``torchtitan.models.deepseek_v3``, read from the
# installed package): per layer, its name -> HF's; experts stacked [E, ...]; no model. prefix.
TITAN_LAYER = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TITAN_DENSE = {f"feed_forward.{w}.weight": f"mlp.{p}.weight" for w, p in (("w1", "gate_proj"), ("w2", "down_proj"))}
TITAN_DENSE |= {"feed_forward.w3.weight": "mlp.up_proj.weight"}
TITAN_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias_E": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
TITAN_EXPERTS = {"w1_EFD": "gate_proj", "w2_EDF": "down_proj", "w3_EFD": "up_proj"}
TITAN_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
TITAN_TOP |= {"lm_head.weight": "lm_head.weight"}


def _titan_checkpoint(hf_dir: Path, path: Path) -> Path:
    """``hf_dir``'s weights as torchtitan 0.3.0 saves a DeepSeek-V3 step (rows as they are: its RoPE
    rotates interleaved pairs, as DeepSeek's weights do)."""
    hf = hf_tensors(hf_dir)
    state = {ours: hf[theirs] for ours, theirs in TITAN_TOP.items()}
    for i in range(3):
        layer = TITAN_LAYER | (TITAN_DENSE if i == 0 else TITAN_MOE)
        state |= {f"layers.{i}.{ours}": hf[f"model.layers.{i}.{theirs}"] for ours, theirs in layer.items()}
        for ours, theirs in TITAN_EXPERTS.items() if i else ():
            experts = [hf[f"model.layers.{i}.mlp.experts.{e}.{theirs}.weight"] for e in range(8)]
            state[f"layers.{i}.moe.routed_experts.inner_experts.{ours}"] = torch.stack(experts)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_torchtitan_checkpoints_are_read_and_written(tmp_path):
    """A torchtitan 0.3.0 DeepSeek-V3 checkpoint (its names, its trained expert bias) computes
    transformers' logits on the same weights; ``--to torchtitan`` writes back its tensors bitwise."""
    path = hf_model(tmp_path / "hf")
    titan = _titan_checkpoint(path, tmp_path / "titan")
    args = open_model_checkpoint(path).args
    with torch.no_grad():
        want = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        assert (load_model(titan, model="deepseek_v3", args=args)(TOKENS) - want).abs().max().item() <= 1e-5
    ours = convert(titan, tmp_path / "ours", "dcp", progress=False, args=args, model="deepseek_v3")
    back = convert(ours, tmp_path / "back", "torchtitan", progress=False)
    original, written = _stored(titan), _stored(back)
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)


# What DeepSeek-V3's FP8 release quantizes: every projection of attention, dense layers and experts
# (the router, norms, embedding and output stay in bf16).
FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_an_fp8_directory_loads_to_fp8s_error(tmp_path):
    """DeepSeek-V3's own FP8 layout on a random model whose projections end in partial 128-blocks
    (``kv_a_proj_with_mqa`` 160 x 192, ``q_b_proj`` 192 x 144 ...): every quantized weight is within
    e4m3's error of the float32 original (half a step of 3 mantissa bits, 2^-4 of a value, or 2^-10 of
    its block's scale below e4m3's normals), the logits within 1e-5 of transformers' on the values the
    blocks stand for, and further from the original's than that: FP8 did change the model."""
    path = hf_model(tmp_path / "hf", hidden_size=192, kv_lora_rank=128, qk_rope_head_dim=32, q_lora_rank=144)
    quantize_directory(path, tmp_path / "fp8", "fp8", lambda name, _: name.split(".")[-2] in FP8, tmp_path / "values")
    stored, original = hf_tensors(tmp_path / "fp8"), hf_tensors(path)
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
    worst = 0.0
    for name, values in stored.items():
        if name.endswith("weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            scales = reference_fp8(torch.ones_like(stored[weight], dtype=torch.float32), values)
            bound = 2**-4 * original[weight].abs() + 2**-10 * scales
            error = (reference_fp8(stored[weight], values) - original[weight]).abs()
            assert (error <= bound * (1 + 1e-6)).all(), weight
            worst = max(worst, (error / bound).max().item())
    assert worst > 0.5
    ours = load_model(tmp_path / "fp8")
    with torch.no_grad():
        want = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "values").eval()(TOKENS).logits
        unquantized = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        assert (ours(TOKENS) - want).abs().max().item() <= 1e-5
    assert (want - unquantized).abs().max().item() > 1e-4


def _tp_worker(rank, world_size, seeds):
    """Per seed: the loss and every full gradient of one packed batch on one process and under tp2
    (sequence parallel, loss parallel), through the seed's family's plan: (loss on one process, under
    tp2, each gradient's largest gap, the same gradients' names, each gradient's largest value)."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.train.trainer import token_cross_entropy

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tokens = torch.arange(64).reshape(2, 32) * 7 % 500
    labels = torch.roll(tokens, -1, 1)
    positions = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, 32)
    documents = torch.cat([torch.zeros(20, dtype=torch.long), torch.ones(12, dtype=torch.long)]).expand(2, 32)
    out = {}
    for name, seed in seeds.items():
        args = open_model_checkpoint(seed).args
        results = []
        for tp in (False, True):
            plan = family_of(args).tensor_parallel
            shard = (lambda m: plan.apply(m, mesh["tp"], True)) if tp else None
            [model] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=seed, shard_fn=shard)
            with loss_parallel() if tp else contextlib.nullcontext():
                loss = token_cross_entropy(model(tokens, positions=positions, document_ids=documents), labels)
                loss.backward()
            full = {n: p.grad.full_tensor() if tp else p.grad for n, p in model.named_parameters()}
            results.append((float(loss.full_tensor() if tp else loss), full))
        (loss_one, grads_one), (loss_tp, grads_tp) = results
        gaps = {n: (grads_tp[n] - grads_one[n]).abs().max().item() for n in grads_one}
        scales = {n: grads_one[n].abs().max().item() for n in grads_one}
        out[name] = (loss_one, loss_tp, gaps, sorted(grads_one) == sorted(grads_tp), scales)
    return out


@pytest.mark.slow
def test_mla_under_tp_computes_one_process_gradients(tmp_path):
    """tp2 with sequence parallelism on a packed batch, low-rank and plain q (with attention biases:
    wkv_a's replicated, wo's after the rowwise sum): the loss within 1e-5 of one process's and every
    gradient within 1e-5 -- the replicated down projections' too, whose shared RoPE key each rank's
    heads reach only in part."""
    seeds = {
        q: str(
            create_seed_checkpoint(
                tiny_config(*M, "--model.q_lora_rank", q, "--model.attention_bias", str(q == "0").lower()),
                tmp_path / q,
                seed=1,
                progress=False,
            )
        )
        for q in ("64", "0")
    }
    results = run_distributed(_tp_worker, 2, seeds)
    for name in seeds:
        loss_one, loss_tp, gaps, same_names, _ = results[0][name]
        assert same_names and "layers.1.attention.wkv_a.weight" in gaps, name
        assert ("layers.1.attention.wo.bias" in gaps) == (name == "0"), name
        assert abs(loss_tp - loss_one) <= 1e-5 * loss_one, (name, loss_tp, loss_one)
        assert max(gaps.values()) <= 1e-5, (name, {n: g for n, g in gaps.items() if g > 1e-5})


@pytest.mark.parametrize(
    "config,world,overrides,per_rank,per_gpu,state_gib",
    [
        ("deepseek_v3_671b", 256, [], 32, 8, 42.9),
        ("deepseek_v3_671b", 2048, ["pipeline_parallel_degree", "16", "expert_parallel_degree", "64"], 4, 2, 5.4),
        ("deepseek_v3_16b", 8, [], 8, 8, 29.3),
    ],
)
def test_the_shipped_configs_plan_each_gpus_share(capsys, config, world, overrides, per_rank, per_gpu, state_gib):
    """``seedckpt plan`` of the shipped configs (671B on 256 GPUs, and on 2048 as DeepSeek laid it
    out): the experts an EP rank and a GPU hold, every parameter on one stage, compute within 5 % of
    balanced, and the largest share of fp32 parameters, gradients and AdamW state a GPU holds (the
    figures docs/model_families.md quotes)."""
    argv = ["plan", "--config", f"configs/{config}.toml", "--world-size", str(world), "--json"]
    argv += [f"--parallelism.{key}" if i % 2 == 0 else key for i, key in enumerate(overrides)]
    assert cli(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["experts_per_ep_rank"], plan["expert_rows_per_gpu"]) == (per_rank, per_gpu)
    assert sum(stage["params"] for stage in plan["stages"]) == plan["total_params"]
    assert plan["imbalance"]["stage_flops"] <= 1.05
    assert round(max(rank["train_state_bytes_per_gpu"] for rank in plan["ranks"]) / 2**30, 1) == state_gib


M = ["--model.name", "deepseek_v3"]
ONE = ["--parallelism.pipeline_parallel_degree", "1"]
STEPS = ["--training.steps", "4", "--checkpoint.interval", "2"]


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}, step {step}: {a} vs {b}"


@pytest.mark.slow
def test_layouts_match_one_process_and_resume_bitwise(tmp_path):
    """The debug DeepSeek-V3 (MLA, YaRN, grouped routing, a shared expert, the bias balancing) from
    its seed: pp2 x dp_shard2 x ep2 and tp2 x ep2 (sequence parallel, the experts over the TP ranks)
    train with one process's losses within 1e-5; pp2 x dp_shard2 x ep2 saved at step 2 resumes
    bitwise (losses and every tensor of step 4, the moving expert bias included)."""
    seed = create_seed_checkpoint(tiny_config(*M), tmp_path / "seed", seed=0, progress=False, workers=1)
    torchrun(tmp_path / "one", seed, 1, *M, *ONE, *STEPS)
    want = losses(tmp_path / "one")
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    pp2 = [*ep2, "--training.local_batch_size", "4", *STEPS]
    torchrun(tmp_path / "pp2_dp2_ep2", seed, 4, *M, *pp2)
    _close(losses(tmp_path / "pp2_dp2_ep2"), want, "pp2 x dp_shard2 x ep2")
    tp2 = [*ONE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "true"]
    torchrun(tmp_path / "tp2_ep2", seed, 2, *M, *tp2, *ep2, *STEPS)
    _close(losses(tmp_path / "tp2_ep2"), want, "tp2 x ep2")
    shutil.copytree(tmp_path / "pp2_dp2_ep2" / "ckpt" / "step-2", tmp_path / "resumed" / "ckpt" / "step-2")
    torchrun(tmp_path / "resumed", seed, 4, *M, *pp2)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "pp2_dp2_ep2")[2:]
    a, b = (model_state(tmp_path / run / "ckpt" / "step-4") for run in ("pp2_dp2_ep2", "resumed"))
    assert "layers.1.moe.expert_bias" in a and [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.slow
def test_sft_from_an_hf_directory_on_pp2_x_dp2_x_ep2_exports_its_trained_bias(tmp_path, chat_inputs):
    """SFT from a transformers DeepSeek-V3 directory on pp=2 x dp_shard=2, the experts over the two
    DP ranks, balanced by the correction bias: the masked loss falls, the bias moves, and the
    end-of-run HF export -- trained bias included, which HF's class holds -- loads in transformers
    with our checkpoint's logits."""
    tokenizer, chats, tokenizer_vocab = chat_inputs
    path = hf_model(tmp_path / "hf", vocab_size=-(-tokenizer_vocab // 8) * 8)
    export = ["--checkpoint.export_at_end", "hf", "--checkpoint.export_dtype", "float32"]
    steps = ["--training.steps", "6", "--checkpoint.interval", "6"]
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    sft(tmp_path / "run", path, tokenizer, chats, 4, *PP2_DP2, *ep2, *export, *steps)
    loss = losses(tmp_path / "run")
    assert len(loss) == 6 and loss[-1] < loss[0] - 0.3, loss
    step = tmp_path / "run" / "ckpt" / "step-6"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(hf_tensors(Path(f"{step}-hf"))[bias], hf_tensors(path)[bias])
    ours = load_model(step)
    tokens = TOKENS % ours.args.vocab_size
    with torch.no_grad():
        exported = transformers.DeepseekV3ForCausalLM.from_pretrained(f"{step}-hf").eval()(tokens).logits
        assert (exported - ours(tokens)).abs().max().item() <= 1e-5
