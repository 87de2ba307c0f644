"""Reading and writing the ``config.json`` of the Hugging Face decoder families.

Every field that changes the math is read or refused: an activation other than SiLU, a RoPE
stretch this version does not compute (``rope_scaling``), an MLP bias, an attention bias where the
family has none, a layer kind other than full or sliding-window attention (``layer_windows``) --
each is a ``ValueError`` naming the field, never silently dropped. Every field read is checked for
its type and range as it is read (``read``: an integer >= 1, a finite number > 0, true or false),
so a string epsilon or a NaN RoPE base is refused at import, naming the field, rather than failing
later inside the model. A null is read as ``transformers`` reads it: refused where the family's class
or model takes none (``refuse_nulls``, with each family's ``NOT_NULL``), else as the meaning the
class gives it (a null ``sliding_window``: no window; ``num_key_value_heads``: as many as the heads).
"""

from __future__ import annotations

import torch

from models.common.args import check_bool, check_float, check_int
from models.common.rope import SCALING_TYPES, RopeScaling

REQUIRED = object()  # ``read``'s default: the field must be there
AS_ABSENT = object()  # ``read``'s ``null``: a null field means what an absent one does


def read(cfg: dict, name: str, check, default=REQUIRED, null=AS_ABSENT, **rule):
    """``cfg[name]`` checked by ``check`` (``check_int``, ``check_float`` or ``check_bool`` of
    ``models.common.args``, given ``rule``); ``default`` where it is absent, ``null`` where it is null
    (``REQUIRED``: refused). ``transformers`` tells the two apart where its class turns a None into
    something else than the default: an absent ``num_key_value_heads`` is the class's default (8 for
    Mistral), a null one as many as the heads."""
    value = cfg.get(name)
    if value is None:
        fallback = default if name not in cfg or null is AS_ABSENT else null
        if fallback is REQUIRED:
            raise ValueError(f"config.json lacks {name}")
        return fallback
    return check(name, value, **rule)


# The fields every decoder config class of transformers read here types without None (Llama's and
# those built like it; Gemma's name the activation hidden_activation): transformers refuses a null
# one, where ``read`` would take the class's default. A family adds its class's own (``refuse_nulls``).
NOT_NULL = (
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "tie_word_embeddings",
)


def refuse_nulls(cfg: dict, names: tuple[str, ...], config_class: str) -> None:
    """One line for the first of ``names`` that ``cfg`` holds as null: the fields transformers'
    ``config_class`` types without None (it refuses the file) or whose None its model cannot run
    (DeepSeek-V3's ``n_group``), which ``read`` would otherwise take for the class's default or derive
    (a null ``head_dim`` as ``hidden_size // num_attention_heads``). A null the class gives a meaning
    (Mistral's ``sliding_window``: no window) is read by the family as that meaning instead."""
    null = next((name for name in names if name in cfg and cfg[name] is None), None)
    if null is not None:
        raise ValueError(
            f"config.json has {null} = null, which transformers' {config_class} refuses: give its value, "
            "or leave the field out for the class's default"
        )


def size(cfg: dict, name: str, default: int) -> int:
    """A size or count (an integer >= 1): ``default`` (the family's class's) where the file leaves it
    out; refused where it is null, which no class turns into a size."""
    return read(cfg, name, check_int, default, null=REQUIRED)


def stated(cfg: dict, name: str, value) -> str:
    """``name = value`` for a refusal, saying so where ``value`` is the class's default for a file
    that leaves ``name`` out (the user looks for it in the file otherwise)."""
    return f"{name} = {value!r}" + ("" if name in cfg else " (the class's default, as config.json has none)")


def table(cfg: dict, name: str) -> dict:
    """The JSON object ``cfg[name]``; ``{}`` where it is absent or null."""
    value = cfg.get(name)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} = {value!r}; it must be an object")
    return value or {}


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """``rope_theta``, at the top level (transformers < 5) or in ``rope_parameters`` (>= 5). A null one
    where no other is given is refused: ``transformers``' model finds no RoPE base there and fails."""
    rope = table(cfg, "rope_parameters") or table(cfg, "rope_scaling")
    named = "rope_theta" in cfg or "rope_theta" in rope
    if named and cfg.get("rope_theta") is None and rope.get("rope_theta") is None:
        raise ValueError(
            "config.json has rope_theta = null, which transformers' model cannot run: give its value, or leave "
            "the field out for the class's default"
        )
    return read(cfg, "rope_theta", check_float, read(rope, "rope_theta", check_float, default))


