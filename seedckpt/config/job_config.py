"""Job configuration: TOML files with torchtitan's section/key names, overridable from the CLI.

Precedence: dataclass defaults < TOML file < ``--section.key value`` arguments. Unknown sections
or keys are errors (with a suggestion), so a typo never silently falls back to a default. Choices
are ``Literal`` fields checked as they are read; ranges are checked by each section's ``validate``
once the file and every override are applied -- all before any process group exists.

``[model]`` takes ``name`` and ``flavor`` plus any field of the family's args (e.g. ``n_layers =
8``), which overrides the flavor -- handy for an 8B-shaped model with fewer layers.

Every key carries a one-line doc (``option``); ``config_reference`` lists them all for ``--help``.
``load_config`` returns a frozen ``JobConfig``: the loader gathers and checks every value first and
then constructs the sections, so nothing can change a config once it is validated.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import signal
import sys
import tempfile
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from models.family import ModelFamily
from models.registry import DEFAULT_FAMILY, FAMILIES, get_family
from seedckpt.checkpoint.manifest import TOKENIZER_DIR
from seedckpt.data.mixture import parse_sources
from seedckpt.data.tokenizer import own_tokenizer
from seedckpt.materialize.model_checkpoint import detect_family
from seedckpt.utils.errors import SeedckptError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPES = {name: getattr(torch, name) for name in typing.get_args(DTypeName)}
# The torch.distributed.pipelining schedules the trainer builds and runs (torch 2.13). torch's
# get_schedule_class also accepts its abstract bases (PipelineScheduleSingle, PipelineScheduleMulti),
# which every rank would only crash on, and ignores case, which the V-layout and split-backward
# checks (exact names) would miss -- so the config takes exactly these names.
PipelineSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]


# The V-shaped schedules fail forward only (``eval``) in torch 2.13 (measured: an assertion in the
# schedule's runtime), so validation refuses them.
FORWARD_ONLY_FAILS = ("ZBVZeroBubble", "DualPipeV")


def _check(key: str, value, ok: bool, rule: str) -> None:
    """One range rule of one key: ``training.lr = -1.0; it must be a finite number > 0``."""
    if not ok:
        raise SeedckptError(f"{key} = {value!r}; it must be {rule}")


def option(default, doc: str, *, toml_key: bool = True):
    """A section field with its one-line doc, which ``config_reference`` (and so ``--help``) prints.

    ``toml_key=False`` marks a field the loader fills itself, which no TOML file or ``--section.key``
    may set. A list or read-only mapping default is rebuilt for each instance: dataclasses refuse an
    unhashable default (a list shared by every instance would be one list).
    """
    metadata = {"doc": doc, "toml_key": toml_key}
    if isinstance(default, (list, types.MappingProxyType)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _flavor_names() -> str:
    return "; ".join(f"{name}: {', '.join(family.flavors)}" for name, family in FAMILIES.items())


@dataclass(frozen=True)
class Job:
    """the run's outputs"""

    dump_folder: str = option(
        "./outputs", "metrics.jsonl, TensorBoard events (tensorboard/) and profiler traces (traces/) of the run"
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "where each rank trains: cuda:LOCAL_RANK with nccl, or cpu with gloo (auto: cuda when a GPU is visible)"
    )


@dataclass(frozen=True)
class Model:
    """the architecture; a new run's shape, checked against the checkpoint when fine-tuning"""

    name: str = option(DEFAULT_FAMILY, f"model family: {', '.join(FAMILIES)}")
    flavor: str = option("debug", f"preset shape of the family ({_flavor_names()})")
    overrides: Mapping = option(
        types.MappingProxyType({}),
        "the family's args fields set in [model], which override the flavor's",
        toml_key=False,
    )
    given: frozenset = option(
        frozenset(),
        "the [model] keys the user set (fine-tuning checks them against the pretrained checkpoint)",
        toml_key=False,
    )


