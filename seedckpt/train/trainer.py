"""Pretraining, SFT and OSFT: the training loop, pipeline parallel x data parallel x tensor parallel
on a ``(pp, dp_replicate, dp_shard, tp)`` mesh.

One run, end to end -- the trainer is the loop; each other concern is one module:

1. resolve the config once (``resolve``): the model (fine-tuning's from the pretrained checkpoint),
   the layout (``ParallelDims``) and the data, all checked before touching a process group;
2. pick the start (``start``): the newest complete ``step-N``, the pretrained weights, the seed, or
   direct init -- opened once, before any rendezvous, and handed on;
3. build this rank's stage(s) on ``meta`` (``stages.stage_models``), parallelize them there
   (``parallelize.parallelize_stage``: tensor parallel, activation checkpointing, compile, and data
   parallelism -- ``data_parallel``: FSDP2, or manual FSDP once loaded), then materialize and load
   them (``stages.load_stages``) -- the same load path for seed, pretrained weights and resume;
4. the train state (``train_state``: optimizers, LR schedules, RNG, data position); for a resume it
   loads itself from the same checkpoint;
5. each step: the global batch for that step (same for every layout), this DP rank's slice,
   forward/backward through the pipeline schedule (or directly when pp = 1), finish the
   data-parallel gradients (manual FSDP: one reduce-scatter per step), for OSFT project the
   gradients off the frozen subspaces, clip by the global gradient norm across PP and DP, AdamW
   (for OSFT, project the trainable factors again), LR schedule, telemetry. The loss is the mean over the
   global batch's label tokens (chat data masks all but the assistant's), whatever the layout;
6. every ``checkpoint.interval`` steps (and at the end) the train state writes ``step-N``
   atomically, and the newest ``keep_latest_k`` are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from seedckpt.checkpoint import complete_steps, destination_lock, prune_steps, step_dir, step_dirs
from seedckpt.checkpoint.background import BackgroundSaver, SavedInBackground
from seedckpt.cli.convert import convert
from seedckpt.config.job_config import JobConfig, check_output_folders, config_reference, load_config
from seedckpt.config.resolve import ResolvedRun, resolve
from seedckpt.data.datasets import held_out_dataset, make_dataset
from seedckpt.data.sources import IGNORE_INDEX, keyed_generator
from seedckpt.finetune.osft import OSFTProjector
from seedckpt.finetune.pretrained import osft_spec
from seedckpt.materialize.init_recipe import RECIPE_VERSION
from seedckpt.materialize.model_checkpoint import check_args_match, parameter_count
from seedckpt.materialize.stages import load_stages, stage_models
from seedckpt.materialize.start import changed_settings, check_resume_matches_osft, fallback_hint
from seedckpt.parallel.data_parallel import make_data_parallel
from seedckpt.parallel.parallelize import TiedEmbeddings, check_compile_supported, parallelize_stage
from seedckpt.parallel.pipeline import plan_rank_stages, stage_ids_for_rank
from seedckpt.train.balancing import ExpertBalancing
from seedckpt.train.failures import EXIT_ERROR, EXIT_INTERRUPTED, report_failure, stop_at_first_sigint
from seedckpt.train.metrics import METRICS_FILE, MetricsLogger, peak_memory_bytes, peak_tflops, utilization
from seedckpt.train.mlflow_sink import check_mlflow
from seedckpt.train.optimizer import adamw_implementation
from seedckpt.train.preemption import SaveOnSignals
from seedckpt.train.state import TrainState
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import local

# What a resume does instead of loading each part checkpoint.exclude_from_loading names.
EXCLUDED = {
    "optimizer": "fresh AdamW moments",
    "lr_scheduler": "the schedule starts again, warmup included",
    "data": "batches start again from the first",
    "rng": "derived from training.seed, the rank and the step",
}

# How long a stopped run waits for its background save in flight to end (BackgroundSaver.drain):
# under torchrun's 30 s grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) between its SIGTERM and SIGKILL.
SAVE_DRAIN_S = 20.0


# The float32 logits the default loss (training.loss_chunk_tokens = -1) holds at once, at most: a
# 2-layer model at a 65 536 vocabulary x 8192 tokens peaked at 7.1 GiB with the whole logits.
LOSS_CHUNK_BYTES = 128 * 2**20
# On a GPU, chunks of 1 GiB: each chunk adds its output-weight gradient into a float32 sum (a read
# and a write of vocabulary x dim x 4 bytes: 1 GiB at Llama 3's 128k x 2048), so chunks of 128 MiB
# (261 tokens) would spend ~30 ms a step of 8192 tokens on that traffic alone at 3 TB/s; ~2 k-token
# chunks spend ~4 ms, and their matmuls are large enough to run at the GPU's rate.
LOSS_CHUNK_BYTES_CUDA = 2**30


def loss_chunk_tokens(
    requested: int, vocab_per_rank: int, micro_batch_tokens: int, budget: int = LOSS_CHUNK_BYTES
) -> int:
    """``training.loss_chunk_tokens`` as run: -1 chunks only when a micro-batch's float32 logits (a
    rank's vocabulary slice of them under TP) exceed ``budget`` bytes, in chunks that fit it;
    0 and N as given."""
    if requested >= 0:
        return requested
    per_chunk = max(1, budget // (4 * vocab_per_rank))
    return 0 if micro_batch_tokens <= per_chunk else per_chunk


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of a micro-batch's label tokens (in float32, whatever the logits' dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def clip_grad_norm_(
    params: list[nn.Parameter], max_norm: float, pp_group, duplicates=(), dp_group=None
) -> torch.Tensor:
    """Clip by the norm over *all* gradients of the model: DP shards and pipeline stages
    (``duplicates``: copies of a tied parameter, counted once through the original). FSDP2's
    gradients are DTensors that know their DP mesh; plain shards (manual FSDP) name it: ``dp_group``.
    Gradients on different meshes (experts over the EP mesh, the rest over the DP x TP one) are
    normed and clipped per mesh (DTensor's foreach ops take one), each norm reduced over its own
    mesh, so every element counts once."""
    skip = {id(p) for p in duplicates}
    by_mesh = {}  # mesh (None: plain tensors) -> parameters with gradients
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [
        _full(torch.nn.utils.get_total_norm([p.grad for p in ps if id(p) not in skip], norm_type=2.0, foreach=True))
        for ps in by_mesh.values()
    ]
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm() if norms else torch.zeros(())
    groups = [g for g in (dp_group, pp_group) if g is not None]
    if groups:  # sum of squares over the other ranks' parts
        squared = norm**2
        for group in groups:
            dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    if max_norm > 0:
        for ps in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, norm, foreach=True)
    return norm


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A DTensor norm (partial over its shards) reduced to the full one; a plain tensor as it is."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class Trainer:
    """The training loop over this rank's stages, built from a start (``start``), a data-parallel
    implementation (``data_parallel``) and a train state (``train_state``)."""

    def __init__(self, run: ResolvedRun, data=None):
        """``run``: the config resolved for this world, with its start (``resolve(cfg, world).with_start()``)."""
        cfg = self.cfg = run.cfg
        self.rank = dist.get_rank()
        if run.start is None or run.dims.world_size != dist.get_world_size():
            raise ValueError("Trainer needs a run resolved for this world size, with its start")
        self.dims = run.dims
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if run.device == "cuda" else torch.device("cpu")
        )
        self.mesh = self.dims.build_mesh(self.device.type)
        self.expert_mesh = self.dims.build_expert_mesh(self.device.type)  # None without expert parallelism
        # checkpoint.async_mode: saves staged here, written by a background thread over its own group.
        self.saver = BackgroundSaver(self.device) if cfg.checkpoint.async_mode == "async" else None
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp_replicate") * self.dims.dp_shard + self.mesh.get_local_rank(
            "dp_shard"
        )
        par, train, ckpt = cfg.parallelism, cfg.training, cfg.checkpoint
        self.args = run.args
        self.specs = plan_rank_stages(
            self.args,
            self.pp_rank,
            self.dims.pp,
            par.pipeline_parallel_stages_per_rank,
            par.pipeline_parallel_schedule,
            par.pipeline_parallel_split_points,
            train.seq_len,
        )
        self.accum = self.dims.accumulation_steps(cfg)
        # Set each step: micro-batch losses are token sums times loss_scale = dp / (label tokens in
        # the global batch), so what FSDP averages over DP ranks is the global per-token mean.
        self.loss_scale = 1.0
        # Compiled apart from the scale, a Python float that changes every step: dynamo guards on
        # such a value, so a scale inside the compiled function would recompile at each step. Not
        # under TP: compiled, the loss-parallel cross-entropy of torch 2.13 returns 0 (measured).
        compiled = train.compile and self.dims.tp == 1
        self.cross_entropy = torch.compile(token_cross_entropy) if compiled else token_cross_entropy
        # training.loss_chunk_tokens: the last stage returns its summed loss, computed chunk by chunk
        # from its labels (``Transformer.forward(labels=...)``), instead of the logits.
        rows = train.local_batch_size // (self.dims.microbatches(cfg) if self.dims.pp > 1 else 1)
        budget = LOSS_CHUNK_BYTES_CUDA if self.device.type == "cuda" else LOSS_CHUNK_BYTES
        self.loss_chunk = loss_chunk_tokens(
            train.loss_chunk_tokens, run.args.vocab_size // self.dims.tp, rows * train.row_tokens, budget
        )
        self.chunked_loss = self.loss_chunk > 0
        self.global_batch = self.dims.global_batch_size(cfg)
        self.data = data or make_dataset(cfg.data, self.args.vocab_size, train.seq_len, train.seed, train.row_tokens)
        validation_seed = keyed_generator("seedckpt-validation", train.seed).initial_seed()  # draws of its own
        self.validation_data = (
            held_out_dataset(
                cfg.data, cfg.validation.path, self.args.vocab_size, train.seq_len, validation_seed, train.row_tokens
            )
            if cfg.validation.enabled
            else None
        )

        start = run.start
        self.data_parallel = make_data_parallel(cfg, self.dims, self.mesh, self.expert_mesh)
        initial = bool(ckpt.initial_load_path) and start.path == Path(ckpt.initial_load_path).resolve()
        origin = (
            "continuing the train state of"
            if initial and start.step
            else "starting from the weights of"
            if initial
            else "resuming from"
            if start.step
            else "starting from pretrained"
            if start.pretrained
            else "starting from seed checkpoint"
            if start.path
            else f"initializing directly from seed {train.seed} ({RECIPE_VERSION}, no seed file):"
        )
        self.log(
            f"{origin} {start.path or ''} (step {start.step}); mesh pp={self.dims.pp} "
            f"dp_replicate={self.dims.dp_replicate} dp_shard={self.dims.dp_shard}"
            f"{f' tp={self.dims.tp}' if self.dims.tp > 1 else ''}"
            f"{f' (experts: ep={self.dims.ep} efsdp={self.dims.efsdp})' if self.dims.ep > 1 else ''}"
            f" on {self.device.type}"
            f"{self.data_parallel.log_label}; "
            f"AdamW {adamw_implementation(cfg.optimizer.implementation, self.device.type)}"
            f"; data: {self.data.description}"
        )
        for change in changed_settings(cfg, start):
            self.log(f"resuming with a changed setting, applied from step {start.step + 1}: {change}")
        self.osft = osft_spec(cfg)
        if start.checkpoint is not None:  # a config that does not match is no damage: no fallback advice
            check_args_match(start.checkpoint, self.args, start.pretrained)
        try:
            self.modules, osft_targets = stage_models(self.args, self.specs, self.osft)
            for module in self.modules:
                module.loss_chunk_tokens = self.loss_chunk
                parallelize_stage(module, cfg, self.dims, self.mesh, self.data_parallel.shard_on_meta, self.expert_mesh)
            load_stages(
                self.modules,
                self.args,
                self.device,
                checkpoint=start.checkpoint,
                seed=train.seed if start.checkpoint is None else None,
                grow_vocab=start.pretrained,
                osft=self.osft,
                osft_targets=osft_targets,
                stage_group=self.data_parallel.stage_group() if self.osft is not None else None,
            )
            self.data_parallel.wrap_loaded(self.modules)
            self.tied = self._tie_across_stages()
            # OSFT: gradients and trainable factors stay orthogonal to the frozen singular subspaces.
            self.projector = OSFTProjector(self.modules) if self.osft is not None else None
            self.state = TrainState(
                cfg, self.args, self.modules, self.data_parallel, start.step, self.global_batch, self.osft
            )
            sched = cfg.lr_scheduler
            self.log(
                f"AdamW betas {tuple(cfg.optimizer.betas)} eps {cfg.optimizer.eps}, {self.state.groups_described}; "
                f"lr {train.lr} after {train.warmup_steps} warmup steps: {sched.decay_type}"
                f"{f' over the last {sched.decay_ratio:g} of the steps' if sched.decay_type == 'wsd' else ''}"
                f"{f' to {sched.min_lr_factor:g} x lr' if sched.decay_type != 'constant' else ''}"
            )
            if train.warmup_steps > train.steps:
                self.log(
                    f"warning: training.warmup_steps = {train.warmup_steps} is longer than the run's "
                    f"{train.steps} steps: the learning rate never reaches training.lr = {train.lr}; "
                    f"set training.warmup_steps <= {train.steps}"
                )
            if start.step:
                excluded = frozenset(ckpt.exclude_from_loading)
                self.state.load(start.checkpoint, excluded)
                if excluded:
                    self.log(
                        f"not loaded from {start.path} (checkpoint.exclude_from_loading): "
                        + ", ".join(f"{part} ({EXCLUDED[part]})" for part in ckpt.exclude_from_loading)
                    )
                elif self.state.rng_derived:
                    self.log(
                        f"{start.path} holds no RNG state for this rank (it was saved by fewer ranks): "
                        "derived from training.seed, the rank and the step",
                        all_ranks=True,
                    )
                newer = sorted(n for n in step_dirs(ckpt.folder) if n > start.step)
                if newer:
                    self.log(
                        f"checkpoint.load_step = {start.step}: the folder also holds the newer "
                        f"{', '.join(f'step-{n}' for n in newer)}; this run replaces each when it saves that step"
                    )
        except SeedckptError as e:  # a damaged step-N: say which checkpoint would resume instead
            if not start.step:
                raise
            raise SeedckptError(
                f"cannot resume: {e}; {fallback_hint(step_dirs(cfg.checkpoint.folder), start.step)}"
            ) from None
        self.pipeline = self._build_pipeline() if self.dims.pp > 1 else None
        # each stage module's forwards in a training step: its micro-batches
        self.forwards_per_step = self.accum * (self.dims.microbatches(cfg) if self.pipeline is not None else 1)
        moe_layers = len(getattr(self.args, "moe_layers", ()))
        self.balancing = (
            ExpertBalancing(self.modules, self.mesh, self.dims, self.device, self.global_batch, moe_layers)
            if moe_layers
            else None
        )
        # Clipped: the gradients of what the optimizers step (frozen parameters have none).
        self.params = [p for i in range(len(self.modules)) for p in self.data_parallel.parameters(i)]
        # MFU (metrics): the model's FLOPs per token, against this GPU's peak; no peak on a CPU.
        self.flops_per_token = run.family.flops_per_token(
            self.args, train.seq_len, parameter_count(run.family, self.args)
        )
        self.peak_tflops = (
            peak_tflops(
                torch.cuda.get_device_name(self.device),
                train.mixed_precision_param,
                tf32=torch.get_float32_matmul_precision() != "highest",
            )
            if self.device.type == "cuda"
            else None
        )

    # -- setup -------------------------------------------------------------------------------
    def _tie_across_stages(self) -> TiedEmbeddings | None:
        par = self.cfg.parallelism
        if not self.args.tie_word_embeddings or self.dims.pp == 1:
            return None
        owner = {
            s: r
            for r in range(self.dims.pp)
            for s in stage_ids_for_rank(
                r, self.dims.pp, par.pipeline_parallel_stages_per_rank, par.pipeline_parallel_schedule
            )
        }
        return TiedEmbeddings(self.modules, self.specs, self.mesh, self.dims.pp, owner.__getitem__)

    def _build_pipeline(self):
        par = self.cfg.parallelism
        group = self.mesh["pp"].get_group()
        stages = [
            PipelineStage(m, s.stage_id, s.num_stages, self.device, group=group)
            for m, s in zip(self.modules, self.specs)
        ]
        schedule = get_schedule_class(par.pipeline_parallel_schedule)
        n_micro = self.dims.microbatches(self.cfg)
        # scale_grads=False: the schedule would rescale *all* gradients at every step() call,
        # including those accumulated by earlier micro-steps; the loss is pre-scaled instead.
        if issubclass(schedule, PipelineScheduleSingle):
            return schedule(stages[0], n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)
        return schedule(stages, n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch, scaled so the gradients add up to the
        global batch's per-token mean (micro-batches hold different numbers of label tokens).
        ``output``: the logits, or with ``training.loss_chunk_tokens`` the summed loss itself."""
        return (output if self.chunked_loss else self.cross_entropy(output, labels)) * self.loss_scale

    def _osft_leak(self) -> float:
        """The worst ||U_high^T U_low|| / ||V_high^T V_low|| over every stage (collective)."""
        leak = torch.tensor(self.projector.worst_leak(), dtype=torch.float64, device=self.device)
        dist.all_reduce(leak, op=dist.ReduceOp.MAX)
        return leak.item()

    def save(self, val_loss: float | None = None) -> None:
        """Synchronous: write ``step-N``, then prune. Asynchronous: wait for the save in flight, then
        stage this one; it is pruned after and logged once every rank has published it. ``val_loss``:
        the step's, when it was validated (``checkpoint.keep_best`` keeps the lowest)."""
        if self.saver is None:
            start = time.perf_counter()
            path = self.state.save(val_loss=val_loss)
            self._saved(path, time.perf_counter() - start)
            return
        self._published(self.saver.wait())
        self.state.save(self.saver, val_loss)

    def _published(self, saved: SavedInBackground | None) -> None:
        """Prune and log a background save that every rank has published (``None``: none has)."""
        if saved is not None:
            self._saved(saved.path, saved.stall_s, saved.background_s)

    def _saved(self, path: Path, stall_s: float, background_s: float | None = None) -> None:
        ckpt, best = self.cfg.checkpoint, ""
        if self.rank == 0:  # after the new step is published: never fewer complete steps than before
            saved = int(path.name.removeprefix("step-"))
            kept = prune_steps(ckpt.folder, ckpt.keep_latest_k, saved, ckpt.keep_best)
            best = f"; lowest validation loss: step-{kept}, kept (checkpoint.keep_best)" if kept is not None else ""
        background = f", background {background_s:.2f} s" if background_s is not None else ""
        self.log(f"saved checkpoint {path} (stall {stall_s:.2f} s{background}){best}")

    # -- the loop -------------------------------------------------------------------------------
    def local_batches(self, step: int):
        """This DP rank's ``Batch`` for each accumulation micro-step of ``step``; sets the loss scale
        from the global batch (which every rank has), so no collective is needed for it."""
        batch = self.data.global_batch(step - self.state.data_start, self.global_batch)
        self.label_tokens = batch.num_label_tokens
        self.loss_scale = self.dims.dp / max(1, self.label_tokens)
        return self._local_rows(batch)

    def _local_rows(self, batch):
        """This DP rank's rows of a global batch, one ``Batch`` per accumulation micro-step."""
        local = self.cfg.training.local_batch_size
        for k in range(self.accum):
            start = (k * self.dims.dp + self.dp_rank) * local
            yield batch.rows(start, start + local).to(self.device)

    def train_step(self, batches) -> torch.Tensor:
        """Forward/backward over the accumulation micro-steps; the local loss (0 off the last stage).
        Under tensor parallelism the logits are split by vocabulary, and the cross-entropy runs on the
        splits (``loss_parallel``), forward and backward."""
        with loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext():
            return self._forward_backward(batches)

    def validate(self) -> float:
        """The mean per-token loss over ``validation.steps`` global batches of the held-out data --
        the same batches at every validation, split over the ranks as a training step is, forward
        only. Collective."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens, scale, self.loss_scale = 0, self.loss_scale, 1.0  # summed cross-entropy per micro-batch
        try:
            with torch.no_grad(), loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext():
                for index in range(1, self.cfg.validation.steps + 1):
                    batch = self.validation_data.global_batch(index, self.global_batch)
                    tokens += batch.num_label_tokens
                    total += self._forward_backward(self._local_rows(batch), backward=False)
        finally:
            self.loss_scale = scale
        dist.all_reduce(total)  # the last stages' DP-local sums, each on every TP rank
        return total.item() / (self.dims.tp * max(1, tokens))

    def _forward_backward(self, batches, backward: bool = True) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        has_first = any(s.is_first for s in self.specs)
        has_last = any(s.is_last for s in self.specs)
        for batch in batches:
            # Packed rows: per-document positions and attention, given to every stage.
            extra = {
                k: v for k, v in (("positions", batch.positions), ("document_ids", batch.document_ids)) if v is not None
            }
            if self.chunked_loss:  # every stage is given them; the one holding the output uses them
                extra["labels"] = batch.labels
            if self.pipeline is None:
                loss = self._loss(self.modules[0](batch.inputs, **extra), batch.labels)
                if backward:
                    loss.backward()
                total += local(loss.detach())
                continue
            losses = [] if has_last else None
            (self.pipeline.step if backward else self.pipeline.eval)(
                *([batch.inputs] if has_first else []),
                target=batch.labels if has_last else None,
                losses=losses,
                return_outputs=False,  # the losses are what is used (a chunked loss is 0-dimensional: not mergeable)
                **extra,
            )
            if has_last:
                total += local(torch.stack(losses).sum().detach())
        return total

    def run(self, signals: SaveOnSignals | None = None) -> int:
        """Train to ``training.steps`` (or ``stop_after_step``); 0, or 128 + the signal number when
        one of ``signals`` (``checkpoint.save_on_signals``) stopped the run after saving its step."""
        train, ckpt, state = self.cfg.training, self.cfg.checkpoint, self.state
        stopped_by = 0
        metrics = (
            MetricsLogger(
                self.cfg.job.dump_folder,
                self.cfg.metrics.enable_tensorboard,
                after_step=state.step,
                wandb=self._wandb_run() if self.cfg.metrics.wandb else None,
                mlflow=self._mlflow_run() if self.cfg.metrics.mlflow else None,
            )
            if self.rank == 0
            else None
        )
        profile_steps = {int(s) for s in self.cfg.profiling.steps}
        tokens_per_step = self.global_batch * train.row_tokens
        # Logged only when timed (metrics.collective_timing): an untimed run's rows carry no collective columns.
        collectives = self.data_parallel.collectives
        try:
            while state.step < train.steps:
                if self.saver is not None:  # a failed background save stops every rank here
                    self._published(self.saver.poll())
                state.step += 1
                t0 = time.perf_counter()
                if collectives is not None:
                    collectives.reset()
                with self._maybe_profile(state.step in profile_steps):
                    batches = list(self.local_batches(state.step))
                    data_wait = time.perf_counter() - t0
                    if self.balancing is not None:
                        self.balancing.start_step()
                    local_loss = self.train_step(batches)
                    self.data_parallel.sync_gradients()
                    if self.saver is not None:  # CUDA: the save in flight's copies are done before the
                        self.saver.wait_for_staging()  # state changes (the expert bias, then the optimizer)
                    # mixtures of experts: the step's expert loads over the global batch, bias balancing
                    moe = self.balancing.finish_step(self.forwards_per_step) if self.balancing is not None else {}
                    if self.tied is not None:
                        self.tied.sync_grads()
                    if self.projector is not None:  # before clipping: the norm counts only what the step applies
                        self.projector.project_gradients()
                    grad_norm = clip_grad_norm_(
                        self.params,
                        train.max_norm,
                        self.mesh["pp"].get_group() if self.dims.pp > 1 else None,
                        self.tied.duplicates if self.tied is not None else (),
                        self.data_parallel.grad_norm_group,
                    )
                    self._check_finite(state.step, "gradient norm", grad_norm.item())
                    lr = state.schedulers[0].get_last_lr()[0]  # this step's (the scheduler then moves on)
                    for optimizer, scheduler in zip(state.optimizers, state.schedulers):
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        scheduler.step()
                    if self.projector is not None:  # AdamW's per-element scaling leaves the complement
                        self.projector.project_parameters()
                comm = dataclasses.asdict(collectives) if collectives is not None else {}
                signum = float(signals.signum) if signals is not None else 0.0
                stats = torch.tensor(
                    [local_loss.item(), float(peak_memory_bytes(self.device)), signum, *comm.values()],
                    dtype=torch.float64,
                    device=self.device,
                )
                dist.all_reduce(stats[:1])  # sum of the last stages' DP-local parts (each x dp, on tp ranks)
                # the busiest rank's memory and collectives, and a signal any rank received
                dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
                stopped_by = int(stats[2].item())
                self._check_finite(state.step, "loss", stats[0].item())
                step_time = time.perf_counter() - t0
                tokens_per_s = tokens_per_step / step_time
                val = self.cfg.validation
                validating = val.enabled and (state.step % val.interval == 0 or state.step == train.steps)
                logging = state.step % self.cfg.metrics.log_freq == 0 or state.step == train.steps or validating
                extra = {"osft_leak": self._osft_leak()} if logging and self.projector is not None else {}
                if validating:
                    extra["val_loss"] = self.validate()
                if metrics is not None and logging:
                    metrics.log(
                        {
                            "step": state.step,
                            "steps": train.steps,
                            "loss": stats[0].item() / (self.dims.dp * self.dims.tp),
                            "lr": lr,
                            "grad_norm": grad_norm.item(),
                            "label_tokens": self.label_tokens,
                            "tokens_per_s": tokens_per_s,
                            "step_time_s": step_time,
                            **utilization(self.flops_per_token, tokens_per_s, dist.get_world_size(), self.peak_tflops),
                            "data_wait_s": data_wait,
                            # data.sources: the rows each source gave this step's global batch
                            **{f"rows_{name}": n for name, n in getattr(self.data, "consumption", {}).items()},
                            "peak_mem_bytes": int(stats[1].item()),
                            **{k: (int if k.endswith("calls") else float)(v) for k, v in zip(comm, stats[3:].tolist())},
                            **moe,
                            **extra,
                        }
                    )
                stopping = state.step == train.stop_after_step
                at_interval = ckpt.interval > 0 and state.step % ckpt.interval == 0
                ends = stopping or state.step == train.steps or stopped_by
                if ckpt.enable and (at_interval or ends):  # interval 0: the last only
                    self.save(extra.get("val_loss"))
                if stopping:
                    self.log(f"stopping after step {state.step} (training.stop_after_step); run again to resume")
                    break
                if stopped_by:
                    break
            if self.saver is not None:
                self._published(self.saver.wait())
            # Let every rank's outstanding pipeline sends complete before the group is torn down.
            dist.barrier()
        except BaseException:
            if self.saver is not None:
                self.saver.drain(SAVE_DRAIN_S)
            raise
        finally:
            if metrics is not None:
                metrics.close()
        if stopped_by and self.rank == 0:
            print(
                f"train.py: stopped by {SaveOnSignals.name(stopped_by)} (checkpoint.save_on_signals) after step "
                f"{state.step}: "
                + (
                    f"saved {step_dir(ckpt.folder, state.step)}; the same command resumes from it"
                    if ckpt.enable
                    else "nothing saved (checkpoint.enable = false)"
                ),
                file=sys.stderr,
                flush=True,
            )
        return 128 + stopped_by if stopped_by else 0

    def _check_finite(self, step: int, what: str, value: float) -> None:
        """Stop at a non-finite gradient norm (before it reaches the weights) or loss (before the
        step is saved): both are global, so every rank stops at the same step, and nothing
        non-finite is applied or saved."""
        if math.isfinite(value):
            return
        steps = complete_steps(self.cfg.checkpoint.folder)
        newest = f"the newest checkpoint is {steps[max(steps)]}" if steps else "no checkpoint was saved yet"
        raise SeedckptError(
            f"step {step}: the {what} is {value}: training diverged (or the data holds a bad value); nothing "
            f"non-finite was applied or saved; {newest}: resume from it with a lower training.lr, more "
            "training.warmup_steps or gradient clipping (training.max_norm)"
        )

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
        trace = Path(self.cfg.job.dump_folder) / "traces" / f"step-{self.state.step}-rank{self.rank}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        self.log(f"wrote Chrome trace {trace}", all_ranks=True)

    def _wandb_run(self) -> dict:
        """The W&B run's project, name and config: every section's values."""
        metrics = self.cfg.metrics
        return {
            "project": metrics.wandb_project,
            "name": self._run_name(metrics.wandb_run_name),
            "config": self.cfg.to_dict(),
        }

    def _mlflow_run(self) -> dict:
        """The MLflow run's tracking store, experiment, name and config."""
        metrics = self.cfg.metrics
        return {
            "tracking_uri": metrics.mlflow_tracking_uri,
            "experiment": metrics.mlflow_experiment,
            "name": self._run_name(metrics.mlflow_run_name),
            "config": self.cfg.to_dict(),
        }

    def _run_name(self, given: str) -> str:
        """A metrics sink's run name: the one given, else job.dump_folder's name."""
        return given or Path(self.cfg.job.dump_folder).resolve().name

    def log(self, message: str, all_ranks: bool = False) -> None:
        if all_ranks or self.rank == 0:
            print(f"[rank{self.rank}] {message}", flush=True)


def quiet_library_logs() -> None:
    """Silence Python warnings, torch's loggers (DTensor's redistribution advice under TP) and
    transformers' logging: what a rank > 0 would print, rank 0 prints too. transformers reads the
    variable when it is imported (later, with the tokenizer, in a fresh rank); a process that
    imported it already has its logger set directly."""
    warnings.simplefilter("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.set_verbosity_error()


def _init_process_group(device: str) -> None:
    """torchrun's env:// rendezvous; a plain ``python train.py`` runs as a world of one.

    The backend follows ``device`` (``ResolvedRun.device``), not what the machine has: a CPU run on a GPU
    machine stays on gloo. A CUDA run keeps gloo beside nccl for what lives on the CPU (a
    checkpoint's bytes, the RNG state)."""
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=10)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pipeline x FSDP2 pretraining from a seed checkpoint. Any config key can be "
        "overridden with --section.key value.",
        epilog="examples:\n"
        "  seedckpt launch --nproc-per-node 4 train.py --config configs/debug.toml\n"
        "  seedckpt launch --nproc-per-node 4 train.py --config configs/debug.toml --training.steps 50 \\\n"
        "      --parallelism.pipeline_parallel_schedule Interleaved1F1B "
        "--parallelism.pipeline_parallel_stages_per_rank 2\n\n" + config_reference(),
    )
    parser.add_argument("--config", required=True, help="job config TOML, e.g. configs/debug.toml")
    opts, overrides = parser.parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    # DTensor's advice on the gradient norm's reductions over 2-D meshes (flatten the mesh dims) is
    # the code's to act on, not the user's: one line per rank of each run under TP or EP
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if rank != 0:
        quiet_library_logs()  # every rank sees the same data and config: rank 0 warns for all
    cfg = None
    try:  # every rank validates the same config, so rank 0 speaks for all
        cfg = load_config(opts.config, overrides)
        run = resolve(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # fail before any rendezvous
        if cfg.metrics.enable_tensorboard:
            MetricsLogger.check_tensorboard()
        if cfg.metrics.wandb:
            MetricsLogger.check_wandb()
        if cfg.metrics.mlflow:
            check_mlflow()
        check_output_folders(cfg)
        if cfg.training.compile:
            check_compile_supported(run.device)
        with contextlib.ExitStack() as run_lock:
            if rank == 0:  # one run per checkpoint.folder and per metrics file: a second fails here, naming the first
                run_lock.enter_context(destination_lock(cfg.checkpoint.folder))
                run_lock.enter_context(destination_lock(Path(cfg.job.dump_folder) / METRICS_FILE))
            run = run.with_start()
            if rank == 0:
                for note in run.notes:
                    print(f"[rank0] {note}", flush=True)
            check_resume_matches_osft(cfg, run.start)
            if run.start.step == cfg.training.steps:
                if rank == 0:
                    print(
                        f"[rank0] nothing to train: {run.start.path} already reached training.steps = "
                        f"{cfg.training.steps}; raise --training.steps to continue",
                        flush=True,
                    )
                return 0
            train = cfg.training
            data = make_dataset(cfg.data, run.args.vocab_size, train.seq_len, train.seed, train.row_tokens)
            return _train(run, data, rank)
    except SeedckptError as e:
        if rank == 0:
            print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the process group, or while tearing it down after the run
        if rank == 0:
            line = _interrupted_line(cfg.checkpoint.folder) if cfg is not None else "interrupted; nothing was written"
            print(f"train.py: {line}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _interrupted_line(folder: str) -> str:
    steps = complete_steps(folder)
    newest = (
        f"the newest checkpoint is {steps[max(steps)]}: the same command resumes from it"
        if steps
        else "no checkpoint was saved yet"
    )
    return "interrupted; no checkpoint is left half-written (a save in progress is finished or removed); " + newest


def _train(run: ResolvedRun, data, rank: int) -> int:
    stop_at_first_sigint()
    signals = SaveOnSignals(run.cfg.checkpoint.save_on_signals)
    _init_process_group(run.device)
    trainer = None
    try:
        trainer = Trainer(run, data)
        status = trainer.run(signals)
        finished = trainer.state.step == run.cfg.training.steps
    except BaseException as e:  # one report per failure, whichever ranks it reaches (rank_failures)
        return report_failure(e, rank, _interrupted_line(run.cfg.checkpoint.folder))
    finally:
        # Pipeline schedules keep P2P work objects in reference cycles; collected after the group is
        # gone (at interpreter exit) they abort the process ("terminate called without an active
        # exception", seen about once in six ZBV runs, and once after a Ctrl-C with async saves).
        # Free them, the trainer's included, while the group still exists.
        trainer = None
        gc.collect()
        dist.destroy_process_group()
    if status == 0 and finished and rank == 0 and run.cfg.checkpoint.export_at_end != "none":
        try:
            export_last_step(run.cfg)
        except KeyboardInterrupt:  # the run itself is complete and saved: say how to export it
            last = step_dir(run.cfg.checkpoint.folder, run.cfg.training.steps)
            print(
                f"train.py: interrupted while exporting {last}, which is complete; nothing was left half-written: "
                f"`seedckpt convert {last} {last}-hf --to hf --dtype {run.cfg.checkpoint.export_dtype}` exports it",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
    return status


def export_last_step(cfg: JobConfig) -> Path:
    """``checkpoint.export_at_end``: the last ``step-N`` as a Hugging Face directory beside it,
    written as ``seedckpt convert`` writes one (to a temporary name, renamed when complete). Run by
    rank 0 after the process group is gone: a large model's export takes longer than a collective
    may wait, and the other ranks have nothing to add."""
    ckpt = cfg.checkpoint
    last = step_dir(ckpt.folder, cfg.training.steps)
    out = last.with_name(f"{last.name}-{ckpt.export_at_end}")
    print(f"[rank0] exporting {last} to {out} ({ckpt.export_dtype}, checkpoint.export_at_end)", flush=True)
    convert(last, out, ckpt.export_at_end, dtype=ckpt.export_dtype, force=True, progress=False, dense=True)
    print(f"[rank0] exported {out}", flush=True)
    return out
