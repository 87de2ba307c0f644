"""The decoder's RMSNorms: torch's, whose weight is the scale, and Gemma's, whose scale is ``1 + weight``.

Gemma's norm (``OffsetRMSNorm``) stores the scale's offset from one, so a zero weight is the identity
and its init is zeros where torch's is ones; it computes in float32 at least (``upcast``: a float64
model's in float64, within 1e-12 of the exact norm where float32 gave 3e-7) and rounds once, at the
end (a ``1 + w`` rounded to bfloat16 would lose w's low bits: next to one, bfloat16's values are 2^-7
apart, so any |w| below 2^-8 would vanish). Both compute ``x / sqrt(mean(x^2) + eps)``.
``rms_norm`` builds the one a model's options ask for and ``init_norm`` sets either to its identity,
so the decoder names no kind of norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, in float32 at least (Gemma's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + upcast(self.weight))).type_as(x)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least: bfloat16 and float16 computed in float32, float64 kept, so a float64
    model's norms compute in float64 (RoPE and the router still round to float32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(dim: int, eps: float, offset: bool = False) -> nn.Module:
    """An RMSNorm over ``dim`` features: scaled by ``1 + weight`` (``offset``) or by ``weight``."""
    return OffsetRMSNorm(dim, eps) if offset else nn.RMSNorm(dim, eps=eps)


def init_norm(init, norm: nn.Module) -> None:
    """Set ``norm``'s weight to its identity scale: zeros for ``1 + weight``, ones for torch's."""
    (init.zeros_ if isinstance(norm, OffsetRMSNorm) else init.ones_)(norm.weight)
