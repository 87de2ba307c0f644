"""Reading DCP's ``.metadata`` without trusting it.

DCP's ``.metadata`` is a raw pickle, and stock ``FileSystemReader.read_metadata`` would run
arbitrary code from a crafted file. ``SafeFileSystemReader`` unpickles it with an exact allow-list
of the classes DCP metadata consists of. (Tensor payloads are read either raw by
``direct.DirectFileSystemReader`` or by DCP with ``torch.load(weights_only=True)``.)
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from seedckpt.checkpoint.manifest import TensorInfo
from seedckpt.checkpoint.untrusted import MAX_METADATA_BYTES, read_bounded
from seedckpt.errors import SeedckptError


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: an exact allow-list of (module, name) pairs.

    Names must be plain identifiers -- pickle resolves dotted names attribute by attribute, so
    ``("torch.distributed.checkpoint.metadata", "os.system")`` would otherwise reach ``os.system``.
    """

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint._hf_utils", "_HFStorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str):
        allowed = (module, name) in self._ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if allowed and "." not in name:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """The unpickled ``.metadata`` file at ``path``; a ``SeedckptError`` for anything else."""
    return parse_dcp_metadata(read_bounded(path, MAX_METADATA_BYTES), path)


def parse_dcp_metadata(data: bytes, path: Path) -> Metadata:
    """``.metadata``'s bytes (read once, also to check their checksum) unpickled."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any damage to the pickle: truncation, bad opcodes, wrong types, deep nesting
        raise SeedckptError(f"{path} is not valid DCP metadata ({str(e)[:200]}); the checkpoint is "
                            "corrupt or not a DCP checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise SeedckptError(f"{path} does not hold DCP metadata")
    return metadata


def tensor_infos(metadata: Metadata) -> dict[str, TensorInfo]:
    """The tensors a DCP checkpoint stores, by stored key."""
    return {fqn: TensorInfo(tuple(md.size), md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read cannot execute code; ``metadata``, when given, is
    reused instead of read again (reading tensors one by one)."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._known = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = self._known or read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata
