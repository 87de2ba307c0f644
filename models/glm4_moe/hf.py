"""GLM-4.5 in Hugging Face's layout: ``config.json`` both ways and ``Glm4MoeForCausalLM``'s names.

``config.json``: every field ``transformers`` 5.24's ``Glm4MoeConfig`` reads is read, with that
class's default where a file leaves it out; ``partial_rotary_factor`` from the RoPE table, else the
top level (files before transformers 5), else 0.5 -- the class's. ``head_dim`` is no field of the
class: absent, it is ``hidden_size // num_attention_heads``, as its attention takes it. Refused in
one line: another activation, an MLP bias, a layer kind other than full attention, a RoPE stretch
not computed here; an export refuses a sliding window, which the class has none of.

Names: the shared decoder's (``models.common.hf_names``) for attention, norms and dense layers, and
DeepSeek-V3's for the mixtures of experts (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.*``): ``Glm4MoeHFNames`` is
DeepSeek-V3's adapter with GLM's attention. RoPE rows: HF turns halves of each head's first
``rotary_dim`` channels, ours interleaved pairs of them, so only those rows of ``wq``/``wk`` (and
their biases, and the q/k norms' weights) are permuted, within each head.

The hub checkpoints' multi-token-prediction layer (``model.layers.92`` of GLM-4.5, ``46`` of Air: one
layer past the last, with its ``eh_proj``) is skipped with one warning line, as ``transformers``
skips it; an export writes ``num_nextn_predict_layers: 0``.
"""

from __future__ import annotations

import re

import torch

from models.common import hf_config
from models.common.args import check_bool, check_float, check_int
from models.common.hf_names import HFNames, heads_of
from models.deepseek_v3.hf import ROUTING_NOT_NULL, DeepseekV3HFNames, moe_config
from models.glm4_moe.args import Glm4MoeArgs

ARCHITECTURE, MODEL_TYPE = "Glm4MoeForCausalLM", "glm4_moe"

# transformers' Glm4MoeConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)
PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig's, for a file that gives none
_ATTENTION = re.compile(r"layers\.\d+\.attention\..+")
_SELF_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\..+")


class Glm4MoeHFNames(DeepseekV3HFNames):
    """The name adapter between our FQNs and ``Glm4MoeForCausalLM``'s for a model of ``args``: DeepSeek-V3's
    but for attention, which is the shared decoder's (``q_norm`` is a head's norm here, not MLA's latent one)."""

    MODEL = "GLM-4.5"

    def to_stored(self, fqn: str) -> str:
        return HFNames.to_stored(self, fqn) if _ATTENTION.fullmatch(fqn) else super().to_stored(fqn)

    def from_stored(self, name: str):
        m = _SELF_ATTN.fullmatch(name)
        if m and int(m.group(1)) < self.args.n_layers:  # past them: the multi-token-prediction layer
            return HFNames.from_stored(self, name)
        return super().from_stored(name)

    def row_groups(self, fqn: str) -> int | None:
        """q/k rows are permuted within each head (their norms: one head's worth)."""
        return heads_of(fqn, self.args)

    def rope_rows(self) -> slice:
        """The rows of each head RoPE turns: the first ``rotary_dim``."""
        return slice(0, self.args.rotary_dim)


def config(args: Glm4MoeArgs, dtype: torch.dtype) -> dict:
    if args.sliding_window is not None:
        raise ValueError(
            f"sliding_window = {args.sliding_window}: GLM-4.5's config.json has no sliding window; remove "
            "model.sliding_window"
        )
    cfg = hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": args.partial_rotary_factor}
    return {
        **cfg,
        "partial_rotary_factor": args.partial_rotary_factor,
        "use_qk_norm": args.qk_norm,
        "attention_bias": args.attention_bias,
        **moe_config(args),
    }


# Glm4MoeConfig's fields that refuse null (``hf_config.refuse_nulls``); its model cannot run a null
# head_dim, which the class keeps
NOT_NULL = (
    *hf_config.NOT_NULL,
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "num_key_value_heads",
    "use_qk_norm",
    *ROUTING_NOT_NULL,
    "norm_topk_prob",
    "output_router_logits",
)


def args_from_config(cfg: dict) -> Glm4MoeArgs:
    hf_config.refuse_nulls(cfg, NOT_NULL, "Glm4MoeConfig")
    hf_config.refuse_common(cfg, "GLM-4.5")  # layer_types: the class attends to every position whatever it says

    def field(name: str, check, default, **rule):
        return hf_config.read(cfg, name, check, default, **rule)

    return Glm4MoeArgs(
        **hf_config.decoder_fields(cfg, partial_rotary=True, **HF_DEFAULTS),
        partial_rotary_factor=hf_config.partial_rotary_factor(cfg, PARTIAL_ROTARY_FACTOR),
        qk_norm=field("use_qk_norm", check_bool, False),
        attention_bias=field("attention_bias", check_bool, False),
        first_k_dense_replace=field("first_k_dense_replace", check_int, 1, least=0),
        n_experts=hf_config.size(cfg, "n_routed_experts", 128),
        n_shared_experts=field("n_shared_experts", check_int, 1, least=0),
        top_k=hf_config.size(cfg, "num_experts_per_tok", 8),
        moe_ffn_dim=hf_config.size(cfg, "moe_intermediate_size", 1408),
        n_group=hf_config.size(cfg, "n_group", 1),
        topk_group=hf_config.size(cfg, "topk_group", 1),
        norm_topk_prob=field("norm_topk_prob", check_bool, True),
        routed_scaling_factor=field("routed_scaling_factor", check_float, 1.0),
    )
