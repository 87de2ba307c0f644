"""Job configuration: TOML files with torchtitan's section/key names, overridable from the CLI.

Precedence: dataclass defaults < TOML file < ``--section.key value`` arguments. Unknown sections
or keys are errors (with a suggestion), so a typo never silently falls back to a default. Choices
are ``Literal`` fields checked as they are read; ranges are checked by each section's ``validate``
once the file and every override are applied -- all before any process group exists.

``[model]`` takes ``name`` and ``flavor`` plus any ``ModelArgs`` field (e.g. ``n_layers = 8``),
which overrides the flavor -- handy for an 8B-shaped model with fewer layers.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from models.llama import LLAMA3_FLAVORS, ModelArgs, Transformer
from seedckpt.errors import SeedckptError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS = {"llama3": (Transformer, LLAMA3_FLAVORS)}
DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPES = {name: getattr(torch, name) for name in typing.get_args(DTypeName)}
# The torch.distributed.pipelining schedules the trainer builds and runs (torch 2.13). torch's
# get_schedule_class also accepts its abstract bases (PipelineScheduleSingle, PipelineScheduleMulti),
# which every rank would only crash on, and ignores case, which the V-layout and split-backward
# checks (exact names) would miss -- so the config takes exactly these names.
PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                           "ZBVZeroBubble", "DualPipeV"]


def _check(key: str, value, ok: bool, rule: str) -> None:
    """One range rule of one key: ``training.lr = -1.0; it must be a finite number > 0``."""
    if not ok:
        raise SeedckptError(f"{key} = {value!r}; it must be {rule}")


@dataclass
class Job:
    dump_folder: str = "./outputs"


@dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debug"
    overrides: dict = field(default_factory=dict)  # ModelArgs fields set in [model]
    given: set = field(default_factory=set)  # keys the user set (fine-tuning checks them against the checkpoint)


@dataclass
class Training:
    steps: int = 10
    local_batch_size: int = 8
    global_batch_size: int = -1
    seq_len: int = 128
    lr: float = 8e-4
    warmup_steps: int = 2
    max_norm: float = 1.0
    seed: int = 0  # any integer: it is hashed into each tensor's and each step's generator
    mixed_precision_param: DTypeName = "float32"
    mixed_precision_reduce: DTypeName = "float32"
    # Save a checkpoint and exit after this step (0: run to `steps`), e.g. before a job's time
    # limit; the LR schedule still spans `steps`, so the resumed run continues exactly.
    stop_after_step: int = 0

    def validate(self) -> None:
        for key in ("steps", "local_batch_size", "seq_len"):
            _check(f"training.{key}", getattr(self, key), getattr(self, key) >= 1, ">= 1")
        _check("training.global_batch_size", self.global_batch_size,
               self.global_batch_size == -1 or self.global_batch_size >= 1,
               ">= 1, or -1 for local_batch_size x the data-parallel degree")
        # nan passes no comparison and inf trains to nan: floats must be finite as well
        _check("training.lr", self.lr, math.isfinite(self.lr) and self.lr > 0, "a finite number > 0")
        _check("training.max_norm", self.max_norm, math.isfinite(self.max_norm) and self.max_norm >= 0,
               "a finite number >= 0 (0: no clipping)")
        _check("training.warmup_steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0")
        _check("training.stop_after_step", self.stop_after_step, self.stop_after_step >= 0,
               ">= 0 (0: run to training.steps)")


@dataclass
class Parallelism:
    pipeline_parallel_degree: int = 1
    data_parallel_shard_degree: int = -1
    data_parallel_replicate_degree: int = 1
    pipeline_parallel_schedule: PipelineSchedule = "1F1B"
    pipeline_parallel_microbatches: int = -1  # -1: as many as stages
    pipeline_parallel_stages_per_rank: int = 1
    pipeline_parallel_split_points: list = field(default_factory=list)  # e.g. ["layers.4"]
    # "manual": seedckpt.manual_fsdp, one flat sharded vector per stage and explicit collectives
    # (data parallelism only; see JobConfig.validate)
    fsdp_impl: Literal["fsdp2", "manual"] = "fsdp2"
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"

    def validate(self) -> None:
        """Each degree on its own; whether they multiply to the world size is ParallelDims' job."""
        for key in ("pipeline_parallel_degree", "data_parallel_replicate_degree", "pipeline_parallel_stages_per_rank"):
            _check(f"parallelism.{key}", getattr(self, key), getattr(self, key) >= 1, ">= 1")
        _check("parallelism.data_parallel_shard_degree", self.data_parallel_shard_degree,
               self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
               ">= 1, or -1 for the rest of the world size")
        _check("parallelism.pipeline_parallel_microbatches", self.pipeline_parallel_microbatches,
               self.pipeline_parallel_microbatches == -1 or self.pipeline_parallel_microbatches >= 1,
               ">= 1, or -1 for one per pipeline stage")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    selective_every: int = 2  # selective: checkpoint every k-th block

    def validate(self) -> None:
        _check("activation_checkpoint.selective_every", self.selective_every, self.selective_every >= 1, ">= 1")


