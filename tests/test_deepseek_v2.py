"""Softmax-routed DeepSeek (DeepSeek-V2's routing, torchtitan's DeepSeek recipes) against
``transformers``' ``DeepseekV2ForCausalLM``: logits both ways on tiny awkward configs (greedy and
group-limited routing, plain and low-rank q, YaRN past its original context, a block epsilon the
latent norms do not take), ``config.json`` fields refused in one line, exports a class cannot compute
refused before anything is written, the torchtitan flavors' routing and parameter counts, and
torchtitan's own checkpoints (names, its expert bias on the softmax scores) with torchtitan's logits."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models.common.moe import moe_modules
from models.deepseek_v3 import FLAVORS
from models.deepseek_v3.hf_v2 import args_from_config, config
from models.registry import get_family
from seedckpt import load_model
from seedckpt.cli.main import main as cli
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
from tests.test_deepseek_v3 import (
    ONE,
    STEPS,
    TINY_FIELDS,
    TITAN_DENSE,
    TITAN_EXPERTS,
    TITAN_LAYER,
    TITAN_MOE,
    TITAN_TOP,
    M,
    _close,
    assert_both_ways,
    hf_tensors,
)
from tests.test_train import losses, torchrun

transformers = pytest.importorskip("transformers")

FAMILY = get_family("deepseek_v3")
TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# DeepSeek-V3's tiny fields less its routing; V2's routing per case
TINY = {k: v for k, v in TINY_FIELDS.items() if k not in ("n_group", "topk_group")} | dict(routed_scaling_factor=1.0)
CASES = {
    # DeepSeek-V2-Lite's routing: the top 3 of 8 softmax scores, no low-rank q, YaRN with equal mscales
    "greedy_plain_q_yarn": dict(q_lora_rank=None, n_shared_experts=2, rope_parameters=YARN),
    # DeepSeek-V2's: 4 groups of 4 ranked by their best score, 2 kept, weights times 16, low-rank q, a
    # block epsilon of 1e-2 (the latent norms keep 1e-6), no dense layer
    "group_limited_low_rank_eps": dict(
        topk_method="group_limited_greedy",
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
        rms_norm_eps=1e-2,
        first_k_dense_replace=0,
    ),
    # no shared experts (transformers stores empty ones), every expert chosen, tied embeddings
    "no_shared_all_experts_tied": dict(n_shared_experts=0, num_experts_per_tok=8, tie_word_embeddings=True),
}


def hf_model(path, **changes):
    """A random ``DeepseekV2ForCausalLM`` saved at ``path``: every tensor random, norms too."""
    torch.manual_seed(5)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**(TINY | changes)))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.08)
    model.eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_deepseek_v2_both_ways(tmp_path, case):
    """HF -> DCP -> our model, HF -> our pp=2 stages, ``load_model``, and DCP -> HF that
    ``transformers`` loads as ``DeepseekV2ForCausalLM``: logits within 1e-5 of its own each way, on 40
    positions (past YaRN's original 16); the tensors written back are bitwise the originals."""
    path = hf_model(tmp_path / "hf", **CASES[case])
    assert_both_ways(path, transformers.DeepseekV2ForCausalLM, TOKENS, tmp_path)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "deepseek_v2"


def test_the_routing_is_computed_not_assumed(tmp_path):
    """The same weights read as DeepSeek-V3 (sigmoid, renormalized) compute other logits, and a
    group ranked by its two best scores instead of its best picks other experts: each option is
    what moves the logits onto transformers'."""
    case = CASES["group_limited_low_rank_eps"]
    path = hf_model(tmp_path / "hf", **case)
    args = open_model_checkpoint(path).args
    assert (args.score_func, args.group_top, args.n_group, args.norm_topk_prob) == ("softmax", 1, 4, False)
    model = load_model(path)
    with torch.no_grad():
        want = transformers.DeepseekV2ForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        assert (model(TOKENS) - want).abs().max().item() <= 1e-5
        for other in (dict(score_func="sigmoid", norm_topk_prob=True), dict(group_top=2)):
            for moe in moe_modules(model):
                moe.router.options = dataclasses.replace(moe.options, **other)
            assert (model(TOKENS) - want).abs().max().item() > 1e-3, other


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("topk_method", "noaux_tc", "topk_method = 'noaux_tc'"),
        ("scoring_func", "sigmoid", "scoring_func = 'sigmoid'"),
        ("norm_topk_prob", True, "norm_topk_prob = true"),
        ("num_experts_per_tok", None, "lacks num_experts_per_tok"),
        ("n_group", None, "lacks n_group"),
        ("moe_layer_freq", 2, "moe_layer_freq = 2"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ],
)
def test_deepseek_v2_fields_not_computed_are_refused_in_one_line(field, value, named):
    cfg = {"model_type": "deepseek_v2", **TINY, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}
    with pytest.raises(ValueError) as refused:
        args_from_config({**cfg, field: value})
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_torchtitan_flavors_route_as_torchtitan_and_export_where_a_class_can(tmp_path):
    """torchtitan 0.3.0's recipes (``torchtitan.models.deepseek_v3``, read from the installed
    package): debugmodel, 16B and 236B route by softmax without renormalization (236B in 8 groups, 3
    kept, ranked by their two best scores, times 16), 671B by sigmoid; YaRN's mscale 0.70 (236B,
    671B: 1.0) in the softmax scale only. 16B reads back from the DeepSeek-V2 config.json it exports
    as; 236B has no transformers class, so its export is refused in one line before any file."""
    routing = {
        name: (args.score_func, args.n_group, args.topk_group, args.norm_topk_prob, args.routed_scaling_factor)
        for name, args in FLAVORS.items()
    }
    assert routing["debugmodel"] == routing["16B"] == ("softmax", 1, 1, False, 1.0)
    assert routing["236B"] == ("softmax", 8, 3, False, 16.0) and FLAVORS["236B"].group_top == 2
    assert routing["671B"] == ("sigmoid", 8, 4, True, 2.5)
    mscale = 0.1 * 0.70 * math.log(40) + 1
    assert FLAVORS["16B"].softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    for name in ("debugmodel", "16B"):
        with pytest.warns(UserWarning, match="latent_norm_eps = 1e-05: transformers' DeepSeek classes"):
            written = config(FLAVORS[name], torch.bfloat16)
        assert (written["model_type"], written["topk_method"]) == ("deepseek_v2", "greedy")
        # what transformers' class cannot hold: the expert bias (balanced by the auxiliary loss instead),
        # torchtitan's epsilon in the latent norms (written with a warning line)
        unheld = dict(load_balance="aux_loss", latent_norm_eps=1e-6)
        assert args_from_config(written) == dataclasses.replace(FLAVORS[name], **unheld)
    with pytest.raises(ValueError, match="transformers' DeepSeek-V2 ranks a group by its best one"):
        config(FLAVORS["236B"], torch.bfloat16)
    seed = tmp_path / "seed"
    small = dict(dim=64, n_layers=2, n_heads=2, vocab_size=64, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8)
    small |= dict(qk_rope_head_dim=8, v_head_dim=8, ffn_dim=32, moe_ffn_dim=16, n_experts=16)
    overrides = [part for key, value in small.items() for part in (f"--model.{key}", str(value))]
    flavor = ["--model.name", "deepseek_v3", "--model.flavor", "236B"]
    assert cli(["seed", "--config", "configs/debug.toml", *flavor, *overrides, "--output", str(seed), "--quiet"]) == 0
    assert cli(["convert", str(seed), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 2
    assert not (tmp_path / "hf").exists()


def _titan_checkpoint(hf_dir, path, layers: int, experts: int, bias: torch.Tensor | None = None, extra=None):
    """``hf_dir``'s DeepSeek-V2 weights as torchtitan 0.3.0 saves a DeepSeek step (its names; experts
    stacked; an ``expert_bias_E`` in every MoE layer, zero unless given), and the ``extra`` tensors."""
    hf = hf_tensors(hf_dir)
    state = {ours: hf[theirs] for ours, theirs in TITAN_TOP.items()}
    for i in range(layers):
        dense = f"model.layers.{i}.mlp.gate_proj.weight" in hf
        layer = TITAN_LAYER | {"attention.wq.weight": "self_attn.q_proj.weight"} | (TITAN_DENSE if dense else TITAN_MOE)
        state |= {
            f"layers.{i}.{ours}": hf[f"model.layers.{i}.{theirs}"]
            for ours, theirs in layer.items()
            if f"model.layers.{i}.{theirs}" in hf  # the query's projections; no correction bias in V2
        }
        if dense:
            continue
        state[f"layers.{i}.moe.expert_bias_E"] = torch.zeros(experts) if bias is None else bias
        for ours, theirs in TITAN_EXPERTS.items():
            stacked = [hf[f"model.layers.{i}.mlp.experts.{e}.{theirs}.weight"] for e in range(experts)]
            state[f"layers.{i}.moe.routed_experts.inner_experts.{ours}"] = torch.stack(stacked)
    dcp.save(state | (extra or {}), checkpoint_id=str(path), no_dist=True)
    return path


def test_a_torchtitan_softmax_checkpoint_reads_with_its_expert_bias_on_the_softmax_scores(tmp_path):
    """torchtitan's softmax-routed DeepSeek (its debugmodel/16B/236B routing: the expert bias added to
    the softmax scores to choose, the weights from the scores alone): with a zero bias, transformers'
    DeepSeek-V2 logits within 1e-5; with a bias that moves the choice, the logits move, and they
    equal those of the same model with that bias as its own (``load_balance = "bias"``)."""
    path = hf_model(tmp_path / "hf", **CASES["greedy_plain_q_yarn"])
    args = dataclasses.replace(open_model_checkpoint(path).args, load_balance="bias")
    with torch.no_grad():
        want = transformers.DeepseekV2ForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        zero = _titan_checkpoint(path, tmp_path / "zero", 3, 8)
        assert (load_model(zero, model="deepseek_v3", args=args)(TOKENS) - want).abs().max().item() <= 1e-5
        bias = torch.linspace(-0.2, 0.2, 8)
        biased = load_model(_titan_checkpoint(path, tmp_path / "biased", 3, 8, bias), model="deepseek_v3", args=args)
        assert (biased(TOKENS) - want).abs().max().item() > 1e-3
        ours = load_model(zero, model="deepseek_v3", args=args)
        for moe in moe_modules(ours):
            moe.expert_bias.copy_(bias)
        assert torch.equal(ours(TOKENS), biased(TOKENS))


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_a_torchtitan_checkpoint_read_into_a_recipes_shapes_routed_otherwise_says_so(flavor):
    """torchtitan's checkpoints record no routing: read into a model with one of its recipes' shapes
    (16B: softmax; 671B: sigmoid), names that only torchtitan writes bring one warning line naming the
    fields and the flavor when the routing (or RoPE) is not the recipe's; none when it is, nor for
    shapes no recipe has, nor for our own names."""
    other = "sigmoid" if FLAVORS[flavor].score_func == "softmax" else "softmax"
    mismatched = FAMILY.renamings["torchtitan"](dataclasses.replace(FLAVORS[flavor], score_func=other))
    with pytest.warns(UserWarning) as caught:
        assert mismatched.from_stored("layers.5.moe.routed_experts.inner_experts.w1_EFD") == "layers.5.moe.experts.w1"
        mismatched.from_stored("lm_head.weight")
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "\n" not in said[0]
    assert f"torchtitan's DeepSeek {flavor} recipe but computes score_func = {other!r}" in said[0]
    assert f"set model.flavor = {flavor!r}" in said[0]
    quiet = [
        (FLAVORS[flavor], "lm_head.weight"),
        (dataclasses.replace(FLAVORS["debug"], score_func="softmax"), "lm_head.weight"),
        (dataclasses.replace(FLAVORS[flavor], score_func=other), "output.weight"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for args, name in quiet:
            FAMILY.renamings["torchtitan"](args).from_stored(name)


def test_torchtitan_multi_token_prediction_layers_are_left_out_in_one_line():
    """torchtitan's ``mtp_layers.{d}.*`` (``num_mtp_layers``) map to nothing of this model, and the
    name adapter leaves them out with one line, as the HF checkpoint's MTP layer is; any other
    unknown name stays refused."""
    names = FAMILY.renamings["torchtitan"](FLAVORS["debugmodel"])
    stored = ["mtp_layers.0.eh_proj.weight", "mtp_layers.0.attention.wq.weight", "mtp_layers.1.enorm.weight"]
    assert [names.from_stored(name) for name in stored] == [None] * 3
    refused, note = names.left_out([*stored, "extra.weight"])
    assert refused == ["extra.weight"]
    assert note == (
        "mtp_layers.0 and up (torchtitan's multi-token-prediction layers, 2) are skipped: this model, like "
        "transformers', predicts the next token only"
    )


def test_a_torchtitan_checkpoint_with_multi_token_prediction_layers_loads_without_them(tmp_path):
    """torchtitan's DeepSeek step with an ``mtp_layers.0`` module: read with one line naming what is
    skipped, the same logits as without it; a stray tensor beside it is still refused."""
    path = hf_model(tmp_path / "hf", **CASES["greedy_plain_q_yarn"])
    args = open_model_checkpoint(path).args
    plain = load_model(_titan_checkpoint(path, tmp_path / "plain", 3, 8), model="deepseek_v3", args=args)
    mtp = {"mtp_layers.0.eh_proj.weight": torch.randn(64, 128), "mtp_layers.0.enorm.weight": torch.ones(64)}
    with_mtp = _titan_checkpoint(path, tmp_path / "mtp", 3, 8, extra=mtp)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = load_model(with_mtp, model="deepseek_v3", args=args)
    assert any("mtp_layers.0 and up (torchtitan's multi-token-prediction layers" in str(w.message) for w in said)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))
    stray = _titan_checkpoint(path, tmp_path / "stray", 3, 8, extra={**mtp, "extra.weight": torch.ones(2)})
    with pytest.raises(SeedckptError, match="extra.weight"):
        load_model(stray, model="deepseek_v3", args=args)


SOFTMAX_GROUPS = ["--model.score_func", "softmax", "--model.norm_topk_prob", "false", "--model.group_top", "1"]


@pytest.mark.slow
def test_softmax_routing_trains_on_pp2_x_dp_shard2_x_ep2_with_one_process_losses(tmp_path):
    """The debug DeepSeek routed by softmax in 4 groups ranked by their best score (DeepSeek-V2's
    group_limited_greedy) and balanced by the expert bias on the softmax scores (torchtitan's), from its
    seed: pp2 x dp_shard2 x ep2 trains with one process's losses within 1e-5."""
    seed = create_seed_checkpoint(tiny_config(*M, *SOFTMAX_GROUPS), tmp_path / "seed", seed=0, progress=False)
    assert open_model_checkpoint(seed).args.score_func == "softmax"
    torchrun(tmp_path / "one", seed, 1, *M, *SOFTMAX_GROUPS, *ONE, *STEPS)
    pp2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4", *STEPS]
    torchrun(tmp_path / "pp2_dp2_ep2", seed, 4, *M, *SOFTMAX_GROUPS, *pp2)
    _close(losses(tmp_path / "pp2_dp2_ep2"), losses(tmp_path / "one"), "pp2 x dp_shard2 x ep2")


def test_aux_loss_alpha_is_the_aux_loss_coef_both_ways():
    """DeepSeek's ``aux_loss_alpha`` weighs the sequence-wise balance loss: read as ``aux_loss_coef``
    (0.001 where the file leaves it out) and written back as it."""
    cfg = {"model_type": "deepseek_v2", **TINY}
    assert args_from_config(cfg).aux_loss_coef == 0.001
    args = args_from_config({**cfg, "aux_loss_alpha": 0.025})
    assert (args.load_balance, args.aux_loss_coef) == ("aux_loss", 0.025)
    assert config(args, torch.float32)["aux_loss_alpha"] == 0.025


def test_a_batch_wise_balance_loss_is_named_in_one_line():
    """``seq_aux = false`` (DeepSeek's batch-wise balance loss, not the sequence-wise one trained here)
    is said in one line naming the key that turns it off; ``seq_aux = true`` reads silently."""
    cfg = {"model_type": "deepseek_v2", **TINY}
    with pytest.warns(UserWarning, match="seq_aux = false.*model.aux_loss_coef = 0"):
        args_from_config({**cfg, "seq_aux": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args_from_config({**cfg, "seq_aux": True})
