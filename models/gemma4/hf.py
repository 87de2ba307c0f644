"""Gemma 4's Hugging Face layout: ``config.json`` both ways, and the tensor names.

Read: ``Gemma4ForCausalLM``'s directories (model_type ``gemma4_text``) and the multimodal
``Gemma4ForConditionalGeneration``'s (``gemma4``: the releases), whose decoder is its ``text_config``
and whose files store it under ``model.language_model.`` (the module's names, as transformers 5
saves them) or ``language_model.model.``. Their vision and audio towers and embedders
(``model.vision_tower.*``, ``model.embed_vision.*``, ``model.audio_tower.*``, ``model.embed_audio.*``)
are skipped with one line: this model is the text decoder. The multimodal class ties the output by
its own top-level ``tie_word_embeddings`` and applies its ``text_config``'s final softcap. A
kv-shared layer's key and value projections and norms, which a file may hold and transformers
ignores, are skipped with a line too. Written: a ``Gemma4ForCausalLM`` directory.

A field the file leaves out takes ``Gemma4TextConfig``'s default (``HF_DEFAULTS``; the layer kinds:
every sixth layer global, and the last, which transformers always makes global; the RoPE of each
kind: 10^4 on the windowed layers, 10^6 "proportional" with a quarter of the pairs turning on the
global ones). The global layers' head size and key/value heads are read as transformers reads them:
``per_layer_config`` (what transformers 5.24 writes), else ``global_head_dim`` (512) and, with
``attention_k_eq_v``, ``num_global_key_value_heads``. Refused in one line: a head shape that differs
within a layer kind, another per-layer override, attention biases, dropout, bidirectional
attention over text (``use_bidirectional_attention`` "all"; "vision", which configs derived from
26B-A4B carry, turns image tokens only, so text reads as causal), another activation, a RoPE kind
other than these, and a null where ``Gemma4TextConfig`` holds no null.

Names: as transformers names the modules (``models.gemma4``'s docstring lists ours); the q/k rows
are stored as they are (no RoPE permutation: Gemma 4 turns halves, as transformers does).
"""

from __future__ import annotations

import re

import torch

from models.common import hf_config
from models.common.args import check_bool, check_float, check_int
from models.common.hf_names import ExpertNames, HFNames, join_gate_up, split_gate_up
from models.gemma3 import hf as gemma3_hf
from models.gemma4.args import Gemma4Args, sliding_layers
from seedckpt.utils.stored_parts import StoredParts

ARCHITECTURE, MODEL_TYPE, WRAPPER_TYPE = "Gemma4ForCausalLM", "gemma4_text", "gemma4"

# transformers' Gemma4TextConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=262144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
)
# Fields Gemma4TextConfig types without None, so transformers refuses a null one: Gemma3TextConfig's
# (but its score scale, which Gemma 4 has not) and Gemma 4's own
NOT_NULL = (
    *(name for name in gemma3_hf.NOT_NULL if name != "query_pre_attn_scalar"),
    "sliding_window",
    "vocab_size_per_layer_input",
    "hidden_size_per_layer_input",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "enable_moe_block",
    "use_double_wide_mlp",
    "global_head_dim",
)
GLOBAL_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
LOCAL_ROPE = {"rope_type": "default", "rope_theta": 1e4}
PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")  # the per_layer_config overrides read


def args_from_config(cfg: dict) -> Gemma4Args:
    """Our args for a ``gemma4_text`` ``config.json``, or a ``gemma4`` one's decoder (``text_config``)."""
    if cfg.get("model_type") != WRAPPER_TYPE:
        return text_args(cfg)
    tied = hf_config.read(cfg, "tie_word_embeddings", check_bool, True, null=False)
    return text_args(hf_config.table(cfg, "text_config"), tied=tied)


def text_args(cfg: dict, tied: bool | None = None) -> Gemma4Args:
    """``tied``: the output's tie where another field decides it (None: this ``tie_word_embeddings``)."""
    refuse_uncomputed(cfg)
    plain = {
        name: value for name, value in cfg.items() if name not in ("rope_theta", "rope_scaling", "rope_parameters")
    }
    fields = hf_config.decoder_fields(plain, **HF_DEFAULTS) | rope_fields(cfg)
    if tied is not None:
        fields["tie_word_embeddings"] = tied
    kinds = layer_kinds(cfg, fields["n_layers"])
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    window = hf_config.read(cfg, "sliding_window", check_int, 512)
    k_eq_v = hf_config.read(cfg, "attention_k_eq_v", check_bool, False)
    return Gemma4Args(
        **fields,
        **global_shape(cfg, fields, kinds, k_eq_v),
        **moe_fields(cfg),
        sliding_window=window if sliding else None,
        window_layers=sliding if sliding else None,
        attention_k_eq_v=k_eq_v,
        final_logit_softcap=hf_config.read(cfg, "final_logit_softcapping", check_float, None),
        per_layer_dim=hf_config.read(cfg, "hidden_size_per_layer_input", check_int, 256, least=0),
        per_layer_vocab_size=per_layer_vocab(cfg, fields["vocab_size"]),
        kv_shared_layers=hf_config.read(cfg, "num_kv_shared_layers", check_int, 0, least=0),
        double_wide_mlp=hf_config.read(cfg, "use_double_wide_mlp", check_bool, False),
    )


def per_layer_vocab(cfg: dict, vocab_size: int) -> int | None:
    """``vocab_size_per_layer_input``; None where it is the vocabulary's (a grown vocabulary grows it,
    as transformers' ``resize_token_embeddings`` does)."""
    rows = hf_config.read(cfg, "vocab_size_per_layer_input", check_int, 262144)
    return None if rows == vocab_size else rows


def refuse_uncomputed(cfg: dict) -> None:
    """Refuse, in one line each, a null ``Gemma4TextConfig`` refuses and what this version does not compute."""
    hf_config.refuse_nulls(cfg, NOT_NULL, "Gemma4TextConfig")
    hf_config.refuse(cfg, "Gemma 4", hidden_activation="gelu_pytorch_tanh", attention_dropout=0.0, attention_bias=False)
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": image tokens only
        raise ValueError(
            f"config.json has use_bidirectional_attention = {cfg['use_bidirectional_attention']!r}; this version "
            'computes causal attention (text, as "vision" leaves it): set it null'
        )


def layer_kinds(cfg: dict, n_layers: int) -> list[str]:
    """``layer_types`` (default: every sixth layer global), the last layer made global as
    transformers makes it whatever the file says."""
    default = ["sliding_attention" if i in sliding_layers(n_layers) else "full_attention" for i in range(n_layers)]
    kinds = list(hf_config.layer_kinds(cfg | {"num_hidden_layers": n_layers}, default))
    return kinds[:-1] + ["full_attention"]


def rope_fields(cfg: dict) -> dict:
    """Each layer kind's RoPE (``rope_parameters``, keyed by kind; absent: the class's)."""
    parameters = hf_config.table(cfg, "rope_parameters") or {
        "full_attention": GLOBAL_ROPE,
        "sliding_attention": LOCAL_ROPE,
    }
    missing = [kind for kind in ("full_attention", "sliding_attention") if not parameters.get(kind)]
    if missing:
        raise ValueError(f"config.json's rope_parameters lacks {' and '.join(missing)}: give each layer kind's RoPE")
    local, full = dict(parameters["sliding_attention"]), dict(parameters["full_attention"])
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json turns the windowed layers' RoPE {local['rope_type']!r} (rope_parameters.sliding_attention); "
            "this version turns them plainly (default)"
        )
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(
            f"config.json asks for {kind!r} RoPE on the global layers (rope_parameters.full_attention); this "
            "version computes default and proportional"
        )
    proportional = kind == "proportional"
    return {
        "rope_local_theta": hf_config.read(local, "rope_theta", check_float, LOCAL_ROPE["rope_theta"]),
        "rope_theta": hf_config.read(full, "rope_theta", check_float, GLOBAL_ROPE["rope_theta"]),
        "global_rope_fraction": hf_config.read(full, "partial_rotary_factor", check_float, 1.0)
        if proportional
        else 1.0,
        "global_rope_factor": hf_config.read(full, "factor", check_float, 1.0) if proportional else 1.0,
    }


