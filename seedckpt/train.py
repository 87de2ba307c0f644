"""Pretraining, SFT and OSFT: pipeline parallel x FSDP2 on a ``(pp, dp_replicate, dp_shard)`` mesh
(or, with ``parallelism.fsdp_impl = "manual"``, data parallelism through ``manual_fsdp``).

One run, end to end:

1. validate the layout (``ParallelDims``), the fine-tuning set-up and the data before touching a
   process group;
2. pick the start: the newest complete ``checkpoint.folder/step-N``, else
   ``finetune.pretrained`` for SFT / OSFT, else ``checkpoint.seed_checkpoint`` (which must exist -- a run
   never silently starts from random), or, with ``checkpoint.init_from = "direct"``, each rank's own
   per-tensor init from ``training.seed`` (bitwise the seed file that seed would make);
3. build this rank's stage(s) through ``stages.build_stages`` -- the same load path for seed,
   pretrained weights and resume -- with activation checkpointing and FSDP2 applied on ``meta``
   (manual FSDP: the stage is built unsharded and then wrapped, each rank keeping its shard);
4. for a resume, load optimizer, LR schedule and RNG from the same checkpoint;
5. each step: the global batch for that step (same for every layout), this DP rank's slice,
   forward/backward through the pipeline schedule (or directly when pp = 1), for OSFT project the
   gradients off the frozen subspaces (manual FSDP: reduce-scatter the accumulated gradients, once
   per step), clip by the global gradient norm across PP and DP, AdamW
   (for OSFT, project the trainable factors again), LR schedule, telemetry. The loss is the mean over the
   global batch's label tokens (chat data masks all but the assistant's), whatever the layout;
6. every ``checkpoint.interval`` steps (and at the end) write ``step-N`` atomically and keep the
   newest ``keep_latest_k``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from seedckpt.checkpoint import (TOKENIZER_DIR, DcpCheckpoint, complete_steps, destination_lock, make_manifest,
                                 prune_steps, step_dir, write_checkpoint)
from seedckpt.checkpoint.manifest import OPTIMIZER_PREFIX, RNG_PREFIX, TRAIN_STATE_KEY, read_manifest
from seedckpt.collectives import CollectiveTimes, time_fsdp2_collectives
from seedckpt.config import DTYPES, JobConfig, check_output_folders, config_reference, load_config
from seedckpt.data import IGNORE_INDEX
from seedckpt.datasets import make_dataset
from seedckpt.errors import SeedckptError
from seedckpt.finetune import osft_spec, prepare_finetune
from seedckpt.init import RECIPE_VERSION
from seedckpt.layouts import open_model_checkpoint
from seedckpt.manual_fsdp import FlatShardedModel
from seedckpt.metrics import MetricsLogger, peak_memory_bytes
from seedckpt.osft import OSFTProjector, manifest_osft, osft_record
from seedckpt.parallel import (ParallelDims, TiedEmbeddings, apply_activation_checkpointing, apply_fsdp,
                               reshard_after_forward)
from seedckpt.stages import build_stages, plan_rank_stages, stage_ids_for_rank
from seedckpt.tokenizer import tokenizer_files

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Start:
    path: Path | None  # None: initialize directly from training.seed
    step: int  # 0 when starting from the seed or the pretrained weights
    pretrained: bool = False  # fine-tuning's first start: the vocabulary may grow


def find_start(cfg: JobConfig) -> Start:
    steps = complete_steps(cfg.checkpoint.folder)
    if steps:
        newest = max(steps)
        if newest > cfg.training.steps:
            raise SeedckptError(f"{steps[newest]} is beyond training.steps = {cfg.training.steps}; raise "
                                "training.steps to continue this run, or start a new checkpoint.folder")
        try:
            DcpCheckpoint(steps[newest])  # .metadata, its checksum and every data file's length
        except SeedckptError as e:
            raise SeedckptError(f"cannot resume: {e}; {fallback_hint(steps, newest)}") from None
        return Start(steps[newest], newest)
    if cfg.finetune.mode != "none":
        return Start(Path(cfg.finetune.pretrained), 0, pretrained=True)
    if cfg.checkpoint.init_from == "direct":
        check_direct_init_matches_seed(cfg)
        return Start(None, 0)
    seed = cfg.checkpoint.seed_checkpoint
    if not seed:
        raise SeedckptError("no checkpoint to start from: set checkpoint.seed_checkpoint (create it with "
                            "`python create_seed_checkpoint.py --config CONFIG`)")
    if not Path(seed).is_dir():
        raise SeedckptError(f"checkpoint.seed_checkpoint {seed} does not exist; create it with "
                            f"`python create_seed_checkpoint.py --config CONFIG --output {seed}`")
    open_model_checkpoint(seed, complete=False)  # damaged or incomplete: one line now, not one per rank later
    return Start(Path(seed), 0)


def fallback_hint(steps: dict[int, Path], broken: int) -> str:
    """What to do about a damaged ``step-N``: which earlier checkpoint would resume instead. A run
    never falls back by itself -- that would silently throw work away on a storage fault."""
    for step in sorted((s for s in steps if s < broken), reverse=True):
        try:
            DcpCheckpoint(steps[step])
        except SeedckptError:
            continue
        return (f"the newest intact checkpoint before it is {steps[step]}: move {steps[broken]} out of the folder "
                f"to resume from step {step}")
    return "no earlier checkpoint in the folder is intact: start again from the seed in a new checkpoint.folder"


def changed_training_settings(cfg: JobConfig, start: Start) -> list[str]:
    """The ``[training]`` values that differ from those ``start``'s checkpoint was trained with (they
    all apply from the next step; the log says which changed)."""
    saved = (read_manifest(start.path) or {}).get("training") if start.step else None
    if not isinstance(saved, dict):
        return []
    now = dataclasses.asdict(cfg.training)
    return [f"training.{k} {saved[k]!r} -> {v!r}" for k, v in now.items() if k in saved and saved[k] != v]


def check_resume_matches_osft(cfg: JobConfig, start: Start) -> None:
    """A resumed run must train what its checkpoint holds: the same OSFT settings (the factors'
    shapes follow from them), or dense weights for a run without OSFT."""
    if not start.step:
        return
    saved = manifest_osft(read_manifest(start.path))
    wanted = osft_spec(cfg)
    if saved != wanted:
        raise SeedckptError(f"{start.path} was trained with {_describe_osft(saved)}, but the config asks for "
                            f"{_describe_osft(wanted)}; resume with the same [finetune] settings, or start a new "
                            "checkpoint.folder")


def _describe_osft(spec) -> str:
    return f"osft (ratio {spec.ratio}, targets {list(spec.patterns)})" if spec is not None else "no osft"


def check_direct_init_matches_seed(cfg: JobConfig) -> None:
    """Direct init promises the values of the seed made with ``training.seed``; when a configured
    ``seed_checkpoint`` exists and was made otherwise (another seed, an older init recipe), refuse
    rather than silently start from different weights."""
    path = Path(cfg.checkpoint.seed_checkpoint) if cfg.checkpoint.seed_checkpoint else None
    manifest = read_manifest(path) if path is not None and path.is_dir() else None
    if manifest is None:
        return
    recipe = (manifest.get("init") or {}).get("recipe")
    made = (manifest.get("seed"), recipe)
    if made != (cfg.training.seed, RECIPE_VERSION):
        raise SeedckptError(
            f"checkpoint.init_from = direct would draw seed {cfg.training.seed} with {RECIPE_VERSION}, but "
            f"checkpoint.seed_checkpoint {path} was made with seed {made[0]} and {recipe or 'an unknown recipe'}: "
            "load it (checkpoint.init_from = seed_checkpoint), or unset checkpoint.seed_checkpoint")


def warmup_cosine(warmup: int, total: int):
    """Linear warmup to the peak LR, then cosine decay to 10 % of it at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, pp_group, duplicates=(),
                    dp_group=None) -> torch.Tensor:
    """Clip by the norm over *all* gradients of the model: DP shards and pipeline stages
    (``duplicates``: copies of a tied parameter, counted once through the original). FSDP2's
    gradients are DTensors that know their DP mesh; plain shards (manual FSDP) name it: ``dp_group``."""
    skip = {id(p) for p in duplicates}
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):  # partial over the FSDP mesh -> reduce to the full norm
        norm = norm.full_tensor()
    groups = [g for g in (dp_group, pp_group) if g is not None]
    if groups:  # sum of squares over the other ranks' parts
        squared = norm ** 2
        for group in groups:
            dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


