"""Reading and writing the ``config.json`` of the Hugging Face decoder families.

Every field that changes the math is read or refused: an activation other than SiLU, a RoPE
scaling, an MLP bias, a sliding window shorter than the positions, an attention bias where the
family has none -- each is a ``ValueError`` naming the field, never silently dropped.
"""

from __future__ import annotations

import torch


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """``rope_theta``, at the top level (transformers < 5) or in ``rope_parameters`` (>= 5)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(cfg.get("rope_theta", rope.get("rope_theta", default)))


def rope_type(cfg: dict) -> str | None:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return rope.get("rope_type", rope.get("type"))


def refuse(cfg: dict, what: str, **allowed) -> None:
    """Refuse each field of ``cfg`` set to another value than the one ``allowed`` names."""
    for field, value in allowed.items():
        if cfg.get(field) is not None and cfg[field] != value:
            raise ValueError(f"config.json has {field} = {cfg[field]!r}; {what} supports only {value!r}")


def refuse_common(cfg: dict, what: str) -> None:
    """What no family here computes: another activation, a RoPE scaling, an MLP bias."""
    refuse(cfg, what, hidden_act="silu", mlp_bias=False)
    if rope_type(cfg) not in (None, "default"):
        raise ValueError(f"config.json asks for {rope_type(cfg)!r} RoPE scaling; {what} supports none")


def decoder_fields(cfg: dict) -> dict:
    """The shared ``DecoderArgs`` fields from an HF ``config.json``; a ``KeyError`` for a missing
    required one."""
    n_heads = cfg["num_attention_heads"]
    return {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": cfg.get("num_key_value_heads") or n_heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        "ffn_dim": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(cfg),
        "max_seq_len": cfg.get("max_position_embeddings", 32768),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "initializer_range": cfg.get("initializer_range", 0.02),
    }


def decoder_config(args, dtype: torch.dtype, architecture: str, model_type: str) -> dict:
    """The shared part of a ``config.json`` that ``transformers`` loads as ``architecture``."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": args.initializer_range,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields HF's MoE families share (``num_local_experts`` is Mixtral's
    name, and what ``transformers`` 5 writes for Qwen3-MoE's ``num_experts`` too)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return {
        "n_experts": experts,
        "top_k": cfg["num_experts_per_tok"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "aux_loss_coef": cfg.get("router_aux_loss_coef", 0.001),
    }


def moe_config(args) -> dict:
    """The mixture-of-experts part of a ``config.json``, as ``moe_fields`` reads it."""
    return {
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }
