"""A Llama's Hugging Face ``config.json``, both ways (its tensor names: ``models.common.hf_names``).

Every field that changes the math is read or refused: another activation, an attention or MLP bias,
a RoPE stretch other than Llama 3's, linear and YaRN. Errors here are ``ValueError``s; the format
that reads the file names it.
"""

from __future__ import annotations

import torch

from models.common import hf_config as common
from models.common.args import check_bool, check_float, check_int
from models.common.rope import RopeScaling as GenericRopeScaling
from models.family import matching_flavor
from models.llama3.args import LLAMA3_FLAVORS, SHAPE_FIELDS, ModelArgs, RopeScaling


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A ``config.json`` that ``transformers`` loads as ``LlamaForCausalLM``."""
    scaling = None
    if isinstance(args.rope_scaling, GenericRopeScaling):
        scaling = args.rope_scaling.to_config(args.rope_theta)
    elif args.rope_scaling is not None:
        s = args.rope_scaling
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_scaling(cfg: dict) -> RopeScaling | GenericRopeScaling | None:
    """Llama 3's RoPE scaling (``rope_type = "llama3"``) as Llama's own dataclass, another stretch
    as ``models.common.rope``'s (``common.rope_scaling``: linear, YaRN; the rest refused), or None."""
    rope = common.rope_table(cfg)
    kind = rope.get("rope_type", rope.get("type"))
    if kind != "llama3":
        return common.rope_scaling(cfg)
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in rope]
    if missing:
        raise ValueError(f"config.json's llama3 rope scaling lacks {', '.join(missing)}")
    return RopeScaling(**{f: rope[f] for f in fields})


# LlamaConfig's fields that refuse null (``common.refuse_nulls``)
NOT_NULL = (*common.NOT_NULL, "attention_bias", "mlp_bias")


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """Our ModelArgs for an HF Llama ``config.json`` (a released flavor's own args when shapes
    match), each field checked as it is read (``common.read``); a field the file leaves out takes
    ``LlamaConfig``'s default (``common.LLAMA_DEFAULTS``), which is what the file means."""
    if cfg.get("model_type") not in (None, "llama"):
        raise ValueError(f"config.json has model_type {cfg.get('model_type')!r}, not a Llama's")
    common.refuse_nulls(cfg, NOT_NULL, "LlamaConfig")
    common.refuse(cfg, "Llama", hidden_act="silu", attention_bias=False, mlp_bias=False)
    if "sliding_attention" in common.layer_kinds(cfg):
        raise ValueError("config.json has sliding_attention in layer_types; Llama attends to every position")
    defaults = common.LLAMA_DEFAULTS
    dim, hidden = (common.size(cfg, name, defaults[name]) for name in ("hidden_size", "intermediate_size"))
    n_heads = common.size(cfg, "num_attention_heads", defaults["num_attention_heads"])
    if common.read(cfg, "head_dim", check_int, dim // n_heads) != dim // n_heads:
        raise ValueError(f"config.json head_dim {cfg['head_dim']} != hidden_size / num_attention_heads")
    base = int(2 * 4 * dim / 3)
    args = ModelArgs(
        dim=dim,
        n_layers=common.size(cfg, "num_hidden_layers", defaults["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=common.read(cfg, "num_key_value_heads", check_int, n_heads),
        vocab_size=common.size(cfg, "vocab_size", defaults["vocab_size"]),
        # multiple_of = intermediate_size reproduces it exactly from our formula
        multiple_of=hidden,
        ffn_dim_multiplier=None if base <= hidden else hidden / base,
        norm_eps=common.read(cfg, "rms_norm_eps", check_float, defaults["rms_norm_eps"]),
        rope_theta=common.rope_theta(cfg, defaults["rope_theta"]),
        rope_scaling=_rope_scaling(cfg),
        max_seq_len=common.read(cfg, "max_position_embeddings", check_int, defaults["max_position_embeddings"]),
        tie_word_embeddings=common.read(cfg, "tie_word_embeddings", check_bool, defaults["tie_word_embeddings"]),
    )
    if args.ffn_hidden_dim != hidden:
        raise ValueError(f"cannot express intermediate_size={hidden} for hidden_size={dim}")
    name = matching_flavor(LLAMA3_FLAVORS, SHAPE_FIELDS, args)
    if name is None:
        return args
    canonical = LLAMA3_FLAVORS[name]  # prefer the canonical spelling of a known shape
    return ModelArgs(
        **{
            **canonical.to_dict(),
            "norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": args.rope_scaling,
            "max_seq_len": args.max_seq_len,
            "tie_word_embeddings": args.tie_word_embeddings,
        }
    )