@dataclass(frozen=True)
class Training:
    """the optimization loop (AdamW: [optimizer]; the schedule after warmup: [lr_scheduler])"""

    steps: int = option(10, "optimizer steps of the run; the learning-rate schedule spans them")
    local_batch_size: int = option(8, "sequences per data-parallel rank and step")
    global_batch_size: int = option(
        -1,
        "sequences per step over all data-parallel ranks; more than local x "
        "data-parallel degree accumulates gradients (-1: exactly that)",
    )
    seq_len: int = option(128, "tokens per sequence")
    lr: float = option(8e-4, "peak learning rate, reached after warmup_steps")
    warmup_steps: int = option(2, "steps of linear learning-rate warmup")
    max_norm: float = option(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = option(0, "any integer: hashed into each tensor's init generator and each step's data")
    mixed_precision_param: DTypeName = option(
        "float32", "dtype of the parameters in forward and backward (FSDP2's param_dtype; the optimizer keeps float32)"
    )
    mixed_precision_reduce: DTypeName = option("float32", "dtype gradients are reduced in across data-parallel ranks")
    stop_after_step: int = option(
        0,
        "save a checkpoint and exit after this step, e.g. before a job's time limit; "
        "the schedule still spans steps, so a resumed run continues exactly "
        "(0: run to steps)",
    )
    compile: bool = option(
        False,
        "torch.compile each transformer block (one graph shared by all of them) and the "
        "loss; checkpoints are unchanged, so compiled and eager runs resume each other",
    )
    max_tokens_per_rank: int = option(
        0,
        "SFT by token budget (chat, pretokenized; packed): each rank's micro-batch holds this many tokens, "
        "local_batch_size rows of max_tokens_per_rank / local_batch_size tokens filled with whole samples "
        "(seq_len still bounds a sample); the loss is per label token of the global batch, as always "
        "(0: rows of seq_len)",
    )
    loss_chunk_tokens: int = option(
        -1,
        "run the output projection and the cross-entropy this many tokens at a time, each chunk's gradients "
        "taken in forward, so at most one chunk's logits exist and none is computed twice (-1: chunks sized "
        "from the vocabulary so a chunk's float32 logits stay under 128 MiB, 1 GiB on a GPU, none when the "
        "micro-batch's fit; 0: the micro-batch's logits all at once)",
    )

    def validate(self) -> None:
        for key in ("steps", "local_batch_size", "seq_len"):
            _check(f"training.{key}", getattr(self, key), getattr(self, key) >= 1, ">= 1")
        _check(
            "training.global_batch_size",
            self.global_batch_size,
            self.global_batch_size == -1 or self.global_batch_size >= 1,
            ">= 1, or -1 for local_batch_size x the data-parallel degree",
        )
        # nan passes no comparison and inf trains to nan: floats must be finite as well
        _check("training.lr", self.lr, math.isfinite(self.lr) and self.lr > 0, "a finite number > 0")
        _check(
            "training.max_norm",
            self.max_norm,
            math.isfinite(self.max_norm) and self.max_norm >= 0,
            "a finite number >= 0 (0: no clipping)",
        )
        _check("training.warmup_steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0")
        _check(
            "training.loss_chunk_tokens",
            self.loss_chunk_tokens,
            self.loss_chunk_tokens >= -1,
            ">= 0, or -1 for chunks sized from the vocabulary (0: no chunks)",
        )
        _check(  # local_batch_size >= 1 was checked above
            "training.max_tokens_per_rank",
            self.max_tokens_per_rank,
            self.max_tokens_per_rank == 0
            or (self.max_tokens_per_rank % self.local_batch_size == 0 and self.row_tokens >= self.seq_len),
            f"a multiple of training.local_batch_size = {self.local_batch_size} whose rows (max_tokens_per_rank / "
            f"local_batch_size) hold training.seq_len = {self.seq_len} tokens, the longest sample; or 0 (off)",
        )
        _check(
            "training.stop_after_step",
            self.stop_after_step,
            self.stop_after_step >= 0,
            ">= 0 (0: run to training.steps)",
        )

    @property
    def row_tokens(self) -> int:
        """The length of a batch row: ``seq_len``, or a row's share of ``max_tokens_per_rank``."""
        return self.max_tokens_per_rank // self.local_batch_size if self.max_tokens_per_rank else self.seq_len


ParameterKind = Literal["norm", "bias", "embedding"]
TrainStatePart = Literal["optimizer", "lr_scheduler", "data", "rng"]


@dataclass(frozen=True)
class Optimizer:
    """AdamW: its hyperparameters (training.lr is the peak learning rate) and kernels"""

    betas: list[float] = option([0.9, 0.95], "AdamW's (beta1, beta2) (command line: 0.9,0.95)")
    eps: float = option(1e-8, "AdamW's epsilon, added to the second moment's root")
    weight_decay: float = option(0.1, "decoupled weight decay (fine-tuning usually takes 0)")
    weight_decay_exclude: list[ParameterKind] = option(
        [],
        'parameters trained without weight decay, any of "norm" (norm weights), "bias" and "embedding" '
        "(command line: norm,bias)",
    )
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = option(
        "auto",
        "fused: one kernel for all of a stage's tensors; foreach: batched per op; for-loop: per tensor "
        "(auto: fused on cuda, foreach on cpu, which on cpu computes what for-loop does, bitwise)",
    )

    def validate(self) -> None:
        ok = len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas)
        _check("optimizer.betas", self.betas, ok, "two numbers in [0, 1), e.g. [0.9, 0.95]")
        _check("optimizer.eps", self.eps, math.isfinite(self.eps) and self.eps > 0, "a finite number > 0")
        wd = self.weight_decay
        _check("optimizer.weight_decay", wd, math.isfinite(wd) and wd >= 0, "a finite number >= 0")


@dataclass(frozen=True)
class LrScheduler:
    """the learning rate after training.warmup_steps of linear warmup"""

    decay_type: Literal["cosine", "linear", "wsd", "constant"] = option(
        "cosine",
        "cosine or linear: decay from the peak to min_lr_factor x lr over the steps after warmup; wsd: "
        "warmup-stable-decay, the peak held, then a linear decay over the last decay_ratio of them; "
        "constant: the peak throughout",
    )
    decay_ratio: float = option(0.2, "wsd: the fraction of the steps after warmup spent decaying")
    min_lr_factor: float = option(0.1, "the learning rate the decay ends at, as a fraction of training.lr")

    def validate(self) -> None:
        ratio, floor = self.decay_ratio, self.min_lr_factor
        _check("lr_scheduler.decay_ratio", ratio, 0.0 < ratio <= 1.0, "in (0, 1]")  # nan fails too
        _check("lr_scheduler.min_lr_factor", floor, 0.0 <= floor <= 1.0, "in [0, 1]")


@dataclass(frozen=True)
class Parallelism:
    """the device mesh: pipeline stages x FSDP2 shards (x replicas) x tensor-parallel ranks"""

    pipeline_parallel_degree: int = option(1, "ranks along the pipeline (the mesh's pp dimension)")
    data_parallel_shard_degree: int = option(
        -1, "ranks each stage's parameters are sharded over (-1: the rest of the world size)"
    )
    data_parallel_replicate_degree: int = option(1, "replicas of the sharded model (HSDP when > 1)")
    tensor_parallel_degree: int = option(
        1, "ranks each block's matrices are split over (the innermost mesh dimension: keep it within a node)"
    )
    enable_sequence_parallel: bool = option(
        True, "with tensor parallelism: split the norms' activations along the sequence across the TP ranks"
    )
    expert_parallel_degree: int = option(
        1,
        "ranks each MoE layer's experts are split over (Shard(0), tokens sent to them by all-to-all); "
        "carved from the data_parallel_shard_degree x tensor_parallel_degree ranks, so it must divide "
        "their product and model.n_experts",
    )
    pipeline_parallel_schedule: PipelineSchedule = option("1F1B", "torch.distributed.pipelining schedule")
    pipeline_parallel_microbatches: int = option(-1, "microbatches per local batch (-1: one per pipeline stage)")
    pipeline_parallel_stages_per_rank: int = option(
        1, "pipeline stages each rank holds (2 or more for the interleaved and V schedules)"
    )
    pipeline_parallel_split_points: list = option(
        [],
        "the first layer of each stage after the first, e.g. "
        '["layers.4"] (command line: layers.4,layers.8; '
        "empty: stages cut to even compute, attention at training.seq_len)",
    )
    fsdp_impl: Literal["fsdp2", "manual"] = option(
        "fsdp2",
        "fsdp2: torch's fully_shard; manual: "
        "seedckpt.parallel.manual_fsdp, one flat sharded vector per "
        "stage and explicit collectives (data parallelism "
        "only)",
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = option(
        "default",
        "free the gathered parameters after forward (default: unless pipelining, where each "
        "microbatch would gather them again)",
    )

    def validate(self) -> None:
        """Each degree on its own; whether they multiply to the world size is ParallelDims' job."""
        for key in (
            "pipeline_parallel_degree",
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "expert_parallel_degree",
            "pipeline_parallel_stages_per_rank",
        ):
            _check(f"parallelism.{key}", getattr(self, key), getattr(self, key) >= 1, ">= 1")
        _check(
            "parallelism.data_parallel_shard_degree",
            self.data_parallel_shard_degree,
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            ">= 1, or -1 for the rest of the world size",
        )
        _check(
            "parallelism.pipeline_parallel_microbatches",
            self.pipeline_parallel_microbatches,
            self.pipeline_parallel_microbatches == -1 or self.pipeline_parallel_microbatches >= 1,
            ">= 1, or -1 for one per pipeline stage",
        )


@dataclass(frozen=True)
class ActivationCheckpoint:
    """recompute activations in backward instead of keeping them"""

    mode: Literal["none", "full", "selective"] = option(
        "none", "full: every transformer block; selective: every selective_every-th block"
    )
    selective_every: int = option(2, "selective: checkpoint every k-th block")

    def validate(self) -> None:
        _check("activation_checkpoint.selective_every", self.selective_every, self.selective_every >= 1, ">= 1")


@dataclass(frozen=True)
class Checkpoint:
    """where the weights come from and where the run saves"""

    init_from: Literal["seed_checkpoint", "direct"] = option(
        "seed_checkpoint",
        "a new run's weights: load seed_checkpoint, or direct: every rank initializes its own "
        "shards from training.seed (bitwise what the seed made with it would hold)",
    )
    seed_checkpoint: str = option("", "the seed checkpoint directory a new run loads")
    enable: bool = option(
        True, "false: the run saves no step-N (a benchmark or smoke run; it cannot be resumed or exported)"
    )
    folder: str = option("./checkpoints", "the run's step-N checkpoints; a run resumes from the latest complete one")
    interval: int = option(100, "save every this many steps (0: only at the end and at training.stop_after_step)")
    keep_latest_k: int = option(3, "step checkpoints kept, the older ones deleted (0: keep all)")
    keep_best: bool = option(
        False,
        "also keep the step-N with the lowest validation loss, whatever keep_latest_k (needs validation.enabled, "
        "and validation.interval a multiple of checkpoint.interval so that every validated step is saved)",
    )
    async_mode: Literal["disabled", "async"] = option(
        "disabled",
        "async: the step's state is copied in memory and written, checksummed and published by a "
        "background thread while training goes on (one save in flight; disabled: training waits)",
    )
    verify_checksums: bool = option(
        True, "check every byte loaded against the CRC32C checksums the checkpoint records (a few % of a load)"
    )
    save_on_signals: list[str] = option(
        ["SIGTERM", "SIGUSR1"],
        "signals that make every rank finish its step, save step-N and exit with 128 + the signal "
        "(a scheduler's warning before preemption, e.g. Slurm's --signal=USR1@90; [] to leave them alone)",
    )
    export_at_end: Literal["none", "hf"] = option(
        "none",
        "hf: once the last step is saved, also write it as a Hugging Face directory (model, config and, for "
        "fine-tuning, the tokenizer) at checkpoint.folder/step-N-hf, as `seedckpt convert --to hf` does",
    )
    export_dtype: DTypeName = option("bfloat16", "the dtype of the exported weights (export_at_end)")
    load_step: int = option(-1, "resume this step-N of checkpoint.folder, not the newest (-1: the newest)")
    exclude_from_loading: list[TrainStatePart] = option(
        [],
        'what a resume does not load, any of "optimizer" (fresh AdamW moments), "lr_scheduler" (the schedule '
        'starts again, warmup included), "data" (batches start again from the first), "rng" (derived from '
        "training.seed, the rank and the step) (command line: optimizer,lr_scheduler)",
    )
    initial_load_path: str = option(
        "",
        "a new run's start (no step-N in checkpoint.folder yet), instead of seed_checkpoint: another run's "
        "step-N, a seed or a Hugging Face directory of the same model",
    )
    initial_load_model_only: bool = option(
        True,
        "initial_load_path: load its weights only and start at step 0 (false: a step-N's whole train state, "
        "continuing from its step in this run's folder)",
    )

    def validate(self) -> None:
        _check("checkpoint.interval", self.interval, self.interval >= 0, ">= 0 (0: save only at the end)")
        _check(
            "checkpoint.export_at_end",
            self.export_at_end,
            self.enable or self.export_at_end == "none",
            '"none" while checkpoint.enable = false (the export is of the last saved step)',
        )
        _check("checkpoint.keep_latest_k", self.keep_latest_k, self.keep_latest_k >= 0, ">= 0 (0: keep all)")
        _check("checkpoint.load_step", self.load_step, self.load_step >= 1 or self.load_step == -1, ">= 1, or -1")
        # SIGKILL and SIGSTOP cannot be caught; Ctrl-C's SIGINT has its own handling (stop at once)
        catchable = set(signal.Signals.__members__) - {"SIGKILL", "SIGSTOP", "SIGINT"}
        bad = [name for name in self.save_on_signals if name not in catchable]
        _check("checkpoint.save_on_signals", bad, not bad, "signals a run can catch, e.g. SIGTERM, SIGUSR1, SIGUSR2")


@dataclass(frozen=True)
class Data:
    """the training tokens"""

    kind: Literal["synthetic", "text", "tokens", "chat", "pretokenized"] = option(
        "synthetic",
        "synthetic: random tokens; text: a corpus; tokens: a corpus tokenized once by `seedckpt tokenize`, "
        "read window by window; chat: conversations, loss on assistant tokens; pretokenized: Mini Trainer's "
        'JSONL {"input_ids", "labels"} (-100: no loss), packed as chat is',
    )
    path: str = option(
        "",
        'text: text, JSONL {"text": ...} or parquet file(s) (empty: the built-in corpus); tokens: the token directory '
        "(`seedckpt tokenize`; with --chat, conversations packed as chat); chat, pretokenized: JSONL file(s), "
        "comma-separated or a directory of *.jsonl",
    )
    sources: list = option(
        [],
        "tokens: a weighted mixture of token directories instead of data.path: [[data.sources]] tables with "
        'path and weight (kind = "tokens" optional), or ["tokens/web:0.7", "tokens/code:0.3"] (command line: '
        "tokens/web:0.7,tokens/code:0.3); each row draws its source with these weights",
    )
    tokenizer: str = option(
        "",
        "a Hugging Face tokenizer directory (empty: fine-tuning chat data or text files takes the one "
        "finetune.pretrained carries; else byte-level, text only)",
    )
    overflow: Literal["truncate", "drop"] = option(
        "truncate",
        "chat, pretokenized, chat token directories: what happens to a sample longer than seq_len + 1 tokens",
    )
    packing: bool = option(
        True,
        "chat, pretokenized, chat token directories: several samples per row, attention masked per sample "
        "(its own document)",
    )


@dataclass(frozen=True)
class Metrics:
    """what each step logs"""

    enable_tensorboard: bool = option(False, "also write TensorBoard events to job.dump_folder/tensorboard")
    log_freq: int = option(1, "log every log_freq-th step (and the last one)")
    wandb: bool = option(
        False,
        "also log each step to Weights & Biases (pip install 'seedckpt[wandb]'; WANDB_MODE=offline works); "
        "a resumed run continues the same W&B run",
    )
    wandb_project: str = option("seedckpt", "metrics.wandb: the W&B project")
    wandb_run_name: str = option("", "metrics.wandb: the run's name in W&B (empty: job.dump_folder's name)")
    mlflow: bool = option(
        False,
        "also log each step to MLflow (pip install 'seedckpt[mlflow]'); a resumed run continues the same MLflow run",
    )
    mlflow_tracking_uri: str = option(
        "", "metrics.mlflow: the tracking store (empty: sqlite:///<job.dump_folder>/mlflow.db; or http://host:5000)"
    )
    mlflow_experiment: str = option("seedckpt", "metrics.mlflow: the MLflow experiment")
    mlflow_run_name: str = option("", "metrics.mlflow: the run's name in MLflow (empty: job.dump_folder's name)")
    collective_timing: Literal["auto", "on", "off"] = option(
        "auto",
        "per-step data-parallel all-gather / reduce-scatter calls and seconds; auto: on for manual FSDP "
        "(it issues them itself: free), off for FSDP2 (timing swaps its comms through a private API)",
    )

    def validate(self) -> None:
        _check("metrics.log_freq", self.log_freq, self.log_freq >= 1, ">= 1 (log every log_freq-th step)")


@dataclass(frozen=True)
class Validation:
    """a held-out loss during training"""

    enabled: bool = option(False, "compute the validation loss every interval steps and at the last step")
    interval: int = option(100, "steps between validations")
    steps: int = option(4, "global batches per validation: the same batches every time, so the losses compare")
    path: str = option(
        "",
        "the held-out data, in data.kind's format (data.path's syntax); synthetic data needs none: it draws "
        "batches of its own",
    )

    def validate(self) -> None:
        _check("validation.interval", self.interval, self.interval >= 1, ">= 1")
        _check("validation.steps", self.steps, self.steps >= 1, ">= 1")


@dataclass(frozen=True)
class Profiling:
    """torch profiler traces"""

    steps: list = option([], "steps to trace, e.g. [3, 4] (command line: 3,4): Chrome traces in job.dump_folder/traces")

    def validate(self) -> None:
        """Entries are ints from TOML, text from the command line; the trainer reads them with int()."""
        ok = all(str(step).isdigit() and int(step) >= 1 for step in self.steps)
        _check("profiling.steps", self.steps, ok, "a list of step numbers >= 1, e.g. [3, 4] (command line: 3,4)")


@dataclass(frozen=True)
class Finetune:
    """start from pretrained weights instead of a seed"""

    mode: Literal["none", "sft", "osft"] = option(
        "none", "none: pretraining; sft: full fine-tuning; osft: orthogonal subspace fine-tuning"
    )
    pretrained: str = option(
        "", "sft, osft: a DCP checkpoint of ours or a Hugging Face directory of model.name's family"
    )
    osft_unfreeze_rank_ratio: float = option(0.25, "osft: the trainable fraction of each target's rank")
    osft_target_patterns: list = option(
        [],
        "osft: the block linears to train, by name suffix or regular "
        "expression (empty: the family's defaults, every attention and "
        "feed-forward matrix)",
    )

    def validate(self) -> None:
        ratio = self.osft_unfreeze_rank_ratio
        _check("finetune.osft_unfreeze_rank_ratio", ratio, 0.0 < ratio <= 1.0, "in (0, 1]")  # nan fails too


@dataclass(frozen=True)
class JobConfig:
    """One job's settings, one frozen dataclass per ``[section]``: built once by ``load_config`` and
    then only read, so every rank and every part of the run sees the values that were validated."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LrScheduler = field(default_factory=LrScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    finetune: Finetune = field(default_factory=Finetune)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)

    def validate(self) -> None:
        """Every value on its own, then what one section needs of another. Runs once the TOML file
        and every override are applied (``load_config``), so a bad value fails before any process
        group or allocation. Fitting the model and the world size is ``resolve``'s job (fine-tuning's
        model comes from its pretrained checkpoint)."""
        for section in (
            self.training,
            self.optimizer,
            self.lr_scheduler,
            self.parallelism,
            self.activation_checkpoint,
            self.checkpoint,
            self.metrics,
            self.validation,
            self.profiling,
            self.finetune,
        ):
            section.validate()
        if self.checkpoint.initial_load_path and self.finetune.mode != "none":
            raise SeedckptError(
                "checkpoint.initial_load_path and finetune.mode = "
                f"{self.finetune.mode!r} both name the weights a run starts from; fine-tuning starts from "
                "finetune.pretrained: set one of them"
            )
        if self.data.sources:
            if self.data.kind != "tokens" or self.data.path:
                raise SeedckptError(
                    "data.sources mixes token directories: set data.kind = 'tokens' and leave data.path empty "
                    f"(got data.kind = {self.data.kind!r}, data.path = {self.data.path!r})"
                )
            parse_sources(self.data.sources)
        schedule = self.parallelism.pipeline_parallel_schedule
        if self.validation.enabled and self.parallelism.pipeline_parallel_degree > 1 and schedule in FORWARD_ONLY_FAILS:
            raise SeedckptError(
                f"validation.enabled with parallelism.pipeline_parallel_schedule = {schedule!r}: torch 2.13 cannot "
                "run that schedule forward only; choose another schedule (1F1B, Interleaved1F1B, "
                "InterleavedZeroBubble, ...) or leave validation off"
            )
        if self.validation.enabled and not self.validation.path and self.data.kind != "synthetic":
            raise SeedckptError(
                f"validation.enabled needs validation.path: held-out data in data.kind = {self.data.kind!r}'s format"
            )
        budget = self.training.max_tokens_per_rank
        if budget and not (self.data.kind in ("chat", "pretokenized", "tokens") and self.data.packing):
            raise SeedckptError(
                f"training.max_tokens_per_rank = {budget} packs SFT samples into rows of that many tokens: it needs "
                f"data.kind = 'chat', 'pretokenized' or 'tokens' (a `seedckpt tokenize --chat` directory) with "
                f"data.packing = true (got data.kind = {self.data.kind!r}, data.packing = {self.data.packing})"
            )
        ckpt, val = self.checkpoint, self.validation
        if ckpt.keep_best and not (val.enabled and ckpt.enable and ckpt.interval and val.interval % ckpt.interval == 0):
            raise SeedckptError(
                "checkpoint.keep_best keeps the saved step with the lowest validation loss: it needs "
                "validation.enabled = true and validation.interval a multiple of checkpoint.interval (got "
                f"validation.enabled = {val.enabled}, validation.interval = {val.interval}, checkpoint.interval = "
                f"{ckpt.interval}, checkpoint.enable = {ckpt.enable})"
            )
        if self.data.kind == "chat" and not self.data.tokenizer:
            self._refuse_chat_without_tokenizer()
        self._check_manual_fsdp()
        if self.finetune.mode == "none":
            self.model_args()  # the flavor and the [model] overrides
        else:  # they apply to the pretrained checkpoint's args (``finetune.pretrained``); the depth bound here
            check_layer_count(self.model.overrides)

    def _refuse_chat_without_tokenizer(self) -> None:
        """Chat data is rendered with a tokenizer's chat template. A fine-tune whose checkpoint is
        missing is left to the start, which names that first."""
        ft = self.finetune
        if ft.mode != "none" and not (ft.pretrained and Path(ft.pretrained).exists()):
            return
        carries = (
            f", and finetune.pretrained {ft.pretrained} carries none (no tokenizer.json in it or in its "
            f"{TOKENIZER_DIR}/)"
            if ft.mode != "none"
            else ""
        )
        raise SeedckptError(
            f"data.kind = 'chat' needs data.tokenizer{carries}: set --data.tokenizer to a Hugging Face tokenizer "
            "directory with a chat template (tokenizer.json + tokenizer_config.json)"
        )

    def _check_manual_fsdp(self) -> None:
        """Manual FSDP shards one whole stage over a flat data-parallel group: refuse, naming each
        key, what it has no code for (pipeline stages and their schedules, HSDP's 2-D mesh, experts
        sharded over a mesh of their own, OSFT's frozen factors and per-matrix projections,
        parameter groups in one flat vector)."""
        par = self.parallelism
        if par.fsdp_impl != "manual":
            return
        unsupported = [
            (key, value, fix)
            for key, value, fix, ok in (
                (
                    "parallelism.pipeline_parallel_degree",
                    par.pipeline_parallel_degree,
                    "1",
                    par.pipeline_parallel_degree == 1,
                ),
                (
                    "parallelism.data_parallel_replicate_degree",
                    par.data_parallel_replicate_degree,
                    "1",
                    par.data_parallel_replicate_degree == 1,
                ),
                (
                    "parallelism.tensor_parallel_degree",
                    par.tensor_parallel_degree,
                    "1",
                    par.tensor_parallel_degree == 1,
                ),
                (
                    "parallelism.expert_parallel_degree",
                    par.expert_parallel_degree,
                    "1",
                    par.expert_parallel_degree == 1,
                ),
                ("finetune.mode", self.finetune.mode, "'none' or 'sft'", self.finetune.mode != "osft"),
                (
                    "optimizer.weight_decay_exclude",
                    self.optimizer.weight_decay_exclude,
                    "[]",
                    not self.optimizer.weight_decay_exclude,
                ),
            )
            if not ok
        ]
        if unsupported:
            found = ", ".join(f"{key} = {value!r}" for key, value, _ in unsupported)
            fixes = ", ".join(f"{key} = {fix}" for key, _, fix in unsupported)
            raise SeedckptError(
                f"parallelism.fsdp_impl = 'manual' (one flat shard over plain data parallelism) "
                f"does not support {found}; set {fixes}, or use parallelism.fsdp_impl = 'fsdp2'"
            )

    def to_dict(self) -> dict:
        """Every section's keys and values as a TOML file would set them, ``[model]``'s args
        overrides among its keys: plain data, for a tracker's run config."""
        out = {
            section: {k: getattr(getattr(self, section), k) for k in _toml_keys(cls)}
            for section, cls in _sections().items()
        }
        out["model"].update(self.model.overrides)
        return out

    def model_args(self):
        """The flavor's args with the ``[model]`` overrides applied: the model this config
        describes. A run's model is ``resolve``'s (fine-tuning takes the pretrained checkpoint's)."""
        flavors = self.model_family().flavors
        if self.model.flavor not in flavors:
            raise SeedckptError(
                f"unknown model.flavor {self.model.flavor!r} for {self.model.name}; choose one of {sorted(flavors)}"
            )
        base = flavors[self.model.flavor].to_dict()
        check_layer_count(self.model.overrides)
        try:
            return self.model_family().args.from_dict({**base, **self.model.overrides})
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise SeedckptError(f"invalid [model] settings: {e}") from None

    def model_family(self) -> ModelFamily:
        """The family of ``model.name``: its class, flavors, hooks and name adapters."""
        try:
            return get_family(self.model.name)
        except ValueError as e:
            raise SeedckptError(str(e)) from None

    def build_model(self):
        """The model ``model.name`` with ``model_args()`` (use under a device context)."""
        return self.model_family().model(self.model_args())


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read ``path`` (optional) and apply ``--section.key value`` overrides; returns a frozen JobConfig."""
    settings = _Settings()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise SeedckptError(f"config file {path} not found; pass --config with a path such as configs/debug.toml")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise SeedckptError(f"{path} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise SeedckptError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                settings.set(section, key, value, source=str(path))
    for section, key, text in parse_overrides(overrides):
        settings.set(section, key, text, source="command line", from_text=True)
    cfg = with_pretrained_tokenizer(settings.build())
    cfg.validate()  # only now: an override may repair what the file set, or break it
    return cfg


def with_pretrained_tokenizer(cfg: JobConfig) -> JobConfig:
    """A fine-tune that tokenizes (chat data, text files) and names no ``data.tokenizer`` takes the
    tokenizer ``finetune.pretrained`` carries: the ids its model was trained with, never byte-level
    ids. Filled in here, as the file and command line are read, so that every part of the run (the
    data, the tokenizer saved with each ``step-N``, the run's recorded config) sees the same one.
    Whether a tokenizer that *is* named keeps the model's ids is checked when the run starts
    (``finetune.pretrained.finetune_model``)."""
    data, ft = cfg.data, cfg.finetune
    tokenizes = data.kind == "chat" or (data.kind == "text" and data.path)
    if data.tokenizer or ft.mode == "none" or not ft.pretrained or not tokenizes:
        return cfg
    own = own_tokenizer(ft.pretrained)
    return dataclasses.replace(cfg, data=dataclasses.replace(data, tokenizer=str(own))) if own else cfg


def config_reference(width: int = 100) -> str:
    """Every section and key with its type or choices, default and doc, as ``--help`` prints it.

    Rendered from the dataclasses themselves, so the listing cannot drift from what the loader
    accepts (a test checks that every field has a doc)."""
    sections = _sections()
    defaults = {section: cls() for section, cls in sections.items()}
    rows = {
        section: [
            (
                f"  {key} = {_toml_literal(getattr(defaults[section], key))}",
                f"({_type_name(_field_type(cls, key))}) {f.metadata.get('doc', '')}",
            )
            for key, f in _toml_keys(cls).items()
        ]
        for section, cls in sections.items()
    }
    column = 2 + max(len(setting) for section_rows in rows.values() for setting, _ in section_rows)
    lines = ["config keys (TOML: [section] key = value; command line, which wins: --section.key value):"]
    for section, cls in sections.items():
        lines += ["", f"[{section}]  {cls.__doc__}"]
        for setting, doc in rows[section]:
            wrapped = textwrap.wrap(doc, width=max(width - column, 30), break_on_hyphens=False)
            lines.append(setting.ljust(column) + wrapped[0])
            lines += [" " * column + more for more in wrapped[1:]]
        if cls is Model:
            for name, family in FAMILIES.items():
                lines += textwrap.wrap(
                    f"and for {name}, any {family.args.__module__}.{family.args.__name__} field, "
                    "which replaces the flavor's value: "
                    f"{', '.join(f.name for f in dataclasses.fields(family.args))}",
                    width=width,
                    initial_indent="  ",
                    subsequent_indent="    ",
                )
    return "\n".join(lines)


def _toml_literal(value) -> str:
    """A default as it would be written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(item) for item in value) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _type_name(typ) -> str:
    if typing.get_origin(typ) is list and typing.get_args(typ):
        return f"list of {_type_name(typing.get_args(typ)[0])}"
    if typing.get_origin(typ) is Literal:
        return " | ".join(json.dumps(choice) for choice in typing.get_args(typ))
    return typ.__name__


