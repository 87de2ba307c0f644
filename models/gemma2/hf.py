"""Gemma 2's Hugging Face layout (``Gemma2ForCausalLM``, model_type ``gemma2``): ``config.json``
both ways; the tensor names are Gemma 3's without the q/k head norms (``models.gemma3.hf.Gemma3Names``).

A field the file leaves out takes ``Gemma2Config``'s default (``HF_DEFAULTS``; the layer kinds
alternate from a sliding first layer; both softcaps on, 30 on the logits and 50 on the attention
scores); a null softcap is none, as ``Gemma2Config`` types them. Refused in one line as for Gemma 3:
bidirectional attention, attention dropout, another activation, and a null where ``Gemma2Config``
holds no null.
"""

from __future__ import annotations

import torch

from models.common import hf_config
from models.common.args import check_bool, check_float, check_int
from models.gemma2.args import Gemma2Args
from models.gemma3 import hf as gemma3_hf

ARCHITECTURE, MODEL_TYPE = "Gemma2ForCausalLM", "gemma2"

# transformers' Gemma2Config defaults where they differ from LlamaConfig's (``hf_config.decoder_fields``):
# Gemma3TextConfig's shapes, but for the vocabulary and the positions
HF_DEFAULTS = gemma3_hf.HF_DEFAULTS | dict(vocab_size=256000, max_position_embeddings=8192)
SOFTCAPS = (
    ("final_logit_softcap", "final_logit_softcapping", 30.0),
    ("attn_logit_softcap", "attn_logit_softcapping", 50.0),
)


def args_from_config(cfg: dict) -> Gemma2Args:
    """Our args for a ``gemma2`` ``config.json``."""
    gemma3_hf.refuse_gemma(cfg, "Gemma2Config", "Gemma 2")
    fields = hf_config.decoder_fields(cfg, **HF_DEFAULTS)
    kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(fields["n_layers"])]
    window = cfg["sliding_window"] if "sliding_window" in cfg else 4096  # null: none (refused where a layer slides)
    return Gemma2Args(
        **fields,
        **hf_config.layer_windows(cfg, window, kinds),
        query_pre_attn_scalar=hf_config.read(cfg, "query_pre_attn_scalar", check_int, 256),
        attention_bias=hf_config.read(cfg, "attention_bias", check_bool, False),
        **{ours: hf_config.read(cfg, theirs, check_float, default, null=None) for ours, theirs, default in SOFTCAPS},
    )


def config(args: Gemma2Args, dtype: torch.dtype) -> dict:
    """A ``Gemma2ForCausalLM`` ``config.json``, as ``args_from_config`` reads it."""
    shared = hf_config.decoder_config(args, dtype, ARCHITECTURE, MODEL_TYPE)
    del shared["hidden_act"]  # Gemma's is hidden_activation
    return {
        **shared,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": args.query_pre_attn_scalar,
        **hf_config.window_config(args),
        **{theirs: getattr(args, ours) for ours, theirs, _ in SOFTCAPS},
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
    }
