"""Expert parallelism: each MoE layer's experts split over the EP ranks, tokens sent to them and back.

Every parameter of the experts' module -- the three weights, and gpt-oss's per-expert biases when
the block has them -- is a ``Shard(0)`` DTensor over the EP mesh (``ParallelDims.build_expert_mesh``),
so each EP rank holds a contiguous block of every layer's experts and a checkpoint keeps global
shapes; the experts' ``compute`` receives the local blocks by parameter name. Shared experts are
no routed expert: they stay whole on every EP rank. The token dispatcher here is the only place
the all-to-all lives; the model's MoE layer (``models.common.moe``) stays a single-process module:

1. every rank routes its own tokens (router and counts before dispatch: the balancing statistics
   stay the global batch's), sorts the (token, choice) slots by expert and calls its experts;
2. the dispatcher exchanges counts, then sends each expert's slots to the rank owning it with the
   functional collectives' ``all_to_all_single`` (uneven splits, autograd: backward is the reverse
   all-to-all; ``torch.distributed.nn.functional``'s, which torch 2.13 deprecates for it, warns at
   every run), and sorts what it received by local expert (stable: by source rank within an
   expert);
3. the local experts run, the results go back by the reverse all-to-all, in the sender's order.

A token's experts and its weighted sum are computed as in one process (the same routing, the same
order of its ``top_k`` terms); only the experts' matmuls see their rows in other batches.

Under ``training.compile`` the exchanges (2. and 3.) stay out of the graphs: their splits come to
the host, so they are ``torch.compiler.disable``-d and a compiled block's graph ends before each
and resumes after it (``parallelize.apply_compile``); the local experts between them run compiled.

Under tensor parallelism the MoE layer runs on the whole sequence on every TP rank (the TP plan
gathers it), so its slots are the same on all of them: each TP rank then dispatches only its
``1/tp`` share of them (DTensor's ``Shard(0)`` chunks of the ``Replicate`` slots), and the shares
are gathered again after the experts. Both are DTensor redistributions, whose backward gathers
the shares' gradients (and takes its share of the replicated one), so the layer's input and router
gradients stay replicated like the rest of the block's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from models.common.moe import GroupedExperts, moe_modules
from seedckpt.utils.tensors import local, local_rows


class ExpertParallel(ParallelStyle):
    """``GroupedExperts`` over the EP mesh: weights ``Shard(0)``, forward through the dispatcher.
    ``tp_mesh``: the TP ranks that share the layer's tokens (each dispatches a share), or None."""

    def __init__(self, tp_mesh: DeviceMesh | None = None):
        super().__init__()
        self.tp_mesh = tp_mesh

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            # local: under TP the plan made the experts replicated DTensors; src_data_rank=None: no data moved
            sharded = distribute_tensor(local(param).detach(), device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        # the module's own forward, replaced: its weights are DTensors, the dispatched tokens plain
        module.forward = functools.partial(dispatched_forward, module, device_mesh, self.tp_mesh)
        return module


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> None:
    """Every MoE layer of a (stage) model, on ``meta`` or materialized."""
    for layer in moe_modules(model):
        parallelize_module(layer.experts, ep_mesh, ExpertParallel(tp_mesh))


def dispatched_forward(
    experts: GroupedExperts, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``GroupedExperts.forward`` under EP: ``x`` (slots, dim) sorted by expert, ``counts`` (experts,)
    slots per expert -> the experts' outputs for ``x``, in its order."""
    slots = x.shape[0]
    if tp_mesh is not None:
        x, counts = _tp_share(x, counts, tp_mesh)
    received, local_counts, route = _dispatch(x, counts, ep_mesh)
    out = experts.compute(received, local_counts, **{n: local(w) for n, w in experts.named_parameters()})
    out = _combine(out, route, ep_mesh)
    return out if tp_mesh is None else _tp_gather(out, slots, tp_mesh)


@dataclass(frozen=True)
class _Route:
    """How one call's slots travelled: the rows sent to and received from each EP rank, and the
    permutation that sorted the received rows by local expert."""

    sent: list[int]
    received: list[int]
    order: torch.Tensor


@torch.compiler.disable  # host-synced splits: a compiled block's graph ends before and resumes after
def _dispatch(x: torch.Tensor, counts: torch.Tensor, ep_mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor, _Route]:
    """Send each expert's slots to the EP rank that owns it (experts ``[r * n, (r + 1) * n)`` on EP
    rank ``r``: a contiguous run of the expert-sorted slots); return the received slots sorted by
    local expert, the slots per local expert, and the route back. The received rows change in
    number with every call: marked dynamic, so the compiled experts after this take any count (left
    to dynamo, they compile again at the second call, the tiny model's second MoE layer)."""
    group = ep_mesh.get_group()
    ep = group.size()
    send = counts.reshape(ep, -1)  # (destination rank, its local experts)
    recv = torch.empty_like(send)  # (source rank, my local experts)
    dist.all_to_all_single(recv, send, group=group)
    sent, received = send.sum(1).tolist(), recv.sum(1).tolist()  # a host sync: the splits size the exchange
    rows = all_to_all_single(x.contiguous(), received, sent, group)
    local_experts = torch.arange(send.shape[1], device=x.device).repeat(ep)
    order = local_experts.repeat_interleave(recv.flatten()).argsort(stable=True)
    received_rows = rows[order]
    torch._dynamo.maybe_mark_dynamic(received_rows, 0)
    return received_rows, recv.sum(0), _Route(sent, received, order)


@torch.compiler.disable
def _combine(out: torch.Tensor, route: _Route, ep_mesh: DeviceMesh) -> torch.Tensor:
    """The inverse of ``_dispatch``: the experts' outputs back to the ranks (and slots) they came from.
    Waited for here: handed on unwaited (an ``AsyncCollectiveTensor``), it hung the compile of the
    graph after it, which waits on its inputs (dp_shard2 x ep2 with full AC on gloo, torch 2.13)."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    back = all_to_all_single(out[inverse].contiguous(), route.sent, route.received, ep_mesh.get_group())
    return wait_tensor(back)


def _tp_share(x: torch.Tensor, counts: torch.Tensor, tp_mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's chunk of the slots every TP rank holds, and its slots per expert."""
    share = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)])
    lo, hi = local_rows(share)
    expert_of_slot = torch.repeat_interleave(counts)[lo:hi]
    return share.to_local(), torch.bincount(expert_of_slot, minlength=counts.numel())


def _tp_gather(out: torch.Tensor, slots: int, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The inverse of ``_tp_share``: every TP rank's chunk of the ``slots`` outputs, on every TP rank."""
    shape = (slots, out.shape[1])
    chunks = DTensor.from_local(out, tp_mesh, [Shard(0)], run_check=False, shape=shape, stride=(shape[1], 1))
    return chunks.redistribute(tp_mesh, [Replicate()]).to_local()