def rope_table(cfg: dict) -> dict:
    """The RoPE table ``transformers`` reads: ``rope_scaling`` (before transformers 5) over
    ``rope_parameters``."""
    return table(cfg, "rope_scaling") or table(cfg, "rope_parameters")


# Per stretch, the rope_parameters fields it takes; these others change nothing or are checked apart.
ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}
ROPE_OTHER_FIELDS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def rope_scaling(cfg: dict, partial: bool = False) -> RopeScaling | None:
    """The RoPE stretch a ``config.json`` asks for (``rope_scaling`` / ``rope_parameters``), or None
    for plain RoPE; every field checked (``RopeScaling``).

    As ``transformers`` reads it: YaRN's and Llama 3's ``original_max_position_embeddings`` falls back
    to the top-level field of that name, then to ``max_position_embeddings``; ``beta_fast`` and
    ``beta_slow`` given as 0 or null mean 32 and 1. ``dynamic``, ``longrope`` and any other kind are
    refused, as are a field the kind does not take and, unless the family reads it (``partial``:
    ``partial_rotary_factor``), a partial rotary width."""
    if not partial and partial_rotary_factor(cfg, 1.0) != 1.0:
        raise ValueError(
            f"config.json has partial_rotary_factor = {partial_rotary_factor(cfg, 1.0)!r}; this family rotates "
            "whole heads (1.0)"
        )
    rope = rope_table(cfg)
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in SCALING_TYPES:
        raise ValueError(
            f"config.json asks for {kind!r} RoPE scaling (rope_parameters.rope_type); this version computes "
            f"{', '.join(SCALING_TYPES)} or none"
        )
    unknown = sorted(set(rope) - set(ROPE_FIELDS[kind]) - set(ROPE_OTHER_FIELDS))
    if unknown:
        raise ValueError(f"config.json's {kind} RoPE scaling has {', '.join(unknown)}, which {kind} RoPE does not take")
    fields = {name: rope[name] for name in ROPE_FIELDS[kind] if rope.get(name) is not None}
    if kind != "linear" and "original_max_position_embeddings" not in fields:
        fields["original_max_position_embeddings"] = read(
            cfg, "original_max_position_embeddings", check_int, read(cfg, "max_position_embeddings", check_int, None)
        )
    if kind == "yarn":
        for name in ("beta_fast", "beta_slow"):  # transformers: ``or`` its default
            if not fields.get(name, True):
                del fields[name]
    if "factor" not in fields:
        raise ValueError(f"config.json's {kind} RoPE scaling lacks factor")
    return RopeScaling(rope_type=kind, **fields)


def partial_rotary_factor(cfg: dict, default: float) -> float:
    """The share of each head RoPE turns, as ``transformers`` reads it: ``partial_rotary_factor`` in
    the RoPE table, else at the top level (files before transformers 5), else the family's class's
    ``default``; a number in (0, 1]."""
    top = read(cfg, "partial_rotary_factor", check_float, default)
    fraction = read(rope_table(cfg), "partial_rotary_factor", check_float, top)
    if fraction > 1:
        raise ValueError(f"config.json has partial_rotary_factor = {fraction!r}; it must be in (0, 1]")
    return fraction


def rope_config(args) -> dict:
    """``rope_theta`` and ``rope_parameters`` of a ``config.json``, as ``rope_scaling`` reads them."""
    scaling = args.rope_scaling
    parameters = {"rope_type": "default", "rope_theta": args.rope_theta} if scaling is None else None
    return {"rope_theta": args.rope_theta, "rope_parameters": parameters or scaling.to_config(args.rope_theta)}


def refuse(cfg: dict, what: str, **allowed) -> None:
    """Refuse each field of ``cfg`` set to another value than the one ``allowed`` names."""
    for field, value in allowed.items():
        if cfg.get(field) is not None and cfg[field] != value:
            raise ValueError(f"config.json has {field} = {cfg[field]!r}; {what} supports only {value!r}")


