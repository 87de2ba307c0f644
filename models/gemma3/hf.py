"""Gemma 3's Hugging Face layout: ``config.json`` both ways, and the tensor names.

Read: ``Gemma3ForCausalLM``'s directories (model_type ``gemma3_text``: 1B and any text-only save)
and the multimodal ``Gemma3ForConditionalGeneration``'s (``gemma3``: the 4B, 12B and 27B releases),
whose decoder is its ``text_config`` and whose files store it under ``language_model.model.`` (as
``save_pretrained`` writes them) or ``model.language_model.`` (the module's own names). Their vision
tower and projector (``vision_tower.*``, ``multi_modal_projector.*``) are skipped with one line:
this model is the text decoder. As transformers computes them, the multimodal class ties the output
by its own top-level ``tie_word_embeddings`` and applies no ``final_logit_softcapping``, whatever its
``text_config`` says. Written: a ``Gemma3ForCausalLM`` directory.

A field the file leaves out takes ``Gemma3TextConfig``'s default (``HF_DEFAULTS``; the layer kinds
from ``sliding_window_pattern``, 6; the RoPE bases 10^6 and 10^4). RoPE is read in both forms
transformers reads: per layer kind in ``rope_parameters`` (``full_attention``, ``sliding_attention``),
or transformers 4's ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` (the global
layers' stretch). Refused in one line: bidirectional attention, attention dropout, another
activation, a stretch of the sliding-window layers' RoPE, a null where ``Gemma3TextConfig`` holds no
null, and ``attn_logit_softcapping`` (Gemma 2's; Gemma 3's releases set none): transformers'
``Gemma3Attention`` keeps the field but never hands it to its attention, so its logits are those of
no softcap, and reading the field either way would compute another model than someone expects.

Names: the shared decoder's (``models.common.hf_names``) but for the norms. Gemma's
``post_attention_layernorm`` is the norm on the attention's output (ours ``post_attention_norm``),
where Llama's is the norm before the feed-forward (ours ``ffn_norm``, Gemma's
``pre_feedforward_layernorm``); ``post_feedforward_layernorm`` is ``post_ffn_norm``.
"""

from __future__ import annotations

import re

import torch

from models.common import hf_config
from models.common.args import check_bool, check_float, check_int
from models.common.hf_names import HFNames
from models.gemma3.args import Gemma3Args

ARCHITECTURE, MODEL_TYPE, WRAPPER_TYPE = "Gemma3ForCausalLM", "gemma3_text", "gemma3"

# transformers' Gemma3TextConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
)
ROPE_THETA, LOCAL_ROPE_THETA = 1e6, 1e4  # Gemma3TextConfig's bases, global and sliding-window layers
# Fields Gemma3TextConfig (and Gemma2Config) types without None, so transformers refuses a null one; the shared reader
# would take it for the default or derive it (a null head_dim as hidden_size // num_attention_heads).
NOT_NULL = (
    "num_key_value_heads",
    "head_dim",
    "hidden_activation",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "query_pre_attn_scalar",
)
LAYER_KINDS = ("full_attention", "sliding_attention")  # rope_parameters' keys


def args_from_config(cfg: dict) -> Gemma3Args:
    """Our args for a ``gemma3_text`` ``config.json``, or a ``gemma3`` one's decoder (``text_config``)."""
    if cfg.get("model_type") != WRAPPER_TYPE:
        return text_args(cfg)
    tied = hf_config.read(cfg, "tie_word_embeddings", check_bool, True, null=False)
    return text_args(hf_config.table(cfg, "text_config"), tied=tied, softcap=False)


def text_args(cfg: dict, tied: bool | None = None, softcap: bool = True) -> Gemma3Args:
    """``tied``: the output's tie where another field decides it (None: this ``tie_word_embeddings``);
    ``softcap``: whether ``final_logit_softcapping`` applies."""
    refuse_uncomputed(cfg)
    rope = {name: value for name, value in cfg.items() if name not in ("rope_theta", "rope_scaling", "rope_parameters")}
    fields = hf_config.decoder_fields(rope, **HF_DEFAULTS) | rope_fields(cfg)
    if tied is not None:
        fields["tie_word_embeddings"] = tied
    pattern = hf_config.read(cfg, "sliding_window_pattern", check_int, 6)
    kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(fields["n_layers"])]
    window = cfg["sliding_window"] if "sliding_window" in cfg else 4096  # null: none (refused where a layer slides)
    return Gemma3Args(
        **fields,
        **hf_config.layer_windows(cfg, window, kinds),
        query_pre_attn_scalar=hf_config.read(cfg, "query_pre_attn_scalar", check_int, 256),
        final_logit_softcap=hf_config.read(cfg, "final_logit_softcapping", check_float, None) if softcap else None,
        attention_bias=hf_config.read(cfg, "attention_bias", check_bool, False),
    )


def refuse_uncomputed(cfg: dict) -> None:
    """Refuse, in one line each, a null ``Gemma3TextConfig`` refuses and what this version does not compute."""
    refuse_gemma(cfg, "Gemma3TextConfig", "Gemma 3")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"config.json has attn_logit_softcapping = {cfg['attn_logit_softcapping']!r}, which transformers' "
            "Gemma 3 reads but never applies (Gemma 2 applies it): set it null to compute what transformers computes"
        )


