"""Data parallelism behind one interface: FSDP2 (``fully_shard``, the default) or manual FSDP
(``parallelism.fsdp_impl = "manual"``, ``manual_fsdp.FlatShardedModel``).

The trainer never asks which one runs. It calls, in order:

1. ``shard_on_meta(module)`` while the stage is still on ``meta`` (``stages.build_stages``'s
   ``shard_fn``): FSDP2 shards here, so each rank materializes and loads only its shards;
2. ``wrap_loaded(modules)`` once every tensor has its value: manual FSDP flattens each stage here,
   each rank copying its shard out of the loaded, unsharded stage;

and then, each step: ``parameters(i)`` is what stage ``i``'s optimizer steps and clipping sees,
``sync_gradients()`` runs after the last backward and before clipping, ``grad_norm_group`` is the
group clipping sums the squared norm over. For checkpoints, ``model_state_dict(i)`` and
``optimizer_state_dict(i, ...)`` / ``load_optimizer_state_dict(i, ...)`` use FSDP2's keys (the
optimizer's flattened: ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), so a checkpoint of
either implementation resumes the other. ``stage_group()`` names the ranks that hold the same
stages (OSFT's distributed SVD runs across them).

Collective timing (``metrics.collective_timing``) -- on by default only where it costs nothing:
manual FSDP issues its two collectives itself, so timing them is two clock reads a call (``auto``:
on). FSDP2 issues its own inside its hooks; timing them means replacing its comms through
``set_custom_all_gather`` / ``set_custom_reduce_scatter``, whose interfaces torch 2.13 defines only
in the private ``_fsdp_api`` module and which take FSDP2 off its default (and future optimized)
paths (``auto``: off). ``on`` times both, ``off`` neither. Untimed, ``collectives`` is ``None`` and
the metrics rows carry no collective columns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh

from seedckpt.config.job_config import DTYPES, JobConfig
from seedckpt.parallel.collectives import CollectiveTimes, time_fsdp2_collectives
from seedckpt.parallel.manual_fsdp import FlatShardedModel
from seedckpt.parallel.parallelize import ParallelDims, apply_fsdp, reshard_after_forward

# FSDP2's optimizer state dict with one key per parameter FQN: the checkpoint layout of both implementations.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class DataParallel(ABC):
    """This rank's stage modules sharded over its data-parallel ranks (see the module docstring)."""

    timed_by_default: ClassVar[bool]  # what metrics.collective_timing = "auto" means for this implementation
    log_label: ClassVar[str] = ""  # how the run log names it, after the mesh

    def __init__(self, cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None):
        self.dims, self.mesh, self.expert_mesh = dims, mesh, expert_mesh
        train = cfg.training
        self.param_dtype, self.reduce_dtype = DTYPES[train.mixed_precision_param], DTYPES[train.mixed_precision_reduce]
        timing = cfg.metrics.collective_timing
        timed = timing == "on" or (timing == "auto" and self.timed_by_default)
        # This rank's all-gathers and reduce-scatters, per step (the trainer resets and logs them).
        self.collectives = CollectiveTimes() if timed else None
        self.modules: list[nn.Module] = []

    def shard_on_meta(self, module: nn.Module) -> None:
        """Shard a stage module before it is materialized (nothing by default)."""

    def wrap_loaded(self, modules: list[nn.Module]) -> None:
        """Take over the stage modules once every tensor has its value."""
        self.modules = modules

    def stage_group(self):
        """The ranks that hold this rank's stages (its DP group), or None on one DP rank."""
        if self.dims.dp == 1:
            return None
        if self.dims.dp_replicate == 1:
            return self.mesh["dp_shard"].get_group()
        return self.mesh["dp_replicate", "dp_shard"]._flatten().get_group()

    @abstractmethod
    def parameters(self, stage: int) -> list[nn.Parameter]:
        """What stage ``stage``'s optimizer steps and gradient clipping counts."""

    def sync_gradients(self) -> None:
        """Finish the gradients once per optimizer step, after the last backward (nothing by default)."""

    @property
    def grad_norm_group(self):
        """The group the gradient norm's squares are summed over, or None where the gradients
        (DTensors) carry their mesh."""
        return None

    @abstractmethod
    def model_state_dict(self, stage: int) -> dict:
        """Stage ``stage``'s model state for a checkpoint: its state-dict keys (collective)."""

    @abstractmethod
    def optimizer_state_dict(self, stage: int, optimizer: torch.optim.Optimizer) -> dict:
        """Stage ``stage``'s optimizer state in FSDP2's flattened keys (collective)."""

    @abstractmethod
    def load_optimizer_state_dict(self, stage: int, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """The inverse of ``optimizer_state_dict``."""


class FSDP2(DataParallel):
    """``fully_shard`` per transformer block and the root, over ``dp_shard`` (or HSDP over
    ``(dp_replicate, dp_shard)``), carrying mixed precision. On one DP rank in float32 it is not
    applied at all: there is nothing to shard and nothing to cast. Under expert parallelism each
    MoE layer's experts are sharded over ``efsdp`` (HSDP: ``(dp_replicate, efsdp)``) of the
    experts' mesh instead: the ranks that hold the same experts."""

    timed_by_default = False  # timing replaces FSDP2's comms through the private _fsdp_api interfaces

    def __init__(self, cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None):
        super().__init__(cfg, dims, mesh, expert_mesh)
        self.applied = dims.dp > 1 or (self.param_dtype, self.reduce_dtype) != (torch.float32, torch.float32)
        self.reshard_after_forward = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp)

    def shard_on_meta(self, module: nn.Module) -> None:
        if not self.applied:
            return
        apply_fsdp(
            module,
            self._data_parallel_mesh(self.mesh, "dp_shard"),
            self.param_dtype,
            self.reduce_dtype,
            self.reshard_after_forward,
            None if self.expert_mesh is None else self._data_parallel_mesh(self.expert_mesh, "efsdp"),
            self.dims.dp,
        )
        if self.collectives is not None:
            time_fsdp2_collectives(module, self.collectives)

    def _data_parallel_mesh(self, mesh: DeviceMesh, shard: str) -> DeviceMesh:
        """``mesh``'s ``shard`` dimension, with ``dp_replicate`` before it for HSDP."""
        return mesh["dp_replicate", shard] if self.dims.dp_replicate > 1 else mesh[shard]

    def parameters(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.modules[stage].parameters() if p.requires_grad]  # OSFT freezes some

    def model_state_dict(self, stage: int) -> dict:
        return self.modules[stage].state_dict()  # DTensors: DCP writes each shard once

    def optimizer_state_dict(self, stage: int, optimizer: torch.optim.Optimizer) -> dict:
        return get_optimizer_state_dict(self.modules[stage], optimizer, options=OPTIM_OPTIONS)

    def load_optimizer_state_dict(self, stage: int, optimizer: torch.optim.Optimizer, state: dict) -> None:
        set_optimizer_state_dict(self.modules[stage], optimizer, state, options=OPTIM_OPTIONS)