@dataclass
class Checkpoint:
    # Where a new run's weights come from: "seed_checkpoint" (load it) or "direct" (every rank
    # initializes its own shards from training.seed: bitwise what the seed made with it would hold).
    init_from: Literal["seed_checkpoint", "direct"] = "seed_checkpoint"
    seed_checkpoint: str = ""
    folder: str = "./checkpoints"
    interval: int = 100  # 0: only at the end (and at training.stop_after_step)
    keep_latest_k: int = 3  # 0: keep all
    # Check every byte loaded against the CRC32C checksums the checkpoint records (a few % of a load).
    verify_checksums: bool = True

    def validate(self) -> None:
        _check("checkpoint.interval", self.interval, self.interval >= 0, ">= 0 (0: save only at the end)")
        _check("checkpoint.keep_latest_k", self.keep_latest_k, self.keep_latest_k >= 0, ">= 0 (0: keep all)")


@dataclass
class Data:
    kind: Literal["synthetic", "text", "chat"] = "synthetic"
    # text: a local text / JSONL {"text": ...} file (empty = the built-in corpus);
    # chat: JSONL {"messages": [...]} file(s), comma-separated or a directory of *.jsonl
    path: str = ""
    tokenizer: str = ""  # a Hugging Face tokenizer directory; empty = byte-level (text only)
    # chat: a conversation longer than seq_len + 1 tokens is truncated or dropped
    overflow: Literal["truncate", "drop"] = "truncate"
    packing: bool = True  # chat: several conversations per row, attention masked per conversation


@dataclass
class Metrics:
    enable_tensorboard: bool = False
    log_freq: int = 1
    # per-step DP all-gather/reduce-scatter calls and seconds; auto: on for manual FSDP (free), off for FSDP2
    collective_timing: Literal["auto", "on", "off"] = "auto"

    def validate(self) -> None:
        _check("metrics.log_freq", self.log_freq, self.log_freq >= 1, ">= 1 (log every log_freq-th step)")


@dataclass
class Profiling:
    steps: list = field(default_factory=list)  # e.g. [3, 4] (CLI: 3,4): Chrome traces of these steps

    def validate(self) -> None:
        """Entries are ints from TOML, text from the command line; the trainer reads them with int()."""
        ok = all(str(step).isdigit() and int(step) >= 1 for step in self.steps)
        _check("profiling.steps", self.steps, ok, "a list of step numbers >= 1, e.g. [3, 4] (command line: 3,4)")


