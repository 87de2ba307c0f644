"""Qwen3.5 in Hugging Face's layout: ``config.json`` both ways and ``Qwen3_5ForCausalLM``'s names.

Read: ``Qwen3_5ForCausalLM``'s directories (model_type ``qwen3_5_text``) and the multimodal
``Qwen3_5ForConditionalGeneration``'s (``qwen3_5``: the releases), whose decoder is its
``text_config`` and whose files store it under ``model.language_model.``; their vision tower
(``model.visual.*``) and multi-token-prediction module (``mtp.*``) are skipped with one line: this
model is the text decoder, predicting the next token, as transformers' causal LM is. As
transformers builds it, the multimodal class ties its output by its own top-level
``tie_word_embeddings``. Written: a ``Qwen3_5ForCausalLM`` directory.

A field the file leaves out takes ``Qwen3_5TextConfig``'s default (``HF_DEFAULTS``; ``layer_types``
from ``full_attention_interval``, 4; ``partial_rotary_factor`` 0.25). Refused in one line: a layer
kind other than ``linear_attention`` and ``full_attention``, another activation, attention dropout, a
RoPE stretch. The multimodal RoPE's sections (``mrope_section``) turn text positions as plain RoPE
does (every section reads the same position), so they are read past.

Names: the shared decoder's for the full-attention layers, norms and MLPs; a Gated DeltaNet layer's
``linear_attn.*`` are ours ``attention.*`` (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``), unchanged. RoPE rows: HF
turns halves of each head's first ``rotary_dim`` channels, ours interleaved pairs of them, so only
those rows of ``wq`` (a head's query rows, not its gate's), ``wk`` and the q/k norms are permuted.
``in_proj_qkv``'s rows and ``conv1d``'s channels are HF's all-q, all-k, all-v, ours grouped by key
head (``models.common.gated_deltanet.qkv_from_hf``): read and written whole, reordered.
"""

from __future__ import annotations

import re

import torch

from models.common import hf_config
from models.common.args import check_bool, check_int
from models.common.gated_deltanet import qkv_from_hf, qkv_to_hf
from models.common.hf_names import HFNames, permute_from_hf, permute_to_hf
from models.qwen3_5.args import FULL_ATTENTION_INTERVAL, Qwen35Args

ARCHITECTURE, MODEL_TYPE, WRAPPER_TYPE = "Qwen3_5ForCausalLM", "qwen3_5_text", "qwen3_5"

