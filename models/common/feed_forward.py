"""The dense gated feed-forward: the decoder's dense layers and a mixture of experts' shared experts.

``w2(act(w1 x) * w3 x)`` with ``w1`` (gate) and ``w3`` (up) ``[hidden, dim]`` and ``w2`` (down)
``[dim, hidden]``, no biases. ``act`` is SiLU (SwiGLU) by default, or GELU in its tanh approximation
(``gelu_tanh``: GeGLU, Gemma's ``gelu_pytorch_tanh``). Its init follows ``options.init``
(``options``: any options object with ``init`` and ``init_std``, a ``DecoderOptions`` or a
``MoEOptions``): torchtitan's truncated normals (``w1`` at 0.02, ``w2``/``w3`` at the layer's
depth-scaled std) or HF's plain normal.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# Absolute bound of ``nn.init.trunc_normal_``'s defaults (a=-2, b=2), which torchtitan keeps.
TRUNC_BOUND = 2.0
# The gate's activation, by name
GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x): SwiGLU, or GeGLU (``activation``: a ``GATE_ACTIVATIONS`` name)."""

    def __init__(self, dim: int, hidden_dim: int, options, init_std: float, activation: str = "silu"):
        super().__init__()
        self.options = options
        self.init_std = init_std
        self.activation = GATE_ACTIVATIONS[activation]
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init) -> None:
        if self.options.init == "normal":
            for linear in (self.w1, self.w2, self.w3):
                init.normal_(linear.weight, std=self.options.init_std)
            return
        init.trunc_normal_(self.w1.weight, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal_(linear.weight, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))
