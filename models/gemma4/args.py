"""Gemma 4's args: the shared decoder's fields, each layer kind's attention shape, per-layer inputs,
the layers that reuse another's keys and values, and the mixture of experts beside the MLP.

Defaults are ``Gemma4TextConfig``'s; ``models.gemma4``'s docstring says what each computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.common.args import SHAPE_FIELDS as DECODER_SHAPE_FIELDS
from models.common.args import DecoderArgs, check_bool, check_float, check_int
from models.common.decoder import DecoderOptions
from models.common.moe import MoEOptions

SLIDING_PATTERN = 6  # Gemma4TextConfig's layer kinds: every sixth layer global, the others windowed


def sliding_layers(n_layers: int, pattern: int = SLIDING_PATTERN) -> list[int]:
    """The windowed layers of Gemma 4's rule: every ``pattern``-th layer and the last attend globally."""
    return [i for i in range(n_layers - 1) if (i + 1) % pattern]


@dataclass
class Gemma4Args(DecoderArgs):
    dim: int = 2304
    n_layers: int = 30
    n_heads: int = 8
    n_kv_heads: int | None = 4  # the windowed layers' key/value heads
    head_dim: int | None = 256  # the windowed layers' head size
    ffn_dim: int = 9216
    vocab_size: int = 262144
    max_seq_len: int = 131072
    tie_word_embeddings: bool = True
    sliding_window: int | None = 512
    rope_theta: float = 1e6  # the global layers' base
    rope_local_theta: float = 1e4  # the windowed layers' base, every pair turning
    global_head_dim: int = 512  # the global layers' head size
    global_kv_heads: int | None = None  # the global layers' key/value heads (None: n_kv_heads)
    attention_k_eq_v: bool = False  # the global layers' values are their keys' projection (no wv)
    global_rope_fraction: float = 0.25  # the share of a global head's pairs that turn ("proportional")
    global_rope_factor: float = 1.0  # the turning pairs' frequencies are divided by it
    final_logit_softcap: float | None = None  # None: no softcap
    per_layer_dim: int = 256  # each layer's input width (hidden_size_per_layer_input); 0: none
    per_layer_vocab_size: int | None = None  # the per-layer inputs' table's rows (None: vocab_size, grown with it)
    kv_shared_layers: int = 0  # the last layers, which reuse the keys and values of an earlier one
    double_wide_mlp: bool = False  # the kv-shared layers' MLP twice as wide
    n_experts: int = 0  # 0: no mixture of experts beside the MLP
    top_k: int = 8
    moe_ffn_dim: int = 704
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 0.001

    def __post_init__(self):
        if self.window_layers is None and self.sliding_window is not None:
            self.window_layers = sliding_layers(self.n_layers)
        super().__post_init__()
        if self.rope_scaling is not None:
            raise ValueError("Gemma 4 stretches no RoPE (rope_scaling); remove model.rope_scaling")
        for name in ("global_head_dim", "top_k", "moe_ffn_dim"):
            check_int(name, getattr(self, name))
        for name in ("per_layer_dim", "kv_shared_layers", "n_experts"):
            check_int(name, getattr(self, name), least=0)
        if self.global_head_dim % 2:
            raise ValueError(f"global_head_dim = {self.global_head_dim} must be even for RoPE")
        if self.global_kv_heads is None:
            self.global_kv_heads = self.n_kv_heads
        if self.n_heads % check_int("global_kv_heads", self.global_kv_heads):
            raise ValueError(f"n_heads = {self.n_heads} is not divisible by global_kv_heads = {self.global_kv_heads}")
        for name in ("rope_local_theta", "global_rope_fraction", "global_rope_factor", "bias_update_rate"):
            setattr(self, name, check_float(name, getattr(self, name), positive=name != "bias_update_rate"))
        self.aux_loss_coef = check_float("aux_loss_coef", self.aux_loss_coef, positive=False)
        if self.global_rope_fraction > 1:
            raise ValueError(f"global_rope_fraction = {self.global_rope_fraction}; it must be in (0, 1]")
        if self.final_logit_softcap is not None:
            self.final_logit_softcap = check_float("final_logit_softcap", self.final_logit_softcap)
        for name in ("attention_k_eq_v", "double_wide_mlp"):
            check_bool(name, getattr(self, name))
        if (
            self.per_layer_vocab_size is not None
            and check_int("per_layer_vocab_size", self.per_layer_vocab_size) < self.vocab_size
        ):
            raise ValueError(
                f"per_layer_vocab_size = {self.per_layer_vocab_size} is below vocab_size = {self.vocab_size}: tokens "
                "past it would have no per-layer input; give them equal"
            )
        self._check_kv_sharing()
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"top_k = {self.top_k} exceeds n_experts = {self.n_experts}")

    def _check_kv_sharing(self) -> None:
        if self.kv_shared_layers >= self.n_layers:
            raise ValueError(
                f"kv_shared_layers = {self.kv_shared_layers} leaves no layer to compute keys and values for them: "
                f"it must be below n_layers = {self.n_layers}"
            )
        first = self.first_kv_shared_layer
        for kind in {self.is_sliding(i) for i in range(first, self.n_layers)}:
            if not any(self.is_sliding(i) == kind for i in range(first)):
                name = "windowed" if kind else "global"
                raise ValueError(
                    f"kv_shared_layers = {self.kv_shared_layers} makes {name} layers reuse the keys of a {name} "
                    f"layer before layer {first}, and there is none: lower kv_shared_layers or change window_layers"
                )

    @property
    def per_layer_vocab(self) -> int:
        return self.vocab_size if self.per_layer_vocab_size is None else self.per_layer_vocab_size

    def is_sliding(self, layer: int) -> bool:
        return self.layer_windows[layer] is not None

    @property
    def first_kv_shared_layer(self) -> int:
        return self.n_layers - self.kv_shared_layers

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer ``layer`` reuses: the last layer of its kind before
        the shared ones (transformers' ``kv_sharing_modes``); None: it computes its own."""
        first = self.first_kv_shared_layer
        if layer < first:
            return None
        return max(i for i in range(first) if self.is_sliding(i) == self.is_sliding(layer))

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.n_kv_heads if self.is_sliding(layer) else self.global_kv_heads

    def layer_ffn_dim(self, layer: int) -> int:
        """Layer ``layer``'s MLP width: twice ``ffn_dim`` in a kv-shared layer with ``double_wide_mlp``."""
        return self.ffn_dim * (2 if self.double_wide_mlp and self.kv_source(layer) is not None else 1)

    def values_are_keys(self, layer: int) -> bool:
        """Whether layer ``layer``'s values are its keys' projection (``attention_k_eq_v``: global layers)."""
        return self.attention_k_eq_v and not self.is_sliding(layer)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layers)) if self.n_experts else ()

    @property
    def moe_options(self) -> MoEOptions:
        return MoEOptions(
            n_experts=self.n_experts,
            top_k=self.top_k,
            ffn_dim=self.moe_ffn_dim,
            activation="gelu_tanh",
            load_balance=self.load_balance,
            aux_loss_coef=float(self.aux_loss_coef),
            bias_update_rate=float(self.bias_update_rate),
            init="normal",
            init_std=self.initializer_range,
        )

    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=False,
            qk_norm=True,
            sandwich_norms=True,
            activation="gelu_tanh",
            embedding_multiplier=self.dim**0.5,
            embedding_multiplier_rounded=True,
            attention_multiplier=1.0,
            logit_softcap=self.final_logit_softcap,
            window_rope_theta=self.rope_local_theta,
            layer_windows=self.layer_windows,
            init="normal",
            init_std=self.initializer_range,
            moe=self.moe_options if self.n_experts else None,
            moe_layers=self.moe_layers,
        )


# Which tensors exist and their shapes.
SHAPE_FIELDS = (
    *DECODER_SHAPE_FIELDS,
    "window_layers",
    "global_head_dim",
    "global_kv_heads",
    "attention_k_eq_v",
    "per_layer_dim",
    "per_layer_vocab_size",
    "kv_shared_layers",
    "double_wide_mlp",
    "n_experts",
    "moe_ffn_dim",
)