def check_output_folders(cfg: JobConfig) -> None:
    """Create ``checkpoint.folder`` and ``job.dump_folder`` and prove each is writable by writing
    and deleting a file there -- so a read-only or mistyped path fails before rendezvous with the
    key that names it, not as an OSError at the first checkpoint after hours of training. The
    checkpoint folder must lie apart from the checkpoint the run starts from: a run writing its
    ``step-N`` inside its seed (or around its pretrained step) would have them pruned or deleted
    with it."""
    folder = Path(cfg.checkpoint.folder).resolve()
    key, start = (
        ("finetune.pretrained", cfg.finetune.pretrained)
        if cfg.finetune.mode != "none"
        else ("checkpoint.initial_load_path", cfg.checkpoint.initial_load_path)
        if cfg.checkpoint.initial_load_path
        else ("checkpoint.seed_checkpoint", cfg.checkpoint.seed_checkpoint)
    )
    source = Path(start).resolve() if start else None
    if source is not None and (folder == source or folder in source.parents or source in folder.parents):
        raise SeedckptError(
            f"checkpoint.folder = {cfg.checkpoint.folder} and {key} = {start} overlap: the run's step-N "
            "checkpoints would live in, or around, the checkpoint it starts from; choose a checkpoint.folder "
            "apart from it"
        )
    for key, folder in (("checkpoint.folder", cfg.checkpoint.folder), ("job.dump_folder", cfg.job.dump_folder)):
        if Path(folder).exists() and not Path(folder).is_dir():
            raise SeedckptError(
                f"{key} = {folder}: cannot write there (a file is in the way); choose a writable directory"
            )
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".seedckpt-write-probe-"):
                pass  # deleted on close
        except OSError as e:
            raise SeedckptError(
                f"{key} = {folder}: cannot write there ({e.strerror or e}); choose a writable directory"
            ) from None


