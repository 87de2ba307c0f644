"""DeepSeek-V3 in Hugging Face's layout: ``config.json`` both ways and ``DeepseekV3ForCausalLM``'s
tensor names.

``config.json``: every field ``transformers`` 5.24's ``DeepseekV3Config`` reads is read, with that
class's default where a file leaves it out (its model is what the file means); a field whose value
changes the math and is not computed here is refused, naming it (another activation, DeepSeek's
own ``scoring_func`` / ``topk_method`` other than V3's, key/value heads fewer than the heads).
A null is read as transformers reads it: ``q_lora_rank: null`` is our ``0`` (no low-rank query),
``norm_topk_prob`` and ``rope_interleave`` null are false (the model tests them for truth: no
renormalization, halves rotated); a null the class refuses, or its model cannot run (``n_group``,
``topk_group``, ``num_experts_per_tok``, ``first_k_dense_replace``, ``v_head_dim``, ``head_dim``), is
refused (``NOT_NULL``). ``attention_bias`` is computed (``q_a_proj``, ``kv_a_proj_with_mqa`` and
``o_proj`` biases).

Names: the shared decoder's (``models.common.hf_names``) for the embedding, norms, dense
feed-forward and output; per layer

==============================================  ==================================================
ours (``layers.{i}.``)                          Hugging Face's (``model.layers.{i}.``)
==============================================  ==================================================
``attention.wq`` (``q_lora_rank = 0``)          ``self_attn.q_proj``
``attention.wq_a``, ``q_norm``, ``wq_b``        ``self_attn.q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
``attention.wkv_a``, ``kv_norm``, ``wkv_b``     ``self_attn.kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``
``attention.wo``                                ``self_attn.o_proj``
``moe.router.gate.weight``                      ``mlp.gate.weight``
``moe.expert_bias``                             ``mlp.gate.e_score_correction_bias``
``moe.experts.{w1,w2,w3}`` ``[E, ...]``         ``mlp.experts.{e}.{gate,down,up}_proj.weight``
``moe.shared_experts.{w1,w2,w3}``               ``mlp.shared_experts.{gate,down,up}_proj``
==============================================  ==================================================

RoPE rows: DeepSeek's weights rotate interleaved pairs (``rope_interleave: true``), as our RoPE
does, so nothing is permuted. A file with ``rope_interleave: false`` rotates halves: the RoPE rows
of each head of ``wq``/``wq_b`` (the last ``qk_rope_head_dim`` of each head's rows) and of
``wkv_a`` (its last ``qk_rope_head_dim`` rows) are permuted within themselves, both ways.

The hub checkpoint's multi-token-prediction module is stored as one more layer
(``model.layers.61`` for 671B, told apart by its ``eh_proj``); ``transformers`` ignores it and so
does this reader: its tensors are skipped, with one warning line saying so. A layer past
``num_hidden_layers`` without an ``eh_proj`` is a decoder layer the config leaves out: refused.
Shared experts stored while ``n_shared_experts`` is 0 are refused too, unless empty (as
``transformers`` writes them for none). A ``first_k_dense_replace`` of ``num_hidden_layers`` or more
makes every layer dense, as ``transformers`` builds it: read so, with a warning line.
"""

from __future__ import annotations

import re
import warnings

import torch

from models.common import hf_config
from models.common.args import check_bool, check_float, check_int
from models.common.hf_names import ExpertNames, HFNames, permute_from_hf, permute_to_hf
from models.deepseek_v3.args import DeepseekV3Args

