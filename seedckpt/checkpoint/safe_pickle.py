"""Reading DCP's ``.metadata`` without trusting it.

DCP's ``.metadata`` is a raw pickle, and stock ``FileSystemReader.read_metadata`` would run
arbitrary code from a crafted file. ``SafeFileSystemReader`` unpickles it with an exact allow-list
of the classes DCP metadata consists of. Tensor payloads are read either raw by
``owned_reads.OwnedFileSystemReader`` or by DCP with ``torch.load(weights_only=True)``; the non-tensor
entries of a training checkpoint (step, LR schedule, optimizer scalars), which stock DCP unpickles
with every class allowed, go through ``load_plain_values`` instead.
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
from seedckpt.utils.errors import SeedckptError


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: an exact allow-list of (module, name) pairs.

    Names must be plain identifiers -- pickle resolves dotted names attribute by attribute, so
    ``("torch.distributed.checkpoint.metadata", "os.system")`` would otherwise reach ``os.system``.
    """

    _ALLOWED = {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
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
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
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
        raise SeedckptError(
            f"{path} is not valid DCP metadata ({str(e)[:200]}); the checkpoint is corrupt or not a DCP checkpoint"
        ) from None
    if not isinstance(metadata, Metadata):
        raise SeedckptError(f"{path} does not hold DCP metadata")
    return metadata


def load_plain_values(data: io.BytesIO, what: str):
    """A pickled non-tensor checkpoint entry, read by torch's weights-only unpickler: numbers,
    strings, containers and tensors come back, anything that would run code is refused."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for a forbidden class; many types for damaged bytes
        raise SeedckptError(
            f"{what} is not plain data ({unpickling_reason(e)}); the checkpoint is damaged or "
            "crafted and was not loaded -- restore it or write it again"
        ) from None


def unpickling_reason(error: Exception) -> str:
    """Why torch's weights-only unpickler refused something, in one line, without torch's advice to
    load the file with every class allowed (which would run whatever the file holds)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    facts = [line for line in lines if "weights_only" not in line]
    return (facts[0] if facts else f"{type(error).__name__}")[:300]


def tensor_infos(metadata: Metadata) -> dict[str, TensorInfo]:
    """The tensors a DCP checkpoint stores, by stored key."""
    return {
        fqn: TensorInfo(tuple(md.size), md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read cannot execute code; ``metadata``, when given, is
    reused instead of read again (reading tensors one by one)."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._known = metadata

    def read_data(self, plan, planner):
        """The stock read (tensors with ``torch.load(weights_only=True)``), with a refused pickle
        reported as such, not with torch's advice to allow every class."""
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as e:
            raise SeedckptError(
                f"{self.path}: a stored tensor is not plain data ({unpickling_reason(e)}); the "
                "checkpoint is damaged or crafted and was not loaded -- restore it or write it "
                "again"
            ) from None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = self._known or read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata
