"""DCP checkpoints: ours (read at the recorded raw positions) and foreign ones (the stock way).

Other tools' names for the model's tensors (the caller's ``codec.renamings``: torchtitan 0.3's) are
mapped to ours, rows they store in another order (torchtitan's Qwen3 q/k heads) put back in ours,
and a stored tensor that holds several of ours (torchtitan's gpt-oss ``mlp1``: gate and up
interleaved, a ``StoredParts``) split into them -- and one of ours stored as several (a
``StoredSplit``) joined -- so their checkpoints load as they are; our names never change. ``write``
streams any checkpoint into a DCP one through the one writer, optionally in another tool's names
and fused tensors.
"""

from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from seedckpt.checkpoint.atomic import refuse_partial
from seedckpt.checkpoint.base import (
    OpenedCheckpoint,
    WriteJob,
    group_rows,
    read_in_groups,
    read_stored_rows,
    recorded_layout,
    stored_bounds,
)
from seedckpt.checkpoint.fused import (
    PartsRead,
    SplitOnce,
    SplitRead,
    joined_shape,
    split_joined_shape,
    split_shapes,
)
from seedckpt.checkpoint.integrity import Checksums, ItemChecks, check_data_files, data_file, verify_item
from seedckpt.checkpoint.load import GroupedRows, RowWindow, copy_shared, load_state, one_destination_per_source
from seedckpt.checkpoint.manifest import RAW_ITEMS_KEY, TOKENIZER_DIR, TensorInfo, is_model_key, read_manifest
from seedckpt.checkpoint.model import ModelCodec, ModelLayout, NameAdapter, StoredParts, StoredSplit
from seedckpt.checkpoint.owned_reads import READ_THREADS, OwnedFileSystemReader
from seedckpt.checkpoint.safe_pickle import parse_dcp_metadata, tensor_infos
from seedckpt.checkpoint.untrusted import MAX_METADATA_BYTES, read_bounded
from seedckpt.checkpoint.writer import LazySavePlanner, whole_tensor, write_checkpoint
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import all_finite

OUR_NAMES = True  # stores any tensor under our FQNs (OSFT factors too)
TIED_STORED_ONCE = True  # a tied matrix is stored once; .metadata records the other FQN as its bytes
TOKENIZER_AT = TOKENIZER_DIR  # as a fine-tuning run's step-N keeps the tokenizer files


def detect(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def reader(
    path: Path, codec: ModelCodec | None = None, layout: ModelLayout | None = None, verify: bool = True
) -> DcpCheckpoint:
    return DcpCheckpoint(path, codec, layout, verify)


class DcpCheckpoint(OpenedCheckpoint):
    """A DCP directory (``.metadata`` + ``*.distcp``), with or without our manifest."""

    kind = "dcp"

    def __init__(
        self,
        path: str | os.PathLike,
        codec: ModelCodec | None = None,
        layout: ModelLayout | None = None,
        verify: bool = True,
    ):
        """``codec``/``layout``: the caller's model knowledge (``checkpoint.model``); without them,
        tensors keep their stored names. ``verify``: check every byte read against the checksums the
        manifest records (on by default; checkpoints from before checksums, and foreign ones, have
        none to check)."""
        path = Path(path)
        refuse_partial(path)
        if not path.is_dir():
            raise SeedckptError(
                f"no checkpoint directory at {path}; create one with `seedckpt seed --config CONFIG --output DIR`"
            )
        if not (path / ".metadata").is_file():
            raise SeedckptError(
                f"{path} is not a complete DCP checkpoint (no .metadata); "
                "it may be an interrupted write -- write it again"
            )
        manifest = read_manifest(path)
        self.checksums = Checksums.from_manifest(manifest, path)
        data = read_bounded(path / ".metadata", MAX_METADATA_BYTES)
        if self.checksums is not None:
            self.checksums.check_metadata(data, path)
        self.metadata = parse_dcp_metadata(data, path / ".metadata")
        check_data_files(path, self.metadata.storage_data, self.checksums.files if self.checksums else None)
        self.check_reads = verify and self.checksums is not None
        recorded = recorded_layout(codec, manifest, path)
        renamings = codec.renamings(recorded or layout).values() if codec else ()
        # Our FQN -> the name adapter of the tool whose names the checkpoint is in (none: ours); its
        # stored keys that hold several of ours -> how (``StoredParts``).
        self.renamed, fused, left_out = _renamed(self.metadata.state_dict_metadata, renamings)
        self.stored = {fqn: names.to_stored(fqn) for fqn, names in self.renamed.items()}  # our FQN -> key
        self.parts = {fqn: parts for parts in fused.values() for fqn in parts.fqns}
        self.split_once = SplitOnce()
        ours = {key: fqn for fqn, key in self.stored.items() if key not in fused}
        infos = tensor_infos(self.metadata)
        self.all_tensors = {ours.get(k, k): v for k, v in infos.items() if k not in left_out and k not in fused}
        try:
            self.all_tensors |= _split_infos(fused, infos)
        except ValueError as e:
            raise SeedckptError(f"{path}: {e}") from None
        super().__init__(
            path, {f: i for f, i in self.all_tensors.items() if is_model_key(f)}, manifest, recorded, layout
        )
        raw = (manifest or {}).get(RAW_ITEMS_KEY)
        self.raw_items = raw if isinstance(raw, dict) else {}
        # Keys whose bytes another key stores: read (and checked) through that key only, once.
        self.shared = _shared_bytes(self.metadata)
        if self.checksums is not None:
            self._refuse_unchecked_items()
        shared = {ours.get(k, k): ours.get(source, source) for k, source in self.shared.items()}
        self._refuse_undeclared_ties(shared)
        self.aliases.update(shared)
        self.alias_tied(dict(self.all_tensors))  # tied checkpoints written before .metadata recorded the alias
        for fqn, source in self.aliases.items():
            self.stored[fqn] = self.stored.get(source, source)
            self.all_tensors[fqn] = self.all_tensors[source]
        self._leave_out_zero_unkept()

    def _leave_out_zero_unkept(self) -> None:
        """Tensors stored in another tool's names that this model has no place for but whose zero is
        the same model as their absence (torchtitan's expert bias, read into a model balanced without
        one) are left out when their values are zero; any other value is refused with the fix."""
        unused = [fqn for fqn in self.renamed if self.layout is not None and fqn not in self.layout.shapes]
        for fqn in unused:
            reason = self.renamed[fqn].unkept_unless_zero(fqn)
            if reason is None:
                continue
            if any(slab.count_nonzero() for slab in self.slabs(fqn)):
                raise SeedckptError(f"{self.path}: {reason}")
            del self.infos[fqn], self.all_tensors[fqn]

    def _refuse_undeclared_ties(self, shared: dict[str, str]) -> None:
        """Two entries of ``.metadata`` at the same bytes are one tensor under two names, which only a
        tie the model declares makes true (a tied output projection is the embedding); any other
        (``wq`` pointed at ``wo``'s bytes) is refused. Without a model to ask (opened without the
        caller's model knowledge) a tie cannot be judged and is read as recorded."""
        if self.layout is None:
            return
        undeclared = [
            f"{fqn} at the bytes of {source}"
            for fqn, source in shared.items()
            if self.layout.aliases.get(fqn) != source
        ]
        if undeclared:
            raise SeedckptError(
                f"{self.path}: .metadata records {', '.join(undeclared[:3])}, a tie this model does not have; "
                "the checkpoint is damaged or crafted -- restore it or write it again"
            )

    def _refuse_unchecked_items(self) -> None:
        """Every item ``.metadata`` points to must be one the manifest records a checksum for, with
        the same length: an item added or stretched after the write (a crafted training-state
        entry) is refused before any of its bytes are read, whether or not reads are checked."""
        items = self.checksums.items
        unchecked = [
            f"{_describe(index)} in {info.relative_path}"
            for index, info in self.metadata.storage_data.items()
            if index.fqn not in self.shared
            and getattr(items.get((info.relative_path, info.offset)), "length", None) != info.length
        ]
        if unchecked:
            raise SeedckptError(
                f"{self.path}: {len(unchecked)} item(s) of .metadata have no checksum recorded in "
                f"the manifest, e.g. {', '.join(unchecked[:3])}; they were not written with this "
                "checkpoint (it was altered or crafted) -- restore it or write it again"
            )

    def tensors(self) -> dict[str, TensorInfo]:
        return self.all_tensors

    def stored_name(self, fqn: str) -> str:
        return self.stored.get(fqn, fqn)

    def has_entry(self, key: str) -> bool:
        keys = self.metadata.state_dict_metadata  # DCP stores nested containers as "key.sub..." entries
        return key in keys or any(k.startswith(key + ".") for k in keys)

    def reader(self) -> OwnedFileSystemReader:
        return OwnedFileSystemReader(
            self.path, self.raw_items, self.metadata, self.checksums if self.check_reads else None
        )

    def read_tensor(self, fqn: str) -> torch.Tensor:
        key = self.stored.get(fqn, fqn)
        if isinstance(self.parts.get(fqn), StoredSplit):
            split = self.parts[fqn]
            shapes = split_shapes(split, self.all_tensors[fqn].shape)
            return split.join(tuple(self._read_whole(k, shape, fqn) for k, shape in zip(split.keys, shapes)))
        if fqn in self.parts:
            shape = joined_shape(self.parts[fqn], self.all_tensors)
            return self.split_once.read(fqn, self.parts[fqn], lambda: self._read_whole(key, shape, fqn))
        tensor = self._read_whole(key, self.all_tensors[fqn].shape, fqn)
        names = self.renamed.get(fqn)
        groups = names.row_groups(fqn) if names is not None else None
        return names.from_stored_rows(tensor, groups) if groups else tensor

    def reads_rows(self, fqn: str) -> bool:
        return True

    def read_align(self, fqn: str) -> int:
        return group_rows(None if fqn in self.parts else self.renamed.get(fqn), fqn, self.all_tensors[fqn].shape[0])

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``fqn``, reading (and checking) only the stored rows they come
        from: a fused or split tensor's through ``load``'s rows; where another tool permutes rows
        within groups (torchtitan's Qwen3 q/k heads), the whole groups around them."""
        info = self.all_tensors[fqn]
        if not info.shape:
            return self.read_tensor(fqn)
        if fqn in self.parts:
            window = RowWindow(torch.empty((stop - start, *info.shape[1:]), dtype=info.dtype), start)
            self.load({fqn: window})
            return window.dest

        def stored(lo: int, hi: int) -> torch.Tensor:
            window = RowWindow(torch.empty((hi - lo, *info.shape[1:]), dtype=info.dtype), lo)
            load_state({self.stored.get(fqn, fqn): window}, self.reader(), self.path, no_dist=True)
            return window.dest

        return read_in_groups(self.renamed.get(fqn), fqn, start, stop, stored, self.read_align)

    def _read_whole(self, key: str, shape: tuple[int, ...], fqn: str) -> torch.Tensor:
        """The stored ``key`` as it is stored, whole (of ``shape``, in ``fqn``'s dtype)."""
        out = {key: torch.empty(shape, dtype=self.all_tensors[fqn].dtype)}
        load_state(out, self.reader(), self.path, no_dist=True)
        return out[key]

    def load(self, state_dict: dict) -> None:
        """Load ``state_dict`` (tensors, DTensors, ``RowWindow``s, training state) in place via DCP;
        each rank reads only the rows it asks for. Collective across the default process group
        when one is initialized. DCP replaces non-tensor entries (training state) in the dict it
        loads; they are handed back in ``state_dict``."""
        self.check_covers(state_dict)
        plain = {key: wanted for key, wanted in state_dict.items() if key not in self.parts}
        stored, shared = one_destination_per_source(plain, lambda key: self.stored.get(key, key))
        permuted = self._grouped_rows(plain, stored)
        split = self._parts_reads(state_dict, stored)
        # a permuted tensor's window is None where this rank holds none of its rows: nothing to read;
        # every other entry (training state passed as None included) is loaded, and DCP's values
        # for non-tensor entries come back through ``loading``
        absent = {self.stored[key] for key, grouped in permuted.items() if grouped.window is None}
        loading = {k: v for k, v in stored.items() if k not in absent}
        load_state(loading, self.reader(), self.path)
        stored.update(loading)
        for key, grouped in permuted.items():
            grouped.finish(self.renamed[key].from_stored_rows)
            stored[self.stored[key]] = grouped.wanted
        for read in split:
            read.finish()
        copy_shared(state_dict, stored, shared)
        copies = {key for key, _ in shared}
        for key in plain:
            if key not in copies:
                state_dict[key] = stored[self.stored.get(key, key)]

    def _parts_reads(self, state_dict: dict, stored: dict) -> list[PartsRead]:
        """Our tensors of ``state_dict`` that another tool stores fused (torchtitan's gpt-oss ``mlp1``):
        in ``stored``, each stored key they share gets one buffer for the stored experts (dim-0 rows)
        their destinations hold, split into them by the returned reads' ``finish``."""
        fused: dict[str, dict] = {}  # stored key -> {our fqn: destination}
        for fqn in [fqn for fqn in state_dict if fqn in self.parts]:
            fused.setdefault(self.stored[fqn], {})[fqn] = state_dict[fqn]
        reads = []
        for key, wanted in fused.items():
            parts = self.parts[next(iter(wanted))]
            read = SplitRead if isinstance(parts, StoredSplit) else PartsRead
            reads.append(read(parts, wanted, self.infos, key, stored))
        return reads

    def _grouped_rows(self, state_dict: dict, stored: dict) -> dict[str, GroupedRows]:
        """Tensors another tool stores with rows permuted in groups (torchtitan's Qwen3 q/k heads):
        in ``stored``, each is replaced by the window of whole groups around this rank's rows (None:
        it holds none), read and put back in order by the returned ``GroupedRows``."""
        permuted = {}
        for key, names in self.renamed.items():
            groups = names.row_groups(key) if key in state_dict else None
            if groups and stored.get(self.stored[key]) is state_dict[key]:
                permuted[key] = GroupedRows(state_dict[key], groups)
                stored[self.stored[key]] = permuted[key].window
        return permuted

    def verify(self, on_bytes=lambda n: None) -> list[str]:
        """Read every item whole and check each piece against the checksums written with it; the
        problems found, each naming the tensor (or entry) and the file. ``on_bytes``: progress. The
        floating-point tensors holding NaN or Inf are left in ``nonfinite``: intact bytes, but a
        model no run should start from."""
        if self.checksums is None:
            return []
        names = {
            (info.relative_path, info.offset): index
            for index, info in self.metadata.storage_data.items()
            if index.fqn not in self.shared
        }
        fds = {file: os.open(data_file(self.path, file), os.O_RDONLY) for file in self.checksums.files}
        self.nonfinite = set()

        def check(item: ItemChecks) -> str | None:
            index = names.get((item.file, item.offset))
            stored = self.metadata.state_dict_metadata.get(index.fqn) if index is not None else None
            dtype = getattr(getattr(stored, "properties", None), "dtype", None)
            chunk = next((c for c in getattr(stored, "chunks", ()) if tuple(c.offsets) == tuple(index.offset)), None)
            look_for_nonfinite = None
            if chunk is not None and dtype.is_floating_point:
                end = item.start + math.prod(chunk.sizes) * dtype.itemsize  # then bytes of the format

                def look_for_nonfinite(view, at) -> None:
                    if at < end and not all_finite(torch.frombuffer(view[: end - at], dtype=dtype)):
                        self.nonfinite.add(index.fqn)

            try:
                on_bytes(verify_item(fds[item.file], item, f"{_describe(index)} in {self.path}", look_for_nonfinite))
            except SeedckptError as e:
                return str(e)
            return None

        try:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                problems = [p for p in pool.map(check, self.checksums.items.values()) if p]
        finally:
            for fd in fds.values():
                os.close(fd)
        return problems


def _shared_bytes(metadata) -> dict[str, str]:
    """``{key: source}`` for the keys of ``metadata`` whose every chunk lies at the bytes of one
    earlier key with the same tensor metadata: the alias our writer records for a tied FQN
    (``write_checkpoint``'s ``aliases``). The first key to point at some bytes stores them."""
    owner: dict[tuple[str, int, int], str] = {}
    owners: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        where = (info.relative_path, info.offset, info.length)  # an alias is its source's file, offset and length
        owners.setdefault(index.fqn, set()).add(owner.setdefault(where, index.fqn))
    tensors = metadata.state_dict_metadata
    return {
        key: source
        for key, (source, *others) in owners.items()
        if not others and source != key and tensors.get(key) == tensors.get(source)
    }


def _renamed(keys, renamings) -> tuple[dict, dict[str, StoredParts | StoredSplit], set[str]]:
    """``{our FQN: name adapter}`` for every key of a checkpoint in another tool's names: those of the
    first of the ``renamings`` that maps one of its keys to another name. Every key, since a name
    that is ours may still hold rows in that tool's order (torchtitan's Qwen3 ``q_norm``). Also the
    keys that hold several of ours (``{key: StoredParts}``), and the stored keys that tool's adapter
    leaves out on purpose (torchtitan's multi-token-prediction layers), named in one warning line;
    keys it maps to nothing and does not leave out stay, so the model's check refuses them."""
    for names in renamings:
        ours = {key: names.from_stored(key) for key in keys}
        if any(fqn is not None and fqn != key for key, fqn in ours.items()):
            skipped = [key for key, fqn in ours.items() if fqn is None]
            refused, note = names.left_out(skipped) if skipped else ([], None)
            if note is not None:
                warnings.warn(note, stacklevel=4)
            fused = {key: fqn for key, fqn in ours.items() if isinstance(fqn, (StoredParts, StoredSplit))}
            fqns = [f for fqn in ours.values() if fqn is not None for f in getattr(fqn, "fqns", (fqn,))]
            return dict.fromkeys(fqns, names), fused, set(skipped) - set(refused)
    return {}, {}, set()


def _split_infos(fused: dict, infos: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Ours that the stored keys of ``fused`` hold, each with its shape once split (or joined, for a
    ``StoredSplit``); ``ValueError`` when a stored part of one is missing."""
    ours = {}
    for key, parts in fused.items():
        if isinstance(parts, StoredSplit):
            ours[parts.fqn] = TensorInfo(split_joined_shape(parts, infos), infos[key].dtype)
            continue
        ours.update(
            (fqn, TensorInfo(shape, infos[key].dtype))
            for fqn, shape in zip(parts.fqns, split_shapes(parts, infos[key].shape))
        )
    return ours


def write(source: OpenedCheckpoint, dst: Path, job: WriteJob, names: NameAdapter | None = None) -> Path:
    """``source``'s tensors as a DCP checkpoint with ``job.manifest``, each written as chunks of
    ``SLAB_BYTES`` of rows, each read when the writer asks for it (a few slabs in memory at a time);
    ``names``: another tool's names (row order and fused tensors) instead of ours, with the zero
    tensors its model has and ours lacks. One of ours that tool splits into several (``StoredSplit``)
    is read whole, once for its parts."""
    try:
        entries = _stored_entries(job.infos, names)
    except ValueError as e:
        raise SeedckptError(f"{source.path}: {e}") from None
    zeros = names.zero_filled() if names else {}
    split_once = SplitOnce()

    def rows(key: str, start: int, stop: int) -> torch.Tensor:
        ours = entries[key][0]
        if isinstance(ours, StoredSplit):  # one block: the whole part
            return split_once.take(key, ours.keys, ours.split, lambda: source.read_tensor(ours.fqn))
        if isinstance(ours, StoredParts):  # dim 0 (the experts) is dim 0 of each of ours
            return ours.join(tuple(source.read_rows(fqn, start, stop) for fqn in ours.fqns))
        return read_stored_rows(source, ours, names, start, stop)

    def produce(key: str, start: int, stop: int) -> torch.Tensor:
        if key in zeros:
            return torch.zeros(zeros[key][0], dtype=zeros[key][1]).reshape(-1)[start:stop]
        info = entries[key][1]
        width = math.prod(info.shape[1:])
        if not info.numel:  # an empty tensor: one block of nothing
            return torch.empty(0, dtype=info.dtype)
        first = start // width
        job.on_bytes((stop - start) * info.dtype.itemsize)
        return rows(key, first, -(-stop // width)).reshape(-1)[start - first * width : stop - first * width]

    state = {k: torch.empty(info.shape, dtype=info.dtype, device="meta") for k, (_, info) in entries.items()}
    state.update((k, torch.empty(shape, dtype=dtype, device="meta")) for k, (shape, dtype) in zeros.items())
    cuts = {key: _row_blocks(ours, info, names) for key, (ours, info) in entries.items()}
    return write_checkpoint(
        dst,
        state,
        job.manifest,
        force=job.force,
        planner=LazySavePlanner(produce, cuts=cuts),
        lookahead=1,
        files=job.files,
        aliases=job.aliases,
    )


def _row_blocks(ours, info: TensorInfo, names: NameAdapter | None) -> list[tuple[list[int], list[int]]]:
    """The chunks a stored tensor is written in: slabs of whole rows (``stored_bounds``), or the whole
    tensor for a scalar, an empty one and a part of a ``StoredSplit`` (the split reads ours whole)."""
    if not info.shape or not info.numel or isinstance(ours, StoredSplit):
        return whole_tensor(info.shape)
    bounds = stored_bounds(info, names, ours) if isinstance(ours, str) else stored_bounds(info)
    return [([start] + [0] * (len(info.shape) - 1), [stop - start, *info.shape[1:]]) for start, stop in bounds]


def _stored_entries(infos: dict[str, TensorInfo], names: NameAdapter | None) -> dict:
    """``{stored key: (our FQN, its info)}``, or where the key holds several of ours (``StoredParts``)
    ``(the parts, the joined tensor's info)``, or where it is part of one of ours (``StoredSplit``)
    ``(the split, its part's info)``; ``ValueError`` when one of those is missing."""
    entries = {}
    for fqn, info in infos.items():
        key = names.to_stored(fqn) if names else fqn
        parts = names.from_stored(key) if names else None
        if isinstance(parts, StoredSplit):
            shapes = split_shapes(parts, info.shape)
            entries.update((k, (parts, TensorInfo(shape, info.dtype))) for k, shape in zip(parts.keys, shapes))
        elif isinstance(parts, StoredParts):
            entries[key] = (parts, TensorInfo(joined_shape(parts, infos), info.dtype))
        else:
            entries[key] = (fqn, info)
    return entries


def _describe(index) -> str:
    """A stored item in words: its key, and where a tensor is cut into chunks, which one."""
    if index is None:
        return "bytes no entry of .metadata points to"
    return index.fqn + (f" (chunk at {list(index.offset)})" if index.offset and any(index.offset) else "")