# transformers' Qwen3_5TextConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=32768,
)
PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3_5TextConfig's
KINDS = ("linear_attention", "full_attention")
# Fields Qwen3_5TextConfig types without None, so transformers refuses a null one; the shared reader
# would take it for the default or derive it (a null head_dim as hidden_size // num_attention_heads).
NOT_NULL = (
    *hf_config.NOT_NULL,
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "attention_dropout",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
# config.json's linear-attention fields -> ours, with Qwen3_5TextConfig's defaults
LINEAR_FIELDS = {
    "linear_conv_kernel_dim": ("linear_conv_kernel", 4),
    "linear_key_head_dim": ("linear_key_head_dim", 128),
    "linear_value_head_dim": ("linear_value_head_dim", 128),
    "linear_num_key_heads": ("linear_num_key_heads", 16),
    "linear_num_value_heads": ("linear_num_value_heads", 32),
}
LINEAR_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")
_OURS = re.compile(r"layers\.(\d+)\.attention\.((?:" + "|".join(LINEAR_PARTS) + r")(?:\.weight)?|wo\.bias)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(?:linear_attn\.(.+)|self_attn\.o_proj\.bias)")
QKV_ROWS = ("attention.in_proj_qkv.weight", "attention.conv1d.weight")  # ours grouped by key head
_WRAPPED = "model.language_model."  # the multimodal class's prefix of its decoder's names
_SKIPPED = ("model.visual.", "mtp.")  # its vision tower, and the multi-token-prediction module


def text_name(name: str) -> str | None:
    """A stored name as ``Qwen3_5ForCausalLM`` names it; None for the vision tower's and the MTP's."""
    if name.startswith(_SKIPPED):
        return None
    return "model." + name.removeprefix(_WRAPPED) if name.startswith(_WRAPPED) else name


class Qwen35Names(HFNames):
    """The name adapter between our FQNs and ``Qwen3_5ForCausalLM``'s (see the module docstring)."""

    def to_stored(self, fqn: str) -> str:
        m = _OURS.fullmatch(fqn)
        if m is None:
            return super().to_stored(fqn)
        part = m.group(2)
        return f"model.layers.{m.group(1)}." + ("self_attn.o_proj.bias" if part == "wo.bias" else f"linear_attn.{part}")

    def from_stored(self, name: str) -> str | None:
        plain = text_name(name)
        if plain is None:
            return None  # ``left_out``
        m = _THEIRS.fullmatch(plain)
        if m is None:
            return super().from_stored(plain)
        return f"layers.{m.group(1)}.attention." + (m.group(2) or "wo.bias")

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """The vision tower and the MTP module are skipped with one line; the rest as the base says."""
        kept = [name for name in skipped if text_name(name) is not None]
        refused, note = super().left_out(kept)
        if len(kept) < len(skipped):
            note = (
                f"{len(skipped) - len(kept)} tensors of Qwen3.5's vision tower and multi-token-prediction module "
                "(model.visual.*, mtp.*) are skipped: this model is its text decoder, predicting the next token"
            )
        return refused, note

    def config_fields(self, name: str) -> tuple[str, ...]:
        return super().config_fields(text_name(name) or name)

    def row_groups(self, fqn: str) -> int | None:
        """Per head, the rows of a query (and its gate), a key, or a q/k norm's one head; the
        linear layers' q/k/v rows whole."""
        if fqn.endswith(QKV_ROWS):
            return 1
        if fqn.endswith(("attention.wq.weight", "attention.wq.bias")):
            return self.args.n_heads
        if fqn.endswith(("attention.wk.weight", "attention.wk.bias")):
            return self.args.n_kv_heads
        return 1 if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")) else None

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        if fqn.endswith(QKV_ROWS):
            return qkv_to_hf(tensor, self.args.linear_num_key_heads, self.args.linear_key_head_dim)
        groups = self.row_groups(fqn)
        return self._rope_rows(tensor, groups, permute_to_hf) if groups else tensor

    def from_stored_rows(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        """A linear layer's q/k/v rows are told by their count (the args refuse a q or k projection
        of one head with as many rows); the rest are RoPE rows."""
        if groups == 1 and tensor.dim() > 1 and tensor.shape[0] == self.args.linear_qkv_channels:
            return qkv_from_hf(tensor, self.args.linear_num_key_heads, self.args.linear_key_head_dim)
        return self._rope_rows(tensor, groups, permute_from_hf)

    def _rope_rows(self, tensor: torch.Tensor, groups: int, permute) -> torch.Tensor:
        """``permute`` applied to the first ``rotary_dim`` rows of each of ``groups`` groups."""
        grouped = tensor.reshape(groups, tensor.shape[0] // groups, -1).clone()
        turned = self.args.rotary_dim
        grouped[:, :turned] = permute(grouped[:, :turned].flatten(0, 1), groups).unflatten(0, (groups, turned))
        return grouped.reshape(tensor.shape)


def config(args: Qwen35Args, dtype: torch.dtype) -> dict:
    cfg = hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": args.partial_rotary_factor}
    kinds = ["full_attention" if i in args.full_attention_layers else "linear_attention" for i in range(args.n_layers)]
    linear = {theirs: getattr(args, ours) for theirs, (ours, _) in LINEAR_FIELDS.items()}
    return {**cfg, "layer_types": kinds, **linear, "attention_bias": args.attention_bias, "attention_dropout": 0.0}


def args_from_config(cfg: dict) -> Qwen35Args:
    """Our args for a ``qwen3_5_text`` ``config.json``, or a ``qwen3_5`` one's decoder (``text_config``)."""
    if cfg.get("model_type") != WRAPPER_TYPE:
        return text_args(cfg)
    tied = hf_config.read(cfg, "tie_word_embeddings", check_bool, False)
    return text_args(hf_config.table(cfg, "text_config"), tied=tied)


def text_args(cfg: dict, tied: bool | None = None, defaults: dict = HF_DEFAULTS, what="Qwen3_5TextConfig"):
    """``defaults``, ``what``: the config class's defaults and name (Qwen3.5-MoE's reads through here)."""
    hf_config.refuse_nulls(cfg, NOT_NULL, what)
    hf_config.refuse(cfg, "Qwen3.5", hidden_act="silu", attention_dropout=0.0)
    rope = {**hf_config.rope_table(cfg)}
    for name in ("mrope_section", "mrope_interleaved"):  # text positions: the same in every section
        rope.pop(name, None)
    plain = {**cfg, "rope_parameters": rope} if "rope_parameters" in cfg else cfg
    fields = hf_config.decoder_fields(plain, partial_rotary=True, **defaults)
    if tied is not None:
        fields["tie_word_embeddings"] = tied
    linear = {
        ours: hf_config.read(cfg, theirs, check_int, default) for theirs, (ours, default) in LINEAR_FIELDS.items()
    }
    return Qwen35Args(
        **fields,
        partial_rotary_factor=hf_config.partial_rotary_factor(cfg, PARTIAL_ROTARY_FACTOR),
        attention_bias=hf_config.read(cfg, "attention_bias", check_bool, False),
        full_attention_layers=full_attention_layers(cfg, fields["n_layers"]),
        **linear,
    )


def full_attention_layers(cfg: dict, n_layers: int) -> list[int]:
    """The layers ``layer_types`` makes full attention (absent: every ``full_attention_interval``-th)."""
    interval = hf_config.read(cfg, "full_attention_interval", check_int, FULL_ATTENTION_INTERVAL)
    default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    kinds = hf_config.layer_kinds({**cfg, "num_hidden_layers": n_layers}, default, allowed=KINDS)
    return [i for i, kind in enumerate(kinds) if kind == "full_attention"]
