"""IBM Granite 3.x (dense): the shared decoder with four multipliers -- on the embedding's output,
on each block's branches before the residual add, as the attention scores' scale, and dividing the
logits.

Tensor names are the shared decoder's (``models.common.decoder``); Hugging Face's are
``GraniteForCausalLM``'s. The released flavors tie the output to the embedding. The init recipe is
HF's (``normal``, std ``initializer_range``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import decoder_family, hf_config
from models.common.args import DecoderArgs, check_float
from models.common.decoder import DecoderOptions

ARCHITECTURE, MODEL_TYPE = "GraniteForCausalLM", "granite"
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@dataclass
class GraniteArgs(DecoderArgs):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0  # the attention scores' scale (not head_dim^-0.5)
    logits_scaling: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        for m in MULTIPLIERS:  # finite and > 0: a zero scale or logits divisor computes NaN
            setattr(self, m, check_float(m, getattr(self, m)))
        if self.sliding_window is not None:  # GraniteForCausalLM has none: an export could not say it
            raise ValueError(f"sliding_window = {self.sliding_window}; Granite attends to every position: remove it")

    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(
            **{m: getattr(self, m) for m in MULTIPLIERS}, init="normal", init_std=self.initializer_range
        )


def _granite(ffn_dim, attention_multiplier, logits_scaling, **shape) -> GraniteArgs:
    return GraniteArgs(
        n_layers=40,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=49155,
        rope_theta=10000.0,
        max_seq_len=4096,
        tie_word_embeddings=True,
        norm_eps=1e-5,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=attention_multiplier,
        logits_scaling=logits_scaling,
        **shape,
    )


FLAVORS = {
    "debug": GraniteArgs(
        dim=128,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=320,
        vocab_size=512,
        max_seq_len=512,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=4.0,
    ),
    "2B": _granite(8192, 0.015625, 8.0, dim=2048),
    "8B": _granite(12800, 0.0078125, 16.0, dim=4096),
}


def config(args: GraniteArgs, dtype: torch.dtype) -> dict:
    return {
        **hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE),
        "attention_bias": False,
        "mlp_bias": False,
        **{m: getattr(args, m) for m in MULTIPLIERS},
    }


# GraniteConfig's fields that refuse null (``hf_config.refuse_nulls``)
NOT_NULL = (*hf_config.NOT_NULL, "attention_bias", "attention_dropout", "mlp_bias", *MULTIPLIERS)


def args_from_config(cfg: dict) -> GraniteArgs:
    hf_config.refuse_nulls(cfg, NOT_NULL, "GraniteConfig")
    hf_config.refuse_common(cfg, "Granite")
    hf_config.refuse(cfg, "Granite", attention_bias=False)
    return GraniteArgs(
        **hf_config.decoder_fields(cfg),  # GraniteConfig's defaults are LlamaConfig's
        **{m: hf_config.read(cfg, m, check_float, 1.0) for m in MULTIPLIERS},
    )


GRANITE = decoder_family("granite", GraniteArgs, FLAVORS, (MODEL_TYPE,), config, args_from_config)
