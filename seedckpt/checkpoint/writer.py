"""The one checkpoint writer: DCP files that stock ``dcp.load`` reads, written at the disk's speed,
with the position of every tensor's raw bytes recorded so that readers can skip the parsing.

Every item is an ordinary ``torch.save`` zip record, as ``FileSystemWriter`` writes it. A zip
stores its members uncompressed and ``torch.save`` aligns a tensor's bytes to 64, so the tensor's
raw row-major bytes sit contiguously inside the item. The writer notes where (``raw_items`` in the
manifest); ``owned_reads.OwnedFileSystemReader`` then reads exactly the rows a rank owns from that
position, straight into its tensors, while stock ``dcp.load`` still sees a normal checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, CancelledError, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from seedckpt.checkpoint import block_plan
from seedckpt.checkpoint.atomic import atomic_output, write_json_synced
from seedckpt.checkpoint.integrity import (
    CHECKSUMS_KEY,
    ItemChecks,
    PieceHasher,
    band_checks,
    check_data_files,
    checksums_record,
    crc,
    file_sizes,
    piece_bytes,
)
from seedckpt.checkpoint.load import quiet_single_process_dcp, root_cause
from seedckpt.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, RAW_ITEMS_KEY, dtype_name, is_model_key
from seedckpt.checkpoint.safe_pickle import parse_dcp_metadata, tensor_infos
from seedckpt.utils.errors import SeedckptError


@dataclass
class _Written:
    """An item's DCP storage info, where its raw tensor bytes start (``None``: bytes item) and its
    piece checksums.

    Only travels from the ranks to rank 0's ``finish``, which stores plain ``_StorageInfo`` in
    ``.metadata`` (so stock readers see nothing new), the raw positions and checksums in the manifest."""

    info: _StorageInfo
    data_start: int | None
    checks: ItemChecks


class _RawStream:
    """The file object ``torch.save`` writes into: unbuffered ``os.write`` at the file's end.

    Unbuffered because a buffered Python file copies every block once more, which showed as a
    markedly slower write into tmpfs. It also notes the offset at which the bytes of ``watch`` (the
    tensor being saved) are written: the write whose buffer *is* that tensor's memory; and it
    checksums every byte of the item on the way (``integrity``), in pieces sized to ``whole``, the
    shape of the tensor ``watch`` is a chunk of.
    """

    def __init__(self, fd: int, file_name: str):
        self.fd, self.file_name, self.pos = fd, file_name, os.lseek(fd, 0, os.SEEK_CUR)
        self.watch: torch.Tensor | None = None
        self.whole = torch.Size()
        self.data_start: int | None = None
        self.hasher = PieceHasher(file_name, self.pos)

    def begin_item(self) -> None:
        self.data_start, self.hasher = None, PieceHasher(self.file_name, self.pos)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if (
            self.watch is not None
            and view.nbytes == self.watch.nbytes
            and view.nbytes
            and np.frombuffer(view, np.uint8).ctypes.data == self.watch.data_ptr()
        ):
            itemsize = self.watch.element_size()
            self.data_start = self.pos
            self.hasher.mark_start(piece_bytes(self.whole.numel() * itemsize))
            self.hasher.bands = band_checks(view, self.watch.shape, itemsize, self.whole[0] if self.whole else 1)
        self.hasher.update(view)
        done = 0
        while done < view.nbytes:
            done += os.write(self.fd, view[done:])
        self.pos += done
        return done

    def flush(self) -> None:
        pass


class StreamingFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` whose memory is bounded by the items in flight, not the model.

    Why not the stock writer: its write loop keeps every tensor of a file referenced until the file
    is closed (a lazily materialized save peaks at the whole state's size), and ``torch.save``'s
    zip CRC32 caps its speed well below the disk's. This writer splits a rank's items
    into ``files`` data files of about equal bytes, written concurrently, each by its own thread:
    it resolves the file's items in plan order on ``workers`` threads, at most ``lookahead`` ahead of
    the one being written, writes each with ``torch.save`` (CRC off: files are fsynced and published
    atomically instead) and drops it. Nothing is serialized through one thread: generating,
    checksumming and writing all release the GIL. The files and ``.metadata`` are the stock format
    (DCP's own writer also writes several files per rank): stock ``dcp.load`` reads them. After
    ``finish`` (rank 0), ``raw_items`` holds every tensor item's raw byte position for the manifest.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        lookahead: int = 4,
        workers: int = 2,
        files: int = 1,
        aliases: dict[str, str] | None = None,
    ):
        """``lookahead``: items resolved ahead of the one being written, per file; ``workers``:
        resolving threads per file; ``files``: data files this rank writes concurrently; ``aliases``:
        ``{fqn: source}`` recorded in ``.metadata`` as ``source``'s bytes (``finish``)."""
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.lookahead, self.workers, self.files = lookahead, workers, files
        self.aliases = aliases or {}
        self.raw_items: dict[str, list[list[int]]] = {}
        self.checks: list[ItemChecks] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """The files written at once, each by its own thread. The first failure -- of a file, or
        Ctrl-C (SIGTERM) in this thread while it waits -- stops every file at its next item, so
        the error surfaces within one block: before, the files ran to their ends first (24 s after
        Ctrl-C on a 1B seed, 2 workers, here)."""
        groups = _balanced(plan.items, self.files)
        stop = threading.Event()
        with ThreadPoolExecutor(len(groups)) as writers:
            written = [
                writers.submit(self._write_file, f"{plan.storage_data.prefix}{k}.distcp", items, planner, stop)
                for k, items in enumerate(groups)
            ]
            try:
                for file in wait(written, return_when=FIRST_EXCEPTION).done:
                    if file.exception() is not None:
                        raise file.exception()
                results = [result for file in written for result in file.result()]
            finally:
                stop.set()  # a no-op once every file is complete
        future: Future = Future()
        future.set_result(results)
        return future

    def _write_file(
        self, file_name: str, items: list[WriteItem], planner: SavePlanner, stop: threading.Event
    ) -> list[WriteResult]:
        results = []
        fd = os.open(Path(self.path) / file_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            stream = _RawStream(fd, file_name)
            with ThreadPoolExecutor(self.workers) as pool, _no_zip_crc():
                items, pending = iter(items), deque()

                def submit_next() -> None:
                    item = next(items, None)
                    if item is not None:
                        pending.append((item, pool.submit(planner.resolve_data, item)))

                for _ in range(self.lookahead):
                    submit_next()
                while pending:
                    if stop.is_set():  # another file failed, or the write was interrupted
                        pool.shutdown(cancel_futures=True)
                        raise CancelledError(f"{file_name} was left unfinished")
                    item, future = pending.popleft()
                    data = future.result()
                    submit_next()
                    offset = stream.pos
                    stream.begin_item()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        stream.watch, stream.whole = _compact_cpu(data), item.tensor_data.size
                        torch.save(stream.watch, stream)
                        stream.watch = None
                    length = stream.pos - offset
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=length,
                            storage_data=_Written(
                                _StorageInfo(file_name, offset, length), stream.data_start, stream.hasher.finish()
                            ),
                        )
                    )
                    if isinstance(planner, LazySavePlanner):
                        planner.release(data)
                    del data
                    start_writeback(fd, offset, length)
            os.fsync(fd)
        finally:
            os.close(fd)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                written: _Written = r.storage_data
                plain[-1].append(WriteResult(r.index, r.size_in_bytes, written.info))
                self.checks.append(written.checks)
                if written.data_start is not None:
                    nbytes = _item_nbytes(metadata, r.index)
                    self.raw_items.setdefault(written.info.relative_path, []).append(
                        [written.info.offset, written.data_start, nbytes]
                    )
        plain.append(self._alias_results(metadata, [r for rank_results in plain for r in rank_results]))
        super().finish(metadata, plain)

    def _alias_results(self, metadata: Metadata, written: list[WriteResult]) -> list[WriteResult]:
        """Each alias (a tied output: the embedding's matrix) as an entry of ``metadata`` at its
        source's bytes: the source's tensor metadata, and each of the source's chunks once more under
        the alias's name. Stock ``dcp.load`` then fills a state dict holding both names (a tied
        model's ``state_dict()``) with no second copy on disk. These results come after every written
        one, so the first name ``storage_data`` gives some bytes is the one that stores them
        (``formats.dcp`` reads and checks them under that name)."""
        tensors = metadata.state_dict_metadata
        for fqn, source in self.aliases.items():
            tensors[fqn] = tensors[source]
        return [
            WriteResult(MetadataIndex(fqn, r.index.offset, r.index.index), r.size_in_bytes, r.storage_data)
            for fqn, source in self.aliases.items()
            for r in written
            if r.index.fqn == source
        ]


