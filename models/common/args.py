"""The configuration the Hugging Face decoder families share: Mistral, Qwen2, Qwen3, Granite.

Their ``config.json`` files name the same shapes (``hidden_size``, ``intermediate_size``,
``head_dim`` ...), so their args are one dataclass, ``DecoderArgs``, which each family subclasses
with what is its own (a sliding window, Granite's multipliers) and with ``decoder_options``: how its
decoder differs from Llama 3's. Field names follow torchtitan's (``dim``, ``n_layers``, ``n_heads``
...); the FFN width is given (``ffn_dim``), not derived as Llama's is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from models.common.decoder import DecoderOptions
from models.common.moe import MoEOptions
from models.common.rope import RopeScaling


def check_int(name: str, value, least: int = 1) -> int:
    """``value`` if it is an integer >= ``least`` (a bool is not one); else a ``ValueError`` naming
    ``name``. Every family's args and ``config.json`` readers check their fields with these three."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} = {value!r}; it must be an integer >= {least}")
    return value


def check_float(name: str, value, positive: bool = True) -> float:
    """``value`` as a float if it is a finite number, > 0 (``positive``: an epsilon, a RoPE base, a
    scale) or >= 0; else a ``ValueError`` naming ``name``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} = {value!r}; it must be a finite number {'>' if positive else '>='} 0")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} = {value!r}; it must be true or false")
    return value


def layer_list(name: str, value, n_layers: int) -> list[int]:
    """``value`` if it is a list of layer indices below ``n_layers``; else a ``ValueError`` naming ``name``."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{name} = {value!r}; it must be a list of layer indices")
    outside = [i for i in value if not 0 <= i < n_layers]
    if outside:
        raise ValueError(f"{name} = {value!r} names layers {outside}; the model has layers 0..{n_layers - 1}")
    return value


def check_rope_scaling(value) -> RopeScaling | None:
    """An args' ``rope_scaling``: None, a ``RopeScaling``, or a table of its fields (a manifest's, a
    TOML's) made one; else a ``ValueError`` naming the field."""
    if isinstance(value, dict):
        try:
            return RopeScaling(**value)
        except TypeError as e:  # a missing or unknown field
            raise ValueError(f"rope_scaling = {value!r}: {e}") from None
    if value is not None and not isinstance(value, RopeScaling):
        raise ValueError(f"rope_scaling = {value!r}; it must be a table (rope_type, factor, ...)")
    return value


class DictArgs:
    """``to_dict`` / ``from_dict`` of a family's args dataclass: how a manifest records the model."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; valid: {sorted(names)}")
        return cls(**d)


@dataclass
class DecoderArgs(DictArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads
    head_dim: int | None = None  # None: dim // n_heads
    ffn_dim: int = 14336
    vocab_size: int = 32000
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # the std of HF's init (``DecoderOptions.init = "normal"``)
    rope_scaling: RopeScaling | None = None  # a RoPE stretch (``models.common.rope``); None: plain RoPE
    sliding_window: int | None = None  # positions a token attends back to, itself included; None: all
    window_layers: list[int] | None = None  # the layers ``sliding_window`` applies to; None: every layer

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            check_int(name, getattr(self, name))
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window)
        if self.window_layers is not None:
            self.window_layers = sorted(set(layer_list("window_layers", self.window_layers, self.n_layers)))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        check_int("n_kv_heads", self.n_kv_heads)
        check_int("head_dim", self.head_dim)
        self.norm_eps = check_float("norm_eps", self.norm_eps)
        self.rope_theta = check_float("rope_theta", self.rope_theta)
        self.initializer_range = check_float("initializer_range", self.initializer_range, positive=False)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def ffn_hidden_dim(self) -> int:
        return self.ffn_dim

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (``DecoderOptions.layer_windows``)."""
        slides = range(self.n_layers) if self.window_layers is None else self.window_layers
        return tuple(self.sliding_window if i in slides else None for i in range(self.n_layers))

    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(init="normal", init_std=self.initializer_range, layer_windows=self.layer_windows)


# The fields that decide which tensors exist and their shapes.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "tie_word_embeddings")


@dataclass
class MoEDecoderArgs(DecoderArgs):
    """The shared decoder with mixture-of-experts feed-forwards (``models.common.moe``) in the layers
    ``moe_layers`` names -- Qwen3-MoE's rule: every ``decoder_sparse_step``-th layer, except those in
    ``mlp_only_layers``, which keep a dense feed-forward of width ``ffn_dim``."""

    n_experts: int = 8
    top_k: int = 2  # experts per token
    moe_ffn_dim: int = 768  # each expert's hidden width
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coef: float = 0.001  # HF's router_aux_loss_coef
    bias_update_rate: float = 0.001  # ``bias`` balancing's step per update

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_experts", "top_k", "moe_ffn_dim", "decoder_sparse_step"):
            check_int(name, getattr(self, name))
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        self.mlp_only_layers = sorted(set(layer_list("mlp_only_layers", self.mlp_only_layers, self.n_layers)))
        check_bool("norm_topk_prob", self.norm_topk_prob)
        if self.load_balance not in ("aux_loss", "bias", "none"):
            raise ValueError(f"load_balance={self.load_balance!r}; choose aux_loss, bias or none")
        for name in ("aux_loss_coef", "bias_update_rate"):
            setattr(self, name, check_float(name, getattr(self, name), positive=False))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(
            i for i in range(self.n_layers) if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    def moe_options(self, init: str, init_std: float, score_func: str = "softmax", **routing) -> MoEOptions:
        """The MoE block's options from these args; ``routing``: any other ``MoEOptions`` field
        the family sets from fields of its own (DeepSeek-V3's ``n_group``, ``topk_group``,
        ``n_shared_experts``, ``route_scale``; gpt-oss's ``router_bias``, ``expert_bias_terms``,
        ``activation`` ...). ``MoEOptions`` refuses a combination it cannot run in one line naming
        the field, so a family's ``__post_init__`` calling this checks them at the door."""
        return MoEOptions(
            n_experts=self.n_experts,
            top_k=self.top_k,
            ffn_dim=self.moe_ffn_dim,
            score_func=score_func,
            norm_topk_prob=self.norm_topk_prob,
            load_balance=self.load_balance,
            aux_loss_coef=float(self.aux_loss_coef),
            bias_update_rate=float(self.bias_update_rate),
            init=init,
            init_std=init_std,
            **routing,
        )


# ``load_balance`` decides whether ``expert_bias`` exists; the rest decide the experts' shapes.
MOE_SHAPE_FIELDS = SHAPE_FIELDS + ("n_experts", "moe_ffn_dim", "decoder_sparse_step", "mlp_only_layers", "load_balance")
