"""The one checkpoint reader and the one checkpoint writer.

Every read (seed, stage load, resume, inspect) goes through ``CheckpointReader`` and every write
through ``write_checkpoint``, so validation, safety and crash-safety live in one place each:

* **Safety.** DCP's ``.metadata`` is a raw pickle, and stock ``FileSystemReader.read_metadata``
  would run arbitrary code from a crafted file. ``SafeFileSystemReader`` unpickles it with an
  allow-list of the classes DCP metadata consists of. (Tensor payloads are already read by DCP with
  ``torch.load(weights_only=True)``.)
* **Crash-safety.** A checkpoint is written into a hidden sibling ``.NAME.partial`` and renamed to
  ``NAME`` only when complete (DCP files and manifest fsynced), so any directory with the final
  name is complete, and a killed writer leaves only a ``.partial`` that nothing accepts.
* **Validation.** ``CheckpointReader.check_model_args`` compares the manifest with a config before
  anything is allocated, and ``check_covers`` compares wanted tensors (name, shape, dtype) with
  the metadata -- because ``dcp.load`` silently casts dtypes, ignores extra keys and reports a
  missing key as a ``BaseException``.

Layout: a DCP directory (``.metadata`` + ``*.distcp``, readable by stock ``dcp.load``) plus
``seedckpt.json``, the manifest (format version, kind, model name + full ModelArgs, seed, dtype,
parameter count, per-tensor shape/dtype, torch and seedckpt versions).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pickle
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_load_plan)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, SavePlanner, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import seedckpt
from models.llama import ModelArgs
from seedckpt.errors import SeedckptError
from seedckpt.torchtitan import from_torchtitan_name, stored_names

MANIFEST_NAME = "seedckpt.json"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
TRAINING_STATE_PREFIXES = ("optimizer.", "train_state", "rng.")
TOKENIZER_DIR = "tokenizer"  # a fine-tuning checkpoint's copy of its tokenizer files

# ModelArgs fields that decide tensor shapes: a config must agree with the checkpoint on these.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim")


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


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read cannot execute code."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:  # any damage to the pickle: truncation, bad opcodes, wrong types
                raise SeedckptError(f"{path} is not valid DCP metadata ({e}); the checkpoint is "
                                    "corrupt or not a DCP checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise SeedckptError(f"{path} does not hold DCP metadata")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class StreamingFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` whose memory is bounded by the items in flight, not the model.

    Why not the stock writer: its write loop keeps every tensor of a file referenced until the file
    is closed (measured: a lazily materialized 4.3 GB save peaked at 4.36 GB RSS), and ``torch.save``'s
    zip CRC32 caps it at ~0.35-0.4 GB/s here (3.9 GB/s without). This writer resolves items in plan
    order on ``workers`` threads, at most ``lookahead`` ahead of the one being written, writes each
    with ``torch.save`` (CRC off: files are fsynced and published atomically instead) and drops it.
    The files and ``.metadata`` are the stock format: stock ``dcp.load`` reads them.
    """

    def __init__(self, path: str | os.PathLike, lookahead: int = 4, workers: int = 2):
        """``lookahead``: items resolved ahead of the one being written; ``workers``: resolving threads."""
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.lookahead, self.workers = lookahead, workers

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            with ThreadPoolExecutor(self.workers) as pool, open(Path(self.path) / file_name, "wb") as stream:
                items, pending = iter(plan.items), deque()

                def submit_next() -> None:
                    item = next(items, None)
                    if item is not None:
                        pending.append((item, pool.submit(planner.resolve_data, item)))

                for _ in range(self.lookahead):
                    submit_next()
                while pending:
                    item, future = pending.popleft()
                    data = future.result()
                    submit_next()
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        torch.save(_compact_cpu(data), stream)
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(file_name, offset, length)))
                    del data
                    start_writeback(stream, offset, length)
                stream.flush()
                os.fsync(stream.fileno())
        finally:
            torch.serialization.set_crc32_options(crc)
        future: Future = Future()
        future.set_result(results)
        return future


class LazySavePlanner(DefaultSavePlanner):
    """Plans tensors as row blocks and produces each block only when the writer asks for it.

    The state dict handed to ``dcp.save`` holds ``meta`` tensors of at least one dimension;
    ``produce(fqn, row_start, row_stop)`` returns the rows, and ``rows_per_block(shape)`` decides the
    cut. Blocks are ordinary DCP chunks, exactly what a sharded save writes, so stock ``dcp.load``
    reassembles them. With the streaming writer, memory is bounded by the blocks in flight.
    """

    def __init__(self, produce, rows_per_block=lambda shape: shape[0]):
        super().__init__()
        self.produce, self.rows_per_block = produce, rows_per_block

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, meta in self.state_dict.items():
            shape = meta.shape
            rows = max(1, self.rows_per_block(shape))
            for start in range(0, shape[0], rows):
                offsets = torch.Size([start] + [0] * (len(shape) - 1))
                sizes = torch.Size([min(rows, shape[0] - start), *shape[1:]])
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                properties=TensorProperties(dtype=meta.dtype), size=shape)))
        self.plan = SavePlan(items, planner_data=self.mappings)  # FQN mapping, as the default planner
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk = write_item.tensor_data.chunk
        dtype = self.state_dict[write_item.index.fqn].dtype
        return self.produce(write_item.index.fqn, chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]).to(dtype)


