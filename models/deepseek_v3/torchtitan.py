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

Its multi-token-prediction layers (``mtp_layers.{d}.*``, with ``num_mtp_layers``) are left out
with one line (``left_out``), as the HF checkpoint's MTP layer is: this model predicts the next
token only.

A torchtitan checkpoint records no configuration: its tensors give the shapes, not the routing.
torchtitan's DeepSeek recipes (``debugmodel``, ``16B``, ``236B``: softmax; ``671B``: sigmoid) are
our flavors of those names, so a checkpoint read into a model with a recipe's shapes but another
routing or RoPE than that recipe's (``COMPUTED``) says so in one warning line, naming the fields and
the flavor that computes what torchtitan does, instead of loading without a word.
"""

from __future__ import annotations

import re
import warnings

import torch

from models.deepseek_v3.args import ROUTING, SHAPE_FIELDS
from models.deepseek_v3.flavors import FLAVORS
from models.qwen3_moe.torchtitan import Qwen3MoeTorchtitanNames

_ATTENTION = re.compile(r"layers\.\d+\.attention\..+")
_MTP = re.compile(r"mtp_layers\.(\d+)\..+")
_THEIRS_ONLY = re.compile(r"lm_head\.weight|layers\.\d+\.moe\.(routed_experts\..+|expert_bias_E)")
RECIPES = ("debugmodel", "16B", "236B", "671B")  # torchtitan 0.3.0's DeepSeek recipes: our flavors of those names
COMPUTED = (*ROUTING, "rope_scaling")  # what a recipe computes beyond its shapes
_SHAPES = tuple(f for f in SHAPE_FIELDS if f not in ROUTING and f != "load_balance")


def recipe_mismatch(args) -> str | None:
    """The line saying how ``args`` computes otherwise than torchtitan's recipe with its shapes, or None."""
    recipe = next((r for r in RECIPES if all(getattr(FLAVORS[r], f) == getattr(args, f) for f in _SHAPES)), None)
    if recipe is None:
        return None
    flavor = FLAVORS[recipe]
    differ = [
        f"{f} = {getattr(args, f)!r} (its {getattr(flavor, f)!r})"
        for f in COMPUTED
        if getattr(args, f) != getattr(flavor, f)
    ]
    if not differ:
        return None
    return (
        f"this model has the shapes of torchtitan's DeepSeek {recipe} recipe but computes {', '.join(differ)}: "
        f"its logits are not torchtitan's; set model.flavor = {recipe!r} (without those overrides) to read the "
        "checkpoint as torchtitan computes it"
    )


class DeepseekV3TorchtitanNames(Qwen3MoeTorchtitanNames):
    """torchtitan 0.3's DeepSeek-V3 names as the checkpoint layer's name adapter, for a model of ``args``."""

    def __init__(self, args):
        super().__init__(args)
        self.warned = args is None  # nothing to compare without a model

    def to_stored(self, fqn: str) -> str:
        return fqn if _ATTENTION.fullmatch(fqn) else super().to_stored(fqn)

    def from_stored(self, name: str) -> str | None:
        if _MTP.fullmatch(name):
            return None  # the multi-token-prediction layers (``left_out``)
        if not self.warned and _THEIRS_ONLY.fullmatch(name):  # a checkpoint in torchtitan's names
            self.warned = True
            mismatch = recipe_mismatch(self.args)
            if mismatch is not None:
                warnings.warn(mismatch, stacklevel=2)
        return super().from_stored(name)

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """torchtitan's ``mtp_layers.*`` are left out with one line; nothing else is."""
        mtp = sorted({int(m.group(1)) for m in map(_MTP.fullmatch, skipped) if m})
        refused = [name for name in skipped if not _MTP.fullmatch(name)]
        if not mtp:
            return refused, None
        return refused, (
            f"mtp_layers.{mtp[0]} and up (torchtitan's multi-token-prediction layers, {len(mtp)}) are skipped: "
            "this model, like transformers', predicts the next token only"
        )

    def row_groups(self, fqn: str) -> None:
        return None

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
