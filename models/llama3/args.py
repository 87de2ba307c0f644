"""Llama 3 / 3.1 / 3.2 configuration: ``ModelArgs``, RoPE scaling and the released shapes.

Field names follow Meta's and torchtitan's ``ModelArgs`` (``dim``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``multiple_of``, ``ffn_dim_multiplier`` ...), so torchtitan configs read as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from models.common.args import DictArgs, check_bool, check_float, check_int
from models.common.decoder import DecoderOptions
from models.common.rope import RopeScaling as GenericRopeScaling


@dataclass
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (``rope_type="llama3"`` in HF), computed by
    ``models.common.rope``."""

    rope_type: ClassVar[str] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            setattr(self, name, check_float(f"rope_scaling.{name}", getattr(self, name)))
        check_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        if self.high_freq_factor <= self.low_freq_factor:  # the smooth band between them would divide by 0
            raise ValueError(
                f"rope_scaling.high_freq_factor = {self.high_freq_factor}; it must exceed "
                f"rope_scaling.low_freq_factor = {self.low_freq_factor}"
            )


@dataclass
class ModelArgs(DictArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1's (a table without rope_type), or another stretch (``models.common.rope``: a table
    # with rope_type "linear" or "yarn", as a long-context fine-tune's config.json may ask)
    rope_scaling: RopeScaling | GenericRopeScaling | None = None
    max_seq_len: int = 8192
    # One matrix for the input embedding and the output projection (Llama-3.2 1B/3B). When a
    # pipeline puts them on different stages each holds a copy, kept equal by the trainer.
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            kind = GenericRopeScaling if "rope_type" in self.rope_scaling else RopeScaling
            self.rope_scaling = kind(**self.rope_scaling)
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, (RopeScaling, GenericRopeScaling)):
            raise ValueError(f"rope_scaling = {self.rope_scaling!r}; it must be a table of Llama 3's scaling or none")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            check_int(name, getattr(self, name))
        if self.ffn_dim_multiplier is not None:
            self.ffn_dim_multiplier = check_float("ffn_dim_multiplier", self.ffn_dim_multiplier)
        self.norm_eps = check_float("norm_eps", self.norm_eps)
        self.rope_theta = check_float("rope_theta", self.rope_theta)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def decoder_options(self) -> DecoderOptions:
        """Llama 3 is the shared decoder's plain case."""
        return DecoderOptions()


# ModelArgs fields that decide which tensors exist and their shapes: a config must agree with a
# checkpoint on these (loading an untied checkpoint into a tied model would keep one of two matrices).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_word_embeddings")

_LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)

# Shapes of the released Llama 3.x models (torchtitan's flavors, plus 1B/3B from Llama 3.2 and a
# tiny CPU-friendly ``debug``). 1B and 3B tie the output to the embedding, as released.
LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=128,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        multiple_of=32,
        rope_theta=10000.0,
        max_seq_len=512,
    ),
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=RopeScaling(**_LLAMA32_ROPE),
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=RopeScaling(**_LLAMA32_ROPE),
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=RopeScaling(**_LLAMA31_ROPE),
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=RopeScaling(**_LLAMA31_ROPE),
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=RopeScaling(**_LLAMA31_ROPE),
        max_seq_len=131072,
    ),
}