def parse_overrides(args: typing.Sequence[str]) -> list[tuple[str, str, str]]:
    """``["--training.steps", "5", "--model.flavor=8B"]`` -> ``[(section, key, text), ...]``."""
    out, args = [], list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise SeedckptError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise SeedckptError(f"{arg} needs a value, e.g. {arg} 4")
            value = args[i + 1]
            i += 1
        section, _, key = name.partition(".")
        out.append((section, key, value))
        i += 1
    return out


class _Settings:
    """What the TOML file and the command line set, each value typed and checked as it is read (a
    later one replaces an earlier one); ``build`` then constructs the frozen config in one go."""

    def __init__(self):
        self.sections = _sections()
        self.values: dict[str, dict] = {section: {} for section in self.sections}
        self.model_args: dict = {}  # the family's args fields set in [model]: (value, source, from_text)

    def set(self, section: str, key: str, value, source: str, from_text: bool = False) -> None:
        if section not in self.sections:
            raise SeedckptError(f"{source}: unknown section [{section}]{_suggest(section, self.sections)}")
        cls = self.sections[section]
        keys = _toml_keys(cls)
        if section == "model" and key not in keys:  # checked once model.name is known: build()
            self.model_args[key] = (value, source, from_text)
            return
        if key not in keys:
            raise SeedckptError(f"{source}: unknown key {section}.{key}{_suggest(key, keys)}")
        self.values[section][key] = _coerce(f"{section}.{key}", _field_type(cls, key), value, source, from_text)

    def build(self) -> JobConfig:
        name, _ = self._family()
        model = {
            **self.values["model"],
            "name": name,
            "overrides": types.MappingProxyType(self._model_args()),
            "given": frozenset(self.values["model"]) | frozenset(self.model_args),
        }
        return JobConfig(
            **{
                section: cls(**(model if section == "model" else self.values[section]))
                for section, cls in self.sections.items()
            }
        )

    def _family(self) -> tuple[str, str]:
        """The family whose args ``[model]`` takes, and why in words: ``model.name``; for a fine-tune
        that names none, the pretrained checkpoint's (its manifest's model, its ``config.json``'s
        ``model_type``), as ``convert`` and ``load_model`` take it; else the default. A family the user
        names is the one the checkpoint is opened as: another family's is refused then, naming both."""
        if "name" in self.values["model"]:
            return self.values["model"]["name"], ""
        finetune = self.values["finetune"]
        pretrained = finetune.get("pretrained", Finetune.pretrained)
        if finetune.get("mode", Finetune.mode) != "none" and pretrained and Path(pretrained).exists():
            return detect_family(pretrained), f", the family of finetune.pretrained {pretrained}"
        return Model.name, ""

    def _model_args(self) -> dict:
        """The ``[model]`` keys that are fields of the family's args (``_family``), each typed."""
        name, why = self._family()
        try:
            args = get_family(name).args
        except ValueError as e:
            raise SeedckptError(str(e)) from None
        fields = {f.name: f for f in dataclasses.fields(args)}
        typed = {}
        for key, (value, source, from_text) in self.model_args.items():
            if key not in fields:
                choices = {**_toml_keys(Model), **fields}
                family = f" for {name}{why}" if why else ""
                raise SeedckptError(f"{source}: unknown key model.{key}{family}{_suggest(key, choices)}")
            typed[key] = _coerce(f"model.{key}", _field_type(args, key), value, source, from_text)
        return typed


