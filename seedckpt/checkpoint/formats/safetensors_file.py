"""One ``.safetensors`` file with our FQNs; the manifest is in its metadata.

Why a safetensors writer of our own: ``safetensors.torch.save_file`` (and DCP's
``HuggingFaceStorageWriter``, which calls it per file) needs every tensor of a file in memory at
once -- 5 GB per default HF shard. The format is an 8-byte length, a JSON header computable from
shapes alone, and raw bytes, so it is streamed here a slab of rows at a time. Reading takes a
tensor's rows by one positioned read of their bytes (``read_safetensor_rows``), ``safetensors`` itself
for a whole one, and DCP's ``HuggingFaceStorageReader`` for stage loading (see ``hf``).
"""

from __future__ import annotations

import functools
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


def read_safetensor_rows(file: Path, name: str, info: TensorInfo, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` (dim 0) of the tensor ``name`` (``info``) of ``file``, one
    positioned read of their bytes alone: ``safe_open`` maps the whole file, which counts its size (4
    GB per gpt-oss-120B shard) against an address-space cap (measured: +207 MiB of address space to
    read one 4 MB expert of a 66 MB file), and ``get_tensor`` copies the whole tensor out."""
    stat = file.stat()
    header, data_start = _header(file, stat.st_size, stat.st_mtime_ns)
    row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
    out = torch.empty((count, *info.shape[1:]) if info.shape else (), dtype=info.dtype)
    with open(file, "rb") as f:
        f.seek(data_start + header[name]["data_offsets"][0] + start * row)
        got = f.readinto(out.reshape(-1).view(torch.uint8).numpy())
    if got != out.nbytes:
        raise SeedckptError(f"{file} ends inside {name}: the file was truncated while being read")
    return out


@functools.lru_cache(maxsize=8)
def _header(file: Path, size: int, mtime_ns: int) -> tuple[dict, int]:
    """``file``'s tensor entries and data start, parsed once per version of it (size and mtime): a
    header of 3,000 tensors (a Kimi K2 shard) takes 17.5 ms to parse and check, and a tensor is read
    in many slabs."""
    header, _, data_start = safetensors_header(file)
    return header, data_start


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

    def reads_rows(self, fqn: str) -> bool:
        return True

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        return read_safetensor_rows(self.path, fqn, self.infos[fqn], start, stop - start)


def write_safetensors(
    path: Path, infos: dict[str, TensorInfo], slabs, metadata: dict[str, str], on_tensor=lambda nbytes: None
) -> None:
    """Stream tensors into a safetensors file: the header first (from shapes), then each tensor's
    bytes as ``slabs(name)`` yields them (dim-0 slabs, concatenated the tensor), reading the next slab
    while the current one is written: memory holds two slabs, whatever the tensors."""
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
    pieces = ((name, slab) for name in infos for slab in slabs(name))
    written = dict.fromkeys(infos, 0)
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        f.write(len(blob).to_bytes(8, "little") + blob)
        pending = pool.submit(next, pieces, None)
        while (piece := pending.result()) is not None:
            pending = pool.submit(next, pieces, None)
            name, slab = piece
            _check_slab(name, slab, infos[name], written[name])
            slab = slab.to(infos[name].dtype).contiguous()
            offset = f.tell()
            f.write(slab.reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            start_writeback(f.fileno(), offset, slab.nbytes)
            written[name] += slab.nbytes
            if written[name] == infos[name].nbytes:
                on_tensor(infos[name].nbytes)
            del slab, piece
        short = [name for name, info in infos.items() if written[name] != info.nbytes]
        if short:
            raise SeedckptError(f"{short[0]}: read {written[short[0]]:,} bytes, expected {infos[short[0]].nbytes:,}")
        f.flush()
        os.fsync(f.fileno())


def _check_slab(name: str, slab: torch.Tensor, info: TensorInfo, done: int) -> None:
    """A slab of ``name`` has its rows' shape and stays within the tensor (``done``: bytes written)."""
    rows = tuple(slab.shape[1:]) if info.shape else tuple(slab.shape)
    if rows != (info.shape[1:] if info.shape else ()) or done + slab.numel() * info.dtype.itemsize > info.nbytes:
        raise SeedckptError(f"{name}: read shape {list(slab.shape)}, expected rows of {list(info.shape)}")


def write(source: OpenedCheckpoint, dst: Path, job: WriteJob) -> Path:
    """One file, published once its header reads back."""
    with atomic_output(
        dst, job.force, directory=False, check=safetensors_header, replaces=safetensors_header
    ) as partial:
        write_safetensors(partial, job.infos, source.slabs, {MANIFEST_KEY: json.dumps(job.manifest)}, job.on_bytes)
    return Path(dst)