def start_writeback(stream, offset: int, length: int) -> None:
    """Push the bytes just written towards the disk now, not all at the final fsync.

    ``POSIX_FADV_DONTNEED`` starts asynchronous writeback of the range (and lets the kernel drop
    it from the page cache once clean), so the disk works while the next blocks are generated.
    """
    if hasattr(os, "posix_fadvise"):
        stream.flush()
        os.posix_fadvise(stream.fileno(), offset, length, os.POSIX_FADV_DONTNEED)


def _compact_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (``torch.save`` writes a view's whole storage)."""
    tensor = tensor.detach().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


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


class _KnownMetadataReader(SafeFileSystemReader):
    """Reuses metadata already read, so reading tensors one by one does not re-read ``.metadata``."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata


def check_args_match(saved: ModelArgs, args: ModelArgs, where, flavor: str | None = None,
                     grow_vocab: bool = False) -> None:
    """The tensor shapes that ``saved`` (from a checkpoint) and ``args`` (from a config) imply agree
    (with ``grow_vocab``, ``args`` may have more vocabulary rows than the checkpoint)."""
    diffs = [f"{f}: checkpoint {getattr(saved, f)!r}, config {getattr(args, f)!r}"
             for f in SHAPE_FIELDS if getattr(saved, f) != getattr(args, f)
             and not (f == "vocab_size" and grow_vocab and saved.vocab_size < args.vocab_size)]
    if diffs:
        made_with = f" (model.flavor={flavor!r})" if flavor else ""
        raise SeedckptError(f"config does not match checkpoint {where} ({'; '.join(diffs)}); use the config it "
                            f"was made with{made_with} or create a new seed for this config")


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Loading ``src`` values into ``dst`` is exact (e.g. a bf16 seed into fp32 parameters)."""
    if src == dst:
        return True
    if not (src.is_floating_point and dst.is_floating_point):
        return False
    s, d = torch.finfo(src), torch.finfo(dst)
    return d.bits > s.bits and d.eps <= s.eps and d.max >= s.max


@dataclass(frozen=True)
class RowWindow:
    """A load destination for rows ``[start, start + len(dest))`` of a checkpoint tensor.

    Used where a rank's tensor is not the checkpoint's tensor or a DTensor shard of it: the rows
    of a grown vocabulary that exist in the checkpoint, or the whole RoPE heads around an FSDP
    shard of an HF ``q_proj``. Only these rows are requested from storage.
    """

    dest: torch.Tensor
    start: int


def tensor_problems(fqn: str, info: TensorInfo, wanted: torch.Tensor | RowWindow) -> list[str]:
    """Why a checkpoint entry cannot fill ``wanted``: a shape mismatch or a lossy dtype change
    (stock ``dcp.load`` would cast silently)."""
    if isinstance(wanted, RowWindow):
        shape, stop = tuple(wanted.dest.shape), wanted.start + wanted.dest.shape[0]
        if not info.shape or info.shape[1:] != shape[1:] or stop > info.shape[0]:
            return [f"{fqn}: rows {wanted.start}..{stop} of shape {list(shape)} do not fit the checkpoint's "
                    f"shape {list(info.shape)}"]
        wanted = wanted.dest
    elif info.shape != tuple(wanted.shape):
        return [f"{fqn}: shape {list(info.shape)} in checkpoint, {list(wanted.shape)} in model"]
    if not widens(info.dtype, wanted.dtype):
        return [f"{fqn}: dtype {dtype_name(info.dtype)} in checkpoint, {dtype_name(wanted.dtype)} in model"]
    return []


def _tensor_infos(metadata: Metadata) -> dict[str, TensorInfo]:
    return {fqn: TensorInfo(tuple(md.size), md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


class RowWindowLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, plus ``RowWindow`` entries: those request only their rows."""

    def __init__(self, state_dict: dict):
        super().__init__(allow_partial_load=False)
        self.windows = {k: v for k, v in state_dict.items() if isinstance(v, RowWindow)}

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if k not in self.windows}
        plan = create_default_local_load_plan(plain, self.metadata, strict=True)
        for fqn, window in self.windows.items():
            offsets = torch.Size([window.start] + [0] * (window.dest.dim() - 1))
            chunk = ChunkStorageMetadata(offsets, window.dest.shape)
            plan.items.extend(create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk]))
        return plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        window = self.windows.get(index.fqn)
        return window.dest if window is not None else super().lookup_tensor(index)


def load_state(state_dict: dict, reader, where) -> None:
    """``dcp.load`` through ``RowWindowLoadPlanner``; DCP's failures become one ``SeedckptError``.

    Collective across the default process group when one is initialized.
    """
    try:
        with quiet_single_process_dcp():
            dcp.load(state_dict, storage_reader=reader, planner=RowWindowLoadPlanner(state_dict))
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, SeedckptError)):
            raise
        raise SeedckptError(f"reading {where} failed: {e}") from e


class CheckpointReader:
    """An opened, validated checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.name.endswith(PARTIAL_SUFFIX):
            raise SeedckptError(f"{self.path} is an incomplete checkpoint left by an interrupted write; "
                                "delete it and write the checkpoint again")
        if not self.path.is_dir():
            raise SeedckptError(f"no checkpoint directory at {self.path}; create one with "
                                "`seedckpt seed --config CONFIG --output DIR`")
        if not (self.path / ".metadata").is_file():
            raise SeedckptError(f"{self.path} is not a complete DCP checkpoint (no .metadata); "
                                "it may be an interrupted write -- write it again")
        self.metadata = SafeFileSystemReader(self.path).read_metadata()
        # Our FQN -> the key stored, where a checkpoint uses other names (torchtitan 0.3).
        self.stored = stored_names(self.metadata.state_dict_metadata)
        manifest_path = self.path / MANIFEST_NAME
        self.manifest: dict | None = None
        if manifest_path.is_file():
            try:
                self.manifest = json.loads(manifest_path.read_text())
            except json.JSONDecodeError as e:
                raise SeedckptError(f"{manifest_path} is not valid JSON ({e})") from None

    def tensors(self) -> dict[str, TensorInfo]:
        """The tensors by our FQNs (a torchtitan 0.3 checkpoint's names are mapped)."""
        return {from_torchtitan_name(k): v for k, v in _tensor_infos(self.metadata).items()}

    def model_args(self) -> ModelArgs | None:
        if self.manifest is None:
            return None
        try:
            return ModelArgs.from_dict(self.manifest["model"]["args"])
        except (KeyError, TypeError, ValueError) as e:
            raise SeedckptError(f"{self.path}/{MANIFEST_NAME} is damaged ({e!r})") from None

    def check_model_args(self, args: ModelArgs, grow_vocab: bool = False) -> None:
        """Fail (before any allocation) if ``args`` does not describe the checkpoint's model."""
        saved = self.model_args()
        if saved is not None:  # a foreign DCP checkpoint: per-tensor checks at load time still apply
            check_args_match(saved, args, self.path, self.manifest["model"].get("flavor"), grow_vocab)

    def check_covers(self, wanted: dict) -> None:
        """Every wanted tensor is in the checkpoint with the same global shape and a dtype that loads
        losslessly (every wanted non-tensor entry is present)."""
        have = self.tensors()
        keys = self.metadata.state_dict_metadata
        problems = []
        for fqn, t in wanted.items():
            if not isinstance(t, (torch.Tensor, RowWindow)):  # DCP stores nested containers as "key.sub..." entries
                if fqn not in keys and not any(k.startswith(fqn + ".") for k in keys):
                    problems.append(f"{fqn}: missing from checkpoint")
            elif fqn not in have:
                problems.append(f"{fqn}: missing from checkpoint")
            else:
                problems += tensor_problems(fqn, have[fqn], t)
        if problems:
            unwanted = sorted(set(have) - set(wanted) - {k for k in have if not is_model_key(k)})
            if unwanted:
                problems.append(f"it has {len(unwanted)} model tensors this model does not use, e.g. "
                                f"{', '.join(unwanted[:4])}")
            raise SeedckptError(f"checkpoint {self.path} does not cover the model: " + "; ".join(problems))

    def read_tensor(self, fqn: str) -> torch.Tensor:
        """One whole tensor on CPU, read by this process alone (conversion, diff)."""
        info = self.tensors()[fqn]
        key = self.stored.get(fqn, fqn)
        out = {key: torch.empty(info.shape, dtype=info.dtype)}
        with quiet_single_process_dcp():
            dcp.load(out, storage_reader=_KnownMetadataReader(self.path, self.metadata), no_dist=True)
        return out[key]

    def load(self, state_dict: dict) -> None:
        """Load ``state_dict`` (tensors, DTensors, ``RowWindow``s, training state) in place via DCP;
        each rank reads only the entries it asks for. Collective across the default process group
        when one is initialized."""
        self.check_covers(state_dict)
        stored = {self.stored.get(k, k): v for k, v in state_dict.items()}
        load_state(stored, SafeFileSystemReader(self.path), self.path)
        for key in state_dict:  # DCP replaces non-tensor entries (training state) in the dict it loads
            state_dict[key] = stored[self.stored.get(key, key)]


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns on every single-process call that it assumes a single process; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def make_manifest(kind: str, model_name: str, flavor: str | None, args: ModelArgs, **extra) -> dict:
    """The manifest's fixed fields; ``write_checkpoint`` adds the per-tensor table from what it wrote."""
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": {"name": model_name, "flavor": flavor, "args": args.to_dict()},
        "torch_version": torch.__version__,
        "seedckpt_version": seedckpt.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def is_model_key(fqn: str) -> bool:
    """Model tensors have flat FQNs; training state lives under these reserved prefixes."""
    return not fqn.startswith(TRAINING_STATE_PREFIXES)


def check_destination(path: str | os.PathLike, force: bool) -> Path:
    """Fail early (before any work) when ``path`` exists and ``force`` is not set."""
    path = Path(path)
    if path.exists() and not force:
        raise SeedckptError(f"{path} already exists; pass --force to replace it or choose another destination")
    return path


def write_checkpoint(path: str | os.PathLike, state_dict: dict, manifest: dict, force: bool = False,
                     planner: SavePlanner | None = None, lookahead: int = 4,
                     files: dict[str, Path] | None = None) -> Path:
    """Write a DCP checkpoint plus manifest to ``path`` atomically.

    Collective when a process group is initialized (every rank passes its own entries, e.g. its
    stage's tensors or shards); otherwise single-process. The data goes to ``.NAME.partial`` first;
    rank 0 adds the manifest (with the per-tensor table read back from the written metadata) and
    renames the complete, fsynced directory to ``NAME``. With ``force`` an existing ``NAME`` is
    replaced only after the new one is complete. A custom ``planner`` may produce the data lazily
    (the seed writer generates each item when the writer asks for it). ``files`` maps relative
    names to files that rank 0 copies in before publishing (a fine-tuning run's tokenizer).
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    leader = not distributed or dist.get_rank() == 0
    # Only rank 0 prepares, publishes and cleans up; the others just write into the partial dir.
    with atomic_output(path, force) if leader else contextlib.nullcontext(_partial_of(path)) as partial:
        if distributed:
            dist.barrier()  # rank 0 has removed any stale partial directory
        try:
            with quiet_single_process_dcp():
                dcp.save(state_dict, storage_writer=StreamingFileSystemWriter(partial, lookahead=lookahead),
                         planner=planner, no_dist=not distributed)
        except CheckpointException as e:  # a BaseException wrapping each rank's failure
            raise SeedckptError(f"writing {path} failed: {e}") from e
        if leader:
            written = _tensor_infos(SafeFileSystemReader(partial).read_metadata())
            tensors = {fqn: info for fqn, info in written.items() if is_model_key(fqn)}
            manifest = {**manifest, "num_params": sum(i.numel for i in tensors.values()),
                        "tensors": {fqn: {"shape": list(i.shape), "dtype": dtype_name(i.dtype)}
                                    for fqn, i in tensors.items()}}
            write_json_synced(partial / MANIFEST_NAME, manifest)
            for name, source in (files or {}).items():
                (partial / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, partial / name)
    if distributed:
        dist.barrier()
    return path


def _partial_of(path: Path) -> Path:
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, force: bool = False, directory: bool = True):
    """Yield a hidden ``.NAME.partial`` sibling to write into; publish it as ``NAME`` on success.

    On any error the partial output is removed, so a failed or rejected write leaves nothing behind.
    """
    path = check_destination(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial_of(path)
    _remove(partial)
    if directory:
        partial.mkdir()
    try:
        yield partial
        _publish(partial, path)
    except BaseException:
        _remove(partial)
        raise


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def write_json_synced(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _publish(partial: Path, path: Path) -> None:
    """Rename the complete ``partial`` to ``path``, replacing an existing one last."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        _remove(old)
        path.rename(old)
    partial.rename(path)
    _remove(old)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def complete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """Training checkpoints in ``folder`` that finished writing (``.partial`` ones never match)."""
    folder = Path(folder)
    out = {}
    if folder.is_dir():
        for child in folder.iterdir():
            number = child.name.removeprefix("step-")
            if (child.name.startswith("step-") and number.isdigit() and (child / ".metadata").is_file()
                    and (child / MANIFEST_NAME).is_file()):
                out[int(number)] = child
    return out


def prune_steps(folder: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` complete step checkpoints (``keep <= 0`` keeps all)."""
    if keep <= 0:
        return
    steps = complete_steps(folder)
    for step in sorted(steps)[:-keep]:
        shutil.rmtree(steps[step], ignore_errors=True)
