"""torchtitan 0.3.0's names for DeepSeek-V3, so its DCP checkpoints load as they are and ours are
written in them (``torchtitan.models.deepseek_v3``, read from the installed package).

Its model state, as its checkpointer saves it (no ``model.`` prefix), against ours:

* attention: ``layers.{i}.attention.{wq | wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo}.weight``,
  ours (our names are its; unlike its Llama and Qwen3 there is no ``qkv_linear``);
* the output projection: ``lm_head.weight``, our ``output.weight``;
* mixtures of experts: ``moe.routed_experts.inner_experts.{w1_EFD,w2_EDF,w3_EFD}`` and
  ``moe.expert_bias_E``, mapped as for Qwen3-MoE (``models.qwen3_moe.torchtitan``, whose rule for a
  model balanced without a bias applies too); ``moe.router.gate.weight`` and
  ``moe.shared_experts.{w1,w2,w3}.weight`` are ours.

Its RoPE (``ComplexRoPE``) rotates interleaved pairs, as ours does, so no row is permuted.
"""

from __future__ import annotations

import re

import torch

from models.qwen3_moe.torchtitan import Qwen3MoeTorchtitanNames

_ATTENTION = re.compile(r"layers\.\d+\.attention\..+")


class DeepseekV3TorchtitanNames(Qwen3MoeTorchtitanNames):
    """torchtitan 0.3's DeepSeek-V3 names as the checkpoint layer's name adapter, for a model of ``args``."""

    def to_stored(self, fqn: str) -> str:
        return fqn if _ATTENTION.fullmatch(fqn) else super().to_stored(fqn)

    def row_groups(self, fqn: str) -> None:
        return None

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