def layer_kinds(cfg: dict, default: list[str] | None = None, allowed: tuple[str, ...] | None = None) -> list[str]:
    """``layer_types`` (transformers' per-layer attention: ``full_attention`` or
    ``sliding_attention``, or the family's ``allowed`` kinds), one per layer, checked; ``default``
    where it is absent (None: every layer full)."""
    allowed = allowed or LAYER_KINDS
    n_layers = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is None:
        return default or ["full_attention"] * (n_layers or 0)
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise ValueError(
            f"config.json has layer_types = {kinds!r}; it must list one kind per layer (num_hidden_layers)"
        )
    others = sorted({str(kind) for kind in kinds} - set(allowed))
    if others:
        raise ValueError(
            f"config.json has layer_types with {', '.join(map(repr, others))}; this version computes "
            f"{' and '.join(map(repr, allowed))} layers"
        )
    return kinds


LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_windows(cfg: dict, window: int | None, default: list[str] | None = None) -> dict:
    """The ``DecoderArgs`` fields ``sliding_window`` and ``window_layers``: ``window`` (the family's
    reading of ``sliding_window``, None: no window) in the layers ``layer_kinds`` calls
    ``sliding_attention``. Such layers without a window are refused, as ``transformers`` refuses them
    (it finds no ``sliding_window`` to build their mask from)."""
    if window is not None:
        check_int("sliding_window", window)
    kinds = layer_kinds(cfg, default)
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if window is None and sliding:
        raise ValueError(
            f"config.json makes layers {sliding} sliding_attention (layer_types, or the family's default) but "
            "gives them no window (sliding_window null, or use_sliding_window false): set one, or make them "
            "full_attention"
        )
    if not sliding:
        return {"sliding_window": None, "window_layers": None}
    return {"sliding_window": window, "window_layers": None if len(sliding) == len(kinds) else sliding}


def qwen_layer_windows(cfg: dict, n_layers: int | None = None) -> dict:
    """``layer_windows`` under Qwen's rule: a window only with ``use_sliding_window`` (a null one:
    none); then, in families that slide some of their ``n_layers`` layers (Qwen2, Qwen3), the layers
    ``layer_types`` names, or by default those from ``max_window_layers`` (28) on; with ``n_layers``
    None (Qwen3-MoE) every layer."""
    slides = read(cfg, "use_sliding_window", check_bool, False)
    window = read(cfg, "sliding_window", check_int, 4096, null=None) if slides else None
    if n_layers is None:
        return {"sliding_window": window, "window_layers": None}
    first = read(cfg, "max_window_layers", check_int, 28, least=0)
    default = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n_layers)]
    return layer_windows(cfg, window, default)


def qwen_window_config(args) -> dict:
    """A Qwen2/Qwen3 ``config.json``'s window fields, as ``qwen_layer_windows`` reads them."""
    sliding = [i for i, w in enumerate(args.layer_windows) if w is not None]
    suffix = bool(sliding) and sliding == list(range(sliding[0], args.n_layers))  # max_window_layers' shape
    return {
        **window_config(args),
        "use_sliding_window": bool(sliding),
        "max_window_layers": sliding[0] if suffix else args.n_layers,
    }


def window_config(args) -> dict:
    """``sliding_window`` and ``layer_types`` of a ``config.json``, as ``layer_windows`` reads them."""
    kinds = ["full_attention" if w is None else "sliding_attention" for w in args.layer_windows]
    return {"sliding_window": args.sliding_window, "layer_types": kinds}


def uniform_window(args, what: str) -> int | None:
    """The window of a family whose ``config.json`` has one window for every layer (Mistral,
    Mixtral, Qwen3-MoE), or a ``ValueError`` if ``window_layers`` picks some layers."""
    if args.sliding_window is not None and args.window_layers not in (None, list(range(args.n_layers))):
        raise ValueError(
            f"window_layers = {args.window_layers}: {what}'s config.json slides every layer or none; remove "
            "model.window_layers"
        )
    return args.sliding_window


def refuse_common(cfg: dict, what: str) -> None:
    """What no family here computes: another activation, an MLP bias, a layer kind other than
    full or sliding-window attention."""
    refuse(cfg, what, hidden_act="silu", mlp_bias=False)
    layer_kinds(cfg)