class ManualFSDP(DataParallel):
    """One ``FlatShardedModel`` per stage over ``dp_shard``: data parallelism only, every parameter
    trainable (``config`` refuses other layouts before any rendezvous)."""

    timed_by_default = True  # its own two calls: a pair of clock reads each
    log_label = " with manual FSDP"

    def __init__(self, cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh, expert_mesh: None = None):
        super().__init__(cfg, dims, mesh)
        self.group = mesh["dp_shard"].get_group()
        self.flat: list[FlatShardedModel] = []

    def wrap_loaded(self, modules: list[nn.Module]) -> None:
        super().wrap_loaded(modules)
        self.flat = [
            FlatShardedModel(m, self.group, self.param_dtype, self.reduce_dtype, self.collectives) for m in modules
        ]

    def parameters(self, stage: int) -> list[nn.Parameter]:
        return [self.flat[stage].shard]

    def sync_gradients(self) -> None:
        for flat in self.flat:  # one reduce-scatter per optimizer step, not per micro-batch
            flat.sync_gradients()

    @property
    def grad_norm_group(self):
        return self.group  # plain shards: the norm's squares are summed over the DP ranks

    def model_state_dict(self, stage: int) -> dict:
        return self.flat[stage].full_state_dict()  # full tensors on every rank, DCP writes each once

    def optimizer_state_dict(self, stage: int, optimizer: torch.optim.Optimizer) -> dict:
        return self.flat[stage].optimizer_state_dict(optimizer)

    def load_optimizer_state_dict(self, stage: int, optimizer: torch.optim.Optimizer, state: dict) -> None:
        self.flat[stage].load_optimizer_state_dict(optimizer, state)


def make_data_parallel(
    cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None
) -> DataParallel:
    """The implementation ``parallelism.fsdp_impl`` names (``expert_mesh``: ``ParallelDims.build_expert_mesh``'s)."""
    return (ManualFSDP if cfg.parallelism.fsdp_impl == "manual" else FSDP2)(cfg, dims, mesh, expert_mesh)
