"""Qwen2 and Qwen2.5: the shared decoder with a bias on the q, k and v projections.

Tensor names are the shared decoder's (``models.common.decoder``; the biases are
``layers.{i}.attention.{wq,wk,wv}.bias``); Hugging Face's are ``Qwen2ForCausalLM``'s. The small
flavors tie the output to the embedding. The init recipe is HF's (``normal``, std
``initializer_range``, zero biases). OSFT trains the weights' factors; the biases stay dense and
trainable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import decoder_family, hf_config
from models.common.args import DecoderArgs
from models.common.decoder import DecoderOptions

ARCHITECTURE, MODEL_TYPE = "Qwen2ForCausalLM", "qwen2"


@dataclass
class Qwen2Args(DecoderArgs):
    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=True, init="normal", init_std=self.initializer_range, layer_windows=self.layer_windows
        )


def _qwen2(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, tied, max_seq_len=32768) -> Qwen2Args:
    return Qwen2Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        rope_theta=1e6,
        max_seq_len=max_seq_len,
        tie_word_embeddings=tied,
    )


FLAVORS = {
    "debug": Qwen2Args(dim=128, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=320, vocab_size=512, max_seq_len=512),
    "0.5B": _qwen2(896, 24, 14, 2, 4864, 151936, tied=True),
    "1.5B": _qwen2(1536, 28, 12, 2, 8960, 151936, tied=True),
    "7B": _qwen2(3584, 28, 28, 4, 18944, 152064, tied=False, max_seq_len=131072),
    "72B": _qwen2(8192, 80, 64, 8, 29568, 152064, tied=False, max_seq_len=131072),
}


def config(args: Qwen2Args, dtype: torch.dtype) -> dict:
    return {**hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE), **hf_config.qwen_window_config(args)}


# transformers' Qwen2Config defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, max_position_embeddings=32768)


# Qwen2Config's fields that refuse null (``hf_config.refuse_nulls``)
NOT_NULL = (*hf_config.NOT_NULL, "attention_dropout", "max_window_layers", "use_sliding_window")


def args_from_config(cfg: dict) -> Qwen2Args:
    hf_config.refuse_nulls(cfg, NOT_NULL, "Qwen2Config")
    hf_config.refuse_common(cfg, "Qwen2")
    fields = hf_config.decoder_fields(cfg, **HF_DEFAULTS)
    return Qwen2Args(**fields, **hf_config.qwen_layer_windows(cfg, fields["n_layers"]))


QWEN2 = decoder_family("qwen2", Qwen2Args, FLAVORS, (MODEL_TYPE,), config, args_from_config)
