"""GLM-4.5 (355B-A32B) and GLM-4.5-Air (106B-A12B): grouped-query attention turning part of each head,
then dense layers followed by DeepSeek-V3's mixtures of experts (``Glm4MoeForCausalLM``, model_type
``glm4_moe``; GLM-4.6 and 4.7 share the architecture).

The shared decoder (``models.common.decoder``) with every switch its own: q, k and v carry biases
(``attention_bias``; the output projection none), an RMSNorm over each q and k head when ``qk_norm``
(HF's ``use_qk_norm``: GLM-4.5, not Air), RoPE on the first ``rotary_dim = head_dim *
partial_rotary_factor`` channels of each head only (half, as released; ``models.common.rope``). The
first ``first_k_dense_replace`` layers keep a dense feed-forward of width ``ffn_dim``; every later one
holds ``n_experts`` routed SwiGLU experts of width ``moe_ffn_dim`` beside ``n_shared_experts`` shared
ones (``models.common.moe``), routed as DeepSeek-V3 routes: sigmoid scores, the ``topk_group`` best of
``n_group`` groups (ranked by their two best scores), weights renormalized (``norm_topk_prob``) and
times ``routed_scaling_factor``, the experts chosen with the correction bias added.

Balancing is aux-loss-free by default (``load_balance = "bias"``): the fp32 ``expert_bias`` is HF's
``mlp.gate.e_score_correction_bias``, read and written both ways.

Tensor names: the shared decoder's (``attention.{wq,wk,wv}.{weight,bias}``, ``attention.wo.weight``,
``attention.{q_norm,k_norm}.weight``, ``feed_forward.{w1,w2,w3}`` in the dense layers ...), and in MoE
layers DeepSeek-V3's (``moe.router.gate.weight``, ``moe.expert_bias``, ``moe.experts.{w1,w2,w3}``,
``moe.shared_experts.{w1,w2,w3}.weight``). Hugging Face's are mapped by ``hf``.

Flavors: ``355B-A32B`` and ``106B-A12B`` are GLM-4.5's and GLM-4.5-Air's released ``config.json``
(their multi-token-prediction layer left out, as ``transformers`` leaves it); ``debug`` trains on a
CPU in seconds. The init recipe is HF's (``normal``, std ``initializer_range``; the correction bias
zero), as for the other families without a torchtitan recipe.
"""

from __future__ import annotations

from models.common import decoder_family, moe_flops_per_token
from models.glm4_moe import hf
from models.glm4_moe.args import SHAPE_FIELDS, Glm4MoeArgs


def _glm45(**fields) -> Glm4MoeArgs:
    """A released GLM-4.5 shape: 151552 tokens, 96 heads of 128 over 8 key/value heads, half of each
    turned at base 1e6, 128k positions, one shared expert, 8 routed experts a token, no groups."""
    return Glm4MoeArgs(vocab_size=151552, n_heads=96, max_seq_len=131072, top_k=8, **fields)


FLAVORS = {
    "debug": Glm4MoeArgs(
        dim=128,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        qk_norm=True,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=64,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    "355B-A32B": _glm45(
        dim=5120,
        n_layers=92,
        ffn_dim=12288,
        qk_norm=True,
        first_k_dense_replace=3,
        n_experts=160,
        moe_ffn_dim=1536,
        routed_scaling_factor=2.5,
    ),
    "106B-A12B": _glm45(dim=4096, n_layers=46, ffn_dim=10944, n_experts=128, moe_ffn_dim=1408),
}

GLM4_MOE = decoder_family(
    "glm4_moe",
    Glm4MoeArgs,
    FLAVORS,
    (hf.MODEL_TYPE,),
    hf.config,
    hf.args_from_config,
    shape_fields=SHAPE_FIELDS,
    names=hf.Glm4MoeHFNames,
    flops_per_token=moe_flops_per_token,
)