ARCHITECTURE, MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"
EXPERTS = ExpertNames("mlp", (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")))
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.wq_a.bias": "self_attn.q_a_proj.bias",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.wkv_a.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_LAYER_INV = {theirs: ours for ours, theirs in _LAYER.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")
_QUERY_ROWS = ("attention.wq.weight", "attention.wq_b.weight")  # heads x (nope + rope) rows


class DeepseekV3HFNames(HFNames):
    """The name adapter between our FQNs and ``DeepseekV3ForCausalLM``'s for a model of ``args``
    (GLM-4.5's, whose mixtures of experts are DeepSeek-V3's, builds on it: ``MODEL``, ``rope_rows``)."""

    MODEL = "DeepSeek-V3"  # whose multi-token-prediction module ``left_out`` names

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args, EXPERTS)

    def to_stored(self, fqn: str) -> str:
        m = _OURS.fullmatch(fqn)
        if m and m.group(2) in _LAYER:
            return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
        return super().to_stored(fqn)

    def from_stored(self, name: str):
        m = _THEIRS.fullmatch(name)
        if m and int(m.group(1)) >= self.args.n_layers:
            return None  # a multi-token-prediction module, or a layer config.json leaves out (``left_out``)
        if m and m.group(2) in _LAYER_INV:
            return f"layers.{m.group(1)}.{_LAYER_INV[m.group(2)]}"
        return super().from_stored(name)

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """The layers past ``num_hidden_layers`` that hold an ``eh_proj`` are the multi-token-prediction
        module, skipped with one line; any other such layer is one the model lacks."""
        mtp = {_layer(name) for name in skipped if name.endswith(".eh_proj.weight")}
        refused, _ = super().left_out([name for name in skipped if _layer(name) not in mtp])
        if not mtp:
            return refused, None
        return refused, (
            f"model.layers.{min(mtp)} and up ({self.MODEL}'s multi-token-prediction module) are skipped: this "
            "model, like transformers', predicts the next token only"
        )

    def config_fields(self, name: str) -> tuple[str, ...]:
        m = _THEIRS.fullmatch(name)
        if m and m.group(2).startswith("mlp.shared_experts."):
            return ("n_shared_experts",)
        return super().config_fields(name)

    def unkept_unless_zero(self, fqn: str) -> None:
        return None  # HF's class holds the expert bias (e_score_correction_bias)

    def row_groups(self, fqn: str) -> int | None:
        """With halves-rotated files, rows are permuted within each head (queries) or in the one
        group of ``wkv_a`` (its last rows are the shared RoPE key)."""
        if self.args.rope_interleave:
            return None
        if fqn.endswith(_QUERY_ROWS):
            return self.args.n_heads
        return 1 if fqn.endswith(("attention.wkv_a.weight", "attention.wkv_a.bias")) else None

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        groups = self.row_groups(fqn)
        return self._rope_rows(tensor, groups, permute_to_hf) if groups else tensor

    def from_stored_rows(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        return self._rope_rows(tensor, groups, permute_from_hf)

    def rope_rows(self) -> slice:
        """The rows of each group RoPE turns: the last ``qk_rope_head_dim``."""
        return slice(-self.args.qk_rope_head_dim, None)

    def _rope_rows(self, tensor: torch.Tensor, groups: int, permute) -> torch.Tensor:
        """``permute`` applied to the ``rope_rows`` of each of ``groups`` groups."""
        rows = self.rope_rows()
        grouped = tensor.reshape(groups, tensor.shape[0] // groups, -1).clone()
        for group in grouped:
            group[rows] = permute(group[rows], 1)
        return grouped.reshape(tensor.shape)


def _layer(name: str) -> int:
    """The layer index of HF's ``model.layers.{i}.*`` name; -1 for the others."""
    m = _THEIRS.fullmatch(name)
    return int(m.group(1)) if m else -1


def config(args: DeepseekV3Args, dtype: torch.dtype) -> dict:
    cfg = hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE)
    del cfg["head_dim"]  # transformers derives it (qk_rope_head_dim)
    return {
        **cfg,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": args.rope_interleave,
        "attention_bias": args.attention_bias,
        **moe_config(args),
    }


def moe_config(args) -> dict:
    """The ``config.json`` fields of DeepSeek-V3's mixtures of experts (GLM-4.5's too) after
    ``first_k_dense_replace`` dense layers; no multi-token-prediction module is written."""
    return {
        "first_k_dense_replace": args.first_k_dense_replace,
        "n_routed_experts": args.n_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "norm_topk_prob": args.norm_topk_prob,
        "routed_scaling_factor": args.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
    }


# transformers' DeepseekV3Config defaults (DeepSeek-V3's shapes), for fields a config.json leaves out
_DEFAULTS = DeepseekV3Args()


# The routing fields DeepseekV3Config and the configs built on its routing (Glm4MoeConfig) refuse
# as null, or whose null their model cannot run
ROUTING_NOT_NULL = (
    "first_k_dense_replace",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)

# DeepseekV3Config's fields that refuse null, and those its model cannot run as null (``hf_config.refuse_nulls``)
NOT_NULL = (
    *hf_config.NOT_NULL,
    "attention_bias",
    "output_router_logits",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "head_dim",
    *ROUTING_NOT_NULL,
)


def args_from_config(cfg: dict) -> DeepseekV3Args:
    hf_config.refuse_nulls(cfg, NOT_NULL, "DeepseekV3Config")
    return read_args(cfg)


def read_args(cfg: dict) -> DeepseekV3Args:
    """``args_from_config`` past its nulls (DeepSeek-V2's reader refuses its class's own first)."""
    hf_config.refuse_common(cfg, "DeepSeek-V3")
    hf_config.refuse(cfg, "DeepSeek-V3", scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    n_heads = hf_config.read(cfg, "num_attention_heads", check_int, _DEFAULTS.n_heads)
    # Absent: the class's default (128, DeepSeek-V3's heads); null: as many as the heads. More than the
    # heads changes nothing in transformers' (SDPA) attention, which repeats keys only for fewer.
    n_kv_heads = hf_config.read(cfg, "num_key_value_heads", check_int, _DEFAULTS.n_heads, null=n_heads)
    if n_kv_heads < n_heads:
        raise ValueError(
            f"config.json has {hf_config.stated(cfg, 'num_key_value_heads', n_kv_heads)}; DeepSeek-V3's attention "
            f"gives every head its own key and value: it must be at least num_attention_heads = {n_heads}"
        )

    def field(name: str, hf_name: str, check=check_int, **rule):
        return hf_config.read(cfg, hf_name, check, getattr(_DEFAULTS, name), **rule)

    experts = "n_routed_experts" if cfg.get("n_routed_experts") is not None else "num_local_experts"
    args = DeepseekV3Args(
        dim=field("dim", "hidden_size"),
        n_layers=field("n_layers", "num_hidden_layers"),
        n_heads=n_heads,
        ffn_dim=field("ffn_dim", "intermediate_size"),
        vocab_size=field("vocab_size", "vocab_size"),
        norm_eps=field("norm_eps", "rms_norm_eps", check_float),
        rope_theta=hf_config.rope_theta(cfg),
        rope_scaling=hf_config.rope_scaling(cfg),
        max_seq_len=hf_config.read(cfg, "max_position_embeddings", check_int, 4096),  # transformers' default
        tie_word_embeddings=field("tie_word_embeddings", "tie_word_embeddings", check_bool),
        initializer_range=field("initializer_range", "initializer_range", check_float, positive=False),
        # null: no low-rank query; absent: transformers' default
        q_lora_rank=0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None else field("q_lora_rank", "q_lora_rank"),
        kv_lora_rank=field("kv_lora_rank", "kv_lora_rank"),
        qk_nope_head_dim=field("qk_nope_head_dim", "qk_nope_head_dim"),
        qk_rope_head_dim=field("qk_rope_head_dim", "qk_rope_head_dim"),
        v_head_dim=field("v_head_dim", "v_head_dim"),
        attention_bias=field("attention_bias", "attention_bias", check_bool),
        rope_interleave=field("rope_interleave", "rope_interleave", check_bool, null=False),
        first_k_dense_replace=field("first_k_dense_replace", "first_k_dense_replace", least=0),
        n_experts=field("n_experts", experts),
        n_shared_experts=field("n_shared_experts", "n_shared_experts", least=0),
        top_k=field("top_k", "num_experts_per_tok"),
        moe_ffn_dim=field("moe_ffn_dim", "moe_intermediate_size"),
        n_group=field("n_group", "n_group"),
        topk_group=field("topk_group", "topk_group"),
        norm_topk_prob=field("norm_topk_prob", "norm_topk_prob", check_bool, null=False),
        routed_scaling_factor=field("routed_scaling_factor", "routed_scaling_factor", check_float),
    )
    if not args.moe_layers:
        warnings.warn(
            f"config.json has {hf_config.stated(cfg, 'first_k_dense_replace', args.first_k_dense_replace)}, not "
            f"below num_hidden_layers = {args.n_layers}: every layer is dense and none holds the mixture of "
            "experts (as transformers builds it); lower first_k_dense_replace if the model has experts",
            stacklevel=2,
        )
    return args
