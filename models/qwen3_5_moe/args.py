"""Qwen3.5-MoE's args: Qwen3.5's (``models.qwen3_5.args``: linear and gated full attention) with a
mixture of experts in every layer (``models.common.args.MoEDecoderArgs``' fields). ``ffn_dim`` is
the shared expert's width (HF's ``shared_expert_intermediate_size``): no layer has a dense
feed-forward. Defaults are ``Qwen3_5MoeTextConfig``'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.common.args import MOE_SHAPE_FIELDS, MoEDecoderArgs
from models.common.decoder import DecoderOptions
from models.qwen3_5.args import SHAPE_FIELDS as DENSE_SHAPE_FIELDS
from models.qwen3_5.args import Qwen35Args


@dataclass
class Qwen35MoeArgs(Qwen35Args, MoEDecoderArgs):
    dim: int = 2048
    n_layers: int = 40
    n_kv_heads: int | None = 2
    ffn_dim: int = 512  # the shared expert's width
    n_experts: int = 256
    top_k: int = 8
    moe_ffn_dim: int = 512

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError(
                "Qwen3.5-MoE has a mixture of experts in every layer: leave mlp_only_layers empty and "
                "decoder_sparse_step 1"
            )
        if not self.norm_topk_prob:
            raise ValueError(
                "Qwen3.5-MoE always renormalizes its routing weights (transformers' class has no norm_topk_prob): "
                "leave model.norm_topk_prob true"
            )
        self.decoder_options  # noqa: B018 -- MoEOptions refuses what the block cannot run, here at the door

    @property
    def decoder_options(self) -> DecoderOptions:
        """Qwen3.5's decoder, every layer's feed-forward a mixture of experts: softmax routing over
        all experts, the top ``top_k`` renormalized, beside one shared expert of width ``ffn_dim``
        gated per token. torchtitan 0.3.0's init: the router at the layer's depth-scaled std."""
        shared = dict(n_shared_experts=1, shared_ffn_dim=self.ffn_dim, shared_gate=True)
        moe = self.moe_options("torchtitan", 0.02, router_depth_init=True, **shared)
        return dataclasses.replace(super().decoder_options, moe=moe, moe_layers=self.moe_layers)


# Which tensors exist and their shapes: Qwen3.5's and the experts'.
SHAPE_FIELDS = tuple(dict.fromkeys((*DENSE_SHAPE_FIELDS, *MOE_SHAPE_FIELDS)))
