"""Mistral 7B (v0.1 - v0.3): Llama's architecture with its own ``config.json``.

Tensor names are the shared decoder's (``models.common.decoder``); Hugging Face's are
``MistralForCausalLM``'s. v0.1 attends through a sliding window of 4096 positions in every layer
(``sliding_window``, as ``transformers`` reads it); v0.3 has none. A YaRN or linear RoPE stretch in
``config.json`` is read (``models.common.rope``). The init recipe is HF's (``normal``, std
``initializer_range``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import decoder_family, hf_config
from models.common.args import DecoderArgs

ARCHITECTURE, MODEL_TYPE = "MistralForCausalLM", "mistral"


@dataclass
class MistralArgs(DecoderArgs):
    """The shared decoder's args (``sliding_window``: every layer's window)."""


FLAVORS = {
    "debug": MistralArgs(dim=128, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=320, vocab_size=512, max_seq_len=512),
    "7B": MistralArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        norm_eps=1e-5,
        max_seq_len=32768,
        sliding_window=4096,
    ),
    "7B-v0.3": MistralArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32768,
        norm_eps=1e-5,
        rope_theta=1e6,
        max_seq_len=32768,
    ),
}


def config(args: MistralArgs, dtype: torch.dtype) -> dict:
    window = hf_config.uniform_window(args, "Mistral")
    return {**hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE), "sliding_window": window}


# transformers' MistralConfig defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072)


# MistralConfig's fields that refuse null (``hf_config.refuse_nulls``): a null num_key_value_heads
# too, which Llama's and Qwen's classes read as as many as the heads
NOT_NULL = (*hf_config.NOT_NULL, "attention_dropout", "num_key_value_heads")


def args_from_config(cfg: dict) -> MistralArgs:
    hf_config.refuse_nulls(cfg, NOT_NULL, "MistralConfig")
    hf_config.refuse_common(cfg, "Mistral")
    hf_config.refuse(cfg, "Mistral", attention_bias=False)
    window = cfg["sliding_window"] if "sliding_window" in cfg else 4096  # MistralConfig's (null: none)
    return MistralArgs(**hf_config.decoder_fields(cfg, **HF_DEFAULTS), sliding_window=window)


MISTRAL = decoder_family("mistral", MistralArgs, FLAVORS, (MODEL_TYPE,), config, args_from_config)
