"""DeepSeek-V3 (671B) and its 16B shape: multi-head latent attention, then dense layers followed by
mixtures of routed and shared experts.

The shared decoder (``models.common.decoder``) with two things of its own: the attention is
multi-head latent attention (``attention``: low-rank q and kv projections, a RoPE key shared by
the heads), and the first ``first_k_dense_replace`` layers keep a dense feed-forward of width
``ffn_dim`` while every later layer holds a mixture of experts (``models.common.moe``):
``n_experts`` routed SwiGLU experts of width ``moe_ffn_dim`` plus ``n_shared_experts`` shared
ones, fused into one SwiGLU that every token passes through. Routing is DeepSeek-V3's: sigmoid
scores; the experts are split into ``n_group`` groups, each ranked by the sum of its two best
scores, and a token's ``top_k`` experts come from the ``topk_group`` best groups; their weights
renormalized (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``.

Balancing is aux-loss-free by default (``load_balance = "bias"``): the fp32 ``expert_bias`` added
to the scores to choose experts, which HF's class holds as ``e_score_correction_bias``, so it is
read and written both ways.

Tensor names: the shared decoder's (``tok_embeddings``, ``layers.{i}.{attention_norm,ffn_norm}``,
``layers.{i}.feed_forward.{w1,w2,w3}`` in the dense layers, ``norm``, ``output``), and per layer
``attention.{wq | wq_a, q_norm, wq_b}.weight``, ``attention.{wkv_a, kv_norm, wkv_b, wo}.weight``
(torchtitan's names), in MoE layers ``moe.router.gate.weight`` ``[experts, dim]``,
``moe.expert_bias`` ``[experts]``, ``moe.experts.{w1,w3}`` ``[experts, moe_ffn_dim, dim]``,
``moe.experts.w2`` ``[experts, dim, moe_ffn_dim]`` and ``moe.shared_experts.{w1,w2,w3}.weight``.
Hugging Face's (``hf``) and torchtitan 0.3.0's (``torchtitan``) are mapped onto them.

Flavors: ``671B`` is DeepSeek-V3's released ``config.json``; ``16B`` has the shapes of torchtitan
0.3.0's ``16B`` (DeepSeek-V2-Lite's: no low-rank query, 64 experts, 2 shared, 1 dense layer), routed
as V3 routes (sigmoid, one group) -- torchtitan's 16B routes by softmax, which HF's DeepSeek-V3
class cannot express; ``debug`` trains on a CPU in seconds.

The init recipe is torchtitan's for DeepSeek-V3.
"""

from __future__ import annotations

import dataclasses

import torch

from models.common import OSFT_TARGETS, decoder_family, decoder_layer_flops
from models.common.decoder import Transformer
from models.common.rope import RopeScaling
from models.deepseek_v3.args import SHAPE_FIELDS, DeepseekV3Args
from models.deepseek_v3.hf import MODEL_TYPE, DeepseekV3HFNames, args_from_config, config
from models.deepseek_v3.tensor_parallel import MLA_TENSOR_PARALLEL
from models.deepseek_v3.torchtitan import DeepseekV3TorchtitanNames

FLAVORS = {
    "debug": DeepseekV3Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        rope_scaling=RopeScaling(
            "yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0
        ),
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        n_experts=8,
        n_shared_experts=1,
        top_k=2,
        moe_ffn_dim=64,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    "16B": DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        ffn_dim=10944,
        vocab_size=102400,
        max_seq_len=163840,
        rope_scaling=RopeScaling(
            "yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707
        ),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=1,
        n_experts=64,
        n_shared_experts=2,
        top_k=6,
        moe_ffn_dim=1408,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
    ),
    "671B": DeepseekV3Args(),  # the defaults are DeepSeek-V3's config.json
}

# The block linears OSFT trains by default: every attention projection and dense feed-forward matrix.
_ATTENTION = ("attention.wq", "attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b")
OSFT = (*_ATTENTION, *OSFT_TARGETS[3:])


def attention_flops(args: DeepseekV3Args, layer: int, seq_len: int) -> int:
    """Training FLOPs per token of one layer's attention over ``seq_len`` positions: per head, the
    scores' matmul over ``qk_nope + qk_rope`` dimensions and the weighted sum over ``v_head_dim``,
    2·T FLOPs per dimension forward, three times that with the backward."""
    return 6 * args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) * seq_len


def flops_per_token(args: DeepseekV3Args, seq_len: int, num_params: int | None = None) -> int:
    """Training FLOPs per token (torchtitan's convention, the embedding counted): 6 per parameter a
    token uses -- each MoE layer's router, shared experts and ``top_k`` of its ``n_experts`` routed
    experts -- plus every layer's ``attention_flops``."""
    if num_params is None:
        with torch.device("meta"):
            num_params = sum(p.numel() for p in Transformer(args).parameters())
    moe = args.moe_options()
    idle = len(args.moe_layers) * (moe.n_experts - moe.top_k) * moe.expert_numel(args.dim)
    return 6 * (num_params - idle) + args.n_layers * attention_flops(args, 0, seq_len)


DEEPSEEK_V3 = dataclasses.replace(
    decoder_family(
        "deepseek_v3",
        DeepseekV3Args,
        FLAVORS,
        (MODEL_TYPE,),
        config,
        args_from_config,
        shape_fields=SHAPE_FIELDS,
        names=DeepseekV3HFNames,
        flops_per_token=flops_per_token,
        layer_flops=lambda model_args, seq_len: decoder_layer_flops(model_args, seq_len, attention=attention_flops),
        tensor_parallel=MLA_TENSOR_PARALLEL,
        renamings={"torchtitan": DeepseekV3TorchtitanNames},
    ),
    osft_targets=OSFT,
)
