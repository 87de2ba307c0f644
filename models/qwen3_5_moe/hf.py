"""Qwen3.5-MoE in Hugging Face's layout: ``config.json`` both ways and ``Qwen3_5MoeForCausalLM``'s names.

Read: ``Qwen3_5MoeForCausalLM``'s directories (model_type ``qwen3_5_moe_text``) and the multimodal
``Qwen3_5MoeForConditionalGeneration``'s (``qwen3_5_moe``: the releases), whose decoder is its
``text_config``, stored under ``model.language_model.``; their vision tower and multi-token-prediction
module are skipped with one line, as for the dense Qwen3.5 (``models.qwen3_5.hf``, which reads
everything but the experts). Qwen3.6-35B-A3B is the same ``qwen3_5_moe`` model to transformers (its
documentation: the same ``model_type`` and classes), read alike. Written: a ``Qwen3_5MoeForCausalLM``
directory.

A field the file leaves out takes ``Qwen3_5MoeTextConfig``'s default (``HF_DEFAULTS``, and 256
experts of 512, 8 a token, a shared expert of 512). The class keeps no ``intermediate_size``,
``norm_topk_prob``, ``decoder_sparse_step`` or ``mlp_only_layers`` (every layer is a mixture of
experts, its weights always renormalized), so a file's are read past, as it reads past them.

Names: Qwen3.5's, and the experts as ``transformers`` 5.24 saves them, one tensor per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, router ``mlp.gate.weight``: Qwen3-MoE's); the
shared expert ``mlp.shared_expert.{gate,up,down}_proj.weight`` is our ``moe.shared_experts.{w1,w3,w2}``
and its gate ``mlp.shared_expert_gate.weight`` our ``moe.shared_experts.gate.weight``.

The releases (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B) store each layer's experts fused instead, as
transformers' ``Qwen3_5MoeExperts`` holds them: ``mlp.experts.gate_up_proj`` ``[E, 2 ffn, dim]``, the
gate's rows (our ``w1``) then the up projection's (``w3``), and ``mlp.experts.down_proj`` ``[E, dim,
ffn]``, our ``w2`` as it is (no ``.weight``; their MTP layer's alike, under ``mtp.``, skipped). Both
are read as ``StoredParts``, so a rank reads only its experts' rows of them; a directory holding some
expert both ways, or a ``gate_up_proj`` that is not 3-D with an even row count, is refused in one line.
An export writes one tensor per expert whatever layout was read: it is what ``save_pretrained`` writes
and transformers reads both, and the layout read is not kept past the read (a seed or a training step
holds ours), so following it would export the same weights two ways depending on the path they took.
"""

from __future__ import annotations

import re

import torch

from models.common import hf_config
from models.common.args import check_bool
from models.common.hf_names import join_gate_up, split_gate_up
from models.qwen3_5 import hf as dense
from models.qwen3_5.hf import Qwen35Names, text_name
from models.qwen3_5_moe.args import Qwen35MoeArgs
from models.qwen3_moe import EXPERTS
from seedckpt.utils.stored_parts import StoredParts

ARCHITECTURE, MODEL_TYPE, WRAPPER_TYPE = "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "qwen3_5_moe"
CONFIG_CLASS = "Qwen3_5MoeTextConfig"

# transformers' Qwen3_5MoeTextConfig defaults where they differ from LlamaConfig's
HF_DEFAULTS = dense.HF_DEFAULTS | dict(hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2)
# config.json's mixture-of-experts fields -> Qwen3_5MoeTextConfig's defaults
MOE_DEFAULTS = dict(
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512
)
# The class types them without None (transformers refuses a null one)
NOT_NULL = (*MOE_DEFAULTS, "router_aux_loss_coef", "output_router_logits")

# Ours (within ``layers.{i}.moe.shared_experts.``) -> HF's (within ``model.layers.{i}.mlp.``)
_SHARED = {
    "w1.weight": "shared_expert.gate_proj.weight",
    "w2.weight": "shared_expert.down_proj.weight",
    "w3.weight": "shared_expert.up_proj.weight",
    "gate.weight": "shared_expert_gate.weight",
}
_SHARED_INV = {theirs: ours for ours, theirs in _SHARED.items()}
_OURS = re.compile(r"layers\.(\d+)\.moe\.shared_experts\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.(shared_expert.+)")
_FUSED_THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


# The release's fused experts, within a layer's ``mlp.experts.``: (ours, split, join); both are
# already ours' orientation, ``[experts, out, in]``
_FUSED = {
    "gate_up_proj": (("w1", "w3"), split_gate_up, join_gate_up),
    "down_proj": (("w2",), lambda t: (t,), lambda ours: ours[0]),
}


class Qwen35MoeNames(Qwen35Names):
    """Qwen3.5's name adapter (``models.qwen3_5.hf``) with the experts (one tensor each, or the
    releases' fused ones) and the gated shared expert."""

    def __init__(self, args):
        super().__init__(args, EXPERTS)

    def to_stored(self, fqn: str) -> str:
        m = _OURS.fullmatch(fqn)
        if m is None or m.group(2) not in _SHARED:
            return super().to_stored(fqn)
        return f"model.layers.{m.group(1)}.mlp.{_SHARED[m.group(2)]}"

    def from_stored(self, name: str):
        fused = _FUSED_THEIRS.fullmatch(text_name(name) or "")
        if fused is not None:
            ours, split, join = _FUSED[fused.group(2)]
            return StoredParts(tuple(f"layers.{fused.group(1)}.moe.experts.{w}" for w in ours), split, join)
        m = _THEIRS.fullmatch(text_name(name) or "")
        if m is None or m.group(2) not in _SHARED_INV:
            return super().from_stored(name)
        return f"layers.{m.group(1)}.moe.shared_experts.{_SHARED_INV[m.group(2)]}"


def config(args: Qwen35MoeArgs, dtype: torch.dtype) -> dict:
    cfg = {k: v for k, v in dense.config(args, dtype).items() if k != "intermediate_size"}
    return {
        **cfg,
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "shared_expert_intermediate_size": args.ffn_dim,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }


def args_from_config(cfg: dict) -> Qwen35MoeArgs:
    """Our args for a ``qwen3_5_moe_text`` ``config.json``, or a ``qwen3_5_moe`` one's decoder."""
    tied = None
    if cfg.get("model_type") == WRAPPER_TYPE:  # as transformers builds it: tied by the top-level field
        tied = hf_config.read(cfg, "tie_word_embeddings", check_bool, False)
        cfg = hf_config.table(cfg, "text_config")
    hf_config.refuse_nulls(cfg, NOT_NULL, CONFIG_CLASS)
    shared = hf_config.size(cfg, "shared_expert_intermediate_size", MOE_DEFAULTS["shared_expert_intermediate_size"])
    text = {**{k: v for k, v in cfg.items() if k != "intermediate_size"}, "intermediate_size": shared}
    decoder = dense.text_args(text, tied, HF_DEFAULTS, CONFIG_CLASS)
    experts = hf_config.moe_fields(cfg, MOE_DEFAULTS["num_experts"], MOE_DEFAULTS["num_experts_per_tok"], None)
    moe_ffn_dim = hf_config.size(cfg, "moe_intermediate_size", MOE_DEFAULTS["moe_intermediate_size"])
    return Qwen35MoeArgs(**decoder.to_dict(), **experts, moe_ffn_dim=moe_ffn_dim)
