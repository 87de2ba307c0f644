"""DeepSeek-V3's tensor-parallel plan: the shared decoder's (``models.common.tensor_parallel``: the
embedding and output by vocabulary, the norms, the dense layers and the shared experts split as a
dense feed-forward, the routed experts whole or expert-parallel) with multi-head latent attention's
own entries.

Split by heads, whole heads per rank: the up projections ``wq`` (without a low-rank query) or
``wq_b``, and ``wkv_b``, colwise (a rank holds its heads' rows); ``wo`` rowwise (their columns),
its output reduced as the decoder's is.

Replicated, whole on every TP rank (as replicated DTensors, so every parameter lives on the same
mesh): the down projections ``wq_a`` and ``wkv_a`` and their norms ``q_norm`` and ``kv_norm``. Their
outputs are latents that every head reads -- there are no heads in them to split -- and they are
the small matrices (671B: 7168 x 1536 and 7168 x 576 against 1536 x 24576 and 512 x 32768). Each
rank computes them on the whole sequence.

One gradient needs the plan's help. ``wkv_a``'s last ``qk_rope_head_dim`` outputs are the RoPE key
every head shares; a rank's heads are some of them, so the gradient that reaches that key on a rank
is its heads' part only. ``SharedKeyGradient`` sums it over the TP ranks in backward. The other
paths into the replicated projections are summed by the colwise projections' own backward (a
replicated input's gradient is all-reduced), so each replicated weight gets the same, whole
gradient on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_reduce
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from models.common.tensor_parallel import (
    ReplicatedParameters,
    parallelize_decoder,
    tensor_parallel_sizes,
    tensor_parallel_splits,
)
from models.family import TensorParallelPlan


class _SumSharedKeyGradient(torch.autograd.Function):
    """Identity on ``wkv_a``'s output; in backward, its last ``rope_dim`` columns' gradient summed
    over ``group`` (each rank's heads gave their part of it)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, rope_dim: int, group) -> torch.Tensor:
        ctx.rope_dim, ctx.group = rope_dim, group
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        latent, key = grad.split([grad.shape[-1] - ctx.rope_dim, ctx.rope_dim], dim=-1)
        return torch.cat([latent, all_reduce(key.contiguous(), "sum", ctx.group)], dim=-1), None, None


class SharedKeyGradient(ParallelStyle):
    """``wkv_a``: replicated weights (``ReplicatedParameters``) whose output's shared-key columns
    have their gradient summed over the TP ranks."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = ReplicatedParameters()._apply(module, device_mesh)
        group = device_mesh.get_group()
        module.register_forward_hook(lambda _, __, out: _SumSharedKeyGradient.apply(out, self.rope_dim, group))
        return module


def mla_plan(attention: nn.Module, between) -> dict:
    """The attention entries of one block's plan (keys relative to the block)."""
    low_rank = hasattr(attention, "wq_a")
    query = {"attention.wq_a": ReplicatedParameters(), "attention.q_norm": ReplicatedParameters()} if low_rank else {}
    return {
        # the block's input gathered to the whole sequence, as plain tensors: the styles below take them
        "attention": PrepareModuleInput(
            input_layouts=(between, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        ),
        **query,
        "attention.wq_b" if low_rank else "attention.wq": ColwiseParallel(),
        "attention.wkv_a": SharedKeyGradient(attention.rope_dim),
        "attention.kv_norm": ReplicatedParameters(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
    }


def _splits(fqn: str) -> bool:
    return tensor_parallel_splits(fqn) or fqn.split(".")[-2:-1] in (["wq_b"], ["wkv_b"])


MLA_TENSOR_PARALLEL = TensorParallelPlan(
    lambda model, mesh, sequence_parallel: parallelize_decoder(model, mesh, sequence_parallel, mla_plan),
    tensor_parallel_sizes,
    _splits,
)
