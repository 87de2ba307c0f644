"""The model a checkpoint holds, described to the checkpoint layer.

The checkpoint layer knows no model (``seedckpt.checkpoint.model``). This module describes one to
it from the model family (``models.family``: class, tied weights, HF and torchtitan names) and, for an
OSFT run's checkpoint, from the OSFT settings its manifest records (those targets hold SVD factors
instead of a weight). Every command and the stage builder open checkpoints through
``open_model_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from models.family import ModelFamily
from models.registry import DEFAULT_FAMILY, FAMILIES, family_of, family_of_model_type, get_family
from seedckpt.checkpoint import ModelLayout, OpenedCheckpoint, open_checkpoint
from seedckpt.checkpoint.manifest import MANIFEST_NAME, manifest_flavor, manifest_model, read_manifest
from seedckpt.checkpoint.untrusted import read_json
from seedckpt.finetune.osft import DenseOSFT, OSFTSettings, convert_to_osft, manifest_osft
from seedckpt.utils.errors import SeedckptError


class FamilyCodec:
    """A model family as the checkpoint layer's ``ModelCodec``."""

    def __init__(self, family: ModelFamily):
        self.family = family
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # by the model's args and OSFT settings, as JSON
        self._parameters: dict[str, int] = {}  # the same models' parameter counts (buffers left out)

    def layout(self, args, osft: OSFTSettings | None = None) -> ModelLayout:
        """The tensors ``args`` describes (built on ``meta``: nothing allocated); with ``osft``, its
        targets hold SVD factors instead of a weight. A start asks for the same model several times
        (the config's, the checkpoint's record, the resume's): it is built once per description."""
        key = self._key(args, osft)
        if key not in self._shapes:
            with torch.device("meta"):
                model = self.family.model(args)
                if osft is not None:
                    convert_to_osft(model, osft.patterns, osft.ratio)
                self._shapes[key] = {fqn: tuple(t.shape) for fqn, t in model.state_dict().items()}
                self._parameters[key] = sum(p.numel() for p in model.parameters())  # a tied matrix once
        shapes = dict(self._shapes[key])
        return ModelLayout(args, args.to_dict(), shapes, self.family.tied_weights(args), self.family.flavor_of(args))

    def parameter_count(self, args) -> int:
        """The parameters of ``args``'s model: its tensors less its buffers (an expert bias)."""
        self.layout(args)
        return self._parameters[self._key(args, None)]

    @staticmethod
    def _key(args, osft: OSFTSettings | None) -> str:
        return json.dumps([args.to_dict(), dataclasses.asdict(osft) if osft else None], sort_keys=True, default=str)

    def recorded_layout(self, manifest: dict) -> ModelLayout | None:
        model = manifest_model(manifest, "the manifest")
        if model is None:
            return None
        if model.get("name", self.family.name) != self.family.name:
            raise SeedckptError(
                f"it holds a {model['name']} model, not a {self.family.name} one: set model.name = {model['name']!r}"
            )
        try:
            args = self.family.args.from_dict(model["args"])
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"its model args do not describe a {self.family.name} model: {e!r}") from None
        return self.layout(args, manifest_osft(manifest))

    def hf_layout(self, config: dict) -> ModelLayout:
        model_type = config.get("model_type")
        if model_type is not None and model_type not in self.family.hf.model_types:
            other = family_of_model_type(model_type)
            if other is None:
                read = ", ".join(repr(t) for family in FAMILIES.values() for t in family.hf.model_types)
                raise SeedckptError(
                    f"config.json has model_type {model_type!r}, which no model family here reads (they read "
                    f"{read}); a family is added as 'Adding a family' in docs/model_families.md describes"
                )
            raise SeedckptError(
                f"config.json has model_type {model_type!r}, not a {self.family.name} model: set model.name = "
                f"{other.name!r}"
            )
        return self.layout(self.family.hf.args_from_config(config))

    def renamings(self, layout: ModelLayout | None) -> dict:
        args = layout.args if layout is not None else None
        return {tool: names(args) for tool, names in self.family.renamings.items()}

    def hf_names(self, layout: ModelLayout):
        return self.family.hf.names(layout.args)

    def hf_config(self, layout: ModelLayout, dtype: torch.dtype) -> dict:
        return self.family.hf.config(layout.args, dtype)


CODECS = {name: FamilyCodec(family) for name, family in FAMILIES.items()}


def parameter_count(family: ModelFamily, args) -> int:
    """The parameters of ``args``'s model, a tied matrix once, from its layout (built on ``meta``
    once per description: the start that opened its checkpoint has usually built it already)."""
    return codec_for(family.name).parameter_count(args)


def codec_for(name: str = DEFAULT_FAMILY) -> FamilyCodec:
    try:
        return CODECS[get_family(name).name]
    except ValueError as e:
        raise SeedckptError(str(e)) from None


