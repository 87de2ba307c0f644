"""``resolve``: a loaded job config, fitted once to its world and its checkpoints.

``load_config`` returns a frozen config: what the files and the command line say. What a run is
made of also depends on the world size (``data_parallel_shard_degree = -1``, the layout checks), on
the pretrained checkpoint (fine-tuning's model shape and vocabulary) and on what the checkpoint
folder holds (where to start). ``resolve`` works that out in one place, before any process group,
for ``train.py``, ``seedckpt plan`` and ``seedckpt seed``; nothing changes the config afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.spec import ModelSpec
from seedckpt.config import JobConfig
from seedckpt.finetune import finetune_model
from seedckpt.parallel import ParallelDims
from seedckpt.start import Start, find_start


@dataclass(frozen=True)
class Run:
    """A config resolved: the model (spec and args), the parallel layout and, for a training run,
    where it starts. ``notes``: lines for the run log (the fine-tuned model's shape)."""

    cfg: JobConfig
    spec: ModelSpec
    args: object  # the spec's args: the flavor and [model] keys, or the pretrained checkpoint's
    dims: ParallelDims
    start: Start | None = None
    notes: tuple[str, ...] = ()

    def with_start(self) -> Run:
        """This run with where it starts: the checkpoint folder's newest ``step-N``, the pretrained
        weights or the seed, opened once (``start.find_start``). A training run calls it under the
        folder's lock, after the config's own checks have passed."""
        return replace(self, start=find_start(self.cfg, self.args))


def default_world_size(cfg: JobConfig) -> int:
    """The world the config's degrees describe, ``data_parallel_shard_degree = -1`` counting as 1
    (``seedckpt plan`` without ``--world-size``, ``seedckpt seed``)."""
    par = cfg.parallelism
    return par.pipeline_parallel_degree * par.data_parallel_replicate_degree * max(1, par.data_parallel_shard_degree)


def resolve(cfg: JobConfig, world_size: int) -> Run:
    """Model args and parallel dims (a training run adds its start: ``Run.with_start``), each checked;
    every failure is one ``SeedckptError`` naming the key to change. Reads only metadata."""
    finetune = finetune_model(cfg)
    args, notes = (finetune[0], (finetune[1],)) if finetune else (cfg.model_args(), ())
    dims = ParallelDims.from_config(cfg, world_size, args)
    return Run(cfg, cfg.model_spec(), args, dims, notes=notes)
