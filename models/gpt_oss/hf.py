"""gpt-oss's Hugging Face tensor names: ``GptOssForCausalLM``'s as ``save_pretrained`` writes them.

Attention and norms are the shared decoder's names (``models.common.hf_names``), plus the sinks
(``self_attn.sinks``) and the output projection's bias. The mixture of experts differs from the
other families' in three ways:

* the router is ``mlp.router`` (a weight and a bias), not ``mlp.gate``;
* the experts are stored fused and 3-D, in the ``[experts, in, out]`` orientation (``x @ W``) where
  ours is ``[experts, out, in]`` (``F.linear``): ``mlp.experts.gate_up_proj`` ``[E, dim, 2 ffn]``
  holds the gate (our ``w1``) in its even columns and the up projection (``w3``) in its odd ones,
  interleaved, and ``gate_up_proj_bias`` ``[E, 2 ffn]`` their biases alike; ``down_proj``
  ``[E, ffn, dim]`` is our ``w2`` transposed, ``down_proj_bias`` ``[E, dim]`` our ``b2`` as it is;
* each such tensor is a ``StoredParts``: any block of its experts (dim 0) splits into the same
  block of ours, so an expert-parallel rank reads only its experts' bytes.
"""

from __future__ import annotations

import re

import torch

from models.common.hf_names import ExpertNames, HFNames
from seedckpt.utils.stored_parts import StoredParts

_LAYER = re.compile(r"(model\.)?layers\.(\d+)\.(.+)")

# Ours -> HF's, within a layer, for the tensors stored as they are.
_RENAMED = {
    "attention.sinks": "self_attn.sinks",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.b2": "mlp.experts.down_proj_bias",
}
_RENAMED_INV = {theirs: ours for ours, theirs in _RENAMED.items()}


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Two ``[..., n]`` tensors -> ``[..., 2n]``, the first in the even columns, the second in the odd."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1)


# HF's fused tensors, within a layer: (our tensors in it, split, join).
_FUSED = {
    "mlp.experts.gate_up_proj": (
        ("moe.experts.w1", "moe.experts.w3"),
        lambda t: (_transposed(t[..., 0::2]), _transposed(t[..., 1::2])),
        lambda ours: _interleave(*map(_transposed, ours)),
    ),
    "mlp.experts.gate_up_proj_bias": (
        ("moe.experts.b1", "moe.experts.b3"),
        lambda t: (t[..., 0::2], t[..., 1::2]),
        lambda ours: _interleave(*ours),
    ),
    "mlp.experts.down_proj": (
        ("moe.experts.w2",),
        lambda t: (_transposed(t),),
        lambda ours: _transposed(ours[0]),
    ),
}
_FUSED_OF = {ours: theirs for theirs, (fqns, _, _) in _FUSED.items() for ours in fqns}

# No per-expert tensors; the base adapter's MoE handling leaves a zero expert bias out of an export.
EXPERTS = ExpertNames("mlp", ())


class GptOssNames(HFNames):
    """The name adapter between our FQNs and ``GptOssForCausalLM``'s (see the module docstring)."""

    def __init__(self, args):
        super().__init__(args, EXPERTS)

    def to_stored(self, fqn: str) -> str:
        m = _LAYER.fullmatch(fqn)
        rest = m.group(3) if m and not m.group(1) else None
        theirs = _RENAMED.get(rest) or _FUSED_OF.get(rest)
        return f"model.layers.{m.group(2)}.{theirs}" if theirs else super().to_stored(fqn)

    def from_stored(self, name: str) -> str | StoredParts | None:
        m = _LAYER.fullmatch(name)
        rest = m.group(3) if m and m.group(1) else None
        if rest in _RENAMED_INV:
            return f"layers.{m.group(2)}.{_RENAMED_INV[rest]}"
        if rest in _FUSED:
            fqns, split, join = _FUSED[rest]
            return StoredParts(tuple(f"layers.{m.group(2)}.{ours}" for ours in fqns), split, join)
        if rest is not None and rest.startswith("mlp."):  # not the base's router (``mlp.gate``)
            raise ValueError(f"unexpected tensor {name!r}: this model has no such tensor")
        return super().from_stored(name)