def global_shape(cfg: dict, fields: dict, kinds: list[str], k_eq_v: bool) -> dict:
    """``global_head_dim`` and ``global_kv_heads``, from ``per_layer_config`` or the flat fields."""
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        kv = hf_config.read(cfg, "num_global_key_value_heads", check_int, None) if k_eq_v else None
        return {"global_head_dim": hf_config.read(cfg, "global_head_dim", check_int, 512), "global_kv_heads": kv}
    if not isinstance(overrides, dict):
        raise ValueError(f"config.json has per_layer_config = {overrides!r}; it must be an object")
    shapes = {}
    for layer, kind in enumerate(kinds):
        override = hf_config.table(overrides, next((k for k in overrides if int(k) == layer), str(layer)))
        other = sorted(set(override) - set(PER_LAYER_FIELDS))
        if other:
            raise ValueError(
                f"config.json's per_layer_config gives layer {layer} {', '.join(other)}; this version reads "
                f"{' and '.join(PER_LAYER_FIELDS)} there"
            )
        shape = (
            hf_config.read(override, "head_dim", check_int, fields["head_dim"]),
            hf_config.read(override, "num_key_value_heads", check_int, fields["n_kv_heads"]),
        )
        if shapes.setdefault(kind, shape) != shape:
            raise ValueError(
                f"config.json's per_layer_config gives layer {layer} (head_dim, num_key_value_heads) = {shape}, other "
                f"{kind} layers {shapes[kind]}; this version takes one shape per layer kind"
            )
    if shapes.get("sliding_attention", (fields["head_dim"], fields["n_kv_heads"])) != (
        fields["head_dim"],
        fields["n_kv_heads"],
    ):
        raise ValueError(
            "config.json's per_layer_config reshapes the windowed layers; this version reshapes the global ones only"
        )
    head_dim, kv = shapes.get("full_attention", (512, None))
    return {"global_head_dim": head_dim, "global_kv_heads": kv}


def moe_fields(cfg: dict) -> dict:
    """The mixture of experts beside the MLP (``enable_moe_block``), or none."""
    if not hf_config.read(cfg, "enable_moe_block", check_bool, False):
        return {}
    return {
        "n_experts": hf_config.read(cfg, "num_experts", check_int, hf_config.REQUIRED),
        "top_k": hf_config.read(cfg, "top_k_experts", check_int, hf_config.REQUIRED),
        "moe_ffn_dim": hf_config.read(cfg, "moe_intermediate_size", check_int, hf_config.REQUIRED),
    }


def config(args: Gemma4Args, dtype: torch.dtype) -> dict:
    """A ``Gemma4ForCausalLM`` ``config.json``, as ``args_from_config`` reads it."""
    shared = hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE)
    del shared["hidden_act"], shared["rope_theta"], shared["rope_parameters"]
    kinds = ["full_attention" if w is None else "sliding_attention" for w in args.layer_windows]
    full = {
        "rope_type": "proportional",
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": args.global_rope_fraction,
    }
    overrides = {"head_dim": args.global_head_dim, "num_key_value_heads": args.global_kv_heads}
    return {
        **shared,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": full | ({"factor": args.global_rope_factor} if args.global_rope_factor != 1 else {}),
            "sliding_attention": {"rope_type": "default", "rope_theta": args.rope_local_theta},
        },
        "sliding_window": args.sliding_window or 512,  # no window: no layer reads it
        "layer_types": kinds,
        "per_layer_config": {str(i): overrides for i, kind in enumerate(kinds) if kind == "full_attention"},
        "final_logit_softcapping": args.final_logit_softcap,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": args.attention_k_eq_v,
        "hidden_size_per_layer_input": args.per_layer_dim,
        "vocab_size_per_layer_input": args.per_layer_vocab,
        "num_kv_shared_layers": args.kv_shared_layers,
        "use_double_wide_mlp": args.double_wide_mlp,
        "enable_moe_block": bool(args.n_experts),
        "num_experts": args.n_experts or None,
        "top_k_experts": args.top_k if args.n_experts else None,
        "moe_intermediate_size": args.moe_ffn_dim if args.n_experts else None,
    }


