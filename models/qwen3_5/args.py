"""Qwen3.5's args: the shared decoder's fields, partial RoPE, and the Gated DeltaNet layers' shapes
(``models.qwen3_5``'s docstring says what each computes). Defaults are ``Qwen3_5TextConfig``'s."""

from __future__ import annotations

from dataclasses import dataclass

from models.common.args import SHAPE_FIELDS as DECODER_SHAPE_FIELDS
from models.common.args import DecoderArgs, check_bool, check_float, check_int, layer_list
from models.common.decoder import DecoderOptions
from models.common.gated_deltanet import GatedDeltaNet
from models.qwen3_5.attention import layer_attention

FULL_ATTENTION_INTERVAL = 4  # transformers' default: every 4th layer attends fully, the rest are linear


def every_fourth(n_layers: int, interval: int = FULL_ATTENTION_INTERVAL) -> list[int]:
    """The full-attention layers of ``n_layers`` (``Qwen3_5TextConfig``'s ``full_attention_interval``)."""
    return [i for i in range(n_layers) if (i + 1) % interval == 0]


@dataclass
class Qwen35Args(DecoderArgs):
    dim: int = 4096
    n_heads: int = 16
    n_kv_heads: int | None = 4
    head_dim: int | None = 256
    ffn_dim: int = 12288
    vocab_size: int = 248320
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25  # the share of each head RoPE turns (its first channels)
    attention_bias: bool = False  # biases on q, k, v and o of the full-attention layers
    full_attention_layers: list[int] | None = None  # None: every fourth layer (``every_fourth``)
    linear_conv_kernel: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None:
            raise ValueError("Qwen3.5 has no sliding window; remove model.sliding_window")
        self.partial_rotary_factor = check_float("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor = {self.partial_rotary_factor} turns {self.rotary_dim} of head_dim = "
                f"{self.head_dim} channels; it must be at most 1 and turn an even number, at least 2"
            )
        check_bool("attention_bias", self.attention_bias)
        if self.full_attention_layers is None:
            self.full_attention_layers = every_fourth(self.n_layers)
        layers = layer_list("full_attention_layers", self.full_attention_layers, self.n_layers)
        self.full_attention_layers = sorted(set(layers))
        for name in ("linear_conv_kernel", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads"):
            check_int(name, getattr(self, name))
        check_int("linear_num_value_heads", self.linear_num_value_heads)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads = {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads = {self.linear_num_key_heads}"
            )
        one_head = {2 * self.head_dim: self.n_heads, self.head_dim: self.n_kv_heads}  # wq, wk rows: a head's
        if one_head.get(self.linear_qkv_channels) == 1:
            raise ValueError(
                f"the linear layers' {self.linear_qkv_channels} q/k/v channels equal the rows of a one-head q or k "
                "projection, which a Hugging Face reader could not tell apart: change head_dim or the linear heads"
            )

    @property
    def linear_qkv_channels(self) -> int:
        """The rows of a linear layer's ``in_proj_qkv``: q and k of every key head, and every value head."""
        keys = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        return keys + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE turns (``transformers``: ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def linear_attention(self, layer_id: int, init_std: float) -> GatedDeltaNet:
        return GatedDeltaNet(
            self.dim,
            self.linear_num_key_heads,
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
            self.linear_conv_kernel,
            self.norm_eps,
            init_std,
        )

    @property
    def decoder_options(self) -> DecoderOptions:

        return DecoderOptions(
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm=True,
            norm_offset=True,
            layer_attention=layer_attention,
        )


# Which tensors exist and their shapes.
SHAPE_FIELDS = (
    *DECODER_SHAPE_FIELDS,
    "attention_bias",
    "full_attention_layers",
    "linear_conv_kernel",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
