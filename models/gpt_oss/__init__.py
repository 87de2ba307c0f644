"""gpt-oss (20B, 120B): a mixture of experts in every layer, attention sinks, alternating windows.

What sets it apart from the other decoder families, each a switch of the shared decoder:

* attention: q, k, v and o carry biases (``attention_bias``); every head has a learned sink logit
  that joins each query's softmax and takes probability mass without a value; the layers alternate
  a sliding window of ``sliding_window`` positions (the layers ``window_layers`` names: the even
  ones) and full attention, as HF's ``layer_types`` lists them; RoPE is YaRN (``rope_scaling``),
  with its attention factor;
* every layer's feed-forward is ``n_experts`` experts of width ``moe_ffn_dim``, each with biases and
  a clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``; ``(up + 1)`` times the gate's GLU); the
  router has a bias, takes the ``top_k`` logits and a softmax over those alone.

Tensor names: the shared decoder's, plus ``layers.{i}.attention.sinks`` ``[n_heads]`` and the
attention biases (``attention.{wq,wk,wv,wo}.bias``); in every layer ``moe.router.gate.{weight,bias}``,
``moe.experts.{w1,w3}`` ``[experts, moe_ffn_dim, dim]``, ``moe.experts.w2`` ``[experts, dim,
moe_ffn_dim]`` and their biases ``moe.experts.{b1,b3}`` ``[experts, moe_ffn_dim]``, ``moe.experts.b2``
``[experts, dim]``. Hugging Face's are ``GptOssForCausalLM``'s, fused and transposed (``models.gpt_oss.hf``);
torchtitan 0.3.0's (``torchtitan``: gate and up fused by rows in ``mlp1``) are ``models.gpt_oss.torchtitan``.

Balancing is HF's auxiliary loss at ``router_aux_loss_coef``. The init recipe is HF's (``normal``,
std ``initializer_range``: weights, sinks and the router's bias; the other biases zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import OSFT_TARGETS, decoder_family, hf_config, moe_flops_per_token
from models.common.args import MOE_SHAPE_FIELDS, MoEDecoderArgs, check_bool, check_float
from models.common.decoder import DecoderOptions
from models.common.rope import RopeScaling
from models.gpt_oss.hf import GptOssNames
from models.gpt_oss.torchtitan import GptOssTorchtitanNames

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
# The RoPE both releases use: YaRN stretching a 4096-position training context 32 times.
YARN = RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)


def alternating(n_layers: int) -> list[str]:
    """gpt-oss's ``layer_types`` when a config.json lists none: windowed first, then full, in turn."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


@dataclass
class GptOssArgs(MoEDecoderArgs):
    attention_bias: bool = True  # biases on q, k, v and o (both releases have them)
    swiglu_alpha: float = 1.702  # the experts' clamped SwiGLU: the sigmoid's slope
    swiglu_limit: float = 7.0  # and its clamp

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError(
                "gpt-oss has a mixture of experts in every layer: leave mlp_only_layers empty and decoder_sparse_step 1"
            )
        check_bool("attention_bias", self.attention_bias)
        self.swiglu_alpha = check_float("swiglu_alpha", self.swiglu_alpha)
        self.swiglu_limit = check_float("swiglu_limit", self.swiglu_limit)
        self.decoder_options  # noqa: B018 -- MoEOptions refuses what the block cannot run, here at the door

    @property
    def decoder_options(self) -> DecoderOptions:
        moe = self.moe_options(
            "normal",
            self.initializer_range,
            score_func="softmax_topk",
            router_bias=True,
            expert_bias_terms=True,
            activation="clamped_swiglu",
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )
        return DecoderOptions(
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            attention_sinks=True,
            layer_windows=self.layer_windows,
            init="normal",
            init_std=self.initializer_range,
            moe=moe,
            moe_layers=self.moe_layers,
        )


