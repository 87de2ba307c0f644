"""GLM-4.5 MoE against ``transformers``' ``Glm4MoeForCausalLM`` (the released shapes' parameter counts:
``tests/test_families.py``): logits both ways on awkward tiny configs (partial RoPE at a half, a
quarter given the pre-transformers-5 way, and whole heads; q/k norms; biases; grouped routing with a
correction bias that moves the choice; shared experts; dense first layers; tied embeddings; YaRN),
the multi-token-prediction layer skipped in one line, config fields refused in one line, the
partial RoPE itself against transformers', and pp2 x dp_shard2 x ep2 with one process's losses."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from models.common.rope import apply_rotary_emb, precompute_freqs_cis
from models.glm4_moe import FLAVORS
from models.glm4_moe.hf import args_from_config, config
from models.registry import get_family
from seedckpt import load_model
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import tiny_config
from tests.test_deepseek_v3 import _close, assert_both_ways, convert_with_extra_layer
from tests.test_train import losses, torchrun

transformers = pytest.importorskip("transformers")

FAMILY = get_family("glm4_moe")
TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
# A tiny GLM-4.5: a dense layer then two MoE layers, heads of 16 over 2 key/value heads
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    attention_bias=True,
    max_position_embeddings=64,
)
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    # GLM-4.5's: half of each head turned, q/k norms, 4 groups of 2 (2 kept), weights times 2.5, YaRN
    "half_qk_norm_groups_yarn": dict(
        use_qk_norm=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        rope_parameters={**YARN, "partial_rotary_factor": 0.5},
    ),
    # a quarter turned, given at the top level as files before transformers 5 give it; two shared
    # experts, no renormalization, no dense layer, tied embeddings, no biases
    "quarter_top_level_tied": dict(
        n_shared_experts=2,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    # whole heads turned (head_dim 24, not hidden / heads), no shared experts, all experts but one chosen
    "whole_heads_no_shared": dict(
        head_dim=24,
        n_shared_experts=0,
        num_experts_per_tok=7,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
    ),
}
# config.json edits after save_pretrained: the pre-transformers-5 layout of the quarter case
EDITS = {
    "quarter_top_level_tied": lambda cfg: {
        **{k: v for k, v in cfg.items() if k != "rope_parameters"},
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.25,
    },
}


def hf_model(path: Path, case: str | None = None, **changes) -> Path:
    """A random ``Glm4MoeForCausalLM`` saved at ``path``: every tensor random, norms near one, the
    correction bias large enough to change which experts tokens pick."""
    torch.manual_seed(6)
    fields = TINY | (CASES[case] if case else {}) | changes
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.3 if p.dim() == 1 else 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.eval().save_pretrained(path)
    if case in EDITS:
        (path / "config.json").write_text(json.dumps(EDITS[case](json.loads((path / "config.json").read_text()))))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(tmp_path, case):
    """HF -> DCP -> our model, HF -> our pp=2 stages directly, ``load_model``, and DCP -> HF that
    ``transformers`` loads: logits within 1e-5 of ``Glm4MoeForCausalLM``'s each way on 40 positions
    (past YaRN's original 16), the HF tensors written back bitwise the originals. The correction bias
    changes the logits: it is computed, not dropped."""
    path = hf_model(tmp_path / "hf", case)
    hf, want = assert_both_ways(path, transformers.Glm4MoeForCausalLM, TOKENS, tmp_path)
    with torch.no_grad():
        for layer in hf.model.layers[hf.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert (hf(TOKENS).logits - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_partial_rope_turns_the_first_channels_as_transformers_does(fraction):
    """Our partial RoPE (interleaved pairs among a head's first ``rotary_dim`` channels, the rest
    passed through) is transformers' GLM rotation (halves of those channels) once those rows are
    permuted, at positions 0..39; the passed-through channels come out bitwise."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    args = FLAVORS["debug"].__class__(**(FLAVORS["debug"].to_dict() | {"partial_rotary_factor": fraction}))
    hf_config = transformers.Glm4MoeConfig(**config(args, torch.float32))
    rotary = args.rotary_dim
    q = torch.randn(1, 40, 2, args.head_dim, generator=torch.Generator().manual_seed(7))
    theirs_q = q.clone()
    theirs_q[..., :rotary] = torch.cat([q[..., :rotary:2], q[..., 1:rotary:2]], dim=-1)  # our pairs as halves
    cos, sin = Glm4MoeRotaryEmbedding(hf_config)(q, torch.arange(40)[None])
    want, _ = apply_rotary_pos_emb(theirs_q.transpose(1, 2), theirs_q.transpose(1, 2), cos, sin)
    got = apply_rotary_emb(q, precompute_freqs_cis(args)[:40])
    as_halves = torch.cat([got[..., :rotary:2], got[..., 1:rotary:2], got[..., rotary:]], dim=-1)
    assert (as_halves - want.transpose(1, 2)).abs().max().item() <= 1e-5
    assert torch.equal(got[..., rotary:], q[..., rotary:])


def test_the_multi_token_prediction_layer_is_skipped_in_one_line(tmp_path):
    """A hub-like directory whose files hold one more layer (``model.layers.3``: the MTP layer's own
    tensors and a decoder layer's) converts with one warning line naming it, and the model computes
    transformers' logits (its class leaves the layer out too)."""
    path = hf_model(tmp_path / "hf", "half_qk_norm_groups_yarn")
    mtp = {f"model.layers.3.{n}": torch.randn(64, 64) for n in ("eh_proj.weight", "self_attn.o_proj.weight")}
    mtp |= {"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.self_attn.q_norm.weight": torch.ones(16)}
    said = [str(note) for note in convert_with_extra_layer(path, mtp, tmp_path / "dcp")]
    assert said == [
        "model.layers.3 and up (GLM-4.5's multi-token-prediction module) are skipped: this model, like "
        "transformers', predicts the next token only"
    ]
    with torch.no_grad():
        want = transformers.Glm4MoeForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        assert (load_model(tmp_path / "dcp")(TOKENS) - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("partial_rotary_factor", 1.5, "partial_rotary_factor = 1.5"),
        ("partial_rotary_factor", 0.35, "partial_rotary_factor = 0.35 turns 5"),  # an odd width (16 x 0.35)
        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "'dynamic' RoPE scaling"),
        ("use_qk_norm", "yes", "use_qk_norm = 'yes'"),
        ("num_experts_per_tok", 9, "top_k=9 exceeds n_experts=8"),
    ],
)
def test_config_fields_not_computed_are_refused_in_one_line(field, value, named):
    with pytest.raises(ValueError) as refused:
        args_from_config({"model_type": "glm4_moe", **TINY, field: value})
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_other_families_refuse_a_partial_rotary_width():
    """A family that turns whole heads refuses ``partial_rotary_factor`` other than 1, plain RoPE too."""
    llama = get_family("llama3").hf.args_from_config
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96}
    llama({**base, "partial_rotary_factor": 1.0})
    for rope in (
        {"partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ):
        with pytest.raises(ValueError, match="partial_rotary_factor = 0.5; this family rotates whole heads"):
            llama({**base, **rope})


def test_flavors_read_back_and_an_export_refuses_a_window():
    for name, args in FLAVORS.items():
        assert args_from_config(config(args, torch.bfloat16)) == args, name
    assert (FLAVORS["355B-A32B"].rotary_dim, FLAVORS["106B-A12B"].qk_norm) == (64, False)
    windowed = FLAVORS["debug"].__class__(**(FLAVORS["debug"].to_dict() | {"sliding_window": 8}))
    with pytest.raises(ValueError, match="GLM-4.5's config.json has no sliding window"):
        config(windowed, torch.bfloat16)


M = ["--model.name", "glm4_moe"]
STEPS = ["--training.steps", "4", "--checkpoint.interval", "2"]


@pytest.mark.slow
def test_the_seed_trains_on_pp2_x_dp_shard2_x_ep2_with_one_process_losses(tmp_path):
    """The debug GLM-4.5 (partial RoPE, q/k norms, biases, grouped routing balanced by the correction
    bias, a shared expert, a dense first layer) from its seed: pp2 x dp_shard2 x ep2 trains with one
    process's losses within 1e-5."""
    seed = create_seed_checkpoint(tiny_config(*M), tmp_path / "seed", seed=0, progress=False)
    torchrun(tmp_path / "one", seed, 1, *M, "--parallelism.pipeline_parallel_degree", "1", *STEPS)
    pp2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4", *STEPS]
    with warnings.catch_warnings():
        torchrun(tmp_path / "pp2_dp2_ep2", seed, 4, *M, *pp2)
    _close(losses(tmp_path / "pp2_dp2_ep2"), losses(tmp_path / "one"), "pp2 x dp_shard2 x ep2")