@contextlib.contextmanager
def _no_zip_crc():
    """``torch.save`` without the zip CRC32 in this thread: torch's serialization settings are
    per thread, so set where the file is written (set by the caller of ``write_data`` alone, every
    byte of every file was CRC-ed: ~2.5 GB/s on one core here, ~2 s of CPU for a 1B seed's 4.9 GB)."""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(crc)


def _balanced(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """``items`` dealt into at most ``files`` groups of about equal bytes, each keeping plan order
    (every item goes to the group with the fewest bytes so far); no group is empty."""
    groups: list[list[WriteItem]] = [[] for _ in range(max(1, min(files, len(items))))]
    sizes = [0] * len(groups)
    for item in items:
        k = sizes.index(min(sizes))
        groups[k].append(item)
        sizes[k] += _write_nbytes(item)
    return groups


def _write_nbytes(item: WriteItem) -> int:
    """The bytes an item writes: its chunk's (``WriteItem.tensor_storage_size`` is the whole tensor's)."""
    data = item.tensor_data
    return data.chunk.sizes.numel() * data.properties.dtype.itemsize if data is not None else 1


def _item_nbytes(metadata: Metadata, index: MetadataIndex) -> int:
    """The bytes of the chunk at ``index``, found by its index hint where the plan set one: a scan
    of the tensor's chunks for every item took 0.07-0.10 s against 0.011 s for Qwen3-235B-A22B's
    expert blocks at 16 workers (256 a tensor), and grows with the square of the blocks a tensor."""
    md = metadata.state_dict_metadata[index.fqn]
    hinted = md.chunks[index.index] if index.index is not None and index.index < len(md.chunks) else None
    chunk = hinted if hinted is not None and hinted.offsets == index.offset else None
    chunk = chunk or next(c for c in md.chunks if c.offsets == index.offset)
    return chunk.sizes.numel() * md.properties.dtype.itemsize


class BlockPool:
    """Buffers for written blocks, each ``slot_bytes`` (the largest block's) and reused whatever the
    size of the block.

    A fresh allocation is faulted in page by page (the kernel zeroes every page) and returned to the
    OS when freed, so a writer that allocates each block anew pays that again for every block, which
    made generating a seed's blocks markedly slower; buffers kept by size paid it at every change of
    size (a 4-layer Llama 3 1B seed allocated 522 MiB afresh for 1.9 GB written). A block is a
    tensor over exactly its own bytes at the start of a slot (``torch.frombuffer``): ``torch.save``
    writes a tensor's whole storage. At most ``keep`` idle slots are kept, so memory stays bounded by
    the blocks in flight plus ``keep`` slots. A block larger than a slot gets a buffer of its own."""

    def __init__(self, slot_bytes: int, keep: int):
        self.slot_bytes, self.keep = slot_bytes, keep
        self.idle: list[torch.Tensor] = []
        self.lent: dict[int, torch.Tensor] = {}  # a lent block's address -> its slot
        self.lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not 0 < numel * dtype.itemsize <= self.slot_bytes:
            return torch.empty(numel, dtype=dtype)
        with self.lock:
            slot = self.idle.pop() if self.idle else None
        if slot is None:
            slot = torch.empty(self.slot_bytes, dtype=torch.uint8)
        block = torch.frombuffer(memoryview(slot.numpy()), dtype=dtype, count=numel)
        with self.lock:
            self.lent[block.data_ptr()] = slot
        return block

    def give(self, tensor: torch.Tensor) -> None:
        """Return the slot of ``tensor`` (from ``take``); the caller must not use the tensor afterwards."""
        with self.lock:
            slot = self.lent.pop(tensor.untyped_storage().data_ptr(), None)
            if slot is not None and len(self.idle) < self.keep:
                self.idle.append(slot)


def whole_tensor(shape: torch.Size) -> list[tuple[list[int], list[int]]]:
    """One block: the whole tensor (``LazySavePlanner``'s default cut)."""
    return [([0] * len(shape), list(shape))]


class LazySavePlanner(DefaultSavePlanner):
    """Plans tensors as blocks and produces each block only when the writer asks for it.

    The state dict handed to ``dcp.save`` holds ``meta`` tensors of at least one dimension;
    ``blocks(shape)`` cuts each into blocks ``(offsets, sizes)``, each a run of consecutive
    row-major elements (whole slices of one dimension, one index of the dimensions before it), and
    ``produce(fqn, start, stop)`` returns elements ``[start, stop)`` of the flattened tensor. Blocks
    are ordinary DCP chunks, exactly what a sharded save writes, so stock ``dcp.load`` reassembles
    them. With the streaming writer, memory is bounded by the blocks in flight. ``pool``: where
    ``produce`` takes its buffers, and casts theirs; written blocks are given back to it. ``cuts``:
    ``{fqn: blocks}`` for tensors cut otherwise than ``blocks`` cuts their shape (a conversion's).
    """

    def __init__(self, produce, blocks=whole_tensor, pool: BlockPool | None = None, cuts: dict | None = None):
        super().__init__()
        self.produce, self.blocks, self.pool, self.cuts = produce, blocks, pool, cuts or {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, meta in self.state_dict.items():
            for offsets, sizes in self.cuts.get(fqn) or self.blocks(meta.shape):
                offsets, sizes = torch.Size(offsets), torch.Size(sizes)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets, sizes),
                            properties=TensorProperties(dtype=meta.dtype),
                            size=meta.shape,
                        ),
                    )
                )
        self.plan = SavePlan(items, planner_data=self.mappings)  # FQN mapping, as the default planner
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """One process's blocks planned and checked in one pass (``block_plan``): DCP's own planning
        compares every pair of blocks within a grouped expert weight: 5.7 s of DeepSeek-V3-671B's
        serial start at 16 workers against 0.47 s (``block_plan`` has the figures)."""
        planned = block_plan.global_plan(all_plans[0]) if len(all_plans) == 1 else None
        if planned is None:
            return super().create_global_plan(all_plans)
        plan, self.metadata = planned
        self.global_plan = [plan]
        return self.global_plan, self.metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk = write_item.tensor_data.chunk
        meta = self.state_dict[write_item.index.fqn]
        start = sum(o * math.prod(meta.shape[d + 1 :]) for d, o in enumerate(chunk.offsets))  # row-major
        block = self.produce(write_item.index.fqn, start, start + chunk.sizes.numel())
        return self._cast(block.view(chunk.sizes), meta.dtype)

    def _cast(self, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``block`` in ``dtype`` (a bf16 seed is generated in fp32), its buffer from the pool; the
        fp32 buffer is free then."""
        if block.dtype == dtype:
            return block
        out = (self.pool.take if self.pool is not None else torch.empty)(block.numel(), dtype=dtype)
        out = out.view(block.shape).copy_(block)
        self.release(block)
        return out

    def release(self, data: torch.Tensor) -> None:
        """The writer is done with ``data`` (from ``resolve_data``): its buffer may be reused."""
        if self.pool is not None:
            self.pool.give(data)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Push the bytes just written towards the disk now, not all at the final fsync.

    ``POSIX_FADV_DONTNEED`` starts asynchronous writeback of the range (and lets the kernel drop
    it from the page cache once clean), so the disk works while the next blocks are generated.
    ``fd``: a descriptor whose writes are not buffered in Python (flush a file object first).
    """
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _compact_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning exactly its bytes (``torch.save`` writes a view's whole storage)."""
    tensor = tensor.detach().cpu()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def write_checkpoint(
    path: str | os.PathLike,
    state_dict: dict,
    manifest: dict,
    force: bool = False,
    planner: SavePlanner | None = None,
    lookahead: int = 4,
    files: dict[str, Path] | None = None,
    parallel_files: int = 1,
    resolvers: int = 2,
    group: dist.ProcessGroup | None = None,
    aliases: dict[str, str] | None = None,
) -> Path:
    """Write a DCP checkpoint plus manifest to ``path`` atomically.

    Collective when a process group is initialized (every rank passes its own entries, e.g. its
    stage's tensors or shards); otherwise single-process. The data goes to ``.NAME.partial`` first;
    rank 0 adds the manifest (with the per-tensor table read back from the written metadata and the
    raw byte positions) and renames the complete, fsynced directory to ``NAME``. With ``force`` an
    existing ``NAME`` is replaced only after the new one is complete. A custom ``planner`` may
    produce the data lazily (the seed writer generates each item when the writer asks for it).
    ``files`` maps relative names to files that rank 0 copies in before publishing (a fine-tuning
    run's tokenizer). ``parallel_files`` data files per rank are written at once, each with
    ``resolvers`` threads producing its items ``lookahead`` ahead (``StreamingFileSystemWriter``).
    ``group`` (default: the default group; it must hold every rank) carries the write's
    collectives: a background save passes its own, so that they never interleave with training's.
    ``aliases`` (``{fqn: source}``): FQNs left out of ``state_dict`` because they are ``source``'s
    tensor (a tied output); ``.metadata`` records each as ``source``'s bytes, so stock ``dcp.load``
    of a tied model's state dict finds it. The manifest's table lists only the stored tensors, so
    ``num_params`` counts a tied matrix once.

    Rank 0 holds the destination's lock (``atomic_output``) for the whole write, so another writer
    of ``path`` fails at once. It sends the other ranks the name of the partial directory it
    created, or that it could not start (say the lock is held), in which case every rank raises
    and none waits for it. A training run holds a lock on its whole folder (``destination_lock``),
    so its ``step-N`` writes never contend.
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    leader = not distributed or dist.get_rank() == 0
    with contextlib.ExitStack() as publishing:
        # Only rank 0 prepares, publishes and cleans up; the others just write into its partial dir.
        names = [None]
        try:
            if leader:
                names[0] = publishing.enter_context(atomic_output(path, force))
        finally:
            if distributed:
                dist.broadcast_object_list(names, src=0, group=group)
        partial = names[0]
        if partial is None:
            raise SeedckptError(f"rank 0 could not start writing {path}; its error says why")
        writer = StreamingFileSystemWriter(
            partial, lookahead=lookahead, workers=resolvers, files=parallel_files, aliases=aliases
        )
        try:
            # The warning filter is process-wide state: a background save running distributed leaves it alone.
            with contextlib.nullcontext() if distributed else quiet_single_process_dcp():
                dcp.save(
                    state_dict, storage_writer=writer, planner=planner, process_group=group, no_dist=not distributed
                )
        except CheckpointException as e:  # a BaseException wrapping each rank's failure
            raise root_cause(e, f"writing {path}", writing=True) from None
        if leader:
            metadata_bytes = (partial / ".metadata").read_bytes()
            metadata = parse_dcp_metadata(metadata_bytes, partial / ".metadata")
            sizes = file_sizes(writer.checks)
            check_data_files(partial, metadata.storage_data, sizes)  # publish only what is complete
            tensors = {
                fqn: info
                for fqn, info in tensor_infos(metadata).items()
                if is_model_key(fqn) and fqn not in writer.aliases
            }
            manifest = {
                **manifest,
                "format_version": FORMAT_VERSION,  # the layout of the checksums written here, whatever the caller's
                "num_params": sum(i.numel for i in tensors.values()),
                "tensors": {fqn: {"shape": list(i.shape), "dtype": dtype_name(i.dtype)} for fqn, i in tensors.items()},
                RAW_ITEMS_KEY: writer.raw_items,
                CHECKSUMS_KEY: checksums_record(writer.checks, crc(metadata_bytes), sizes),
            }
            write_json_synced(partial / MANIFEST_NAME, manifest)
            for name, source in (files or {}).items():
                (partial / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, partial / name)
    if distributed:
        dist.barrier(group=group)
    return path