@dataclass
class Finetune:
    mode: Literal["none", "sft", "osft"] = "none"
    pretrained: str = ""  # sft, osft: a DCP checkpoint of ours or a Hugging Face Llama directory
    osft_unfreeze_rank_ratio: float = 0.25  # osft: the trainable fraction of each target's rank
    osft_target_patterns: list = field(default_factory=list)

    def validate(self) -> None:
        ratio = self.osft_unfreeze_rank_ratio
        _check("finetune.osft_unfreeze_rank_ratio", ratio, 0.0 < ratio <= 1.0, "in (0, 1]")  # nan fails too


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    finetune: Finetune = field(default_factory=Finetune)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)

    def validate(self) -> None:
        """Every value on its own, then what one section needs of another. Runs once the TOML file
        and every override are applied (``load_config``), so a bad value fails before any process
        group or allocation. Fitting the model and the world size is ``ParallelDims.from_config``'s
        job: fine-tuning replaces the model's shape first (``pin_model_args``)."""
        for section in (self.training, self.parallelism, self.activation_checkpoint, self.checkpoint,
                        self.metrics, self.profiling, self.finetune):
            section.validate()
        if self.data.kind == "chat" and not self.data.tokenizer:
            raise SeedckptError("data.kind = 'chat' needs data.tokenizer: a Hugging Face tokenizer directory with a "
                                "chat template (tokenizer.json + tokenizer_config.json)")
        self._check_manual_fsdp()
        self.model_args()  # the flavor and the [model] overrides

    def _check_manual_fsdp(self) -> None:
        """Manual FSDP shards one whole stage over a flat data-parallel group: refuse, naming each
        key, what it has no code for (pipeline stages and their schedules, HSDP's 2-D mesh,
        OSFT's frozen factors and per-matrix projections)."""
        par = self.parallelism
        if par.fsdp_impl != "manual":
            return
        unsupported = [(key, value, fix) for key, value, fix, ok in (
            ("parallelism.pipeline_parallel_degree", par.pipeline_parallel_degree, "1",
             par.pipeline_parallel_degree == 1),
            ("parallelism.data_parallel_replicate_degree", par.data_parallel_replicate_degree, "1",
             par.data_parallel_replicate_degree == 1),
            ("finetune.mode", self.finetune.mode, "'none' or 'sft'", self.finetune.mode != "osft"),
        ) if not ok]
        if unsupported:
            found = ", ".join(f"{key} = {value!r}" for key, value, _ in unsupported)
            fixes = ", ".join(f"{key} = {fix}" for key, _, fix in unsupported)
            raise SeedckptError(f"parallelism.fsdp_impl = 'manual' (one flat shard over plain data parallelism) "
                                f"does not support {found}; set {fixes}, or use parallelism.fsdp_impl = 'fsdp2'")

    def model_args(self) -> ModelArgs:
        """The flavor's ModelArgs with the ``[model]`` overrides applied -- or, once fine-tuning has
        read them from the pretrained checkpoint, those (``pin_model_args``)."""
        if self._pinned_args is not None:
            return self._pinned_args
        flavors = _flavors(self.model.name)
        if self.model.flavor not in flavors:
            raise SeedckptError(f"unknown model.flavor {self.model.flavor!r} for {self.model.name}; "
                                f"choose one of {sorted(flavors)}")
        base = flavors[self.model.flavor].to_dict()
        try:
            return ModelArgs.from_dict({**base, **self.model.overrides})
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise SeedckptError(f"invalid [model] settings: {e}") from None

    _pinned_args: ModelArgs | None = field(default=None, repr=False)

    def pin_model_args(self, args: ModelArgs) -> None:
        self._pinned_args = args

    def build_model(self):
        """The model class for ``model.name`` instantiated with ``model_args()`` (use under a device context)."""
        return MODELS[self.model.name][0](self.model_args())


def _flavors(name: str) -> dict[str, ModelArgs]:
    if name not in MODELS:
        raise SeedckptError(f"unknown model.name {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name][1]


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read ``path`` (optional) and apply ``--section.key value`` overrides."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise SeedckptError(f"config file {path} not found; pass --config with a path such as "
                                "configs/debug.toml")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise SeedckptError(f"{path} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise SeedckptError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _set(cfg, section, key, value, source=str(path))
    for section, key, text in parse_overrides(overrides):
        _set(cfg, section, key, text, source="command line", from_text=True)
    cfg.validate()  # only now: an override may repair what the file set, or break it
    return cfg


def check_output_folders(cfg: JobConfig) -> None:
    """Create ``checkpoint.folder`` and ``job.dump_folder`` and prove each is writable by writing
    and deleting a file there -- so a read-only or mistyped path fails before rendezvous with the
    key that names it, not as an OSError at the first checkpoint after hours of training."""
    for key, folder in (("checkpoint.folder", cfg.checkpoint.folder), ("job.dump_folder", cfg.job.dump_folder)):
        if Path(folder).exists() and not Path(folder).is_dir():
            raise SeedckptError(f"{key} = {folder}: cannot write there (a file is in the way); "
                                "choose a writable directory")
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".seedckpt-write-probe-"):
                pass  # deleted on close
        except OSError as e:
            raise SeedckptError(f"{key} = {folder}: cannot write there ({e.strerror or e}); "
                                "choose a writable directory") from None


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


def _set(cfg: JobConfig, section: str, key: str, value, source: str, from_text: bool = False) -> None:
    sections = {f.name: f for f in dataclasses.fields(JobConfig) if not f.name.startswith("_")}
    if section not in sections:
        raise SeedckptError(f"{source}: unknown section [{section}]{_suggest(section, sections)}")
    target = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(target) if f.name not in ("overrides", "given")}
    if section == "model":
        target.given.add(key)
    if section == "model" and key not in fields:
        arg_fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
        if key not in arg_fields:
            raise SeedckptError(f"{source}: unknown key model.{key}"
                                f"{_suggest(key, {**fields, **arg_fields})}")
        target.overrides[key] = _coerce(f"model.{key}", _field_type(ModelArgs, key), value, source, from_text)
        return
    if key not in fields:
        raise SeedckptError(f"{source}: unknown key {section}.{key}{_suggest(key, fields)}")
    setattr(target, key, _coerce(f"{section}.{key}", _field_type(type(target), key), value, source, from_text))


def _field_type(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(name: str, typ, value, source: str, from_text: bool):
    """Convert ``value`` to ``typ``: command-line text is parsed, TOML values are type-checked."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # Optional[X]
        if value is None or (from_text and value.lower() in ("none", "null")):
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
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
