"""Qwen3 (dense): the shared decoder with an RMSNorm over each q and k head before RoPE, and a
head size of its own (``head_dim`` is not ``dim / n_heads``).

Tensor names are the shared decoder's (``models.common.decoder``; the norms are
``layers.{i}.attention.{q_norm,k_norm}.weight``); Hugging Face's are ``Qwen3ForCausalLM``'s. The
small flavors tie the output to the embedding. The init recipe is torchtitan's, as for Llama 3
(torchtitan has a qwen3 model); the q/k norms start at one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import decoder_family, hf_config
from models.common.args import DecoderArgs
from models.common.decoder import DecoderOptions

ARCHITECTURE, MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"


@dataclass
class Qwen3Args(DecoderArgs):
    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(qk_norm=True, init="torchtitan", layer_windows=self.layer_windows)


def _qwen3(dim, n_layers, n_heads, ffn_dim, tied) -> Qwen3Args:
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn_dim,
        vocab_size=151936,
        rope_theta=1e6,
        max_seq_len=40960,
        tie_word_embeddings=tied,
    )


FLAVORS = {
    "debug": Qwen3Args(
        dim=128, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=320, vocab_size=512, max_seq_len=512
    ),
    "0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
    "1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
    "4B": _qwen3(2560, 36, 32, 9728, tied=True),
    "8B": _qwen3(4096, 36, 32, 12288, tied=False),
    "32B": _qwen3(5120, 64, 64, 25600, tied=False),
}


def config(args: Qwen3Args, dtype: torch.dtype) -> dict:
    return {
        **hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE),
        **hf_config.qwen_window_config(args),
        "attention_bias": False,
    }


# transformers' Qwen3Config defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``)
HF_DEFAULTS = dict(
    vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768
)


# Qwen3Config's fields that refuse null (``hf_config.refuse_nulls``)
NOT_NULL = (
    *hf_config.NOT_NULL,
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "max_window_layers",
    "use_sliding_window",
)


def args_from_config(cfg: dict) -> Qwen3Args:
    hf_config.refuse_nulls(cfg, NOT_NULL, "Qwen3Config")
    hf_config.refuse_common(cfg, "Qwen3")
    hf_config.refuse(cfg, "Qwen3", attention_bias=False)
    fields = hf_config.decoder_fields(cfg, **HF_DEFAULTS)
    return Qwen3Args(**fields, **hf_config.qwen_layer_windows(cfg, fields["n_layers"]))


QWEN3 = decoder_family("qwen3", Qwen3Args, FLAVORS, (MODEL_TYPE,), config, args_from_config)
