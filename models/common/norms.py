"""The decoder's RMSNorms: torch's, whose weight is the scale, and Gemma's, whose scale is ``1 + weight``.

Gemma's norm (``OffsetRMSNorm``) stores the scale's offset from one, so a zero weight is the identity
and its init is zeros where torch's is ones; it computes in float32 whatever the input's dtype and
rounds once, at the end (a ``1 + w`` rounded to bfloat16 would lose w's low bits: next to one,
bfloat16's values are 2^-7 apart, so any |w| below 2^-8 would vanish). Both compute ``x / sqrt(mean(x^2) + eps)``.
``rms_norm`` builds the one a model's options ask for and ``init_norm`` sets either to its identity,
so the decoder names no kind of norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, in float32 (Gemma's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rms_norm(dim: int, eps: float, offset: bool = False) -> nn.Module:
    """An RMSNorm over ``dim`` features: scaled by ``1 + weight`` (``offset``) or by ``weight``."""
    return OffsetRMSNorm(dim, eps) if offset else nn.RMSNorm(dim, eps=eps)


def init_norm(init, norm: nn.Module) -> None:
    """Set ``norm``'s weight to its identity scale: zeros for ``1 + weight``, ones for torch's."""
    (init.zeros_ if isinstance(norm, OffsetRMSNorm) else init.ones_)(norm.weight)
