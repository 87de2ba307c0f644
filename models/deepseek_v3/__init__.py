"""DeepSeek-V3 (671B), DeepSeek-V2 and torchtitan's DeepSeek recipes: multi-head latent attention,
then dense layers followed by mixtures of routed and shared experts.

The shared decoder (``models.common.decoder``) with two things of its own: the attention is
multi-head latent attention (``attention``: low-rank q and kv projections, a RoPE key shared by
the heads), and the first ``first_k_dense_replace`` layers keep a dense feed-forward of width
``ffn_dim`` while every later layer holds a mixture of experts (``models.common.moe``):
``n_experts`` routed SwiGLU experts of width ``moe_ffn_dim`` plus ``n_shared_experts`` shared
ones, fused into one SwiGLU that every token passes through. Routing is DeepSeek-V3's by default:
sigmoid scores; the experts are split into ``n_group`` groups, each ranked by the sum of its
``group_top`` (two) best scores, and a token's ``top_k`` experts come from the ``topk_group`` best
groups; their weights renormalized (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. ``score_func = "softmax"`` is DeepSeek-V2's routing and torchtitan's:
a softmax over every expert, usually no groups (V2's ``greedy``; V2's ``group_limited_greedy``
ranks a group by its best score, ``group_top = 1``), no renormalization.

Balancing is aux-loss-free by default (``load_balance = "bias"``): the fp32 ``expert_bias`` added
to the scores to choose experts, which HF's DeepSeek-V3 class holds as ``e_score_correction_bias``,
so it is read and written both ways (HF's DeepSeek-V2 class holds none: there an export keeps
only a zero one, and a DeepSeek-V2 ``config.json`` reads as balanced by the auxiliary loss).

Tensor names: the shared decoder's (``tok_embeddings``, ``layers.{i}.{attention_norm,ffn_norm}``,
``layers.{i}.feed_forward.{w1,w2,w3}`` in the dense layers, ``norm``, ``output``), and per layer
``attention.{wq | wq_a, q_norm, wq_b}.weight``, ``attention.{wkv_a, kv_norm, wkv_b, wo}.weight``
(torchtitan's names), in MoE layers ``moe.router.gate.weight`` ``[experts, dim]``,
``moe.expert_bias`` ``[experts]``, ``moe.experts.{w1,w3}`` ``[experts, moe_ffn_dim, dim]``,
``moe.experts.w2`` ``[experts, dim, moe_ffn_dim]`` and ``moe.shared_experts.{w1,w2,w3}.weight``.
Hugging Face's (``hf``) and torchtitan 0.3.0's (``torchtitan``) are mapped onto them.

Flavors: ``671B`` is DeepSeek-V3's released ``config.json`` (torchtitan 0.3.0's ``671B`` computes
the same); ``debugmodel``, ``16B`` and ``236B`` are torchtitan 0.3.0's recipes of those names, each
computing what torchtitan's computes: softmax routing without renormalization, YaRN's softmax
scale from an ``mscale`` of 0.70 (236B: 1.0), every norm at torchtitan's epsilon 1e-5; ``16B``
has DeepSeek-V2-Lite's shapes (no low-rank query, 64 experts, 2 shared, 1 dense layer) and no
groups, ``236B`` DeepSeek-V2's shapes with 8 groups of which 3 are kept, ranked by their two best
scores, weights times 16 (DeepSeek-V2's own ``config.json`` ranks by the best one and a 0.707
``mscale``: it reads as itself, not as this flavor). ``debug`` trains on a CPU in seconds.

The init recipe is torchtitan's for DeepSeek-V3.
"""

from __future__ import annotations

import dataclasses

import torch

from models.common import OSFT_TARGETS, decoder_family, decoder_layer_flops
from models.common.decoder import Transformer
from models.deepseek_v3 import hf, hf_v2
from models.deepseek_v3.args import SHAPE_FIELDS, DeepseekV3Args
from models.deepseek_v3.flavors import FLAVORS
from models.deepseek_v3.tensor_parallel import MLA_TENSOR_PARALLEL
from models.deepseek_v3.torchtitan import DeepseekV3TorchtitanNames

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
        (hf.MODEL_TYPE, hf_v2.MODEL_TYPE),
        hf_v2.config,
        hf_v2.args_from_config,
        shape_fields=SHAPE_FIELDS,
        names=hf_v2.DeepseekHFNames,
        flops_per_token=flops_per_token,
        layer_flops=lambda model_args, seq_len: decoder_layer_flops(model_args, seq_len, attention=attention_flops),
        tensor_parallel=MLA_TENSOR_PARALLEL,
        renamings={"torchtitan": DeepseekV3TorchtitanNames},
    ),
    osft_targets=OSFT,
)
