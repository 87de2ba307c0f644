"""The train state: everything a ``step-N`` checkpoint holds, and how it saves and loads itself.

That is the stage modules' weights, each stage's AdamW state, the LR schedules, this rank's RNG and
the data position (``step`` and ``data_start``; ``samples_seen`` is recorded for readers). Weights and optimizer state
go through the data-parallel implementation in FSDP2's keys (``data_parallel``), so a checkpoint
does not depend on which implementation wrote it. Saving goes through the one writer
(``write_checkpoint``: a temporary sibling, then a rename), loading through the checkpoint the run
started from (``start.Start``), already opened and validated.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from seedckpt.checkpoint import TOKENIZER_DIR, OpenedCheckpoint, make_manifest, step_dir, write_checkpoint
from seedckpt.checkpoint.background import BackgroundSaver
from seedckpt.checkpoint.fingerprint import weights_fingerprint
from seedckpt.checkpoint.manifest import OPTIMIZER_PREFIX, RNG_PREFIX, TRAIN_STATE_KEY
from seedckpt.config.job_config import JobConfig
from seedckpt.data.sources import keyed_generator
from seedckpt.data.tokenizer import tokenizer_files
from seedckpt.finetune.osft import OSFTSettings, osft_record
from seedckpt.materialize.start import START_KEY, WEIGHTS_KEY, start_identity
from seedckpt.parallel.data_parallel import DataParallel
from seedckpt.train.optimizer import apply_settings, build_adamw, lr_factor, parameter_groups
from seedckpt.utils.errors import SeedckptError


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
        osft: OSFTSettings | None = None,
    ):
        self.cfg, self.args, self.osft = cfg, args, osft
        self.modules, self.data_parallel = modules, data_parallel
        self.step, self.global_batch = step, global_batch
        self.rng_key = f"{RNG_PREFIX}rank{dist.get_rank()}"
        self.rng_derived = False  # set by ``load``: this rank's RNG state was not in the checkpoint
        ft = cfg.finetune  # recorded in every step-N: which job wrote it (``start.check_same_job``)
        self.pretrained_weights = weights_fingerprint(ft.pretrained) if ft.mode != "none" else None
        self.started_from = start_identity(cfg)  # pretraining: the seed's identity, the same way
        # The step before the run's first batch: step s trains on the data's batch s - data_start
        # (``checkpoint.exclude_from_loading = ["data"]`` starts the batches again at a resume).
        self.data_start = 0
        train = cfg.training
        self.optimizers, self.groups = [], []
        for i in range(len(modules)):
            params = data_parallel.parameters(i)
            groups, self.groups_described = parameter_groups([modules[i]], params, cfg.optimizer)
            self.groups.append(groups)
            self.optimizers.append(build_adamw(groups, train.lr, cfg.optimizer, params[0].device.type))
        factor = lr_factor(cfg.lr_scheduler, train.warmup_steps, train.steps)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]

    def _optimizer_states(self) -> list[dict]:
        return [self.data_parallel.optimizer_state_dict(i, o) for i, o in enumerate(self.optimizers)]

    def _training_state(self, optimizer_states: list[dict] | None = None) -> dict:
        """Optimizer (``optimizer_states``: each stage's, when at hand), LR schedule, step, data
        position and this rank's RNG, under the checkpoint's keys."""
        state = {}
        for optim in optimizer_states if optimizer_states is not None else self._optimizer_states():
            state.update({OPTIMIZER_PREFIX + k: v for k, v in optim.items()})
        state[TRAIN_STATE_KEY] = {
            "step": self.step,
            "lr_scheduler": self.schedulers[0].state_dict(),
            "samples_seen": self.step * self.global_batch,
            "data_start": self.data_start,
        }
        state[self.rng_key] = torch.get_rng_state()
        return state

    def load(self, checkpoint: OpenedCheckpoint, exclude: frozenset[str] = frozenset()) -> None:
        """Everything but the weights (which the stage builder loaded) from ``checkpoint``, a
        ``step-N`` at ``self.step``, except the parts ``exclude`` names (``checkpoint.exclude_from_loading``):
        those start afresh. Collective."""
        # Not even built when excluded: torch fills an empty optimizer's state with a zero-gradient
        # step to have tensors to load into, and a fresh AdamW must start at its step 0.
        mine = [] if "optimizer" in exclude else self._optimizer_states()
        state = self._training_state(mine)
        train_state = state[TRAIN_STATE_KEY]
        if not checkpoint.has_entry(f"{TRAIN_STATE_KEY}.data_start"):  # written before it was recorded
            del train_state["data_start"]
        # A rank beyond those that saved (a resume on more ranks) has no RNG state to restore: its
        # generator starts from (training.seed, rank, step) instead, the same on every such resume.
        self.rng_derived = "rng" in exclude or self.rng_key not in checkpoint.tensors()
        if self.rng_derived:
            del state[self.rng_key]
        checkpoint.load(state)
        train_state = state[TRAIN_STATE_KEY]
        for i, keys in enumerate(mine):
            self.data_parallel.load_optimizer_state_dict(
                i, self.optimizers[i], {k: state[OPTIMIZER_PREFIX + k] for k in keys}
            )
            apply_settings(self.optimizers[i], self.groups[i], self.cfg.optimizer)
        for scheduler in self.schedulers:
            if "lr_scheduler" not in exclude:  # excluded: the schedule's step 0 comes next
                scheduler.load_state_dict(train_state["lr_scheduler"])
            self._apply_schedule(scheduler)
        self.data_start = self.step if "data" in exclude else train_state.get("data_start", 0)
        if self.rng_derived:
            torch.set_rng_state(
                keyed_generator("seedckpt-rng", self.cfg.training.seed, self.rng_key, self.step).get_state()
            )
        else:
            torch.set_rng_state(state[self.rng_key])
        if train_state["step"] != self.step:
            raise SeedckptError(f"{checkpoint.path} records step {train_state['step']}, its name says {self.step}")

    def _apply_schedule(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Set the next step's learning rate from the configured peak and schedule (a change is
        logged): a loaded state holds the rates, and the peak, that the saved run would have used
        next. ``_last_lr`` is what ``get_last_lr`` reports; LambdaLR sets it only in ``step``."""
        groups = scheduler.optimizer.param_groups
        scheduler.base_lrs = [self.cfg.training.lr] * len(groups)
        for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = self.cfg.training.lr * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]

    def save(self, background: BackgroundSaver | None = None, val_loss: float | None = None) -> Path:
        """Write ``checkpoint.folder/step-<step>`` (collective) with the run's manifest and tokenizer;
        with ``background``, only stage it there: the write goes on while training does. ``val_loss``:
        the step's validation loss, recorded for ``checkpoint.keep_best``."""
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
            global_batch=self.global_batch,  # a resume on another DP degree keeps it (``resolve.keep_global_batch``)
            seed=cfg.training.seed,
            dtype="float32",
            training=dataclasses.asdict(cfg.training),
            optimizer=dataclasses.asdict(cfg.optimizer),
            lr_scheduler=dataclasses.asdict(cfg.lr_scheduler),
            finetune={
                "mode": ft.mode,
                "pretrained": ft.pretrained,
                WEIGHTS_KEY: self.pretrained_weights,
                **(osft_record(self.osft) if self.osft else {}),
            },
            data={"kind": cfg.data.kind, "path": cfg.data.path},
            **({START_KEY: self.started_from} if self.started_from else {}),
            **({"val_loss": val_loss} if val_loss is not None else {}),
        )
        files = {f"{TOKENIZER_DIR}/{f.name}": f for f in tokenizer_files(tokenizer)} if tokenizer else {}
        path = step_dir(cfg.checkpoint.folder, self.step)
        write = functools.partial(write_checkpoint, path, manifest=manifest, force=True, files=files, aliases=tied)
        if background is None:
            return write(state)
        background.save(path, state, write, since=start)
        return path