def _gpt_oss(n_layers: int, n_experts: int) -> GptOssArgs:
    return GptOssArgs(
        dim=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=2880,
        vocab_size=201088,
        norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=YARN,
        max_seq_len=131072,
        sliding_window=128,
        window_layers=list(range(0, n_layers, 2)),
        n_experts=n_experts,
        top_k=4,
        moe_ffn_dim=2880,
    )


FLAVORS = {
    "debug": GptOssArgs(
        dim=128,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        ffn_dim=128,
        vocab_size=512,
        norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=RopeScaling("yarn", 4.0, 128, truncate=False),
        max_seq_len=512,
        sliding_window=16,
        window_layers=[0, 2],
        n_experts=8,
        top_k=2,
        moe_ffn_dim=128,
    ),
    "20B": _gpt_oss(24, 32),
    "120B": _gpt_oss(36, 128),
}


def config(args: GptOssArgs, dtype: torch.dtype) -> dict:
    moe = hf_config.moe_config(args)
    del moe["norm_topk_prob"]  # gpt-oss's softmax over the chosen logits is normalized by definition
    return {
        **hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE),
        **moe,
        "intermediate_size": args.moe_ffn_dim,
        "num_local_experts": args.n_experts,
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        **hf_config.window_config(args),
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
    }


# transformers 5.24's GptOssConfig: the RoPE stretch of a config.json that has neither rope_parameters
# nor rope_scaling
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# transformers' GptOssConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    max_position_embeddings=131072,
)


# Fields GptOssConfig types without None, so transformers refuses a null one; the shared reader would
# take it for the default or derive it (a null head_dim as hidden_size // num_attention_heads).
NOT_NULL = (
    *hf_config.NOT_NULL,
    "head_dim",
    "num_key_value_heads",
    "num_local_experts",
    "num_experts_per_tok",
    "attention_bias",
    "attention_dropout",
    "swiglu_alpha",
    "swiglu_limit",
    "router_aux_loss_coef",
    "output_router_logits",
)


def args_from_config(cfg: dict) -> GptOssArgs:
    # hidden_act is not read (a null one is refused, as GptOssConfig refuses it): GptOssForCausalLM's experts
    # run their clamped SwiGLU whatever it says
    hf_config.refuse_nulls(cfg, NOT_NULL, "GptOssConfig")
    hf_config.refuse(cfg, "gpt-oss", attention_dropout=0.0)
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        # GptOssConfig's RoPE where a file names none: YaRN, on the file's base or its own
        cfg = {
            **cfg,
            "rope_parameters": {**DEFAULT_ROPE, "rope_theta": cfg.get("rope_theta") or HF_DEFAULTS["rope_theta"]},
        }
    fields = hf_config.decoder_fields(cfg, **HF_DEFAULTS)
    window = cfg["sliding_window"] if "sliding_window" in cfg else 128  # null: none (refused where a layer slides)
    return GptOssArgs(
        **fields,
        # the softmax over the chosen logits is normalized whatever norm_topk_prob says
        **hf_config.moe_fields(cfg, num_local_experts=128, num_experts_per_tok=4, norm_topk_prob=None),
        **hf_config.layer_windows(cfg, window, alternating(fields["n_layers"])),
        moe_ffn_dim=fields["ffn_dim"],
        attention_bias=hf_config.read(cfg, "attention_bias", check_bool, True),
        swiglu_alpha=hf_config.read(cfg, "swiglu_alpha", check_float, 1.702),
        swiglu_limit=hf_config.read(cfg, "swiglu_limit", check_float, 7.0),
    )


GPT_OSS = decoder_family(
    "gpt_oss",
    GptOssArgs,
    FLAVORS,
    (MODEL_TYPE,),
    config,
    args_from_config,
    shape_fields=(*MOE_SHAPE_FIELDS, "attention_bias"),
    names=GptOssNames,
    flops_per_token=moe_flops_per_token,
    osft_targets=tuple(t for t in OSFT_TARGETS if t.startswith("attention.")),  # no dense feed-forward
    renamings={"torchtitan": GptOssTorchtitanNames},
)
