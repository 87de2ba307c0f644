"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of experts in every layer.

Each layer's feed-forward is ``n_experts`` SwiGLU experts of width ``moe_ffn_dim`` (HF's
``intermediate_size``), softmax over the experts, the top two kept and renormalized
(``models.common.moe``). A sliding window (``sliding_window``, every layer) is read as Mistral's is.

Tensor names: the shared decoder's, and ``layers.{i}.moe.router.gate.weight`` ``[experts, dim]``,
``layers.{i}.moe.experts.{w1,w3}`` ``[experts, moe_ffn_dim, dim]``, ``layers.{i}.moe.experts.w2``
``[experts, dim, moe_ffn_dim]``, plus the persistent fp32 ``layers.{i}.moe.expert_bias`` with
``load_balance = "bias"``. Hugging Face's are ``MixtralForCausalLM``'s as ``save_pretrained`` writes
them: ``model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w2,w3}.weight`` (the same roles as ours),
the router ``block_sparse_moe.gate.weight``.

Balancing is HF's by default: the auxiliary loss at ``router_aux_loss_coef`` (sequence-wise,
``models.common.moe``). The init recipe is HF's (``normal``, std ``initializer_range``), as for Mistral.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import hf_config, moe_decoder_family
from models.common.args import MoEDecoderArgs
from models.common.decoder import DecoderOptions
from models.common.hf_names import ExpertNames, HFNames

ARCHITECTURE, MODEL_TYPE = "MixtralForCausalLM", "mixtral"
EXPERTS = ExpertNames("block_sparse_moe", (("w1", "w1"), ("w2", "w2"), ("w3", "w3")))


@dataclass
class MixtralArgs(MoEDecoderArgs):
    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(
            init="normal",
            init_std=self.initializer_range,
            moe=self.moe_options("normal", self.initializer_range),
            moe_layers=self.moe_layers,
            layer_windows=self.layer_windows,
        )


def _mixtral(dim, n_layers, n_heads, ffn_dim, vocab_size, max_seq_len) -> MixtralArgs:
    return MixtralArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        norm_eps=1e-5,
        rope_theta=1e6,
        max_seq_len=max_seq_len,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=ffn_dim,
    )


FLAVORS = {
    "debug": MixtralArgs(
        dim=128,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=128,
        vocab_size=512,
        max_seq_len=512,
        n_experts=4,
        top_k=2,
        moe_ffn_dim=128,
    ),
    "8x7B": _mixtral(4096, 32, 32, 14336, 32000, 32768),
    "8x22B": _mixtral(6144, 56, 48, 16384, 32768, 65536),
}


def export_refusal(args: MixtralArgs) -> str | None:
    """Why ``MixtralForCausalLM`` does not compute ``args``' routing, or None: the class always
    renormalizes the kept experts' scores, so a model that does not would export other logits."""
    if not args.norm_topk_prob:
        return "norm_topk_prob = false: transformers' Mixtral always renormalizes; export to dcp or torchtitan"
    return None


class MixtralNames(HFNames):
    """The shared decoder's names with Mixtral's experts; a routing the class does not compute
    (``export_refusal``) is refused at the first name asked, before any shard is written (the
    writer asks for ``config.json`` only after the last shard)."""

    def __init__(self, args: MixtralArgs):
        super().__init__(args, EXPERTS)

    def to_stored(self, fqn: str) -> str:
        reason = export_refusal(self.args)
        if reason is not None:
            raise ValueError(reason)
        return super().to_stored(fqn)


def config(args: MixtralArgs, dtype: torch.dtype) -> dict:
    """``MixtralConfig`` has no ``norm_topk_prob`` (it always renormalizes): none is written, and a
    model that does not renormalize is refused (``export_refusal``)."""
    reason = export_refusal(args)
    if reason is not None:
        raise ValueError(reason)
    moe = hf_config.moe_config(args)
    del moe["norm_topk_prob"]
    return {
        **hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE),
        **moe,
        "intermediate_size": args.moe_ffn_dim,
        "num_local_experts": args.n_experts,
        "router_jitter_noise": 0.0,
        "sliding_window": hf_config.uniform_window(args, "Mixtral"),
    }


# transformers' MixtralConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    intermediate_size=14336, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072
)


# MixtralConfig's fields that refuse null (``hf_config.refuse_nulls``; num_local_experts: ``moe_fields``)
NOT_NULL = (
    *hf_config.NOT_NULL,
    "attention_dropout",
    "num_key_value_heads",
    "num_experts_per_tok",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
)


def args_from_config(cfg: dict) -> MixtralArgs:
    hf_config.refuse_nulls(cfg, NOT_NULL, "MixtralConfig")
    hf_config.refuse_common(cfg, "Mixtral")
    hf_config.refuse(cfg, "Mixtral", attention_bias=False, router_jitter_noise=0.0)
    fields = hf_config.decoder_fields(cfg, **HF_DEFAULTS)
    return MixtralArgs(
        **fields,
        **hf_config.moe_fields(cfg, num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=None),
        moe_ffn_dim=fields["ffn_dim"],
        sliding_window=cfg.get("sliding_window"),
    )


MIXTRAL = moe_decoder_family(
    "mixtral", MixtralArgs, FLAVORS, (MODEL_TYPE,), config, args_from_config, EXPERTS, names=MixtralNames
)
