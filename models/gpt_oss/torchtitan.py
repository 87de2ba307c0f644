"""torchtitan 0.3.0's names for gpt-oss (``torchtitan.models.gpt_oss``, read from the installed
package), so its DCP checkpoints load as they are and ours can be written in them.

Its model state, as its checkpointer saves it (no ``model.`` prefix), against ours:

* attention: ``layers.{i}.attention.qkv_linear.{wq,wk,wv}.{weight,bias}`` (its fused ``wqkv`` is
  split back into these on save), ``attention.wo.{weight,bias}`` and ``attention.sinks`` ours;
  its RoPE (``CosSinRoPE``) rotates halves of each head, as Hugging Face's does, so the q/k rows
  and biases are permuted per head as HF's are (``HFRowOrder``);
* the experts: ``moe.routed_experts.inner_experts.mlp1_weight_EGD`` ``[E, 2F, D]`` holds our gate
  ``w1`` in its even rows and up ``w3`` in its odd ones (its SwiGLU reads ``x[..., ::2]`` and
  ``x[..., 1::2]``), ``mlp1_bias_EG`` ``[E, 2F]`` their biases alike -- each a ``StoredParts``, so
  an expert-parallel rank reads only its experts' rows; ``mlp2_weight_EDF`` and ``mlp2_bias_ED``
  are our ``w2`` and ``b2`` as they are;
* ``moe.router.gate.{weight,bias}`` ours, ``moe.expert_bias_E`` our ``moe.expert_bias`` (by the
  Qwen3-MoE rule: a model balanced without a bias reads it only at zero and writes zeros);
* ``lm_head.weight``: our ``output.weight``.

What it computes is ours: the same clamped SwiGLU (``x_glu * sigmoid(1.702 x_glu) * (x_linear + 1)``),
a softmax over every expert's logit whose ``top_k`` are chosen -- with its expert bias added to the
softmax scores, not to the logits (``models.common.moe``, ``softmax_topk``) -- and renormalized
(the softmax over the chosen logits), sinks as one more logit per head, YaRN's attention factor
squared in the softmax scale, windows of ``sliding_window`` positions counting the query.

Measured against torchtitan 0.3.0 itself (its debugmodel, random weights, a non-zero expert bias,
its experts in fp32, 200 positions past the 128-position window): our logits within 2.6e-6 of its
own; with the bias added to the logits instead, 0.70 off.

The DCP reader splits each ``mlp1_*`` into ours (only the experts a rank holds are read) and the
writer joins them back, so ``convert --to torchtitan`` writes torchtitan's fused layout.
"""

from __future__ import annotations

import re

import torch

from models.qwen3_moe.torchtitan import Qwen3MoeTorchtitanNames
from seedckpt.utils.stored_parts import StoredParts

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERTS = "moe.routed_experts.inner_experts."


def _interleaved_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2F, ...]`` -> its even and odd dim-1 rows, ``[E, F, ...]`` each."""
    return t[:, 0::2], t[:, 1::2]


def _interleave_rows(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``_interleaved_rows``' inverse."""
    gate, up = parts
    return torch.stack((gate, up), dim=2).flatten(1, 2)


# Within a layer, torchtitan's -> ours, for the tensors stored as they are or renamed only.
_RENAMED = {
    **{f"attention.qkv_linear.{w}.{p}": f"attention.{w}.{p}" for w in ("wq", "wk", "wv") for p in ("weight", "bias")},
    _EXPERTS + "mlp2_weight_EDF": "moe.experts.w2",
    _EXPERTS + "mlp2_bias_ED": "moe.experts.b2",
    "moe.expert_bias_E": "moe.expert_bias",
}
_RENAMED_OURS = {ours: theirs for theirs, ours in _RENAMED.items()}
# torchtitan's fused tensors within a layer -> our tensors in them (gate, up)
_FUSED = {
    _EXPERTS + "mlp1_weight_EGD": ("moe.experts.w1", "moe.experts.w3"),
    _EXPERTS + "mlp1_bias_EG": ("moe.experts.b1", "moe.experts.b3"),
}
_FUSED_OF = {ours: theirs for theirs, fqns in _FUSED.items() for ours in fqns}


class GptOssTorchtitanNames(Qwen3MoeTorchtitanNames):
    """torchtitan 0.3's gpt-oss names as the checkpoint layer's name adapter, for a model of ``args``
    (its heads order the permuted q/k rows; its balancing decides where the bias goes)."""

    def to_stored(self, fqn: str) -> str:
        if fqn == "output.weight":
            return "lm_head.weight"
        m = _LAYER.fullmatch(fqn)
        theirs = m and (_RENAMED_OURS.get(m.group(2)) or _FUSED_OF.get(m.group(2)))
        return f"layers.{m.group(1)}.{theirs}" if theirs else fqn

    def from_stored(self, name: str) -> str | StoredParts:
        if name == "lm_head.weight":
            return "output.weight"
        m = _LAYER.fullmatch(name)
        if m and m.group(2) in _FUSED:
            fqns = tuple(f"layers.{m.group(1)}.{ours}" for ours in _FUSED[m.group(2)])
            return StoredParts(fqns, _interleaved_rows, _interleave_rows)
        ours = m and _RENAMED.get(m.group(2))
        return f"layers.{m.group(1)}.{ours}" if ours else name