# transformers' LlamaConfig defaults by config.json name: what a file that leaves a field out means
# there. None: derived, as the class derives it (key/value heads: as many as the heads; head_dim:
# hidden_size / num_attention_heads).
LLAMA_DEFAULTS = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


def decoder_fields(cfg: dict, partial_rotary: bool = False, **defaults) -> dict:
    """The shared ``DecoderArgs`` fields from an HF ``config.json``, each checked (``read``). A field
    the file leaves out takes the default of the family's ``transformers`` config class, which is
    what the file means there: ``LLAMA_DEFAULTS``, with ``defaults`` (by config.json name) where the
    family's class differs (Mixtral's RoPE base, 1e6, would otherwise silently become 10000). A null
    ``num_key_value_heads`` or ``head_dim`` is derived, as every class derives it. ``partial_rotary``:
    the family reads ``partial_rotary_factor`` itself (``partial_rotary_factor``)."""
    d = LLAMA_DEFAULTS | defaults
    dim, n_heads = (
        size(cfg, "hidden_size", d["hidden_size"]),
        size(cfg, "num_attention_heads", d["num_attention_heads"]),
    )
    return {
        "dim": dim,
        "n_layers": size(cfg, "num_hidden_layers", d["num_hidden_layers"]),
        "n_heads": n_heads,
        "n_kv_heads": read(cfg, "num_key_value_heads", check_int, d["num_key_value_heads"] or n_heads, null=n_heads),
        "head_dim": read(cfg, "head_dim", check_int, d["head_dim"] or dim // n_heads, null=dim // n_heads),
        "ffn_dim": size(cfg, "intermediate_size", d["intermediate_size"]),
        "vocab_size": size(cfg, "vocab_size", d["vocab_size"]),
        "norm_eps": read(cfg, "rms_norm_eps", check_float, d["rms_norm_eps"]),
        "rope_theta": rope_theta(cfg, d["rope_theta"]),
        "rope_scaling": rope_scaling(cfg, partial_rotary),
        "max_seq_len": read(cfg, "max_position_embeddings", check_int, d["max_position_embeddings"]),
        "tie_word_embeddings": read(cfg, "tie_word_embeddings", check_bool, d["tie_word_embeddings"]),
        "initializer_range": read(cfg, "initializer_range", check_float, d["initializer_range"], positive=False),
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
        **rope_config(args),
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": args.initializer_range,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def moe_fields(cfg: dict, num_local_experts: int, num_experts_per_tok: int, norm_topk_prob: bool | None) -> dict:
    """The mixture-of-experts fields HF's MoE families share, each checked (``num_local_experts`` is
    Mixtral's name, and what ``transformers`` 5 writes for Qwen3-MoE's ``num_experts`` too); the
    arguments are the family's class's defaults, for a file that leaves them out. ``norm_topk_prob``
    None: the class has no such field and always renormalizes (Mixtral), so a file's is not read."""
    named = [name for name in ("num_experts", "num_local_experts") if name in cfg]
    given = [name for name in named if cfg[name] is not None]
    if named and not given:  # null: no class turns it into a count
        raise ValueError("config.json lacks num_local_experts (or num_experts)")
    experts = (given or ["num_local_experts"])[0]
    n_experts = read(cfg, experts, check_int, num_local_experts)
    top_k = read(cfg, "num_experts_per_tok", check_int, num_experts_per_tok)
    if top_k > n_experts:
        raise ValueError(
            f"{stated(cfg, 'num_experts_per_tok', top_k)}; it must be at most {stated(cfg, experts, n_experts)}"
        )
    fields = {
        "n_experts": n_experts,
        "top_k": top_k,
        "aux_loss_coef": read(cfg, "router_aux_loss_coef", check_float, 0.001, positive=False),
    }
    if norm_topk_prob is not None:
        fields["norm_topk_prob"] = read(cfg, "norm_topk_prob", check_bool, norm_topk_prob)
    return fields


def moe_config(args) -> dict:
    """The mixture-of-experts part of a ``config.json``, as ``moe_fields`` reads it."""
    return {
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }
