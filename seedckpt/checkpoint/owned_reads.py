"""Reading only the bytes a rank owns, straight into its tensors.

Why not stock ``FileSystemReader``: it reads every item a rank touches whole, parses it with
``torch.load``, and only then narrows to the rows asked for. The seed is written as row blocks of
up to 64 MiB, so with 4 FSDP ranks each rank read ~3x the bytes it owns and staged each item in
memory (measured on Llama-3.2-1B shapes: 4.3 GB read per rank for 1.4 GB owned).

Here every request is a byte range: the raw row-major bytes of a stored chunk sit contiguously at
a known position (recorded by our writer in the manifest, or given by a safetensors header), and a
request for whole rows of it is one contiguous range. It is read with ``os.preadv`` on a thread
pool (the GIL is released during the read). A CPU destination is read into directly when the dtype
matches and it is one contiguous block -- the common case -- or through a bounded buffer otherwise
(a cast, a column slice). A CUDA destination is read through reusable pinned slots, each copied to
the device on a side stream while the threads read the next ones, so the disk (or page cache) and
the host-to-device link work at once (stock: pageable buffers, one blocking copy per tensor). Items
without a known position (foreign checkpoints, training-state bytes) take the stock path.
"""

from __future__ import annotations

import math
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from seedckpt.checkpoint.integrity import (
    PIECE_BYTES,
    Checksums,
    ItemChecks,
    band_mismatch,
    crc,
    data_file,
    verify_item,
)
from seedckpt.checkpoint.safe_pickle import SafeFileSystemReader
from seedckpt.checkpoint.safetensors_header import SAFETENSORS_DTYPES, safetensors_header
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.files import pread_into

READ_BYTES = 16 * 2**20  # about one preadv call; small enough to spread a tensor over the threads
STAGING_BYTES = 256 * 2**20  # at most this much is buffered at once for casts and device copies
READ_THREADS = 8


@dataclass(frozen=True)
class RawChunk:
    """Where the raw row-major bytes of one stored chunk are: ``path`` from ``start``; ``checks``:
    the piece checksums of the item around them (``None``: none recorded, or checking is off)."""

    path: Path
    start: int
    shape: torch.Size
    dtype: torch.dtype
    checks: ItemChecks | None = None

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes if self.shape else self.dtype.itemsize


class StagingSlots:
    """Reusable host buffers of ``nbytes`` for reads bound for a device: a read fills a slot, a copy
    empties it into device memory, and the slot is taken again once that copy is done (``event``).

    On CUDA the slots are pinned, so the copies run ``non_blocking`` on ``stream`` while the threads
    read on: the disk and the host-to-device link work at once. Pinned memory comes from torch's
    caching host allocator, which keeps it for the next load (the resume after the model load)."""

    def __init__(self, count: int, nbytes: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.nbytes = nbytes
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self.free.put((self._new(nbytes), None))

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def copy(self, dest: torch.Tensor, fill) -> None:
        """``fill(memoryview)`` a slot with ``dest.nbytes`` bytes, then copy them into ``dest``
        (flat ``uint8``). A larger request than a slot (a crafted piece size) gets its own buffer."""
        n = dest.numel()
        slot, event = self.free.get() if n <= self.nbytes else (self._new(n), None)
        if event is not None:
            event.synchronize()
        fill(memoryview(slot.numpy())[:n])
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dest.copy_(slot[:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            dest.copy_(slot[:n])
        if slot.numel() == self.nbytes:
            self.free.put((slot, event))

    def start_after(self, device: torch.device) -> None:
        """Order the copies after the work already queued on ``device`` (the materialization that
        allocated and may still be writing the destinations)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def finish_before(self, device: torch.device) -> None:
        """Order the work queued on ``device`` from now on after every copy issued so far."""
        if self.cuda:
            torch.cuda.current_stream(device).wait_stream(self.stream)


class OwnedReads:
    """Runs a rank's read requests as ``preadv`` calls, checking the pieces they cover against the
    recorded checksums; counts the bytes asked for (``bytes_read``) and those read only to check the
    pieces around them (``bytes_read_to_check``).

    A destination in CPU memory is read into directly. Any other (a CUDA tensor) is read through
    ``StagingSlots``, one slot per read, copied onward while the next reads run. ``stage_all`` routes
    CPU destinations through pageable slots too: the device path's code, run where there is no device
    (tests)."""

    def __init__(self, threads: int = READ_THREADS, stage_all: bool = False):
        self.threads = threads
        self.stage_all = stage_all
        self.bytes_read = self.bytes_read_to_check = 0

    def run(self, items: list[ReadItem], locate, planner: LoadPlanner) -> None:
        """Fill every item's destination; ``locate(item)`` gives its ``RawChunk``."""
        fds: dict[Path, int] = {}
        slots: dict[torch.device, StagingSlots] = {}
        batch, staged = [], 0
        try:
            with ThreadPoolExecutor(self.threads) as pool:
                for item in items:
                    chunk = locate(item)
                    if chunk.path not in fds:
                        fds[chunk.path] = os.open(chunk.path, os.O_RDONLY)
                    target = planner.resolve_tensor(item).detach()
                    device = target.device
                    if (device.type != "cpu" or self.stage_all) and device not in slots:
                        slots[device] = StagingSlots(self.threads + 2, READ_BYTES + 2 * PIECE_BYTES, device)
                        slots[device].start_after(device)
                    job = _Job(item, chunk, target, fds[chunk.path], slots.get(device))
                    batch.append(job)
                    staged += job.buffer.nbytes if job.buffer is not None else 0
                    if staged >= STAGING_BYTES:
                        self._finish(batch, pool, planner, slots)
                        batch, staged = [], 0
                self._finish(batch, pool, planner, slots)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _finish(
        self, jobs: list[_Job], pool: ThreadPoolExecutor, planner: LoadPlanner, slots: dict[torch.device, StagingSlots]
    ) -> None:
        units = [unit for job in jobs for unit in job.units()]
        total = sum(pool.map(_read_unit, units))
        asked = sum(job.asked for job in jobs)
        self.bytes_read += asked
        self.bytes_read_to_check += total - asked
        for device, device_slots in slots.items():
            device_slots.finish_before(device)  # the casts below and whatever follows the load
        for job in jobs:
            job.complete()
            planner.commit_tensor(job.item, job.target)


class _Job:
    """One read request: the byte range of its rows, the pieces around it to check, where the bytes go.

    The bytes go to ``dest``: the target itself when it is the stored bytes as they are (same dtype,
    contiguous), else ``buffer``, the stored rows on the target's device, from which ``complete``
    narrows and casts into the target. A request for a slice of the columns of each row (a
    tensor-parallel rowwise shard: ``Shard(1)``) reads only each row's ``segment`` when no checksum
    is to be checked, and the bands around it, to the tiles' rows, when the item's band checksums
    are recorded (``integrity.BandChecks``); else whole rows, so each piece read can be checked."""

    def __init__(self, item: ReadItem, chunk: RawChunk, target: torch.Tensor, fd: int, slots: StagingSlots | None):
        self.item, self.chunk, self.target, self.fd, self.slots = item, chunk, target, fd, slots
        offsets, lengths = list(item.storage_offsets) or [0], list(item.lengths) or [1]
        self.first_row, self.rows = offsets[0], lengths[0]
        rows = self.rows
        whole = [o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], chunk.shape[1:])]
        self.segment = None  # (offset in a row, bytes): the part of each row asked for
        self.bands = chunk.checks.bands if chunk.checks is not None else None
        if not all(whole) and all(whole[1:]) and (chunk.checks is None or self.bands is not None):
            inner = math.prod(chunk.shape[2:]) * chunk.dtype.itemsize
            self.segment = (offsets[1] * inner, lengths[1] * inner)
            if self.bands is not None and (self.bands.row_bytes, self.bands.num_rows) != (
                chunk.row_bytes,
                chunk.shape[0],
            ):
                raise SeedckptError(
                    f"{chunk.path.parent}: the manifest's band checksums of {item.storage_index.fqn} do not fit "
                    "its shape; the checkpoint is damaged"
                )
        shape = (rows, *lengths[1:]) if self.segment else (rows, *chunk.shape[1:])
        straight = (all(whole) or self.segment) and target.dtype == chunk.dtype and target.is_contiguous()
        self.buffer = None if straight else torch.empty(shape, dtype=chunk.dtype, device=target.device)
        self.dest = target if straight else self.buffer
        self.lo = chunk.start + self.first_row * chunk.row_bytes  # the rows asked for: [lo, hi)
        self.hi = self.lo + rows * chunk.row_bytes
        self.asked = rows * self.segment[1] if self.segment else self.hi - self.lo
        self.pieces = range(0)
        if chunk.checks is not None:
            self.pieces = range(*chunk.checks.covering(self.lo, self.hi, chunk.start + chunk.nbytes))

    def dest_bytes(self) -> torch.Tensor:
        return self.dest.reshape(-1).view(torch.uint8) if self.dest.numel() else torch.empty(0, dtype=torch.uint8)

    def units(self) -> list:
        """The reads: whole checked pieces grouped up to ``READ_BYTES`` (or plain ranges when
        unchecked, or runs of rows' segments); the bytes around the request go into small side buffers."""
        checks = self.chunk.checks
        if self.segment is not None and self.bands is not None:
            rows = self.bands.rows_per_tile
            last = self.first_row + self.rows - 1
            return [_BandedSegments(self, group) for group in range(self.first_row // rows, last // rows + 1)]
        if self.segment is not None:
            step = max(1, READ_BYTES // max(1, self.segment[1]))
            return [_Segments(self, range(r, min(self.rows, r + step))) for r in range(0, self.rows, step)]
        if checks is None:
            bounds = [*range(self.lo, self.hi, READ_BYTES), self.hi]
            return [_Unit(self, a, b, range(0), []) for a, b in zip(bounds, bounds[1:])]
        cuts = checks.cuts
        span_lo, span_hi = min(self.lo, cuts[self.pieces.start]), max(self.hi, cuts[self.pieces.stop])
        sides = [
            (span_lo, memoryview(bytearray(self.lo - span_lo))),
            (self.hi, memoryview(bytearray(span_hi - self.hi))),
        ]
        units, group = [], []
        for k in self.pieces:
            group.append(k)
            if cuts[k + 1] - cuts[group[0]] >= READ_BYTES or k == self.pieces.stop - 1:
                units.append(_Unit(self, cuts[group[0]], cuts[k + 1], range(group[0], k + 1), sides))
                group = []
        return units

    def complete(self) -> None:
        if self.buffer is not None:
            part = self.buffer
            for dim, (offset, length) in enumerate(zip(self.item.storage_offsets, self.item.lengths)):
                if dim > (1 if self.segment else 0):
                    part = part.narrow(dim, offset, length)
            self.target.copy_(part.reshape(self.target.shape))


@dataclass
class _Unit:
    """Bytes ``[lo, hi)`` of the job's file, the checked pieces among them, and the side buffers for
    the bytes around the request ((file offset, memory) pairs)."""

    job: _Job
    lo: int
    hi: int
    pieces: range
    sides: list[tuple[int, memoryview]]

    @property
    def asked(self) -> tuple[int, int]:
        """The part of ``[lo, hi)`` the request asked for."""
        return max(self.lo, self.job.lo), min(self.hi, self.job.hi)

    def dest(self) -> torch.Tensor:
        a, b = self.asked
        return self.job.dest_bytes()[a - self.job.lo : b - self.job.lo]

    def read_into(self, asked: memoryview) -> int:
        """Read the unit's bytes: those asked for into ``asked``, the rest into its side buffers,
        checking each piece as it is read. Returns the bytes read."""
        a, _ = self.asked
        chunk = self.job.chunk
        segments = sorted([*self.sides, (a, asked)], key=lambda segment: segment[0])

        def views(lo: int, hi: int) -> list[memoryview]:
            out = []
            for start, mem in segments:
                x, y = max(lo, start), min(hi, start + mem.nbytes)
                if x < y:
                    out.append(mem[x - start : y - start])
            return out

        checks = chunk.checks
        if not self.pieces:
            position = self.lo
            for view in views(self.lo, self.hi):
                _pread_exact(self.job, view, position)
                position += view.nbytes
            return self.hi - self.lo
        # A piece at a time, checked right after it is read, while its bytes are still in the CPU's
        # cache: checking the whole unit after reading it was a second pass over memory.
        for k in self.pieces:
            value, position = 0, checks.cuts[k]
            for view in views(checks.cuts[k], checks.cuts[k + 1]):
                _pread_exact(self.job, view, position)
                position += view.nbytes
                value = crc(view, value)
            if value != checks.crcs[k]:
                raise checks.mismatch(k, value, f"{self.job.item.storage_index.fqn} in {chunk.path.parent}")
        return self.hi - self.lo


@dataclass
class _Segments:
    """The asked-for segment of each of the job's ``rows`` (relative to its first row): one
    ``preadv`` per row, into consecutive bytes of the destination."""

    job: _Job
    rows: range

    def dest(self) -> torch.Tensor:
        length = self.job.segment[1]
        return self.job.dest_bytes()[self.rows.start * length : self.rows.stop * length]

    def read_into(self, asked: memoryview) -> int:
        offset, length = self.job.segment
        row_bytes = self.job.chunk.row_bytes
        for k, row in enumerate(self.rows):
            _pread_exact(self.job, asked[k * length : (k + 1) * length], self.job.lo + row * row_bytes + offset)
        return len(self.rows) * length


@dataclass
class _BandedSegments:
    """The job's rows in one group of tiles: each row's span of whole bands around the segment asked
    for is read, every tile of the span checked, and the asked part copied out."""

    job: _Job
    group: int

    def _rows(self) -> tuple[int, int]:
        """The group's rows, and the part of them the job asks for (chunk rows)."""
        rows = self.job.bands.rows_per_tile
        lo, hi = self.group * rows, min(self.job.bands.num_rows, (self.group + 1) * rows)
        return lo, hi

    def _asked_rows(self) -> tuple[int, int]:
        lo, hi = self._rows()
        return max(lo, self.job.first_row), min(hi, self.job.first_row + self.job.rows)

    def dest(self) -> torch.Tensor:
        lo, hi = self._asked_rows()
        length, first = self.job.segment[1], self.job.first_row
        return self.job.dest_bytes()[(lo - first) * length : (hi - first) * length]

    def read_into(self, asked: memoryview) -> int:
        job, bands = self.job, self.job.bands
        offset, length = job.segment
        width = bands.band_bytes
        first_band, end_band = offset // width, -(-(offset + length) // width)
        span = memoryview(bytearray((end_band - first_band) * width))
        values = [0] * (end_band - first_band)
        lo, hi = self._rows()
        asked_lo, asked_hi = self._asked_rows()
        skip = offset - first_band * width
        for row in range(lo, hi):
            _pread_exact(job, span, job.chunk.start + row * bands.row_bytes + first_band * width)
            for k in range(len(values)):
                values[k] = crc(span[k * width : (k + 1) * width], values[k])
            if asked_lo <= row < asked_hi:
                at = (row - asked_lo) * length
                asked[at : at + length] = span[skip : skip + length]
        for k, value in enumerate(values):
            if value != bands.crcs[self.group * bands.bands + first_band + k]:
                raise band_mismatch(
                    job.chunk.checks,
                    self.group,
                    first_band + k,
                    f"{job.item.storage_index.fqn} in {job.chunk.path.parent}",
                )
        return (hi - lo) * span.nbytes


def _pread_exact(job: _Job, view: memoryview, position: int) -> None:
    done = pread_into(job.fd, view, position)
    if done < view.nbytes:
        raise SeedckptError(
            f"{job.chunk.path} is truncated: a tensor's bytes end at {position + view.nbytes}, "
            f"the file at {position + done}; the checkpoint is damaged -- write it again"
        )


def _read_unit(unit: _Unit | _Segments | _BandedSegments) -> int:
    """Read (and check) one unit into its destination, through a staging slot when the job has them."""
    dest = unit.dest()
    if unit.job.slots is None:
        return unit.read_into(memoryview(dest.numpy()))
    read = []
    unit.job.slots.copy(dest, lambda slot: read.append(unit.read_into(slot)))
    return read[0]


def _tensor_items(plan: LoadPlan, known) -> tuple[list[ReadItem], list[ReadItem]]:
    """(requests with known raw positions, the rest)."""
    direct = [i for i in plan.items if i.type == LoadItemType.TENSOR and known(i.storage_index)]
    rest = [i for i in plan.items if not (i.type == LoadItemType.TENSOR and known(i.storage_index))]
    return direct, rest


def _done() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut


class OwnedFileSystemReader(SafeFileSystemReader):
    """A DCP storage reader for our checkpoints: reads the owned rows of every tensor item at the
    positions the manifest records (``raw_items``), the rest the stock way."""

    def __init__(
        self,
        path,
        raw_items: dict,
        metadata: Metadata | None = None,
        checksums: Checksums | None = None,
        threads: int = READ_THREADS,
    ):
        """``checksums``: check every byte read against them (``None``: nothing to check)."""
        super().__init__(path, metadata)
        self.raw = {(file, entry[0]): entry for file, entries in raw_items.items() for entry in entries}
        self.checksums = checksums
        self.reads = OwnedReads(threads)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def _raw_entry(self, index: MetadataIndex):
        info = self.storage_data[index]
        return self.raw.get((info.relative_path, info.offset))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        direct, rest = _tensor_items(plan, lambda index: self._raw_entry(index) is not None)
        if rest:
            self._check_whole(rest)
            super().read_data(LoadPlan(rest), planner).wait()
        self.reads.run(direct, self._locate, planner)
        return _done()

    def _checks(self, index: MetadataIndex) -> ItemChecks | None:
        info = self.storage_data[index]
        return self.checksums.items.get((info.relative_path, info.offset)) if self.checksums else None

    def _check_whole(self, items: list[ReadItem]) -> None:
        """Items read the stock way (training state, tensors without a raw position) are small:
        each is read once more, whole, to check it before DCP parses it."""
        whole = {}
        for item in items:
            checks = self._checks(item.storage_index)
            if checks is not None:
                whole[(checks.file, checks.offset)] = (checks, item.storage_index.fqn)
        for checks, fqn in whole.values():
            fd = os.open(data_file(Path(self.path), checks.file), os.O_RDONLY)
            try:
                verify_item(fd, checks, f"{fqn} in {self.path}")
            finally:
                os.close(fd)

    def _locate(self, item: ReadItem) -> RawChunk:
        index = item.storage_index
        info = self.storage_data[index]
        _, start, nbytes = self._raw_entry(index)
        md = self.metadata.state_dict_metadata[index.fqn]
        chunk = next((c for c in md.chunks if c.offsets == index.offset), None)
        if (
            chunk is None
            or not info.offset <= start <= start + nbytes <= info.offset + info.length
            or nbytes != chunk.sizes.numel() * md.properties.dtype.itemsize
        ):
            raise SeedckptError(
                f"{self.path}: the manifest's raw position of {index.fqn} does not fit its item in "
                f"{info.relative_path}; the checkpoint is damaged"
            )
        return RawChunk(
            data_file(Path(self.path), info.relative_path), start, chunk.sizes, md.properties.dtype, self._checks(index)
        )


class OwnedHFReader(HuggingFaceStorageReader):
    """DCP's reader of HF safetensors directories, reading each request's rows with ``preadv``
    at the offsets of the safetensors header (stock: ``safe_open`` + ``get_slice`` over ``mmap``,
    whose pages count in the rank's RSS)."""

    def __init__(self, path, threads: int = READ_THREADS):
        super().__init__(str(path))
        self.reads = OwnedReads(threads)
        self.headers: dict[str, tuple[int, dict]] = {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        direct, rest = _tensor_items(plan, lambda index: True)
        if rest:
            super().read_data(LoadPlan(rest), planner).wait()
        self.reads.run(direct, self._locate, planner)
        return _done()

    def _locate(self, item: ReadItem) -> RawChunk:
        info = self.storage_data[item.storage_index]
        path = Path(info.relative_path)
        if info.relative_path not in self.headers:
            header, _, data_start = safetensors_header(path)
            self.headers[info.relative_path] = (data_start, header)
        data_start, header = self.headers[info.relative_path]
        entry = header[item.storage_index.fqn]
        return RawChunk(
            path, data_start + entry["data_offsets"][0], torch.Size(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]]
        )
