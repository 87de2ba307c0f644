"""Mistral 7B (v0.1 - v0.3): Llama's architecture with its own ``config.json``.

Tensor names are the shared decoder's (``models.common.decoder``); Hugging Face's are
``MistralForCausalLM``'s. A sliding window (v0.1: 4096) equals full attention for sequences no
longer than it; longer sequences are refused, since the window is not implemented: in training by
``check_seq_len`` before anything starts, in any forward by the decoder (``attention_window``). The
init recipe is HF's (``normal``, std ``initializer_range``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from models.common import decoder_family, hf_config
from models.common.args import DecoderArgs, check_int
from models.common.decoder import DecoderOptions

ARCHITECTURE, MODEL_TYPE = "MistralForCausalLM", "mistral"


def check_window(args) -> None:
    """``sliding_window``: None (every position) or a count of positions (Mixtral's too)."""
    if args.sliding_window is not None:
        check_int("sliding_window", args.sliding_window)


@dataclass
class MistralArgs(DecoderArgs):
    sliding_window: int | None = None  # positions each token attends back to (None: all)

    def __post_init__(self):
        super().__post_init__()
        check_window(self)

    @property
    def decoder_options(self) -> DecoderOptions:
        return dataclasses.replace(super().decoder_options, attention_window=self.sliding_window)


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


def check_seq_len(args: MistralArgs, seq_len: int) -> str | None:
    window = args.sliding_window
    if window is not None and seq_len > window:
        return (
            f"training.seq_len = {seq_len} exceeds the model's sliding_window = {window}, which this version "
            f"does not implement (it is full attention up to {window}); use training.seq_len <= {window}"
        )
    return None


def config(args: MistralArgs, dtype: torch.dtype) -> dict:
    return {**hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE), "sliding_window": args.sliding_window}


def args_from_config(cfg: dict) -> MistralArgs:
    hf_config.refuse_common(cfg, "Mistral")
    hf_config.refuse(cfg, "Mistral", attention_bias=False)
    return MistralArgs(**hf_config.decoder_fields(cfg), sliding_window=cfg.get("sliding_window"))


MISTRAL = decoder_family(
    "mistral", MistralArgs, FLAVORS, (MODEL_TYPE,), config, args_from_config, check_seq_len=check_seq_len
)
