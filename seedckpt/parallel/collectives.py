"""Per-step telemetry of the data-parallel collectives, for FSDP2 and manual FSDP alike.

``CollectiveTimes`` counts the all-gathers and reduce-scatters a rank issues and the host wall time
spent in them; the trainer zeroes it at the start of every step and logs it beside step time, data
wait and peak memory -- when ``metrics.collective_timing`` asks for it (``data_parallel`` says what
``auto`` means). Manual FSDP adds to it around its own calls. FSDP2 issues its collectives
inside its hooks, so ``time_fsdp2_collectives`` swaps in its public extension point for custom
communication (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``) with comms
that call the same ``torch.distributed`` functions as FSDP2's defaults, timed.

What the seconds mean: host wall time. On gloo a collective blocks the calling thread, so they
are the collective's duration; on nccl they are the launch only (the work runs on a stream) unless
the device is synchronized. HSDP's all-reduce across replicas is FSDP2's own and not counted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# The interfaces FSDPModule.set_custom_all_gather / set_custom_reduce_scatter take (torch 2.13
# defines them in this module and exports no other name for them).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# torch 2.13 names the single-tensor collectives all_gather_single / reduce_scatter_single and
# deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on every call); older
# torch (2.11 on the GPU images) has only the old names, which take the same arguments.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveTimes:
    all_gather_calls: int = 0
    all_gather_s: float = 0.0
    reduce_scatter_calls: int = 0
    reduce_scatter_s: float = 0.0

    def reset(self) -> None:
        self.all_gather_calls = self.reduce_scatter_calls = 0
        self.all_gather_s = self.reduce_scatter_s = 0.0

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
        start = time.perf_counter()
        work = all_gather_single(output, input, group=group, async_op=async_op)
        self.all_gather_s += time.perf_counter() - start
        self.all_gather_calls += 1
        return work

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False
    ):
        start = time.perf_counter()
        work = reduce_scatter_single(output, input, group=group, op=op, async_op=async_op)
        self.reduce_scatter_s += time.perf_counter() - start
        self.reduce_scatter_calls += 1
        return work


class _Allocate:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)  # as FSDP2's default comms allocate


class _TimedAllGather(_Allocate, AllGather):
    def __init__(self, times: CollectiveTimes):
        self.times = times

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return self.times.all_gather(output_tensor, input_tensor, group, async_op)


class _TimedReduceScatter(_Allocate, ReduceScatter):
    def __init__(self, times: CollectiveTimes):
        self.times = times

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return self.times.reduce_scatter(output_tensor, input_tensor, group, op, async_op)


def time_fsdp2_collectives(model: nn.Module, times: CollectiveTimes) -> None:
    """Count and time the all-gathers and reduce-scatters of every ``fully_shard``-ed module in ``model``."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_TimedAllGather(times))
            module.set_custom_reduce_scatter(_TimedReduceScatter(times))