def detect_family(path: str | Path) -> str:
    """The family a checkpoint says it holds: its manifest's model name or its ``config.json``'s
    ``model_type``; the default family where it says neither."""
    path = Path(path)
    if path.is_file():  # our safetensors and torch files embed the manifest
        name = (manifest_model(open_checkpoint(path).manifest, path) or {}).get("name")
        return name if name in FAMILIES else DEFAULT_FAMILY
    if (path / MANIFEST_NAME).is_file():
        name = (manifest_model(read_manifest(path), path) or {}).get("name")
        if name in FAMILIES:
            return name
    if (path / "config.json").is_file():
        config = read_json(path / "config.json", "config.json")
        family = family_of_model_type(config.get("model_type")) if isinstance(config, dict) else None
        if family is not None:
            return family.name
    return DEFAULT_FAMILY


def refuse_float64(checkpoint: OpenedCheckpoint, fix: str) -> None:
    """Weights load only where no value changes (into float32 at most), so float64 weights are cast
    once, on request (``seedckpt convert --dtype``), never silently by a reader: one line, ``fix``."""
    wide = [fqn for fqn, info in checkpoint.infos.items() if info.dtype == torch.float64]
    if wide:
        raise SeedckptError(
            f"{checkpoint.path} holds float64 weights ({len(wide)} tensors, e.g. {wide[0]}), which models here "
            f"hold in float32 at most: {fix}"
        )


def dense_view(source: OpenedCheckpoint) -> DenseOSFT:
    """An OSFT run's checkpoint as the dense model it computes, each target rebuilt only when read
    (one matrix in memory at a time): what a dense export of it holds."""
    args = source.require_args()
    return DenseOSFT(source, codec_for(family_of(args).name).layout(args))


def family_to_open(path: str | Path, args=None, model: str | None = None) -> str:
    """The family a checkpoint at ``path`` is opened as: ``model`` when given, else that of ``args``,
    else the one the checkpoint names (``detect_family``)."""
    return model or (family_of(args).name if args is not None else detect_family(path))


def open_model_checkpoint(
    path: str | Path, args=None, complete: bool = True, verify: bool = True, model: str | None = None
) -> OpenedCheckpoint:
    """``open_checkpoint`` for a ``model`` checkpoint (None: the family of ``args``, else the one the
    checkpoint names): the model it records is read, and ``args`` describes the model where it
    records none (a foreign DCP checkpoint, a torch.save file)."""
    codec = codec_for(family_to_open(path, args, model))
    return open_checkpoint(path, codec, codec.layout(args) if args is not None else None, complete, verify)


def _same_tensors(recorded: ModelLayout, args, grow_vocab: bool) -> bool:
    """Whether ``args`` has the tensors ``recorded`` has (its vocabulary rows, where they may grow): a
    shape field can differ and keep them all (``load_balance`` "aux_loss" or "none": no bias either way)."""
    vocab = recorded.args.vocab_size if grow_vocab and recorded.args.vocab_size < args.vocab_size else args.vocab_size
    return codec_for(family_of(args).name).layout(dataclasses.replace(args, vocab_size=vocab)).shapes == recorded.shapes


def check_args_match(checkpoint: OpenedCheckpoint, args, grow_vocab: bool = False) -> None:
    """Fail (before any allocation) if ``args`` (from a config) does not describe the model the
    checkpoint records: the fields that decide tensor shapes must agree (with ``grow_vocab``,
    ``args`` may have more vocabulary rows). A checkpoint that records no model is checked tensor
    by tensor at load time."""
    if checkpoint.recorded is None:
        return
    tied = family_of(args).tied_weights(args)  # a tied model has an untied one's shapes: values tell them apart
    checkpoint.refuse_distinct_tied({f: s for f, s in tied.items() if checkpoint.layout.aliases.get(f) != s})
    saved = checkpoint.recorded.args
    diffs = [
        f"{f}: checkpoint {getattr(saved, f)!r}, config {getattr(args, f)!r}"
        for f in family_of(args).shape_fields
        if getattr(saved, f) != getattr(args, f)
        and not (f == "vocab_size" and grow_vocab and saved.vocab_size < args.vocab_size)
    ]
    if diffs and not _same_tensors(checkpoint.recorded, args, grow_vocab):
        flavor = manifest_flavor(checkpoint.manifest)
        made_with = f" (model.flavor={flavor!r})" if flavor else ""
        # a run's step-N: the model was trained, not seeded -- the other way out is a new run
        other = (
            "start a new checkpoint.folder"
            if (checkpoint.manifest or {}).get("kind") == "train"
            else ("create a new seed for this config")
        )
        raise SeedckptError(
            f"config does not match checkpoint {checkpoint.path} ({'; '.join(diffs)}); use the "
            f"config it was made with{made_with} or {other}"
        )