def _sections() -> dict[str, type]:
    """``[section]`` name -> its dataclass, in JobConfig's order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig) if not f.name.startswith("_")}


def _toml_keys(section_cls) -> dict[str, dataclasses.Field]:
    """The fields of a section a TOML file or ``--section.key`` may set (not those the loader fills)."""
    return {f.name: f for f in dataclasses.fields(section_cls) if f.metadata.get("toml_key", True)}


def _field_type(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(name: str, typ, value, source: str, from_text: bool):
    """Convert ``value`` to ``typ``: command-line text is parsed, TOML values are type-checked."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # Optional[X]
        if value is None or (from_text and value.lower() in ("none", "null")):
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if typing.get_origin(typ) is list and typing.get_args(typ):  # list[float], list[Literal[...]]
        items = _parse_text(value, list) if from_text else value
        if not isinstance(items, list):
            raise SeedckptError(f"{source}: {name} expects a list, got {value!r}")
        (item,) = typing.get_args(typ)
        return [_coerce(name, item, v, source, from_text) for v in items]
    if typing.get_origin(typ) is Literal:  # a choice: TOML and command-line text alike give the name
        allowed = typing.get_args(typ)
        if value not in allowed:
            raise SeedckptError(f"{source}: {name} = {value!r}; this version supports {', '.join(allowed)}")
        return value
    bad = SeedckptError(f"{source}: {name} expects {getattr(typ, '__name__', typ)}, got {value!r}")
    if from_text:
        try:
            value = _parse_text(value, typ)
        except ValueError:
            raise bad from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if dataclasses.is_dataclass(typ) and isinstance(value, dict):
        return value  # a TOML table such as rope_scaling; ModelArgs validates its fields
    if not isinstance(value, typ) or (typ in (int, float) and isinstance(value, bool)):
        raise bad
    return value


