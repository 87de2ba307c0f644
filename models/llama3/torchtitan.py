"""torchtitan's tensor names, so its DCP checkpoints load as they are and ours can be written in them.

torchtitan up to 0.2 uses Meta's names, which are ours (``layers.{i}.attention.wq.weight``,
``output.weight``). torchtitan 0.3.0 renamed two groups: the attention projections moved under
``attention.qkv_linear`` (``layers.{i}.attention.qkv_linear.{wq,wk,wv}.weight``) and the output
projection became ``lm_head.weight``. The layouts are otherwise identical (same RoPE convention,
same shapes), so the adapter is a pure renaming; our own names never change.
"""

from __future__ import annotations

import re

import torch

_QKV_OURS = re.compile(r"(layers\.\d+\.attention)\.(w[qkv])\.weight")
_QKV_THEIRS = re.compile(r"(layers\.\d+\.attention)\.qkv_linear\.(w[qkv])\.weight")


def to_torchtitan_name(fqn: str) -> str:
    """Our FQN -> torchtitan 0.3's."""
    if fqn == "output.weight":
        return "lm_head.weight"
    return _QKV_OURS.sub(r"\1.qkv_linear.\2.weight", fqn) if _QKV_OURS.fullmatch(fqn) else fqn


def from_torchtitan_name(key: str) -> str:
    """torchtitan 0.3's name -> our FQN (other keys, training state included, pass through)."""
    if key == "lm_head.weight":
        return "output.weight"
    return _QKV_THEIRS.sub(r"\1.\2.weight", key) if _QKV_THEIRS.fullmatch(key) else key


class TorchtitanNames:
    """torchtitan 0.3's names as the checkpoint layer's name adapter: a renaming, rows untouched."""

    def to_stored(self, fqn: str) -> str:
        return to_torchtitan_name(fqn)

    def from_stored(self, name: str) -> str:
        return from_torchtitan_name(name)

    def row_groups(self, fqn: str) -> None:
        return None

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def unkept_unless_zero(self, fqn: str) -> None:
        return None  # the same tensors as ours

    def zero_filled(self) -> dict:
        return {}
