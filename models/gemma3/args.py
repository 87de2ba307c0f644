"""Gemma 3's args: the shared decoder's fields, and what its decoder switches on (``decoder_options``)."""

from __future__ import annotations

from dataclasses import dataclass

from models.common.args import DecoderArgs, check_bool, check_float, check_int
from models.common.decoder import DecoderOptions


def sliding_layers(n_layers: int, pattern: int = 6) -> list[int]:
    """Gemma 3's rule: every ``pattern``-th layer attends globally, the others through the window."""
    return [i for i in range(n_layers) if (i + 1) % pattern]


@dataclass
class GemmaArgs(DecoderArgs):
    """What Gemma 2 and Gemma 3 share: the scores' scale, a logit softcap, optional biases, tied."""

    rope_theta: float = 1e6  # the global layers' base
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: int = 256  # the attention scores' scale is its -1/2 power
    final_logit_softcap: float | None = None  # None: no softcap
    attention_bias: bool = False  # biases on q, k, v and o

    def __post_init__(self):
        super().__post_init__()
        check_int("query_pre_attn_scalar", self.query_pre_attn_scalar)
        if self.final_logit_softcap is not None:
            self.final_logit_softcap = check_float("final_logit_softcap", self.final_logit_softcap)
        check_bool("attention_bias", self.attention_bias)

    def gemma_options(self, **own) -> DecoderOptions:
        """The decoder's switches every Gemma sets, with ``own``: those of one generation."""
        return DecoderOptions(
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            norm_offset=True,
            sandwich_norms=True,
            activation="gelu_tanh",
            embedding_multiplier=self.dim**0.5,
            embedding_multiplier_rounded=True,
            attention_multiplier=self.query_pre_attn_scalar**-0.5,
            logit_softcap=self.final_logit_softcap,
            layer_windows=self.layer_windows,
            init="normal",
            init_std=self.initializer_range,
            **own,
        )


@dataclass
class Gemma3Args(GemmaArgs):
    rope_local_theta: float = 10000.0  # the sliding-window layers' RoPE base, never stretched

    def __post_init__(self):
        super().__post_init__()
        self.rope_local_theta = check_float("rope_local_theta", self.rope_local_theta)

    @property
    def decoder_options(self) -> DecoderOptions:
        return self.gemma_options(qk_norm=True, window_rope_theta=self.rope_local_theta)
