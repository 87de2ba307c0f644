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

import pytest
import torch

from models.common.moe import moe_modules
from models.deepseek_v3 import FLAVORS
from models.deepseek_v3.hf_v2 import args_from_config, config
from models.registry import get_family
from seedckpt import load_model
from seedckpt.cli.convert import convert
from seedckpt.cli.main import main as cli
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from tests.test_convert import our_logits
from tests.test_deepseek_v3 import TINY_FIELDS, hf_tensors

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
    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = hf(TOKENS).logits
        convert(path, tmp_path / "dcp", "dcp", progress=False)
        for source, pp in ((tmp_path / "dcp", 1), (path, 2)):
            assert (our_logits(source, TOKENS, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        assert (load_model(path)(TOKENS) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "deepseek_v2"
        original = {k: t for k, t in hf_tensors(path).items() if t.numel()}
        written = hf_tensors(tmp_path / "back")
        assert written.keys() == original.keys()
        assert all(torch.equal(t, original[k]) for k, t in written.items())
        back = transformers.DeepseekV2ForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


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
