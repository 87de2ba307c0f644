"""``resolve``: a loaded job config, fitted once to its world and its checkpoints.

``load_config`` returns a frozen config: what the files and the command line say. What a run is
made of also depends on the world size (``data_parallel_shard_degree = -1``, the layout checks), on
the pretrained checkpoint (fine-tuning's model shape and vocabulary) and on what the checkpoint
folder holds (where to start), and where the ranks run on the GPUs this machine has (``job.device``).
``resolve`` works that out in one place, before any process group, for ``train.py``, ``seedckpt
plan`` and ``seedckpt seed``; nothing changes the config afterwards.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from models.family import ModelFamily
from seedckpt.checkpoint import OpenedCheckpoint
from seedckpt.config.job_config import JobConfig
from seedckpt.finetune.pretrained import finetune_model
from seedckpt.materialize.stages import indexable_sizes
from seedckpt.materialize.start import Start, find_start
from seedckpt.parallel.parallelize import ParallelDims
from seedckpt.utils.errors import SeedckptError


@dataclass(frozen=True)
class ResolvedRun:
    """A config resolved: the model (family and args), the parallel layout, the device type every rank
    trains on and, for a training run, where it starts. ``notes``: lines for the run log (the
    fine-tuned model's shape)."""

    cfg: JobConfig
    family: ModelFamily
    args: object  # the family's args: the flavor and [model] keys, or the pretrained checkpoint's
    dims: ParallelDims
    device: str  # "cuda" (rank i of a machine on cuda:i, nccl) or "cpu" (gloo)
    start: Start | None = None
    notes: tuple[str, ...] = ()
    pretrained: OpenedCheckpoint | None = None  # fine-tuning: finetune.pretrained, opened once

    def with_start(self) -> ResolvedRun:
        """This run with where it starts: the checkpoint folder's newest ``step-N``, the pretrained
        weights or the seed, opened once (``start.find_start``). A training run calls it under the
        folder's lock, after the config's own checks have passed. A resume keeps its checkpoint's
        global batch (``keep_global_batch``)."""
        start = find_start(self.cfg, self.args, self.pretrained)
        cfg, note = keep_global_batch(self.cfg, self.dims, start)
        return replace(self, cfg=cfg, start=start, notes=self.notes + start.notes + ((note,) if note else ()))


def keep_global_batch(cfg: JobConfig, dims: ParallelDims, start: Start) -> tuple[JobConfig, str | None]:
    """A resume on another data-parallel degree, whose config leaves ``training.global_batch_size``
    at -1, would change the global batch (local batch x DP ranks), and with it the run. It keeps the
    one its ``step-N`` records instead: the local batch, or gradient accumulation, is derived. The
    config and a line for the log; the config unchanged when there is nothing to keep."""
    recorded = (start.checkpoint.manifest or {}).get("global_batch") if start.step else None
    train = cfg.training
    per_step = train.local_batch_size * dims.dp
    if not isinstance(recorded, int) or train.global_batch_size != -1 or recorded == per_step:
        return cfg, None
    if recorded % per_step == 0:
        local = train.local_batch_size
    elif recorded % dims.dp == 0:
        local = recorded // dims.dp
    else:
        raise SeedckptError(
            f"{start.path} was trained with a global batch of {recorded} sequences, which {dims.dp} data-parallel "
            "ranks cannot split evenly; resume on a data-parallel degree that divides it, or set "
            "training.global_batch_size (which changes the run)"
        )
    kept = replace(cfg, training=replace(train, global_batch_size=recorded, local_batch_size=local))
    return kept, (
        f"keeping {start.path.name}'s global batch of {recorded} sequences on {dims.dp} data-parallel rank(s): "
        f"local_batch_size {local} x {recorded // (local * dims.dp)} accumulation step(s) "
        "(set training.global_batch_size to change it)"
    )


def default_world_size(cfg: JobConfig) -> int:
    """The smallest world the config's degrees describe (``seedckpt plan`` without ``--world-size``):
    ``data_parallel_shard_degree = -1`` counts as the least shard degree that lets the expert-parallel
    degree divide ``dp_shard x tp`` (1 without experts)."""
    par = cfg.parallelism
    tp, ep = par.tensor_parallel_degree, par.expert_parallel_degree
    shard = par.data_parallel_shard_degree if par.data_parallel_shard_degree > 0 else ep // math.gcd(ep, tp)
    return par.pipeline_parallel_degree * par.data_parallel_replicate_degree * shard * tp


def choose_device(requested: str, local_ranks: int, gpus: int) -> str:
    """``job.device`` for ``local_ranks`` processes on a machine with ``gpus`` visible GPUs.

    Each rank of a CUDA run takes ``cuda:LOCAL_RANK``, so more ranks than GPUs would fail inside the
    first collective ("invalid device ordinal") on one rank after the rendezvous; here it is one line
    before it. ``local_ranks = 0``: no rank is placed here (``seedckpt plan`` / ``seed`` only
    describe a run), so nothing is checked -- ``auto`` still says what this machine would choose."""
    device = ("cuda" if gpus else "cpu") if requested == "auto" else requested
    if device == "cuda" and local_ranks:
        if not gpus:
            raise SeedckptError(
                "job.device = 'cuda' but torch sees no CUDA device on this machine; use "
                "--job.device cpu (or auto), or run on a machine with a GPU"
            )
        if local_ranks > gpus:
            raise SeedckptError(
                f"{local_ranks} ranks on this machine but only {gpus} visible GPU(s): each rank "
                f"needs its own; launch with --nproc-per-node {gpus}, or use --job.device cpu"
            )
    return device


def resolve(cfg: JobConfig, world_size: int, local_world_size: int | None = None) -> ResolvedRun:
    """Model args, parallel dims and device (a training run adds its start: ``ResolvedRun.with_start``), each
    checked; every failure is one ``SeedckptError`` naming the key to change. Reads only metadata.

    ``local_world_size``: the ranks on this machine (default: torchrun's ``LOCAL_WORLD_SIZE``, 1 for
    a plain ``python train.py``); 0 for a command that places no rank (see ``choose_device``)."""
    finetune = finetune_model(cfg)  # a fine-tune's family is its pretrained checkpoint's (``load_config``)
    args, notes, pretrained = finetune if finetune else (cfg.model_args(), (), None)
    with indexable_sizes(args):  # the pipeline split's costs build the model on meta
        dims = ParallelDims.from_config(cfg, world_size, args)
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = choose_device(cfg.job.device, local_world_size, torch.cuda.device_count())
    return ResolvedRun(cfg, cfg.model_family(), args, dims, device, notes=notes, pretrained=pretrained)
