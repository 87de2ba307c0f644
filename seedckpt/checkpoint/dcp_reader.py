"""DCP checkpoints: ours (read at the recorded raw positions) and foreign ones (the stock way).

torchtitan 0.3 names are mapped to ours (``seedckpt.torchtitan``), so its checkpoints load as
they are; our names never change.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from seedckpt.checkpoint.atomic import PARTIAL_SUFFIX
from seedckpt.checkpoint.base import Checkpoint
from seedckpt.checkpoint.direct import READ_THREADS, DirectFileSystemReader
from seedckpt.checkpoint.integrity import Checksums, ItemChecks, check_data_files, data_file, verify_item
from seedckpt.checkpoint.load import copy_shared, load_state, one_destination_per_source
from seedckpt.checkpoint.manifest import TensorInfo, is_model_key, read_manifest
from seedckpt.checkpoint.safe_pickle import parse_dcp_metadata
from seedckpt.checkpoint.untrusted import MAX_METADATA_BYTES, read_bounded
from seedckpt.checkpoint.writer import RAW_ITEMS_KEY, tensor_infos
from seedckpt.errors import SeedckptError
from seedckpt.torchtitan import from_torchtitan_name, stored_names


class DcpCheckpoint(Checkpoint):
    """A DCP directory (``.metadata`` + ``*.distcp``), with or without our manifest."""

    kind = "dcp"

    def __init__(self, path: str | os.PathLike, args=None, verify: bool = True):
        """``verify``: check every byte read against the checksums the manifest records (on by default;
        checkpoints from before checksums, and foreign ones, have none to check)."""
        path = Path(path)
        if path.name.endswith(PARTIAL_SUFFIX):
            raise SeedckptError(f"{path} is an incomplete checkpoint left by an interrupted write; "
                                "delete it and write the checkpoint again")
        if not path.is_dir():
            raise SeedckptError(f"no checkpoint directory at {path}; create one with "
                                "`seedckpt seed --config CONFIG --output DIR`")
        if not (path / ".metadata").is_file():
            raise SeedckptError(f"{path} is not a complete DCP checkpoint (no .metadata); "
                                "it may be an interrupted write -- write it again")
        manifest = read_manifest(path)
        self.checksums = Checksums.from_manifest(manifest, path)
        data = read_bounded(path / ".metadata", MAX_METADATA_BYTES)
        if self.checksums is not None:
            self.checksums.check_metadata(data, path)
        self.metadata = parse_dcp_metadata(data, path / ".metadata")
        check_data_files(path, self.metadata.storage_data, self.checksums.files if self.checksums else None)
        self.check_reads = verify and self.checksums is not None
        # Our FQN -> the key stored, where a checkpoint uses other names (torchtitan 0.3).
        self.stored = stored_names(self.metadata.state_dict_metadata)
        self.all_tensors = {from_torchtitan_name(k): v for k, v in tensor_infos(self.metadata).items()}
        super().__init__(path, {f: i for f, i in self.all_tensors.items() if is_model_key(f)}, manifest, args)
        raw = (manifest or {}).get(RAW_ITEMS_KEY)
        self.raw_items = raw if isinstance(raw, dict) else {}
        embedding = self.all_tensors.get("tok_embeddings.weight")
        if self.args is not None and self.args.tie_word_embeddings and embedding and "output.weight" not in self.infos:
            # A tied checkpoint may store the matrix once (seeds do): the output reads the embedding.
            self.stored["output.weight"] = self.stored.get("tok_embeddings.weight", "tok_embeddings.weight")
            self.all_tensors["output.weight"] = self.infos["output.weight"] = embedding
            self.aliases["output.weight"] = "tok_embeddings.weight"

    def tensors(self) -> dict[str, TensorInfo]:
        return self.all_tensors

    def has_entry(self, key: str) -> bool:
        keys = self.metadata.state_dict_metadata  # DCP stores nested containers as "key.sub..." entries
        return key in keys or any(k.startswith(key + ".") for k in keys)

    def reader(self) -> DirectFileSystemReader:
        return DirectFileSystemReader(self.path, self.raw_items, self.metadata,
                                      self.checksums if self.check_reads else None)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        info = self.all_tensors[fqn]
        key = self.stored.get(fqn, fqn)
        out = {key: torch.empty(info.shape, dtype=info.dtype)}
        load_state(out, self.reader(), self.path, no_dist=True)
        return out[key]

    def load(self, state_dict: dict) -> None:
        """Load ``state_dict`` (tensors, DTensors, ``RowWindow``s, training state) in place via DCP;
        each rank reads only the rows it asks for. Collective across the default process group
        when one is initialized. DCP replaces non-tensor entries (training state) in the dict it
        loads; they are handed back in ``state_dict``."""
        self.check_covers(state_dict)
        stored, shared = one_destination_per_source(state_dict, lambda key: self.stored.get(key, key))
        load_state(stored, self.reader(), self.path)
        copy_shared(state_dict, stored, shared)
        copies = {key for key, _ in shared}
        for key in state_dict:
            if key not in copies:
                state_dict[key] = stored[self.stored.get(key, key)]

    def verify(self, on_bytes=lambda n: None) -> list[str]:
        """Read every item whole and check each piece against the checksums written with it; the
        problems found, each naming the tensor (or entry) and the file. ``on_bytes``: progress."""
        if self.checksums is None:
            return []
        names = {(info.relative_path, info.offset): index for index, info in self.metadata.storage_data.items()}
        problems = [f"{_describe(index)}: no checksum recorded for it in {info.relative_path}"
                    for index, info in self.metadata.storage_data.items()
                    if (info.relative_path, info.offset) not in self.checksums.items]
        fds = {file: os.open(data_file(self.path, file), os.O_RDONLY) for file in self.checksums.files}

        def check(item: ItemChecks) -> str | None:
            try:
                on_bytes(verify_item(fds[item.file], item, f"{_describe(names.get((item.file, item.offset)))} in "
                                                          f"{self.path}"))
            except SeedckptError as e:
                return str(e)
            return None

        try:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                problems += [p for p in pool.map(check, self.checksums.items.values()) if p]
        finally:
            for fd in fds.values():
                os.close(fd)
        return problems


def _describe(index) -> str:
    """A stored item in words: its key, and where a tensor is cut into chunks, which one."""
    if index is None:
        return "bytes no entry of .metadata points to"
    return index.fqn + (f" (chunk at {list(index.offset)})" if index.offset and any(index.offset) else "")
