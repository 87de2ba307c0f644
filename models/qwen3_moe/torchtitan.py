"""torchtitan 0.3.0's names for Qwen3-MoE, so its DCP checkpoints load as they are and ours are
written in them (torchtitan's ``qwen3`` model with MoE layers, read from the installed package).

Its model state, as its checkpointer saves it (no ``model.`` prefix), against ours:

* attention: ``layers.{i}.attention.qkv_linear.{wq,wk,wv}.weight`` and ``lm_head.weight``, the
  renaming torchtitan 0.3 made for every model (``models.llama3.torchtitan``);
* experts: ``layers.{i}.moe.routed_experts.inner_experts.{w1_EFD,w3_EFD}`` ``[E, F, D]`` and
  ``w2_EDF`` ``[E, D, F]``: our ``moe.experts.{w1,w3,w2}``, the same shapes;
* ``layers.{i}.moe.router.gate.weight``: ours;
* ``layers.{i}.moe.expert_bias_E`` (fp32 ``[E]``): our ``moe.expert_bias``. torchtitan's model
  always has it (``load_balance_coeff`` defaults to 1e-3): zero in a seed, trained after a step.

Its Qwen3 rotates halves of each head (``CosSinRoPE``), as Hugging Face's classes do, so its
``wq``/``wk`` rows and ``q_norm``/``k_norm`` weights are in HF's order: the same per-head
permutation as ``models.common.hf_names``. Its step checkpoints hold the optimizer state under the
fused in-memory name ``qkv_linear.wqkv`` (rows interleaved per KV head); only the model state is
read here, as a start's weights.

The bias decides which experts a token picks, so it is never dropped while it holds anything: a
model balanced without a bias (``load_balance`` other than ``"bias"``) reads a torchtitan checkpoint
only when every ``expert_bias_E`` is zero (checked on the values), and is written with zero ones.
"""

from __future__ import annotations

import re

import torch

from models.common.hf_names import HFRowOrder
from models.llama3.torchtitan import from_torchtitan_name, to_torchtitan_name

# our name after ``layers.{i}.moe.`` -> torchtitan's
_MOE = {
    "experts.w1": "routed_experts.inner_experts.w1_EFD",
    "experts.w2": "routed_experts.inner_experts.w2_EDF",
    "experts.w3": "routed_experts.inner_experts.w3_EFD",
    "expert_bias": "expert_bias_E",
}
_MOE_THEIRS = {theirs: ours for ours, theirs in _MOE.items()}
_IN_MOE = re.compile(r"(layers\.\d+\.moe)\.(.+)")
_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")


class Qwen3MoeTorchtitanNames(HFRowOrder):
    """torchtitan 0.3's Qwen3-MoE names as the checkpoint layer's name adapter, for a model of
    ``args`` (its heads order the permuted rows; its balancing decides where the bias goes)."""

    def to_stored(self, fqn: str) -> str:
        m = _IN_MOE.fullmatch(fqn)
        if m and m.group(2) in _MOE:
            return f"{m.group(1)}.{_MOE[m.group(2)]}"
        return to_torchtitan_name(fqn)

    def from_stored(self, name: str) -> str:
        m = _IN_MOE.fullmatch(name)
        if m and m.group(2) in _MOE_THEIRS:
            return f"{m.group(1)}.{_MOE_THEIRS[m.group(2)]}"
        return from_torchtitan_name(name)

    def stacked_names(self, fqn: str, count: int) -> None:
        return None  # experts are stored grouped, as ours

    def unkept_unless_zero(self, fqn: str) -> str | None:
        """Why this model cannot keep torchtitan's ``fqn`` unless it is zero (the expert bias of a
        model balanced without one); None for every tensor it keeps."""
        if self.args.load_balance == "bias" or not _BIAS.fullmatch(fqn):
            return None
        return (
            f"{self.to_stored(fqn)} is torchtitan's trained expert bias, which chooses each token's experts; "
            f'a model with load_balance = "{self.args.load_balance}" has none: set model.load_balance = "bias"'
        )

    def zero_filled(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors torchtitan's model has and this one lacks, written as zeros: the expert bias
        of each MoE layer of a model balanced without one (zero routes as no bias)."""
        if self.args.load_balance == "bias":
            return {}
        shape = ((self.args.n_experts,), torch.float32)
        return {f"layers.{i}.moe.expert_bias_E": shape for i in self.args.moe_layers}
