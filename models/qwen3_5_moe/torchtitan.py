"""torchtitan 0.3.0's names for Qwen3.5-MoE (``torchtitan.models.qwen3_5`` with MoE layers, read from
the installed package): Qwen3.5's (``models.qwen3_5.torchtitan``: ``attn.*``, the linear layers' q,
k and v stored apart, ``lm_head``, the vision encoder skipped) and the mixture of experts as
torchtitan names it for Qwen3-MoE (``models.qwen3_moe.torchtitan``):

* ``layers.{i}.moe.routed_experts.inner_experts.{w1_EFD,w3_EFD}`` ``[E, F, D]`` and ``w2_EDF``
  ``[E, D, F]``: our ``moe.experts.{w1,w3,w2}``, the same shapes;
* ``layers.{i}.moe.expert_bias_E`` (fp32 ``[E]``, always in its model): our ``moe.expert_bias``,
  kept only at zero by a model balanced without one and written as zeros for it;
* ``moe.router.gate.weight`` and the shared expert ``moe.shared_experts.{w1,w2,w3,gate}.weight``
  (``gate`` ``[1, D]``, its sigmoid scaling the shared output) are ours.

Its router is ours: a softmax over every expert's logit, the ``top_k`` scores plus the expert bias
chosen, their unbiased scores renormalized, applied to the experts' outputs. Measured against
torchtitan 0.3.0 itself (its ``debugmodel_moe`` cut to 512 tokens, random weights and expert bias,
its experts run in fp32, FLA's kernel replaced by a token-by-token rule on the CPU, 80 positions):
our logits within 3.6e-6 of its own (of magnitude 3.5), read with ``load_balance = "bias"``.
"""

from __future__ import annotations

import re

from models.qwen3_5.torchtitan import Qwen35TorchtitanNames
from models.qwen3_moe.torchtitan import Qwen3MoeTorchtitanNames
from seedckpt.utils.stored_parts import StoredSplit

_IN_MOE = re.compile(r"layers\.\d+\.moe\..+")


class Qwen35MoeTorchtitanNames(Qwen35TorchtitanNames):
    """torchtitan 0.3's Qwen3.5-MoE names as the checkpoint layer's name adapter, for a model of
    ``args`` (its heads order the permuted rows; its balancing decides where the bias goes): the
    mixture of experts' tensors by the Qwen3-MoE adapter, the rest by Qwen3.5's."""

    def to_stored(self, fqn: str) -> str:
        return Qwen3MoeTorchtitanNames.to_stored(self, fqn) if _IN_MOE.fullmatch(fqn) else super().to_stored(fqn)

    def from_stored(self, name: str) -> str | StoredSplit | None:
        return Qwen3MoeTorchtitanNames.from_stored(self, name) if _IN_MOE.fullmatch(name) else super().from_stored(name)

    # the expert bias by Qwen3-MoE's rule: a model balanced without one reads it at zero only
    unkept_unless_zero = Qwen3MoeTorchtitanNames.unkept_unless_zero
    zero_filled = Qwen3MoeTorchtitanNames.zero_filled
