"""Hugging Face's layout of a Llama: tensor names, the q/k RoPE permutation and ``config.json``.

Meta's (and our) RoPE rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` of each head; HF's
``LlamaForCausalLM`` rotates halves ``(x0, x_{d/2}), ...``. Converting ``wq``/``wk`` therefore
reorders the rows *within each head* (per KV head for ``wk``, which matters with GQA). Getting this
wrong is subtle: logits still look plausible (torchtitan measured KL 5.4e-6 instead of ~1e-13), so
tests compare logits against ``transformers`` at 1e-5.

``HFNames`` is this layout as the checkpoint layer's name adapter (``seedckpt.checkpoint.model``):
it maps names both ways and says which tensors' rows are permuted in groups (heads). Errors here are
``ValueError``s; the format that reads or writes the file names it.
"""

from __future__ import annotations

import re

import torch

from models.family import matching_flavor
from models.llama3.args import LLAMA3_FLAVORS, SHAPE_FIELDS, ModelArgs, RopeScaling

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_name(fqn: str) -> str:
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS.fullmatch(fqn)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"{fqn} has no Hugging Face Llama name")


def from_hf_name(name: str) -> str | None:
    """Our FQN for an HF tensor name; ``None`` for tensors we do not keep (RoPE caches)."""
    if name in _TOP_INV:
        return _TOP_INV[name]
    m = _THEIRS.fullmatch(name)
    if m and m.group(2) in _LAYER_INV:
        return f"layers.{m.group(1)}.{_LAYER_INV[m.group(2)]}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise ValueError(f"unexpected tensor {name!r} in a Llama checkpoint")


def heads_of(fqn: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows the RoPE permutation reorders, or None for other tensors."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows -> half-split rows, per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Half-split rows -> interleaved-pair rows, per head (inverse of ``permute_to_hf``)."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class HFNames:
    """The name adapter between our FQNs and HF's for one model (``args`` gives the head counts)."""

    def __init__(self, args: ModelArgs):
        self.args = args

    def to_stored(self, fqn: str) -> str:
        return to_hf_name(fqn)

    def from_stored(self, name: str) -> str | None:
        return from_hf_name(name)

    def row_groups(self, fqn: str) -> int | None:
        """Rows of ``fqn`` are permuted within this many equal groups (its heads), or None."""
        return heads_of(fqn, self.args)

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = heads_of(fqn, self.args)
        return permute_to_hf(tensor, heads) if heads else tensor

    def from_stored_rows(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        """Whole groups of rows as stored -> ours."""
        return permute_from_hf(tensor, groups)


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A ``config.json`` that ``transformers`` loads as ``LlamaForCausalLM``."""
    scaling = None
    if args.rope_scaling is not None:
        s = args.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "rope_scaling": scaling,
        "max_position_embeddings": args.max_seq_len, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": args.tie_word_embeddings, "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """Our ModelArgs for an HF Llama ``config.json`` (a released flavor's own args when shapes match)."""
    if cfg.get("model_type") not in (None, "llama"):
        raise ValueError(f"config.json has model_type {cfg.get('model_type')!r}; only Llama is supported")
    try:
        dim, hidden = cfg["hidden_size"], cfg["intermediate_size"]
        n_heads = cfg["num_attention_heads"]
        if cfg.get("head_dim") not in (None, dim // n_heads):
            raise ValueError(f"config.json head_dim {cfg['head_dim']} != hidden_size / num_attention_heads")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        scaling = None
        if rope and rope.get("rope_type", rope.get("type")) == "llama3":
            scaling = RopeScaling(**{k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                          "original_max_position_embeddings")})
        elif rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {rope!r}; only Llama-3 ('llama3') scaling is supported")
        theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        base = int(2 * 4 * dim / 3)
        args = ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                         n_kv_heads=cfg.get("num_key_value_heads", n_heads), vocab_size=cfg["vocab_size"],
                         # multiple_of = intermediate_size reproduces it exactly from our formula
                         multiple_of=hidden, ffn_dim_multiplier=None if base <= hidden else hidden / base,
                         norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta), rope_scaling=scaling,
                         max_seq_len=cfg.get("max_position_embeddings", 8192),
                         tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}; is it a Llama config?") from None
    if args.ffn_hidden_dim != hidden:
        raise ValueError(f"cannot express intermediate_size={hidden} for hidden_size={dim}")
    name = matching_flavor(LLAMA3_FLAVORS, SHAPE_FIELDS, args)
    if name is None:
        return args
    canonical = LLAMA3_FLAVORS[name]  # prefer the canonical spelling of a known shape
    return ModelArgs(**{**canonical.to_dict(), "norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
                        "rope_scaling": args.rope_scaling, "max_seq_len": args.max_seq_len,
                        "tie_word_embeddings": args.tie_word_embeddings})
