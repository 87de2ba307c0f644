"""``seedckpt.json``, the manifest beside every checkpoint we write, and the names it relies on.

The manifest records: format version, kind (seed | train | converted), model name, flavor and full
model arguments (as the caller's model spec spells them), seed, dtype, parameter count, per-tensor
shape/dtype, torch and seedckpt versions, and the byte position of every item's raw data
(``raw_items``, see ``owned_reads``). It is parsed here and nowhere else.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from seedckpt.checkpoint.untrusted import MAX_JSON_BYTES, parse_json, read_bounded
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.version import VERSION

MANIFEST_NAME = "seedckpt.json"
FORMAT_VERSION = 2  # 2: checksum pieces sized per item (``integrity.piece_bytes``); 1: 1 MiB pieces
RAW_ITEMS_KEY = "raw_items"  # {file: [[item offset, raw data offset, raw nbytes], ...]} (``writer``)
TOKENIZER_DIR = "tokenizer"  # a fine-tuning checkpoint's copy of its tokenizer files

# Training state beside the weights in a training checkpoint: these keys, and nothing else, are
# not model tensors (model tensors have flat FQNs).
OPTIMIZER_PREFIX = "optimizer."
TRAIN_STATE_KEY = "train_state"
RNG_PREFIX = "rng."
TRAINING_STATE_PREFIXES = (OPTIMIZER_PREFIX, TRAIN_STATE_KEY, RNG_PREFIX)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_model_key(fqn: str) -> bool:
    """Model tensors have flat FQNs; training state lives under the reserved prefixes."""
    return not fqn.startswith(TRAINING_STATE_PREFIXES)


def make_manifest(kind: str, model_name: str, flavor: str | None, args: dict, **extra) -> dict:
    """The manifest's fixed fields (``args``: the model's arguments as JSON); the writer adds the
    per-tensor table from what it wrote."""
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": {"name": model_name, "flavor": flavor, "args": dict(args)},
        "torch_version": torch.__version__,
        "seedckpt_version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def read_manifest(path: Path) -> dict | None:
    """The manifest of the checkpoint directory ``path``; ``None`` for a foreign checkpoint."""
    file = path / MANIFEST_NAME
    if not file.is_file():
        return None
    return parse_manifest(read_bounded(file, MAX_JSON_BYTES), file)


def parse_manifest(text: str | bytes, where) -> dict:
    """A manifest from its JSON text (a file of ours, or safetensors / torch.save metadata)."""
    manifest = parse_json(text, where, "the seedckpt manifest")
    if not isinstance(manifest, dict):
        raise SeedckptError(f"{where}: the seedckpt manifest is not a JSON object")
    return manifest


def manifest_model(manifest: dict | None, where) -> dict | None:
    """The ``model`` entry (name, flavor, args) a manifest records; None when it records none."""
    if manifest is None:
        return None
    model = manifest.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args"), dict):
        raise SeedckptError(f"{where}: the seedckpt manifest is damaged (its model entry is not an object with args)")
    return model


def manifest_flavor(manifest: dict | None) -> str | None:
    model = (manifest or {}).get("model")
    return model.get("flavor") if isinstance(model, dict) else None
