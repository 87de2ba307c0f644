"""A ``torch.save`` file: ``{fqn: tensor}`` (optionally under ``"model"``) plus our manifest.

Read with ``weights_only=True`` and ``mmap=True``. ``torch.save`` pickles one object, so writing
holds the whole model in memory -- prefer safetensors for large models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from seedckpt.checkpoint.atomic import atomic_output
from seedckpt.checkpoint.base import OpenedCheckpoint, WriteJob, recorded_layout
from seedckpt.checkpoint.formats.safetensors_file import MANIFEST_KEY, embedded_manifest
from seedckpt.checkpoint.manifest import TensorInfo
from seedckpt.checkpoint.model import ModelCodec, ModelLayout
from seedckpt.checkpoint.safe_pickle import unpickling_reason
from seedckpt.utils.errors import SeedckptError

OUR_NAMES = True
TIED_STORED_ONCE = False
TOKENIZER_AT = None  # one file: no place for a tokenizer


def detect(path: Path) -> bool:
    """Any other file: ``torch.load`` decides (weights only)."""
    return path.is_file() and path.suffix != ".safetensors"


def reader(
    path: Path, codec: ModelCodec | None = None, layout: ModelLayout | None = None, verify: bool = True
) -> TorchFile:
    """No checksums to ``verify`` in a torch.save file."""
    return TorchFile(path, codec, layout)


class TorchFile(OpenedCheckpoint):
    kind = "torch"

    def __init__(self, path: Path, codec: ModelCodec | None = None, layout: ModelLayout | None = None):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for foreign or damaged files
            raise SeedckptError(
                f"{path} is not a supported checkpoint (DCP directory, HF directory, "
                f".safetensors or torch.save file of tensors): {unpickling_reason(e)}"
            ) from None
        if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
            obj = obj["model"]
        if not isinstance(obj, dict):
            raise SeedckptError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
        manifest = embedded_manifest(obj.get(MANIFEST_KEY), path)
        self._tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        infos = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in self._tensors.items()}
        super().__init__(path, infos, manifest, recorded_layout(codec, manifest, path), layout)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        return self._tensors[fqn].clone()  # out of the mmap: callers may keep it past the file

    def reads_rows(self, fqn: str) -> bool:
        return True

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        tensor = self._tensors[fqn]
        return (tensor[start:stop] if tensor.dim() else tensor).clone()  # only those pages of the mmap


def _torch_file(path: Path) -> None:
    """``path`` is a torch.save file of tensors (torch.load also reads a safetensors file)."""
    if not detect(path):
        raise SeedckptError(f"{path.name} is a {path.suffix} file")
    TorchFile(path)


def _filled(source: OpenedCheckpoint, fqn: str, info: TensorInfo) -> torch.Tensor:
    """``fqn`` of ``source`` in ``info.dtype``, filled a slab at a time: the pickle needs every tensor
    at once, but never a second copy of one (read, then cast)."""
    out = torch.empty(info.shape, dtype=info.dtype)
    flat, at = out.reshape(-1), 0
    for slab in source.slabs(fqn):
        flat[at : at + slab.numel()].copy_(slab.reshape(-1))
        at += slab.numel()
    return out


def write(source: OpenedCheckpoint, dst: Path, job: WriteJob) -> Path:
    """One pickle of the whole model; published once it reads back as one."""
    with atomic_output(dst, job.force, directory=False, check=TorchFile, replaces=_torch_file) as partial:
        state = {f: _filled(source, f, i) for f, i in job.infos.items()}
        job.on_bytes(sum(i.nbytes for i in job.infos.values()))
        with open(partial, "wb") as f:
            torch.save({**state, MANIFEST_KEY: json.dumps(job.manifest)}, f)
            f.flush()
            os.fsync(f.fileno())
    return Path(dst)
