"""Job configuration: TOML files with torchtitan's section/key names, overridable from the CLI.

Precedence: dataclass defaults < TOML file < ``--section.key value`` arguments. Unknown sections
or keys are errors (with a suggestion), so a typo never silently falls back to a default.

``[model]`` takes ``name`` and ``flavor`` plus any ``ModelArgs`` field (e.g. ``n_layers = 8``),
which overrides the flavor -- handy for an 8B-shaped model with fewer layers.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.llama import LLAMA3_FLAVORS, ModelArgs, Transformer
from seedckpt.errors import SeedckptError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS = {"llama3": (Transformer, LLAMA3_FLAVORS)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    seed: int = 0
    mixed_precision_param: str = "float32"
    mixed_precision_reduce: str = "float32"
    # Save a checkpoint and exit after this step (0: run to `steps`), e.g. before a job's time
    # limit; the LR schedule still spans `steps`, so the resumed run continues exactly.
    stop_after_step: int = 0


@dataclass
class Parallelism:
    pipeline_parallel_degree: int = 1
    data_parallel_shard_degree: int = -1
    data_parallel_replicate_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_microbatches: int = -1  # -1: as many as stages
    pipeline_parallel_stages_per_rank: int = 1
    pipeline_parallel_split_points: list = field(default_factory=list)  # e.g. ["layers.4"]
    fsdp_impl: str = "fsdp2"
    fsdp_reshard_after_forward: str = "default"


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective
    selective_every: int = 2  # selective: checkpoint every k-th block


@dataclass
class Checkpoint:
    # Where a new run's weights come from: "seed_checkpoint" (load it) or "direct" (every rank
    # initializes its own shards from training.seed: bitwise what the seed made with it would hold).
    init_from: str = "seed_checkpoint"
    seed_checkpoint: str = ""
    folder: str = "./checkpoints"
    interval: int = 100
    keep_latest_k: int = 3


@dataclass
class Data:
    kind: str = "synthetic"  # synthetic | text | chat
    # text: a local text / JSONL {"text": ...} file (empty = the built-in corpus);
    # chat: JSONL {"messages": [...]} file(s), comma-separated or a directory of *.jsonl
    path: str = ""
    tokenizer: str = ""  # a Hugging Face tokenizer directory; empty = byte-level (text only)
    overflow: str = "truncate"  # chat: a conversation longer than seq_len + 1 tokens is truncated or dropped
    packing: bool = True  # chat: several conversations per row, attention masked per conversation


@dataclass
class Metrics:
    enable_tensorboard: bool = False
    log_freq: int = 1


@dataclass
class Profiling:
    steps: list = field(default_factory=list)  # e.g. [3, 4] (CLI: 3,4): Chrome traces of these steps


@dataclass
class Finetune:
    mode: str = "none"  # none | sft
    pretrained: str = ""  # sft: a DCP checkpoint of ours or a Hugging Face Llama directory
    osft_unfreeze_rank_ratio: float = 0.25
    osft_target_patterns: list = field(default_factory=list)


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
    cfg.model_args()  # validate flavor and overrides now, not deep inside a run
    return cfg


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
