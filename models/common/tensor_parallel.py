"""The shared decoder's tensor-parallel plan (Megatron's split, written with ``parallelize_module``).

Inside a block, q/k/v and the feed-forward's gate and up projections (``w1``, ``w3``) are split by
output features (colwise: each rank holds some heads, and some of the hidden width), ``wo`` and
``w2`` by input features (rowwise), so each block costs one all-reduce (or, with sequence
parallelism, one all-gather and one reduce-scatter) per projection pair and no rank holds a full
matrix. The embedding and the output projection are split by vocabulary row, and the output's
logits stay split along the vocabulary for a loss-parallel cross-entropy: no rank ever holds a
token's full-vocabulary logits.

Sequence parallelism (on by default with TP): between the projections, the residual stream, the
norms and the embedding's output are split along the sequence, so their activations and the norms'
work are divided by the TP degree instead of repeated. Off, the norms' weights are still DTensors
(replicated), so every parameter lives on the same mesh and the gradient norm is one reduction.
Gemma's sandwich norms, on the branches' outputs (``POST_NORMS``), are split along the sequence too.

Qwen3's per-head q/k norms see each rank's own heads: they run as "sequence parallel" along the
head dimension, which is exactly a per-head norm on the local heads. Qwen2's q/k/v biases are split
with their weights by ``ColwiseParallel``; gpt-oss's ``wo`` bias stays whole (``RowwiseParallel``
adds it once, after the reduction) and its per-head sinks are split with the heads
(``HeadParameter``). A mixture-of-experts layer (Qwen3-MoE, Mixtral) is not
split: it runs whole on every TP rank on the whole sequence (``_moe_plan``), unless expert
parallelism spreads its experts over the TP ranks; only its shared experts (DeepSeek-V3), a dense
SwiGLU, are split as the dense feed-forward is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from models.family import TensorParallelPlan


class ReplicatedParameters(ParallelStyle):
    """A module run whole on every TP rank, its parameters replicated DTensors: plain tensors in and
    out, and each parameter's gradient summed over the mesh by DTensor's backward like every other."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            _replicate_parameters,
            input_fn=lambda _, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor) else x
                for x in inputs
            ),
            output_fn=lambda _, output, mesh: output.to_local(),
        )


class LocalForward(ParallelStyle):
    """A module run whole on every TP rank on plain tensors: its parameters are replicated DTensors,
    as ``ReplicatedParameters``' are (one kind of tensor for the optimizer and the gradient norm;
    every TP rank computes the same gradient), but its forward sees their local tensors -- the
    router's sort and the experts' grouped GEMM have no DTensor rules. The swap is FSDP2's own way
    of registering its unsharded parameters for a forward, undone after it; the gradient reaches
    each DTensor through ``to_local``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, _replicate_parameters)
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

        def to_local(module, _inputs):
            for owner in module.modules():
                for name, param in owner._parameters.items():
                    if isinstance(param, DTensor):
                        swapped.append((owner, name, param))
            for owner, name, param in swapped:
                owner._parameters[name] = param.to_local()

        def restore(module, _inputs, _output):
            while swapped:
                owner, name, param = swapped.pop()
                owner._parameters[name] = param

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore)
        return module


class HeadParameter(ParallelStyle):
    """A module's own parameter ``name`` that holds one value per attention head (gpt-oss's sinks),
    split along dim 0 with the heads its rank computes, and handed to the module's forward as this
    rank's local slice; the module's other parameters are left to their own styles."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        param = module._parameters[self.name]
        sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(self.name, nn.Parameter(sharded, param.requires_grad))
        held: list[nn.Parameter] = []

        def to_local(module, _inputs):
            held.append(module._parameters[self.name])
            module._parameters[self.name] = held[-1].to_local()

        def restore(module, _inputs, _output):
            module._parameters[self.name] = held.pop()

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore)
        return module


def _replicate_parameters(_, module: nn.Module, mesh: DeviceMesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        replicated = distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))