def refuse_gemma(cfg: dict, config_class: str, what: str) -> None:
    """What every Gemma reader refuses in one line: a null where transformers' ``config_class`` takes
    none, and what no Gemma here computes (``what``: the family's name in the message)."""
    hf_config.refuse_nulls(cfg, NOT_NULL, config_class)
    hf_config.refuse(
        cfg, what, hidden_activation="gelu_pytorch_tanh", attention_dropout=0.0, use_bidirectional_attention=False
    )


def rope_fields(cfg: dict) -> dict:
    """``rope_theta``, ``rope_scaling`` (the global layers') and ``rope_local_theta``, as
    ``Gemma3TextConfig`` reads them (see the module docstring)."""
    parameters = hf_config.table(cfg, "rope_parameters")
    flat = sorted(set(parameters) - set(LAYER_KINDS))
    if flat:
        raise ValueError(
            f"config.json's rope_parameters has {', '.join(flat)} at its top, which Gemma 3 does not read: "
            f"give them per layer kind, under {' or '.join(LAYER_KINDS)}"
        )
    full = dict(hf_config.table(parameters, "full_attention") or {"rope_type": "default"})
    full |= hf_config.table(cfg, "rope_scaling")  # transformers 4's field: the global layers' stretch
    full.setdefault("rope_theta", hf_config.read(cfg, "rope_theta", check_float, ROPE_THETA))
    local = dict(hf_config.table(parameters, "sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", hf_config.read(cfg, "rope_local_base_freq", check_float, LOCAL_ROPE_THETA))
    stretch = local.get("rope_type", local.get("type"))
    if stretch not in (None, "default"):
        raise ValueError(
            f"config.json stretches the sliding-window layers' RoPE ({stretch!r}, rope_parameters.sliding_attention); "
            "this version stretches the global layers' only"
        )
    positions = hf_config.read(cfg, "max_position_embeddings", check_int, HF_DEFAULTS["max_position_embeddings"])
    return {
        "rope_theta": check_float("rope_parameters.full_attention.rope_theta", full["rope_theta"]),
        "rope_scaling": hf_config.rope_scaling({"rope_parameters": full, "max_position_embeddings": positions}),
        "rope_local_theta": check_float("rope_parameters.sliding_attention.rope_theta", local["rope_theta"]),
    }


def config(args: Gemma3Args, dtype: torch.dtype) -> dict:
    """A ``Gemma3ForCausalLM`` ``config.json``, as ``args_from_config`` reads it."""
    shared = hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE)
    del shared["hidden_act"], shared["rope_theta"]  # Gemma's are hidden_activation and rope_parameters
    return {
        **shared,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": hf_config.rope_config(args)["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": args.rope_local_theta},
        },
        "query_pre_attn_scalar": args.query_pre_attn_scalar,
        **hf_config.window_config(args),
        "final_logit_softcapping": args.final_logit_softcap,
        "attn_logit_softcapping": None,
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
    }


_LAYER = re.compile(r"(model\.)?layers\.(\d+)\.(.+)")
# Ours -> HF's, within a layer, where Gemma's names differ from the shared decoder's
_RENAMED = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
}
_RENAMED_INV = {theirs: ours for ours, theirs in _RENAMED.items()}
# The multimodal class's prefixes of its decoder's names, and Gemma3ForCausalLM's for them
_WRAPPED = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.", ""))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_name(name: str) -> str | None:
    """A stored name as ``Gemma3ForCausalLM`` names it (the multimodal class's decoder names
    unwrapped); None for the vision tower's and its projector's."""
    if name.startswith(_VISION):
        return None
    prefix, plain = next(((p, q) for p, q in _WRAPPED if name.startswith(p)), ("", ""))
    return plain + name[len(prefix) :]


class Gemma3Names(HFNames):
    """The name adapter between our FQNs and Gemma 3's (see the module docstring)."""

    def to_stored(self, fqn: str) -> str:
        m = _LAYER.fullmatch(fqn)
        theirs = _RENAMED.get(m.group(3)) if m and not m.group(1) else None
        return f"model.layers.{m.group(2)}.{theirs}" if theirs else super().to_stored(fqn)

    def from_stored(self, name: str) -> str | None:
        plain = text_name(name)
        if plain is None:
            return None  # the vision tower (``left_out``)
        m = _LAYER.fullmatch(plain)
        ours = _RENAMED_INV.get(m.group(3)) if m and m.group(1) else None
        return f"layers.{m.group(2)}.{ours}" if ours else super().from_stored(plain)

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """The vision tower and its projector are skipped with one line; the rest as the base says."""
        vision = [name for name in skipped if text_name(name) is None]
        refused, note = super().left_out([name for name in skipped if text_name(name) is not None])
        if vision:
            note = (
                f"{len(vision)} tensors of Gemma 3's vision tower and projector (vision_tower.*, "
                "multi_modal_projector.*) are skipped: this model is its text decoder"
            )
        return refused, note

    def config_fields(self, name: str) -> tuple[str, ...]:
        return super().config_fields(text_name(name) or name)
