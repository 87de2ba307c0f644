"""Reading and writing the ``config.json`` of the Hugging Face decoder families.

Every field that changes the math is read or refused: an activation other than SiLU, a RoPE
scaling, an MLP bias, a sliding window shorter than the positions, an attention bias where the
family has none, a layer that is not full attention -- each is a ``ValueError`` naming the field,
never silently dropped. Every field read is checked for its type and range as it is read (``read``:
an integer >= 1, a finite number > 0, true or false), so a string epsilon or a NaN RoPE base is
refused at import, naming the field, rather than failing later inside the model.
"""

from __future__ import annotations

import torch

from models.common.args import check_bool, check_float, check_int

REQUIRED = object()  # ``read``'s default: the field must be there


def read(cfg: dict, name: str, check, default=REQUIRED, **rule):
    """``cfg[name]`` checked by ``check`` (``check_int``, ``check_float`` or ``check_bool`` of
    ``models.common.args``, given ``rule``); ``default`` where it is absent or null."""
    value = cfg.get(name)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"config.json lacks {name}")
        return default
    return check(name, value, **rule)


def table(cfg: dict, name: str) -> dict:
    """The JSON object ``cfg[name]``; ``{}`` where it is absent or null."""
    value = cfg.get(name)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} = {value!r}; it must be an object")
    return value or {}


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """``rope_theta``, at the top level (transformers < 5) or in ``rope_parameters`` (>= 5)."""
    rope = table(cfg, "rope_parameters") or table(cfg, "rope_scaling")
    return read(cfg, "rope_theta", check_float, read(rope, "rope_theta", check_float, default))


def rope_type(cfg: dict) -> str | None:
    rope = table(cfg, "rope_scaling") or table(cfg, "rope_parameters")
    return rope.get("rope_type", rope.get("type"))


def refuse(cfg: dict, what: str, **allowed) -> None:
    """Refuse each field of ``cfg`` set to another value than the one ``allowed`` names."""
    for field, value in allowed.items():
        if cfg.get(field) is not None and cfg[field] != value:
            raise ValueError(f"config.json has {field} = {cfg[field]!r}; {what} supports only {value!r}")


def refuse_layer_types(cfg: dict, what: str) -> None:
    """``layer_types`` (transformers' per-layer attention), if given: full attention in every layer,
    one entry per layer. No family here computes another kind (a sliding window in some layers)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return
    if not isinstance(kinds, list) or len(kinds) != cfg.get("num_hidden_layers"):
        raise ValueError(
            f"config.json has layer_types = {kinds!r}; it must list one kind per layer (num_hidden_layers)"
        )
    others = sorted({str(kind) for kind in kinds} - {"full_attention"})
    if others:
        raise ValueError(
            f"config.json has layer_types with {', '.join(map(repr, others))}; {what} computes only "
            "'full_attention' layers"
        )


def refuse_common(cfg: dict, what: str) -> None:
    """What no family here computes: another activation, a RoPE scaling, an MLP bias, a layer that
    is not full attention."""
    refuse(cfg, what, hidden_act="silu", mlp_bias=False)
    if rope_type(cfg) not in (None, "default"):
        raise ValueError(f"config.json asks for {rope_type(cfg)!r} RoPE scaling; {what} supports none")
    refuse_layer_types(cfg, what)


def decoder_fields(cfg: dict) -> dict:
    """The shared ``DecoderArgs`` fields from an HF ``config.json``, each checked (``read``)."""
    dim, n_heads = read(cfg, "hidden_size", check_int), read(cfg, "num_attention_heads", check_int)
    return {
        "dim": dim,
        "n_layers": read(cfg, "num_hidden_layers", check_int),
        "n_heads": n_heads,
        "n_kv_heads": read(cfg, "num_key_value_heads", check_int, n_heads),
        "head_dim": read(cfg, "head_dim", check_int, dim // n_heads),
        "ffn_dim": read(cfg, "intermediate_size", check_int),
        "vocab_size": read(cfg, "vocab_size", check_int),
        "norm_eps": read(cfg, "rms_norm_eps", check_float, 1e-6),
        "rope_theta": rope_theta(cfg),
        "max_seq_len": read(cfg, "max_position_embeddings", check_int, 32768),
        "tie_word_embeddings": read(cfg, "tie_word_embeddings", check_bool, False),
        "initializer_range": read(cfg, "initializer_range", check_float, 0.02, positive=False),
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
    """The mixture-of-experts fields HF's MoE families share, each checked (``num_local_experts`` is
    Mixtral's name, and what ``transformers`` 5 writes for Qwen3-MoE's ``num_experts`` too)."""
    experts = next((name for name in ("num_experts", "num_local_experts") if cfg.get(name) is not None), None)
    if experts is None:
        raise ValueError("config.json lacks num_local_experts (or num_experts)")
    n_experts, top_k = read(cfg, experts, check_int), read(cfg, "num_experts_per_tok", check_int)
    if top_k > n_experts:
        raise ValueError(f"num_experts_per_tok = {top_k}; it must be at most {experts} = {n_experts}")
    return {
        "n_experts": n_experts,
        "top_k": top_k,
        "norm_topk_prob": read(cfg, "norm_topk_prob", check_bool, True),
        "aux_loss_coef": read(cfg, "router_aux_loss_coef", check_float, 0.001, positive=False),
    }


def moe_config(args) -> dict:
    """The mixture-of-experts part of a ``config.json``, as ``moe_fields`` reads it."""
    return {
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }
