"""DeepSeek-V2's ``config.json`` (``DeepseekV2ForCausalLM``, model_type ``deepseek_v2``) both ways,
and which ``config.json`` a DeepSeek model of ours is written as.

DeepSeek-V2 is DeepSeek-V3's architecture -- the same multi-head latent attention, dense layers,
shared experts and tensor names -- routed by a softmax over every expert, with no correction bias
and no renormalization. ``transformers`` 5.24's ``DeepseekV2TopkRouter`` computes two routings
(``topk_method``): ``greedy``, the ``top_k`` best scores, and ``group_limited_greedy``, the best of
the ``topk_group`` groups ranked by their best score (our ``group_top = 1``); the weights times
``routed_scaling_factor``. Its RoPE always rotates interleaved pairs (ours: nothing is permuted).

Read: the file is read as the DeepSeek-V3 file it is equivalent to (``hf.args_from_config``, so
every field is checked as there), with ``DeepseekV2Config``'s defaults for the fields it leaves out,
then its routing, and ``aux_loss_alpha`` as ``aux_loss_coef``: DeepSeek's own code weighs its
sequence-wise balance loss (``seq_aux``) by it, the loss ``load_balance = "aux_loss"`` computes;
0.001 where the file leaves it out (DeepSeek's releases; the field's default in ``transformers`` 4's
``DeepseekV2Config``, which 5.24's has not: it keeps the value as an extra attribute). Refused in
one line, as ``transformers`` computes them otherwise than DeepSeek's own code or not at all:
``norm_topk_prob: true`` (the class never renormalizes), a ``scoring_func`` other than softmax,
another ``topk_method``, ``num_experts_per_tok`` left out (the class has no default),
``group_limited_greedy`` without ``n_group`` or ``topk_group``, a null the class refuses or its model
cannot run (``NOT_NULL``: a null ``topk_method`` routes nothing there).

Written: a sigmoid-routed model as DeepSeek-V3 (``hf.config``), a softmax-routed one as DeepSeek-V2
with its ``aux_loss_coef`` as ``aux_loss_alpha``. A routing neither class computes is refused before
anything is written (``export_refusal``, asked by the name adapter too): torchtitan's 236B ranks its
softmax groups by their two best scores, which ``DeepseekV2ForCausalLM`` ranks by their best;
renormalized softmax weights; sigmoid groups ranked by one score. Such models export to DCP or
torchtitan.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from models.common import hf_config
from models.common.args import check_bool, check_float
from models.common.hf_names import HFNames
from models.deepseek_v3 import hf
from models.deepseek_v3.args import DeepseekV3Args

ARCHITECTURE, MODEL_TYPE = "DeepseekV2ForCausalLM", "deepseek_v2"
AUX_LOSS_ALPHA = 0.001  # DeepSeek's own default for its sequence-wise balance loss's weight

# transformers' DeepseekV2Config defaults where DeepseekV3Config's differ, by config.json name; None:
# as the class derives it (key/value heads: as many as the heads).
V2_DEFAULTS = {
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "max_position_embeddings": 2048,
    "first_k_dense_replace": 0,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.0,
    "moe_intermediate_size": 1407,
}
TOPK_METHODS = ("greedy", "group_limited_greedy")
LATENT_NORM_EPS = 1e-6  # the classes' q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says
# DeepseekV2Config's fields that refuse null, and the routing its model cannot run as null
NOT_NULL = (
    *hf_config.NOT_NULL,
    "attention_bias",
    "mlp_bias",
    "output_router_logits",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "routed_scaling_factor",
    "topk_method",
)
_V3_ONLY = ("scoring_func", "topk_method", "rope_interleave", "norm_topk_prob", "n_group", "topk_group")


def args_from_config(cfg: dict) -> DeepseekV3Args:
    """A ``config.json`` of either model_type as our args."""
    return v2_args(cfg) if cfg.get("model_type") == MODEL_TYPE else hf.args_from_config(cfg)


def v2_args(cfg: dict) -> DeepseekV3Args:
    """A ``deepseek_v2`` ``config.json`` as our args (the module docstring)."""
    hf_config.refuse_nulls(cfg, NOT_NULL, "DeepseekV2Config")
    method = cfg.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise ValueError(f"config.json has topk_method = {method!r}; DeepSeek-V2 computes {' or '.join(TOPK_METHODS)}")
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise ValueError(
            f"config.json has scoring_func = {cfg['scoring_func']!r}; transformers' DeepSeek-V2 scores by softmax "
            "(a sigmoid-routed DeepSeek is model_type deepseek_v3)"
        )
    if hf_config.read(cfg, "norm_topk_prob", check_bool, False):
        raise ValueError(
            "config.json has norm_topk_prob = true, which transformers' DeepSeek-V2 ignores (it never "
            "renormalizes) and DeepSeek's own code honours: set it false to load it as transformers computes it"
        )
    if cfg.get("num_experts_per_tok") is None:
        raise ValueError("config.json lacks num_experts_per_tok (DeepseekV2Config has no default)")
    groups = {"n_group": 1, "topk_group": 1}  # greedy: the class reads no groups
    if method == "group_limited_greedy":
        lacking = [name for name in groups if cfg.get(name) is None]
        if lacking:
            raise ValueError(f"config.json lacks {' and '.join(lacking)}, which topk_method group_limited_greedy needs")
        groups = {name: cfg[name] for name in groups}
    # DeepSeek-V3's reader on the same file: V2's defaults, its own routing and interleaved RoPE rows
    view = {k: v for k, v in cfg.items() if k not in _V3_ONLY}
    view = {**{k: v for k, v in V2_DEFAULTS.items() if k not in cfg}, **view, **groups, "norm_topk_prob": False}
    args = hf.read_args({**view, "rope_interleave": True})
    group_top = 1 if method == "group_limited_greedy" else 2
    aux = hf_config.read(cfg, "aux_loss_alpha", check_float, AUX_LOSS_ALPHA, positive=False)
    if cfg.get("seq_aux") is False:  # logits are the same; only training's balance loss would differ
        warnings.warn(
            "config.json has seq_aux = false (DeepSeek's batch-wise balance loss); training here weighs the "
            "sequence-wise one by aux_loss_alpha: set model.aux_loss_coef = 0 to train without it",
            stacklevel=2,
        )
    return dataclasses.replace(
        args, score_func="softmax", group_top=group_top, load_balance="aux_loss", aux_loss_coef=aux
    )


def export_refusal(args: DeepseekV3Args) -> str | None:
    """Why no ``transformers`` class computes ``args``' routing, or None."""
    if args.score_func == "sigmoid":
        if args.n_group > 1 and args.group_top != 2:
            return (
                f"group_top = {args.group_top}: transformers' DeepSeek-V3 ranks sigmoid groups by their two best "
                "scores; export to dcp or torchtitan"
            )
        return None
    if args.norm_topk_prob:
        return (
            "norm_topk_prob = true with softmax routing: transformers' DeepSeek-V2 never renormalizes; export to "
            "dcp or torchtitan"
        )
    if args.n_group > 1 and args.group_top != 1:
        return (
            f"softmax routing in {args.n_group} groups ranked by their {args.group_top} best scores (torchtitan's "
            "236B): transformers' DeepSeek-V2 ranks a group by its best one; export to dcp or torchtitan"
        )
    return None


class DeepseekHFNames(hf.DeepseekV3HFNames):
    """DeepSeek-V3's names (V2's are the same), for a model written as either class: a routing
    neither computes is refused before anything is written, and a softmax-routed model's expert bias
    is kept only at zero (DeepSeek-V2's class has no ``e_score_correction_bias``)."""

    def to_stored(self, fqn: str) -> str:
        reason = export_refusal(self.args)
        if reason is not None:
            raise ValueError(reason)
        return super().to_stored(fqn)

    def unkept_unless_zero(self, fqn: str) -> str | None:
        if self.args.score_func == "sigmoid":
            return super().unkept_unless_zero(fqn)
        return HFNames.unkept_unless_zero(self, fqn)


def config(args: DeepseekV3Args, dtype: torch.dtype) -> dict:
    """The ``config.json`` of the class that computes ``args`` (``export_refusal``: none does). The
    classes' latent norms are at 1e-6: other ``latent_norm_eps`` (torchtitan's recipes, 1e-5) are
    written with a warning line, as they move the logits by about 2e-5 (a random debugmodel)."""
    reason = export_refusal(args)
    if reason is not None:
        raise ValueError(reason)
    if args.latent_norm_eps != LATENT_NORM_EPS:
        warnings.warn(
            f"latent_norm_eps = {args.latent_norm_eps:g}: transformers' DeepSeek classes compute q_a_layernorm and "
            f"kv_a_layernorm at {LATENT_NORM_EPS:g}, so the exported model's logits differ slightly from this one's",
            stacklevel=2,
        )
    written = hf.config(args, dtype)
    if args.score_func == "sigmoid":
        return written
    for name in ("rope_interleave", "num_nextn_predict_layers"):
        del written[name]
    method = "greedy" if args.n_group == 1 else "group_limited_greedy"
    named = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "topk_method": method}
    return {**written, **named, "aux_loss_alpha": args.aux_loss_coef}