_LAYER = re.compile(r"(model\.)?layers\.(\d+)\.(.+)")
# Ours -> HF's, within a layer, where the shared decoder's names are not Gemma 4's
_RENAMED = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm_1.weight",
    "post_moe_norm.weight": "post_feedforward_layernorm_2.weight",
    "moe.expert_norm.weight": "pre_feedforward_layernorm_2.weight",
    "moe.router.gate.weight": "router.proj.weight",
    "moe.router.scale": "router.scale",
    "moe.router.per_expert_scale": "router.per_expert_scale",
    "moe.experts.w2": "experts.down_proj",
    "per_layer.gate.weight": "per_layer_input_gate.weight",
    "per_layer.projection.weight": "per_layer_projection.weight",
    "per_layer.norm.weight": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
}
_RENAMED_INV = {theirs: ours for ours, theirs in _RENAMED.items()}
_TOP = {
    "per_layer_inputs.embeddings.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_inputs.projection.weight": "model.per_layer_model_projection.weight",
    "per_layer_inputs.norm.weight": "model.per_layer_projection_norm.weight",
}
_TOP_INV = {theirs: ours for ours, theirs in _TOP.items()}
# HF's experts' gate and up projections, one tensor [experts, 2 ffn, dim]: ours w1 (its first half) and w3
_GATE_UP = "experts.gate_up_proj"
_GATE_UP_PARTS = ("moe.experts.w1", "moe.experts.w3")
# A kv-shared layer's tensors that a file may hold and transformers ignores
_SHARED_KV = (
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.k_norm.weight",
    "self_attn.v_norm.weight",
)
# The multimodal class's prefixes of its decoder's names, and Gemma4ForCausalLM's for them
_WRAPPED = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))
_TOWERS = tuple(
    f"{prefix}{part}."
    for prefix in ("model.", "")
    for part in ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
)
EXPERTS = ExpertNames("router", ())  # for the base's refusal of a trained expert bias


def text_name(name: str) -> str | None:
    """A stored name as ``Gemma4ForCausalLM`` names it; None for the vision and audio towers'."""
    if name.startswith(_TOWERS):
        return None
    prefix, plain = next(((p, q) for p, q in _WRAPPED if name.startswith(p)), ("", ""))
    return plain + name[len(prefix) :]


class Gemma4Names(HFNames):
    """The name adapter between our FQNs and Gemma 4's (see the module docstring)."""

    def __init__(self, args):
        super().__init__(args, EXPERTS)

    def row_groups(self, fqn: str) -> int | None:
        return None  # q/k rows as transformers stores them (no RoPE permutation)

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def to_stored(self, fqn: str) -> str:
        if fqn in _TOP:
            return _TOP[fqn]
        m = _LAYER.fullmatch(fqn)
        rest = m.group(3) if m and not m.group(1) else None
        theirs = _RENAMED.get(rest) or (_GATE_UP if rest in _GATE_UP_PARTS else None)
        return f"model.layers.{m.group(2)}.{theirs}" if theirs else super().to_stored(fqn)

    def from_stored(self, name: str) -> str | StoredParts | None:
        plain = text_name(name)
        if plain is None or self.unused_kv(plain):
            return None  # ``left_out``
        if plain in _TOP_INV:
            return _TOP_INV[plain]
        m = _LAYER.fullmatch(plain)
        rest = m.group(3) if m and m.group(1) else None
        if rest in _RENAMED_INV:
            return f"layers.{m.group(2)}.{_RENAMED_INV[rest]}"
        if rest == _GATE_UP:
            return StoredParts(tuple(f"layers.{m.group(2)}.{p}" for p in _GATE_UP_PARTS), split_gate_up, join_gate_up)
        return super().from_stored(plain)

    def unused_kv(self, plain: str) -> bool:
        """Whether ``plain`` is a kv-shared layer's key or value tensor (the layer reuses another's)."""
        m = _LAYER.fullmatch(plain)
        return bool(m and m.group(1) and m.group(3) in _SHARED_KV and self.args.kv_source(int(m.group(2))) is not None)

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """The towers and the kv-shared layers' unused keys and values are skipped with one line."""
        towers = [name for name in skipped if text_name(name) is None]
        unused = [name for name in skipped if text_name(name) is not None and self.unused_kv(text_name(name))]
        refused, note = super().left_out([name for name in skipped if name not in towers and name not in unused])
        parts = []
        if towers:
            parts.append(f"{len(towers)} tensors of Gemma 4's vision and audio towers and embedders")
        if unused:
            parts.append(f"{len(unused)} key/value tensors of the kv-shared layers, which reuse an earlier layer's")
        if parts:
            note = f"{' and '.join(parts)} are skipped: this model is the text decoder, as transformers computes it"
        return refused, note

    def config_fields(self, name: str) -> tuple[str, ...]:
        return super().config_fields(text_name(name) or name)