def _parse_text(text: str, typ):
    if typ is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    if typ is list:
        return [v.strip() for v in text.split(",") if v.strip()]
    if typ in (int, float, str):
        return typ(text)
    raise ValueError(f"{typ} cannot be set from the command line; set it in the TOML file")


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; valid: {', '.join(sorted(choices))}"


# The deepest released decoders have under 130 layers (Llama 3.1 405B: 126). Wherever a model is built
# on ``meta`` -- the config check's pipeline split, ``seedckpt plan``, each rank's stage build, the
# seed -- every layer is tens of Python objects, about 35 KB and a few milliseconds a layer here, and
# the balanced split's search grows with the square of the layer count: 1024 layers resolve and plan
# in seconds within half a GB, 10**8 would take days and terabytes. A deeper model is refused at once.
MAX_LAYERS = 1024


def check_layer_count(overrides: dict) -> None:
    """Refuse ``model.n_layers`` above ``MAX_LAYERS`` before the model's args exist: some families'
    args compute a tuple over the layers (their windows, their experts) when they are built."""
    n_layers = overrides.get("n_layers")
    if isinstance(n_layers, int) and n_layers > MAX_LAYERS:
        raise SeedckptError(
            f"model.n_layers = {n_layers}: at most {MAX_LAYERS} layers are supported (each is built as Python "
            "objects on meta, about 35 KB apiece, and the pipeline split grows with their square); lower model.n_layers"
        )