def tensor_parallel_sizes(args) -> dict[str, int]:
    """What the TP degree must divide: heads and KV heads (whole heads per rank), the feed-forward
    width of the dense layers, if any, and the vocabulary (equal slices)."""
    dense = len(getattr(args, "moe_layers", ())) < args.n_layers  # mixtures of experts are not split
    moe = args.decoder_options.moe
    shared = moe.shared_dim if moe is not None else 0  # split like a dense layer
    return {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.n_kv_heads,
        **({"the feed-forward width": args.ffn_hidden_dim} if dense else {}),
        **({"the shared experts' width (n_shared_experts x moe_ffn_dim)": shared} if shared else {}),
        "model.vocab_size": args.vocab_size,
    }


POST_NORMS = ("post_attention_norm", "post_ffn_norm")


def parallelize_decoder(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, attention_plan=None) -> None:
    """Apply the plan to a (pipeline stage of the) decoder, on ``meta`` or materialized.
    ``attention_plan(block.attention, between)``: the block's attention entries, for a family with
    its own attention module (None: ``_attention_plan``, grouped-query attention's)."""
    norm = SequenceParallel() if sequence_parallel else ReplicatedParameters()
    # sandwich norms (Gemma's) on each branch's output, whose sum with the residual takes plain tensors
    post_norm = SequenceParallel(use_local_output=True) if sequence_parallel else ReplicatedParameters()
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None:
        top["norm"] = norm
    if model.output is not None:  # logits split by vocabulary, for the loss-parallel cross-entropy
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {
            "attention_norm": norm,
            **(attention_plan or _attention_plan)(block.attention, between),
            "ffn_norm": norm,
            **{name: post_norm for name in POST_NORMS if getattr(block, name, None) is not None},
            **(_dense_ffn_plan(between) if block.moe is None else _moe_plan(between, block.moe)),
        }
        parallelize_module(block, mesh, plan)
        if getattr(block.attention, "sinks", None) is not None:  # one per q head: split with the heads
            parallelize_module(block.attention, mesh, HeadParameter("sinks"))
    model.tie_weights()  # the plan gave the embedding and the output each a DTensor of their own


def _attention_plan(attention: nn.Module, between) -> dict:
    """Grouped-query attention: q/k/v colwise (whole heads per rank), ``wo`` rowwise."""
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(between, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
    }
    if attention.options.qk_norm:  # per head, on this rank's heads (dim 2 of (b, s, h, d))
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _dense_ffn_plan(between) -> dict:
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }


def _moe_plan(between, moe) -> dict:
    """A mixture of experts runs whole on every TP rank, on the whole sequence (plain tensors in and
    out): routing and the sequence-wise auxiliary loss need every token of a row. Its router and
    routed experts are replicated, as the norms' are. Expert parallelism, when on, then splits the
    experts (and the tokens they run) over the TP ranks too (``seedckpt.parallel.expert_parallel``).
    Shared experts (DeepSeek-V3) are a dense SwiGLU on the replicated tokens, split as the dense
    feed-forward is: ``w1``/``w3`` colwise, ``w2`` rowwise, its output all-reduced to replicated."""
    shared = {}
    if moe.shared_experts is not None:
        shared = {
            "moe.shared_experts.w1": ColwiseParallel(),
            "moe.shared_experts.w3": ColwiseParallel(),
            "moe.shared_experts.w2": RowwiseParallel(),
        }
        if moe.options.shared_gate:  # one logit per token: whole on every rank, on the replicated tokens
            shared["moe.shared_experts.gate"] = ReplicatedParameters()
    return {
        **shared,
        "moe": PrepareModuleInputOutput(
            input_layouts=(between,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(between,),
        ),
        "moe.router": LocalForward(),
        "moe.experts": LocalForward(),
    }


# The modules the plan splits; every other parameter (the norms) is whole on each TP rank, and so
# is the bias of a rowwise split (``wo``, ``w2``: added once, after the partial sums are reduced).
SPLIT_MODULES = ("tok_embeddings", "output", "wq", "wk", "wv", "wo", "w1", "w2", "w3")
ROWWISE = ("wo", "w2")


def tensor_parallel_splits(fqn: str) -> bool:
    """Whether the plan splits ``fqn`` over the TP ranks."""
    parts = fqn.split(".")
    if parts[-2:] == ["attention", "sinks"]:
        return True
    return len(parts) > 1 and parts[-2] in SPLIT_MODULES and not (parts[-1] == "bias" and parts[-2] in ROWWISE)


DECODER_TENSOR_PARALLEL = TensorParallelPlan(parallelize_decoder, tensor_parallel_sizes, tensor_parallel_splits)
