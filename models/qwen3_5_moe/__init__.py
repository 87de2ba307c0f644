"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, model_type ``qwen3_5_moe_text``; the releases are the
multimodal ``qwen3_5_moe``, whose text decoder this is): Qwen3.5's layers (``models.qwen3_5``: three
of every four Gated DeltaNet linear attention, the fourth gated full attention) with a mixture of
experts as every layer's feed-forward.

The mixture (``models.common.moe``): softmax over all ``n_experts`` experts' logits in float32, the
``top_k`` best kept and renormalized to sum to one (transformers' class always renormalizes), each a
SwiGLU of width ``moe_ffn_dim``; beside them one shared expert, a SwiGLU of width ``ffn_dim`` (HF's
``shared_expert_intermediate_size``) that every token runs, its output scaled per token by
``sigmoid(x . g)`` (HF's ``shared_expert_gate``). Balancing is HF's auxiliary loss at
``router_aux_loss_coef`` by default, in its sequence-wise form (``models.common.moe``: each row's and
layer's statistic is ``load_balancing_loss_func``'s on that row and layer).

Tensor names: Qwen3.5's, and in each layer ``moe.router.gate.weight``, ``moe.experts.{w1,w2,w3}``
(gate, down, up, ``[experts, ...]``), ``moe.shared_experts.{w1,w2,w3}.weight`` and
``moe.shared_experts.gate.weight`` ``[1, dim]`` (torchtitan's names), plus the fp32
``moe.expert_bias`` with ``load_balance = "bias"``. Hugging Face's are mapped by ``hf``.

Flavors: ``35B-A3B``, ``122B-A10B`` and ``397B-A17B`` are the released text decoders' shapes, with
``transformers``' parameter counts; ``debug`` trains on a CPU in seconds (on rows longer than the
rule's 64-position chunk, its linear layers cross it: the tests train on 80). The init recipe is
torchtitan 0.3.0's ``qwen3_5`` MoE: Qwen3.5's, the router at the layer's depth-scaled std, the
experts' and the shared expert's ``w1`` at 0.02 and ``w2``/``w3`` depth-scaled, the shared expert's
gate at 0.02. Tensor parallelism is Qwen3.5's plan, each mixture of experts whole on every TP rank
(its shared expert split as a dense feed-forward, its gate whole) unless expert parallelism spreads
its experts.
"""

from __future__ import annotations

import torch

from models.common import decoder_family
from models.common.decoder import Transformer
from models.qwen3_5 import FLAVORS as DENSE_FLAVORS
from models.qwen3_5 import OSFT_TARGETS as DENSE_OSFT_TARGETS
from models.qwen3_5 import QWEN3_5
from models.qwen3_5 import flops_per_token as dense_flops_per_token
from models.qwen3_5_moe import hf
from models.qwen3_5_moe.args import SHAPE_FIELDS, Qwen35MoeArgs
from models.qwen3_5_moe.torchtitan import Qwen35MoeTorchtitanNames

# The block linears OSFT trains by default: every attention matrix of both kinds, and the shared
# expert (the dense feed-forward every token runs); the router and the routed experts stay frozen.
OSFT_TARGETS = (
    *(t for t in DENSE_OSFT_TARGETS if not t.startswith("feed_forward.")),
    "moe.shared_experts.w1",
    "moe.shared_experts.w2",
    "moe.shared_experts.w3",
)


def _released(dim: int, n_layers: int, n_heads: int, v_heads: int, n_experts: int, top_k: int, ffn: int):
    """A released Qwen3.5-MoE text decoder: 248320 tokens, 2 key/value heads of 256 turning a quarter
    at base 10^7, 262144 positions, untied; linear layers with 16 key heads of 128 and ``v_heads``
    value heads of 128; experts and the shared expert all ``ffn`` wide."""
    return Qwen35MoeArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        ffn_dim=ffn,
        vocab_size=248320,
        rope_theta=1e7,
        max_seq_len=262144,
        linear_num_value_heads=v_heads,
        n_experts=n_experts,
        top_k=top_k,
        moe_ffn_dim=ffn,
    )


FLAVORS = {
    # the dense debug flavor's layers, each with 8 experts of 64 (2 a token) and a shared expert of 64
    "debug": Qwen35MoeArgs(
        **{**DENSE_FLAVORS["debug"].to_dict(), "ffn_dim": 64, "n_experts": 8, "top_k": 2, "moe_ffn_dim": 64}
    ),
    "35B-A3B": _released(2048, 40, 16, 32, 256, 8, 512),
    "122B-A10B": _released(3072, 48, 32, 64, 256, 8, 1024),
    "397B-A17B": _released(4096, 60, 32, 64, 512, 10, 1024),
}


def flops_per_token(args: Qwen35MoeArgs, seq_len: int, num_params: int | None = None) -> int:
    """Qwen3.5's count (each layer's own token mixing) on the parameters a token uses: all but the
    ``n_experts - top_k`` routed experts of each layer it is not sent to (MFU against the active size)."""
    if num_params is None:
        with torch.device("meta"):
            num_params = sum(p.numel() for p in Transformer(args).parameters())
    moe = args.decoder_options.moe
    idle = args.n_layers * (moe.n_experts - moe.top_k) * moe.expert_numel(args.dim)
    return dense_flops_per_token(args, seq_len, num_params - idle)


QWEN3_5_MOE = decoder_family(
    "qwen3_5_moe",
    Qwen35MoeArgs,
    FLAVORS,
    (hf.MODEL_TYPE, hf.WRAPPER_TYPE),
    hf.config,
    hf.args_from_config,
    shape_fields=SHAPE_FIELDS,
    names=hf.Qwen35MoeNames,
    osft_targets=OSFT_TARGETS,
    flops_per_token=flops_per_token,
    layer_flops=QWEN3_5.layer_flops,  # counts each block's active parameters (experts by top_k)
    tensor_parallel=QWEN3_5.tensor_parallel,
    renamings={"torchtitan": Qwen35MoeTorchtitanNames},
)
