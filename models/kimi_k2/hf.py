"""Kimi K2 in Hugging Face's layout: DeepSeek-V3's tensor names and fields under ``model_type``
``kimi_k2``.

The released ``config.json`` names ``DeepseekV3ForCausalLM`` as its architecture and holds
DeepSeek-V3's fields; ``transformers`` 5.24 has no ``kimi_k2`` class of its own (its Kimi K2.5
wrapper reads a ``kimi_k2`` text config as ``deepseek_v3``), so a file is read here as DeepSeek-V3's
reader reads it (``models.deepseek_v3.hf``: every field checked, ``DeepseekV3Config``'s default for
one left out) and written as DeepSeek-V3's with ``model_type: kimi_k2``, as released (the hub's
files also name their own code in ``auto_map``, which is not written). ``transformers`` 5.24 loads
such a file as ``DeepseekV3ForCausalLM`` once its ``model_type`` reads ``deepseek_v3``, as its Kimi
K2.5 reader rewrites it: under ``kimi_k2`` its ``AutoConfig`` knows no class, and
``DeepseekV3ForCausalLM.from_pretrained`` leaves every routed expert unloaded (it stacks the
per-expert tensors by a rule it looks up by model_type) with a warning. A model that is not routed
by sigmoid -- Kimi K2's routing and the one ``DeepseekV3ForCausalLM`` computes -- is refused before
anything is written.

Kimi-K2-Thinking's routed experts are stored as 4-bit integers (compressed-tensors'
``pack-quantized``); ``seedckpt.checkpoint.formats.compressed_tensors`` reads them dequantized,
under the names above.
"""

from __future__ import annotations

import dataclasses

import torch

from models.deepseek_v3 import hf as deepseek
from models.deepseek_v3.hf_v2 import DeepseekHFNames, export_refusal
from models.kimi_k2.args import KimiK2Args

MODEL_TYPE = "kimi_k2"


class KimiK2HFNames(DeepseekHFNames):
    """DeepSeek-V3's names; a multi-token-prediction module is named as Kimi K2's."""

    MODEL = "Kimi K2"


def config(args: KimiK2Args, dtype: torch.dtype) -> dict:
    if args.score_func != "sigmoid":
        raise ValueError(
            f"score_func = {args.score_func!r}: Kimi K2's config.json (DeepseekV3ForCausalLM) routes by sigmoid; "
            "export to dcp or torchtitan"
        )
    reason = export_refusal(args)
    if reason is not None:
        raise ValueError(reason)
    return {**deepseek.config(args, dtype), "model_type": MODEL_TYPE}


def args_from_config(cfg: dict) -> KimiK2Args:
    """A ``kimi_k2`` ``config.json`` as our args: DeepSeek-V3's reading of the same fields."""
    read = deepseek.args_from_config(cfg)
    return KimiK2Args(**{f.name: getattr(read, f.name) for f in dataclasses.fields(read)})
