"""Gemma 2's args: Gemma's shared fields (``models.gemma3.args.GemmaArgs``) and the attention scores'
softcap; one RoPE table for every layer, no q/k head norms."""

from __future__ import annotations

from dataclasses import dataclass

from models.common.args import check_float
from models.common.decoder import DecoderOptions
from models.gemma3.args import GemmaArgs


@dataclass
class Gemma2Args(GemmaArgs):
    rope_theta: float = 10000.0
    final_logit_softcap: float | None = 30.0
    attn_logit_softcap: float | None = 50.0  # the attention scores' softcap; None: none

    def __post_init__(self):
        super().__post_init__()
        if self.attn_logit_softcap is not None:
            self.attn_logit_softcap = check_float("attn_logit_softcap", self.attn_logit_softcap)

    @property
    def decoder_options(self) -> DecoderOptions:
        return self.gemma_options(attn_softcap=self.attn_logit_softcap)
