"""The train state: everything a ``step-N`` checkpoint holds, and how it saves and loads itself.

That is the stage modules' weights, each stage's AdamW state, the LR schedules, this rank's RNG and
the data position (``step``; ``samples_seen`` is recorded for readers). Weights and optimizer state
go through the data-parallel implementation in FSDP2's keys (``data_parallel``), so a checkpoint
does not depend on which implementation wrote it. Saving goes through the one writer
(``write_checkpoint``: a temporary sibling, then a rename), loading through the checkpoint the run
started from (``start.Start``), already opened and validated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from seedckpt.checkpoint import TOKENIZER_DIR, Checkpoint, make_manifest, step_dir, write_checkpoint
from seedckpt.checkpoint.background import BackgroundSaver
from seedckpt.checkpoint.manifest import OPTIMIZER_PREFIX, RNG_PREFIX, TRAIN_STATE_KEY
from seedckpt.config.job_config import JobConfig
from seedckpt.data.sources import keyed_generator
from seedckpt.data.tokenizer import tokenizer_files
from seedckpt.finetune.osft import OSFTSpec, osft_record
from seedckpt.parallel.data_parallel import DataParallel
from seedckpt.utils.errors import SeedckptError


def warmup_cosine(warmup: int, total: int):
    """Linear warmup to the peak LR, then cosine decay to 10 % of it at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


# torch.optim.AdamW's keyword arguments for each optimizer.implementation.
ADAMW_KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def adamw_implementation(implementation: str, device_type: str) -> str:
    """``optimizer.implementation`` on ``device_type``, ``auto`` resolved.

    Chosen explicitly because torch's own default depends on where the parameters live (CUDA:
    foreach, CPU: for-loop) and never picks fused. ``auto`` takes fused on CUDA (the whole update
    in one kernel per group of tensors instead of one per operation; torchtitan's choice) and
    foreach on CPU, where foreach has no kernels of its own and falls back to per-tensor ops: the
    same bits as the for-loop torch ran before this option existed. Fused rounds the update
    differently, so changing the implementation changes the numbers; a resume with the same one is
    bitwise."""
    if implementation == "auto":
        return "fused" if device_type == "cuda" else "foreach"
    return implementation


class TrainState:
    """One optimizer and LR schedule per stage module, over what ``data_parallel`` has them step;
    ``step`` is the last completed optimizer step (the trainer advances it)."""

    def __init__(
        self,
        cfg: JobConfig,
        args,
        modules: list[nn.Module],
        data_parallel: DataParallel,
        step: int,
        global_batch: int,
        osft: OSFTSpec | None = None,
    ):
        self.cfg, self.args, self.osft = cfg, args, osft
        self.modules, self.data_parallel = modules, data_parallel
        self.step, self.global_batch = step, global_batch
        self.rng_key = f"{RNG_PREFIX}rank{dist.get_rank()}"
        self.rng_derived = False  # set by ``load``: this rank's RNG state was not in the checkpoint
        train = cfg.training
        self.optimizers = []
        for i in range(len(modules)):
            params = data_parallel.parameters(i)
            kernels = ADAMW_KERNELS[adamw_implementation(cfg.optimizer.implementation, params[0].device.type)]
            self.optimizers.append(
                torch.optim.AdamW(params, lr=train.lr, betas=(0.9, 0.95), weight_decay=0.1, **kernels)
            )
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(train.warmup_steps, train.steps))
            for o in self.optimizers
        ]

    def _optimizer_states(self) -> list[dict]:
        return [self.data_parallel.optimizer_state_dict(i, o) for i, o in enumerate(self.optimizers)]

    def _training_state(self, optimizer_states: list[dict] | None = None) -> dict:
        """Optimizer (``optimizer_states``: each stage's, when at hand), LR schedule, step and this
        rank's RNG, under the checkpoint's keys."""
        state = {}
        for optim in optimizer_states or self._optimizer_states():
            state.update({OPTIMIZER_PREFIX + k: v for k, v in optim.items()})
        state[TRAIN_STATE_KEY] = {
            "step": self.step,
            "lr_scheduler": self.schedulers[0].state_dict(),
            "samples_seen": self.step * self.global_batch,
        }
        state[self.rng_key] = torch.get_rng_state()
        return state

    def load(self, checkpoint: Checkpoint) -> None:
        """Everything but the weights (which the stage builder loaded) from ``checkpoint``, a
        ``step-N`` whose name says ``self.step``. Collective."""
        mine = self._optimizer_states()  # each stage's keys, and tensors to load into
        state = self._training_state(mine)
        # A rank beyond those that saved (a resume on more ranks) has no RNG state to restore: its
        # generator starts from (training.seed, rank, step) instead, the same on every such resume.
        self.rng_derived = self.rng_key not in checkpoint.tensors()
        if self.rng_derived:
            del state[self.rng_key]
        checkpoint.load(state)
        for i, keys in enumerate(mine):
            self.data_parallel.load_optimizer_state_dict(
                i, self.optimizers[i], {k: state[OPTIMIZER_PREFIX + k] for k in keys}
            )
        train_state = state[TRAIN_STATE_KEY]
        for scheduler in self.schedulers:
            scheduler.load_state_dict(train_state["lr_scheduler"])
            # The state restores the peak LR it was saved with; the configured one applies (a
            # change is logged). Warmup and decay are the configured schedule's already.
            scheduler.base_lrs = [self.cfg.training.lr] * len(scheduler.base_lrs)
        if self.rng_derived:
            torch.set_rng_state(
                keyed_generator("seedckpt-rng", self.cfg.training.seed, self.rng_key, self.step).get_state()
            )
        else:
            torch.set_rng_state(state[self.rng_key])
        if train_state["step"] != self.step:
            raise SeedckptError(f"{checkpoint.path} records step {train_state['step']}, its name says {self.step}")

    def save(self, background: BackgroundSaver | None = None) -> Path:
        """Write ``checkpoint.folder/step-<step>`` (collective) with the run's manifest and tokenizer;
        with ``background``, only stage it there: the write goes on while training does."""
        start = time.perf_counter()
        state = {}
        for i in range(len(self.modules)):
            state.update(self.data_parallel.model_state_dict(i))
        cfg = self.cfg
        # A tied output is the embedding's matrix (across pipeline stages, a copy kept bitwise equal
        # to it: ``parallel.TiedEmbeddings``), so it is stored once, as the embedding.
        tied = cfg.model_family().tied_weights(self.args)
        state = {fqn: t for fqn, t in state.items() if fqn not in tied}
        state.update(self._training_state())
        ft, tokenizer = cfg.finetune, cfg.data.tokenizer
        manifest = make_manifest(
            "train",
            cfg.model.name,
            cfg.model.flavor,
            self.args.to_dict(),
            step=self.step,
            seed=cfg.training.seed,
            dtype="float32",
            training=dataclasses.asdict(cfg.training),
            finetune={"mode": ft.mode, "pretrained": ft.pretrained, **(osft_record(self.osft) if self.osft else {})},
        )
        files = {f"{TOKENIZER_DIR}/{f.name}": f for f in tokenizer_files(tokenizer)} if tokenizer else {}
        path = step_dir(cfg.checkpoint.folder, self.step)
        write = functools.partial(write_checkpoint, path, manifest=manifest, force=True, files=files, aliases=tied)
        if background is None:
            return write(state)
        background.save(path, state, write, since=start)
        return path
