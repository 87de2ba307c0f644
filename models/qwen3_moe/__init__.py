"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention with mixture-of-experts feed-forwards.

Every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` holds a mixture of
``n_experts`` SwiGLU experts of width ``moe_ffn_dim`` (``models.common.moe``); the others keep a
dense feed-forward of width ``ffn_dim`` (HF's ``intermediate_size``). Softmax routing over all
experts, the top ``top_k`` kept, renormalized when ``norm_topk_prob``.

Tensor names: the shared decoder's, and in MoE layers ``layers.{i}.moe.router.gate.weight``
``[experts, dim]``, ``layers.{i}.moe.experts.{w1,w3}`` ``[experts, moe_ffn_dim, dim]`` and
``layers.{i}.moe.experts.w2`` ``[experts, dim, moe_ffn_dim]`` (gate, up, down), plus the persistent
fp32 ``layers.{i}.moe.expert_bias`` ``[experts]`` with ``load_balance = "bias"``. Hugging Face's
are ``Qwen3MoeForCausalLM``'s as ``save_pretrained`` writes them: one tensor per expert,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, the router ``mlp.gate.weight``.
torchtitan 0.3's (``routed_experts.inner_experts.w1_EFD`` ..., ``expert_bias_E``) are mapped by
``torchtitan``.

Balancing is HF's by default: the auxiliary loss at ``router_aux_loss_coef`` (in its
sequence-wise form, ``models.common.moe``). The init recipe is torchtitan's, as for Qwen3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import hf_config, moe_decoder_family
from models.common.args import MoEDecoderArgs, check_int
from models.common.decoder import DecoderOptions
from models.common.hf_names import ExpertNames
from models.qwen3_moe.torchtitan import Qwen3MoeTorchtitanNames

ARCHITECTURE, MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"
EXPERTS = ExpertNames("mlp", (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")))


@dataclass
class Qwen3MoeArgs(MoEDecoderArgs):
    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(
            qk_norm=True,
            init="torchtitan",
            moe=self.moe_options("torchtitan", 0.02),
            moe_layers=self.moe_layers,
            layer_windows=self.layer_windows,
        )


def _qwen3_moe(dim, n_layers, n_heads, ffn_dim, moe_ffn_dim) -> Qwen3MoeArgs:
    return Qwen3MoeArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=ffn_dim,
        vocab_size=151936,
        rope_theta=1e6,
        max_seq_len=40960,
        n_experts=128,
        top_k=8,
        moe_ffn_dim=moe_ffn_dim,
    )


FLAVORS = {
    "debug": Qwen3MoeArgs(
        dim=128,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=320,
        vocab_size=512,
        max_seq_len=512,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=64,
        mlp_only_layers=[0],
    ),
    "30B-A3B": _qwen3_moe(2048, 48, 32, 6144, 768),
    "235B-A22B": _qwen3_moe(4096, 94, 64, 12288, 1536),
}


def config(args: Qwen3MoeArgs, dtype: torch.dtype) -> dict:
    return {
        **hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE),
        **hf_config.moe_config(args),
        "num_experts": args.n_experts,
        "moe_intermediate_size": args.moe_ffn_dim,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "attention_bias": False,
        "use_sliding_window": args.sliding_window is not None,
        "sliding_window": hf_config.uniform_window(args, "Qwen3-MoE"),
    }


# transformers' Qwen3MoeConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_key_value_heads=4,
    max_position_embeddings=32768,
)


# Qwen3MoeConfig's fields that refuse null (``hf_config.refuse_nulls``)
NOT_NULL = (
    *hf_config.NOT_NULL,
    "attention_bias",
    "attention_dropout",
    "num_key_value_heads",
    "use_sliding_window",
    "decoder_sparse_step",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
)


def args_from_config(cfg: dict) -> Qwen3MoeArgs:
    hf_config.refuse_nulls(cfg, NOT_NULL, "Qwen3MoeConfig")
    hf_config.refuse_common(cfg, "Qwen3-MoE")
    hf_config.refuse(cfg, "Qwen3-MoE", attention_bias=False)
    return Qwen3MoeArgs(
        **hf_config.decoder_fields(cfg, **HF_DEFAULTS),
        **hf_config.qwen_layer_windows(cfg),
        **hf_config.moe_fields(cfg, num_local_experts=128, num_experts_per_tok=8, norm_topk_prob=False),
        moe_ffn_dim=hf_config.size(cfg, "moe_intermediate_size", 768),
        decoder_sparse_step=hf_config.read(cfg, "decoder_sparse_step", check_int, 1),
        mlp_only_layers=cfg.get("mlp_only_layers") or [],  # checked by the args, under the same name
    )


QWEN3_MOE = moe_decoder_family(
    "qwen3_moe",
    Qwen3MoeArgs,
    FLAVORS,
    (MODEL_TYPE,),
    config,
    args_from_config,
    EXPERTS,
    renamings={"torchtitan": Qwen3MoeTorchtitanNames},
)