class Trainer:
    def __init__(self, cfg: JobConfig, start: Start | None = None, data=None):
        self.cfg = cfg
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.dims = ParallelDims.from_config(cfg, world)
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.mesh = self.dims.build_mesh(self.device.type)
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp_replicate") * self.dims.dp_shard + self.mesh.get_local_rank("dp_shard")
        par, train = cfg.parallelism, cfg.training
        self.args = cfg.model_args()
        self.specs = plan_rank_stages(self.args, self.pp_rank, self.dims.pp, par.pipeline_parallel_stages_per_rank,
                                      par.pipeline_parallel_schedule, par.pipeline_parallel_split_points)
        self.accum = self.dims.accumulation_steps(cfg)
        # Set each step: micro-batch losses are token sums times loss_scale = dp / (label tokens in
        # the global batch), so what FSDP averages over DP ranks is the global per-token mean.
        self.loss_scale = 1.0
        self.global_batch = self.dims.global_batch_size(cfg)
        self.data = data or make_dataset(cfg.data, self.args.vocab_size, train.seq_len, train.seed)

        start = start or find_start(cfg)
        origin = ("resuming from" if start.step else "starting from pretrained" if start.pretrained
                  else "starting from seed checkpoint" if start.path else
                  f"initializing directly from seed {train.seed} ({RECIPE_VERSION}, no seed file):")
        manual = par.fsdp_impl == "manual"
        self.log(f"{origin} {start.path or ''} (step {start.step}); mesh pp={self.dims.pp} "
                 f"dp_replicate={self.dims.dp_replicate} dp_shard={self.dims.dp_shard} on {self.device.type}"
                 f"{' with manual FSDP' if manual else ''}; data: {self.data.description}")
        for change in changed_training_settings(cfg, start):
            self.log(f"resuming with a changed setting, applied from step {start.step + 1}: {change}")
        self.osft = osft_spec(cfg)
        self.collectives = CollectiveTimes()  # this rank's all-gathers and reduce-scatters, per step
        self.step = start.step
        try:
            self.modules = build_stages(self.args, self.specs, self.device, checkpoint=start.path,
                                        seed=None if start.path else train.seed, shard_fn=self._parallelize,
                                        grow_vocab=start.pretrained, osft=self.osft,
                                        stage_group=self._stage_group() if self.osft is not None else None,
                                        verify=cfg.checkpoint.verify_checksums)
            # Manual FSDP (data parallelism only): each stage becomes one flat vector, sharded over DP.
            dtypes = DTYPES[train.mixed_precision_param], DTYPES[train.mixed_precision_reduce]
            self.flat = ([FlatShardedModel(m, self.mesh["dp_shard"].get_group(), *dtypes, self.collectives)
                          for m in self.modules] if manual else None)
            self.tied = self._tie_across_stages()
            # OSFT: gradients and trainable factors stay orthogonal to the frozen singular subspaces.
            self.projector = OSFTProjector(self.modules) if self.osft is not None else None
            self.optimizers = [torch.optim.AdamW(self._optimized_params(i), lr=train.lr, betas=(0.9, 0.95),
                                                 weight_decay=0.1) for i in range(len(self.modules))]
            self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(train.warmup_steps, train.steps))
                               for o in self.optimizers]
            if start.step:
                self._load_training_state(start.path)
        except SeedckptError as e:  # a damaged step-N: say which checkpoint would resume instead
            if not start.step:
                raise
            raise SeedckptError(f"cannot resume: {e}; "
                                f"{fallback_hint(complete_steps(cfg.checkpoint.folder), start.step)}") from None
        self.pipeline = self._build_pipeline() if self.dims.pp > 1 else None
        self.params = ([f.shard for f in self.flat] if self.flat is not None
                       else [p for m in self.modules for p in m.parameters()])

    # -- setup -------------------------------------------------------------------------------
    def _parallelize(self, module: nn.Module) -> None:
        ac, train, par = self.cfg.activation_checkpoint, self.cfg.training, self.cfg.parallelism
        apply_activation_checkpointing(module, ac.mode, ac.selective_every)
        if par.fsdp_impl == "manual":  # wrapped once loaded, unsharded (FlatShardedModel)
            return
        # FSDP2 also carries mixed precision, so it is applied on one rank too when that is asked for.
        if self.dims.dp > 1 or (train.mixed_precision_param, train.mixed_precision_reduce) != ("float32",) * 2:
            mesh = self.mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else self.mesh["dp_shard"]
            apply_fsdp(module, mesh, DTYPES[train.mixed_precision_param], DTYPES[train.mixed_precision_reduce],
                       reshard_after_forward(par.fsdp_reshard_after_forward, self.dims.pp))
            time_fsdp2_collectives(module, self.collectives)

    def _optimized_params(self, i: int) -> list[nn.Parameter]:
        """What stage ``i``'s optimizer steps: its trainable parameters, or manual FSDP's flat shard."""
        if self.flat is not None:
            return [self.flat[i].shard]
        return [p for p in self.modules[i].parameters() if p.requires_grad]

    def _stage_group(self):
        """The ranks that hold this rank's stages (its DP group), or None on one DP rank."""
        if self.dims.dp == 1:
            return None
        if self.dims.dp_replicate == 1:
            return self.mesh["dp_shard"].get_group()
        return self.mesh["dp_replicate", "dp_shard"]._flatten().get_group()

    def _tie_across_stages(self) -> TiedEmbeddings | None:
        par = self.cfg.parallelism
        if not self.args.tie_word_embeddings or self.dims.pp == 1:
            return None
        owner = {s: r for r in range(self.dims.pp) for s in stage_ids_for_rank(
            r, self.dims.pp, par.pipeline_parallel_stages_per_rank, par.pipeline_parallel_schedule)}
        return TiedEmbeddings(self.modules, self.specs, self.mesh, self.dims.pp, owner.__getitem__)

    def _build_pipeline(self):
        par = self.cfg.parallelism
        group = self.mesh["pp"].get_group()
        stages = [PipelineStage(m, s.stage_id, s.num_stages, self.device, group=group)
                  for m, s in zip(self.modules, self.specs)]
        schedule = get_schedule_class(par.pipeline_parallel_schedule)
        n_micro = self.dims.microbatches(self.cfg)
        # scale_grads=False: the schedule would rescale *all* gradients at every step() call,
        # including those accumulated by earlier micro-steps; the loss is pre-scaled instead.
        if issubclass(schedule, PipelineScheduleSingle):
            return schedule(stages[0], n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)
        return schedule(stages, n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch, scaled so the gradients add up to the
        global batch's per-token mean (micro-batches hold different numbers of label tokens)."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        return loss * self.loss_scale

    def _osft_leak(self) -> float:
        """The worst ||U_high^T U_low|| / ||V_high^T V_low|| over every stage (collective)."""
        leak = torch.tensor(self.projector.worst_leak(), dtype=torch.float64, device=self.device)
        dist.all_reduce(leak, op=dist.ReduceOp.MAX)
        return leak.item()

    # -- checkpoint state beyond the weights ----------------------------------------------------
    # Both implementations read and write FSDP2's flattened keys, so either resumes the other.
    def _optimizer_state(self, i: int) -> dict:
        if self.flat is not None:
            return self.flat[i].optimizer_state_dict(self.optimizers[i])
        return get_optimizer_state_dict(self.modules[i], self.optimizers[i], options=OPTIM_OPTIONS)

    def _set_optimizer_state(self, i: int, state: dict) -> None:
        if self.flat is not None:
            self.flat[i].load_optimizer_state_dict(self.optimizers[i], state)
        else:
            set_optimizer_state_dict(self.modules[i], self.optimizers[i], state, options=OPTIM_OPTIONS)

    def _training_state(self, optimizer_states: list[dict] | None = None) -> dict:
        """Optimizer (``optimizer_states``: each stage's ``_optimizer_state``, when at hand), LR
        schedule, step and this rank's RNG."""
        state = {}
        for optim in optimizer_states or [self._optimizer_state(i) for i in range(len(self.modules))]:
            state.update({OPTIMIZER_PREFIX + k: v for k, v in optim.items()})
        state[TRAIN_STATE_KEY] = {"step": self.step, "lr_scheduler": self.schedulers[0].state_dict(),
                                "samples_seen": self.step * self.global_batch}
        state[f"{RNG_PREFIX}rank{self.rank}"] = torch.get_rng_state()
        return state

    def _load_training_state(self, path: Path) -> None:
        mine = [self._optimizer_state(i) for i in range(len(self.modules))]  # each stage's keys
        state = self._training_state(mine)
        DcpCheckpoint(path, verify=self.cfg.checkpoint.verify_checksums).load(state)
        for i, keys in enumerate(mine):
            self._set_optimizer_state(i, {k: state[OPTIMIZER_PREFIX + k] for k in keys})
        train_state = state[TRAIN_STATE_KEY]
        for scheduler in self.schedulers:
            scheduler.load_state_dict(train_state["lr_scheduler"])
            # The state restores the peak LR it was saved with; the configured one applies (a
            # change is logged). Warmup and decay are the configured schedule's already.
            scheduler.base_lrs = [self.cfg.training.lr] * len(scheduler.base_lrs)
        torch.set_rng_state(state[f"{RNG_PREFIX}rank{self.rank}"])
        if train_state["step"] != self.step:
            raise SeedckptError(f"{path} records step {train_state['step']}, its name says {self.step}")

    def save(self) -> None:
        state = {}
        for i, module in enumerate(self.modules):  # manual FSDP: full tensors on every rank, DCP writes each once
            state.update(self.flat[i].full_state_dict() if self.flat is not None else module.state_dict())
        state.update(self._training_state())
        ckpt = self.cfg.checkpoint
        ft, tokenizer = self.cfg.finetune, self.cfg.data.tokenizer
        manifest = make_manifest("train", self.cfg.model.name, self.cfg.model.flavor, self.args.to_dict(),
                                 step=self.step, seed=self.cfg.training.seed, dtype="float32",
                                 training=dataclasses.asdict(self.cfg.training),
                                 finetune={"mode": ft.mode, "pretrained": ft.pretrained,
                                           **(osft_record(self.osft) if self.osft else {})})
        files = {f"{TOKENIZER_DIR}/{f.name}": f for f in tokenizer_files(tokenizer)} if tokenizer else {}
        path = write_checkpoint(step_dir(ckpt.folder, self.step), state, manifest, force=True, files=files)
        if self.rank == 0:
            prune_steps(ckpt.folder, ckpt.keep_latest_k)
        self.log(f"saved checkpoint {path}")

    # -- the loop -------------------------------------------------------------------------------
    def local_batches(self, step: int):
        """This DP rank's ``Batch`` for each accumulation micro-step of ``step``; sets the loss scale
        from the global batch (which every rank has), so no collective is needed for it."""
        batch = self.data.global_batch(step, self.global_batch)
        self.label_tokens = batch.num_label_tokens
        self.loss_scale = self.dims.dp / max(1, self.label_tokens)
        local = self.cfg.training.local_batch_size
        for k in range(self.accum):
            start = (k * self.dims.dp + self.dp_rank) * local
            yield batch.rows(start, start + local).to(self.device)

    def train_step(self, batches) -> torch.Tensor:
        """Forward/backward over the accumulation micro-steps; the local loss (0 off the last stage)."""
        total = torch.zeros((), device=self.device)
        has_first = any(s.is_first for s in self.specs)
        has_last = any(s.is_last for s in self.specs)
        for batch in batches:
            # Packed rows: per-document positions and attention, given to every stage.
            extra = {k: v for k, v in (("positions", batch.positions), ("document_ids", batch.document_ids))
                     if v is not None}
            if self.pipeline is None:
                loss = self._loss(self.modules[0](batch.inputs, **extra), batch.labels)
                loss.backward()
                total += loss.detach()
                continue
            losses = [] if has_last else None
            self.pipeline.step(*([batch.inputs] if has_first else []), target=batch.labels if has_last else None,
                               losses=losses, return_outputs=False, **extra)
            if has_last:
                total += torch.stack(losses).sum().detach()
        return total

    def run(self) -> None:
        train, ckpt = self.cfg.training, self.cfg.checkpoint
        metrics = (MetricsLogger(self.cfg.job.dump_folder, self.cfg.metrics.enable_tensorboard, after_step=self.step)
                   if self.rank == 0 else None)
        profile_steps = {int(s) for s in self.cfg.profiling.steps}
        tokens_per_step = self.global_batch * train.seq_len
        try:
            while self.step < train.steps:
                self.step += 1
                t0 = time.perf_counter()
                self.collectives.reset()
                with self._maybe_profile(self.step in profile_steps):
                    batches = list(self.local_batches(self.step))
                    data_wait = time.perf_counter() - t0
                    local_loss = self.train_step(batches)
                    for flat in self.flat or ():  # one reduce-scatter per optimizer step, not per micro-batch
                        flat.sync_gradients()
                    if self.tied is not None:
                        self.tied.sync_grads()
                    if self.projector is not None:  # before clipping: the norm counts only what the step applies
                        self.projector.project_gradients()
                    grad_norm = clip_grad_norm_(self.params, train.max_norm,
                                                self.mesh["pp"].get_group() if self.dims.pp > 1 else None,
                                                self.tied.duplicates if self.tied is not None else (),
                                                self.flat[0].group if self.flat is not None else None)
                    for optimizer, scheduler in zip(self.optimizers, self.schedulers):
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        scheduler.step()
                    if self.projector is not None:  # AdamW's per-element scaling leaves the complement
                        self.projector.project_parameters()
                comm = dataclasses.asdict(self.collectives)
                stats = torch.tensor([local_loss.item(), float(peak_memory_bytes(self.device)), *comm.values()],
                                     dtype=torch.float64, device=self.device)
                dist.all_reduce(stats[:1])  # sum of the last stages' DP-local parts (each x dp)
                dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)  # the busiest rank's memory and collectives
                step_time = time.perf_counter() - t0
                logging = self.step % self.cfg.metrics.log_freq == 0 or self.step == train.steps
                extra = {"osft_leak": self._osft_leak()} if logging and self.projector is not None else {}
                if metrics is not None and logging:
                    metrics.log({"step": self.step, "steps": train.steps, "loss": stats[0].item() / self.dims.dp,
                                 "lr": self.schedulers[0].get_last_lr()[0], "grad_norm": grad_norm.item(),
                                 "label_tokens": self.label_tokens, "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                                 "data_wait_s": data_wait, "peak_mem_bytes": int(stats[1].item()),
                                 **{k: (int if k.endswith("calls") else float)(v) for k, v in zip(comm, stats[2:].tolist())},
                                 **extra})
                stopping = self.step == train.stop_after_step
                if stopping or (ckpt.interval > 0 and (self.step % ckpt.interval == 0 or self.step == train.steps)):
                    self.save()
                if stopping:
                    self.log(f"stopping after step {self.step} (training.stop_after_step); run again to resume")
                    break
            # Let every rank's outstanding pipeline sends complete before the group is torn down.
            dist.barrier()
        finally:
            if metrics is not None:
                metrics.close()

    @contextlib.contextmanager
    def _maybe_profile(self, enabled: bool):
        if not enabled:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            yield
        trace = Path(self.cfg.job.dump_folder) / "traces" / f"step-{self.step}-rank{self.rank}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        self.log(f"wrote Chrome trace {trace}", all_ranks=True)

    def log(self, message: str, all_ranks: bool = False) -> None:
        if all_ranks or self.rank == 0:
            print(f"[rank{self.rank}] {message}", flush=True)


