"""One ``.safetensors`` file with our FQNs; the manifest is in its metadata.

Why a safetensors writer of our own: ``safetensors.torch.save_file`` (and DCP's
``HuggingFaceStorageWriter``, which calls it per file) needs every tensor of a file in memory at
once -- 5 GB per default HF shard. The format is an 8-byte length, a JSON header computable from
shapes alone, and raw bytes, so it is streamed here tensor by tensor. Reading uses ``safetensors``
itself (and DCP's ``HuggingFaceStorageReader`` for stage loading, see ``hf``).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from seedckpt.checkpoint.atomic import atomic_output
from seedckpt.checkpoint.base import OpenedCheckpoint, WriteJob, recorded_layout
from seedckpt.checkpoint.manifest import TensorInfo, parse_manifest
from seedckpt.checkpoint.model import ModelCodec, ModelLayout
from seedckpt.checkpoint.safetensors_header import SAFETENSORS_DTYPES, safetensors_header
from seedckpt.checkpoint.writer import start_writeback
from seedckpt.utils.errors import SeedckptError

OUR_NAMES = True
TIED_STORED_ONCE = False
TOKENIZER_AT = None  # one file: no place for a tokenizer
MANIFEST_KEY = "seedckpt_manifest"  # in safetensors metadata and torch.save files we write
_ST_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_safetensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def embedded_manifest(text, path: Path) -> dict | None:
    """The manifest we embed in safetensors metadata / torch.save files."""
    return parse_manifest(text, path) if isinstance(text, str) else None


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix == ".safetensors"


def reader(
    path: Path, codec: ModelCodec | None = None, layout: ModelLayout | None = None, verify: bool = True
) -> SafetensorsFile:
    """No checksums to ``verify`` in a safetensors file."""
    return SafetensorsFile(path, codec, layout)


class SafetensorsFile(OpenedCheckpoint):
    kind = "safetensors"

    def __init__(self, path: Path, codec: ModelCodec | None = None, layout: ModelLayout | None = None):
        header, metadata, _ = safetensors_header(path)
        if any(name.startswith("model.") or name == "lm_head.weight" for name in header):
            raise SeedckptError(f"{path} uses Hugging Face names; pass the directory that holds it and its config.json")
        manifest = embedded_manifest(metadata.get(MANIFEST_KEY), path)
        infos = {n: TensorInfo(tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for n, e in header.items()}
        super().__init__(path, infos, manifest, recorded_layout(codec, manifest, path), layout)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        return read_safetensor(self.path, fqn)


def write_safetensors(
    path: Path, infos: dict[str, TensorInfo], read, metadata: dict[str, str], on_tensor=lambda nbytes: None
) -> None:
    """Stream tensors into a safetensors file: the header first (from shapes), then each tensor's
    bytes as ``read(name)`` produces it, reading the next one while the current one is written."""
    header, offset = {}, 0
    for name, info in infos.items():
        header[name] = {
            "dtype": _ST_NAMES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data must start 8-byte aligned
    names = list(infos)
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        f.write(len(blob).to_bytes(8, "little") + blob)
        pending = pool.submit(read, names[0]) if names else None
        for i, name in enumerate(names):
            tensor = pending.result()
            pending = pool.submit(read, names[i + 1]) if i + 1 < len(names) else None
            tensor = tensor.to(infos[name].dtype).contiguous()
            if tuple(tensor.shape) != infos[name].shape:
                raise SeedckptError(f"{name}: read shape {list(tensor.shape)}, expected {list(infos[name].shape)}")
            offset = f.tell()
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            start_writeback(f.fileno(), offset, infos[name].nbytes)
            on_tensor(infos[name].nbytes)
            del tensor
        f.flush()
        os.fsync(f.fileno())


def write(source: OpenedCheckpoint, dst: Path, job: WriteJob) -> Path:
    """One file, published once its header reads back."""
    with atomic_output(
        dst, job.force, directory=False, check=safetensors_header, replaces=safetensors_header
    ) as partial:
        write_safetensors(
            partial, job.infos, source.read_tensor, {MANIFEST_KEY: json.dumps(job.manifest)}, job.on_bytes
        )
    return Path(dst)
