"""Gemma 4's tensor-parallel plan: the shared decoder's (``models.common.tensor_parallel``) for
attention, the MLP, the norms and the embeddings, and for what Gemma 4 adds:

* the per-layer inputs (``per_layer_inputs``) and each block's gate on them (``per_layer``) run
  whole on every TP rank on the whole sequence, their parameters replicated (``LocalForward``), as a
  mixture of experts runs: the table is looked up by token, and the gate's input is a layer's
  ``per_layer_dim``-wide slice (256) -- too narrow to split usefully. Under sequence parallelism
  their inputs are gathered and their outputs split along the sequence again, so the per-layer
  inputs travel beside the hidden state in the same layout;
* a kv-shared layer's attention is a plain layer's without ``wk``/``wv``: the keys and values it
  reuses are the ones the same TP rank computed for its own heads;
* a block with experts runs the MLP as a dense layer (split) and the mixture whole (or over the
  expert-parallel ranks), its three output norms as the sandwich norms are.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInputOutput,
    SequenceParallel,
    parallelize_module,
)

from models.common.tensor_parallel import (
    LocalForward,
    ReplicatedParameters,
    _attention_plan,
    _dense_ffn_plan,
    parallelize_decoder,
    tensor_parallel_sizes,
    tensor_parallel_splits,
)
from models.family import TensorParallelPlan

MOE_NORMS = ("post_mlp_norm", "post_moe_norm")


def _whole(module, mesh, between, inputs: tuple) -> None:
    """Run ``module`` whole on every TP rank: its inputs (laid out as ``inputs``) gathered, its
    parameters replicated, its output split back as the residual stream is."""
    parallelize_module(module, mesh, LocalForward())
    style = PrepareModuleInputOutput(
        input_layouts=inputs,
        desired_input_layouts=(Replicate(),) * len(inputs),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(between,),
    )
    parallelize_module(module, mesh, style)


def _attention(attention, between) -> dict:
    plan = _attention_plan(attention, between)
    if attention.wk is None:  # kv-shared: no keys or values of its own
        del plan["attention.wk"], plan["attention.wv"], plan["attention.k_norm"]
    elif attention.wv is None:  # values are the keys' projection
        del plan["attention.wv"]
    return plan


def parallelize(model, mesh, sequence_parallel: bool) -> None:
    between = Shard(1) if sequence_parallel else Replicate()
    post_norm = SequenceParallel(use_local_output=True) if sequence_parallel else ReplicatedParameters()
    if model.per_layer_inputs is not None:  # the token ids are whole on every rank
        _whole(model.per_layer_inputs, mesh, between, (Replicate(), between))
    parallelize_decoder(model, mesh, sequence_parallel, attention_plan=_attention)
    for block in model.layers.values():
        if block.moe is not None:  # the decoder's plan ran the mixture; the MLP beside it is a dense layer's
            parallelize_module(block, mesh, {**_dense_ffn_plan(between), **{n: post_norm for n in MOE_NORMS}})
        if block.per_layer is not None:
            _whole(block.per_layer, mesh, between, (between, between))
        if block.moe is not None:
            parallelize_module(block.moe.expert_norm, mesh, LocalForward())


def sizes(args) -> dict[str, int]:
    """The decoder's, the global layers' key/value heads and the MLP's width (beside any experts)."""
    return {
        **tensor_parallel_sizes(args),
        "model.global_kv_heads": args.global_kv_heads,
        "the feed-forward width": args.ffn_dim,
    }


GEMMA4_TENSOR_PARALLEL = TensorParallelPlan(parallelize, sizes, tensor_parallel_splits)