def _init_process_group() -> None:
    """torchrun's env:// rendezvous; a plain ``python train.py`` runs as a world of one."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(minutes=10)
    if "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pipeline x FSDP2 pretraining from a seed checkpoint. Any config key can be "
                    "overridden with --section.key value.",
        epilog="examples:\n"
               "  torchrun --nproc-per-node 4 train.py --config configs/debug.toml\n"
               "  torchrun --nproc-per-node 4 train.py --config configs/debug.toml --training.steps 50 \\\n"
               "      --parallelism.pipeline_parallel_schedule Interleaved1F1B "
               "--parallelism.pipeline_parallel_stages_per_rank 2\n\n" + config_reference())
    parser.add_argument("--config", required=True, help="job config TOML, e.g. configs/debug.toml")
    opts, overrides = parser.parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    if rank != 0:
        warnings.simplefilter("ignore")  # every rank sees the same data and config: rank 0 warns for all
    try:  # every rank validates the same config, so rank 0 speaks for all
        cfg = load_config(opts.config, overrides)
        finetune = prepare_finetune(cfg)
        if finetune and rank == 0:
            print(f"[rank0] {finetune}", flush=True)
        ParallelDims.from_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # fail before any rendezvous
        if cfg.metrics.enable_tensorboard:
            MetricsLogger.check_tensorboard()
        check_output_folders(cfg)
        with contextlib.ExitStack() as run_lock:
            if rank == 0:  # one run per checkpoint.folder: a second one fails here, naming the first
                run_lock.enter_context(destination_lock(cfg.checkpoint.folder))
            start = find_start(cfg)
            check_resume_matches_osft(cfg, start)
            if start.step == cfg.training.steps:
                if rank == 0:
                    print(f"[rank0] nothing to train: {start.path} already reached training.steps = "
                          f"{cfg.training.steps}; raise --training.steps to continue", flush=True)
                return 0
            data = make_dataset(cfg.data, cfg.model_args().vocab_size, cfg.training.seq_len, cfg.training.seed)
            return _train(cfg, start, data, rank)
    except SeedckptError as e:
        if rank == 0:
            print(f"train.py: error: {e}", file=sys.stderr)
        return 2


def _train(cfg: JobConfig, start: Start, data, rank: int) -> int:
    _init_process_group()
    try:
        Trainer(cfg, start, data).run()
    except (SeedckptError, OSError) as e:  # may hit one stage only: each failing rank reports
        print(f"train.py: error on rank {rank}: {e}", file=sys.stderr)
        return 2
    finally:
        # Pipeline schedules keep P2P work objects in reference cycles; collected after the group is
        # gone (at interpreter exit) they abort the process ("terminate called without an active
        # exception", seen about once in six ZBV runs). Free them while the group still exists.
        gc.collect()
        dist.destroy_process_group()
    return 0
