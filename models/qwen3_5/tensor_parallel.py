"""Qwen3.5's tensor-parallel plan: the shared decoder's (``models.common.tensor_parallel``), with the
Gated DeltaNet layers split by heads.

A linear layer's projections are split by output rows (colwise): ``in_proj_qkv``'s rows are grouped
by key head (``models.common.gated_deltanet``), so a rank's slice is whole key heads with their q,
k and value heads, and ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` give it those value heads' gate,
write strength and decay; the convolution's channels, ``A_log`` and ``dt_bias`` are split with them
(``HeadParameter``). Each rank runs the rule on its own heads -- no communication inside the layer --
and ``out_proj`` is split by input features (rowwise), one reduction per layer as attention's ``wo``.
The per-head norm sees the rank's heads, as Qwen3's q/k norms do. The full-attention layers are the
decoder's plan (``wq``'s slice holds whole heads with their gates).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from models.common.gated_deltanet import GatedDeltaNet
from models.common.tensor_parallel import (
    HeadParameter,
    _attention_plan,
    parallelize_decoder,
    tensor_parallel_sizes,
    tensor_parallel_splits,
)
from models.family import TensorParallelPlan

LINEAR_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d")
HEAD_PARAMETERS = ("A_log", "dt_bias")


def _plan(attention, between) -> dict:
    if not isinstance(attention, GatedDeltaNet):
        return _attention_plan(attention, between)
    return {
        "attention": PrepareModuleInput(
            input_layouts=(between, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        **{f"attention.{name}": ColwiseParallel() for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
        "attention.conv1d": HeadParameter("weight"),
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),  # per head, this rank's
        "attention.out_proj": RowwiseParallel(output_layouts=between),
    }


def parallelize(model, mesh, sequence_parallel: bool) -> None:
    parallelize_decoder(model, mesh, sequence_parallel, attention_plan=_plan)
    for block in model.layers.values():
        if isinstance(block.attention, GatedDeltaNet):
            for name in HEAD_PARAMETERS:
                parallelize_module(block.attention, mesh, HeadParameter(name))


def sizes(args) -> dict[str, int]:
    """The decoder's, and the linear layers' key heads (their value heads are a multiple)."""
    return {**tensor_parallel_sizes(args), "model.linear_num_key_heads": args.linear_num_key_heads}


def splits(fqn: str) -> bool:
    parts = fqn.split(".")
    if len(parts) > 2 and parts[-2] == "attention" and parts[-1] in HEAD_PARAMETERS:
        return True
    return (len(parts) > 1 and parts[-2] in LINEAR_SPLIT) or tensor_parallel_splits(fqn)


QWEN3_5_TENSOR_PARALLEL = TensorParallelPlan(parallelize, sizes, splits)
