"""Checksums of every byte a checkpoint's data files hold: recorded when written, checked when read.

``torch.save``'s zip CRC32 is off in our writer (it capped the write's speed), and a DCP
directory has no checksum of its own, so a flipped bit would load silently. Instead every item
(one ``torch.save`` record or bytes blob in a ``.distcp`` file) is cut into *pieces* and the
CRC32C of each piece goes into the manifest (``checksums``).

Why pieces, not whole items: a rank reads only the rows it owns (``owned_reads``), and a check must not
force it to read the whole item. The cuts fall at the start of the tensor's raw bytes and every
piece after it, so an FSDP shard of a power-of-two split reads no byte more than it owns; an
unaligned request reads at most one extra piece at each end. The bytes before the raw data (the zip
and pickle records) form a head piece, checked by the rank that reads the first rows.

Why pieces sized to the tensor (``piece_bytes``): a tensor's items are cut into pieces of a power
of two giving the whole tensor at least ``MIN_PIECES`` of them (``MIN_PIECE_BYTES`` to
``PIECE_BYTES``), so any slice of 1/64 of a tensor or more is checked on about its own bytes,
however small the tensor and however it was sharded when written. With 1 MiB pieces whatever the
tensor, a dim-512 model's 1 MiB matrices were one piece each: a tp2 x dp_shard2 rank read 2.86x the
bytes it owned, a dp_shard4 rank 3.27x (``benchmarks/tp_read.py``). Sized to the tensor, not to the
item, the CRCs grow by at most ``MIN_PIECES`` per tensor: tensors of 64 MiB and more keep 1 MiB
pieces however many ranks write them, so a large model's manifest is no larger than before.
Checkpoints of format version 1 have ``PIECE_BYTES`` pieces throughout, recorded once for all.

Why bands too: a tensor-parallel rank that holds a slice of the columns of each row (a rowwise
``Shard(1)``: ``wo``, ``w2``) asks for one short segment per row, and each 1 MiB piece it touches
would have to be read whole (measured on Llama 3.2 1B, tp4: 1.8x the bytes owned). So each tensor
of two or more dimensions also gets *tiles*: up to ``MAX_BANDS`` equal column bands of
``rows_per_tile`` rows, each tile about ``TILE_BYTES``, their CRC32C recorded apart (``bands``).
A column slice that follows the bands (TP degrees dividing their count) is checked by reading only
its own columns, and rows to the tiles' edges. A tensor of ``MIN_PIECES`` rows or more has at least
that many tiles (``MIN_PIECES / bands`` rows of tiles), for the same reason as the pieces: a
dim-512 model's ``[512, 512]`` ``wo`` was one row of tiles, read whole by each FSDP shard.

Why CRC32C (``crc32c`` package, SSE4.2): computed in hardware, several times ``zlib.crc32``'s speed on
one core (``benchmarks/checksums.py``), and the standard storage checksum.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np

from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.files import pread_into

ALGORITHM = "crc32c"
PIECE_BYTES = 1 << 20  # the largest piece (format version 1: every piece)
MIN_PIECE_BYTES = 4 << 10
MIN_PIECES = 64  # pieces (and tile rows) an item is cut into at least, down to MIN_PIECE_BYTES
TILE_BYTES = 256 << 10
MAX_BANDS = 8
# manifest: {"algorithm", "metadata", "files", "items", "bands"} (version 1: and "piece_bytes")
CHECKSUMS_KEY = "checksums"


def crc(data, value: int = 0) -> int:
    return crc32c.crc32c(data, value)


def _power_of_two_below(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n`` < 1)."""
    return 1 << max(n.bit_length() - 1, 0)


def piece_bytes(tensor_nbytes: int) -> int:
    """The piece size of the items of a tensor of ``tensor_nbytes`` (all its shards): a power of two
    cutting it into at least ``MIN_PIECES`` pieces, within ``[MIN_PIECE_BYTES, PIECE_BYTES]``."""
    return max(MIN_PIECE_BYTES, min(PIECE_BYTES, _power_of_two_below(tensor_nbytes // MIN_PIECES)))


@dataclass(frozen=True)
class BandChecks:
    """The tiles of an item's raw tensor bytes: ``num_rows`` rows of ``row_bytes``, cut into ``bands``
    equal column bands and groups of ``rows_per_tile`` rows; tile (group g, band b) is
    ``crcs[g * bands + b]``, the CRC32C of its row segments in order."""

    rows_per_tile: int
    bands: int
    row_bytes: int
    num_rows: int
    crcs: tuple[int, ...]

    def __post_init__(self):
        groups = -(-self.num_rows // self.rows_per_tile) if self.rows_per_tile > 0 else -1
        if (
            self.bands < 2
            or self.rows_per_tile < 1
            or self.row_bytes % self.bands
            or len(self.crcs) != groups * self.bands
        ):
            raise SeedckptError("the manifest's band checksums do not fit their item; the manifest is damaged")

    @property
    def band_bytes(self) -> int:
        return self.row_bytes // self.bands


def band_checks(raw: memoryview, shape, itemsize: int, tensor_rows: int) -> BandChecks | None:
    """The tiles of a row-major tensor's bytes ``raw`` of ``shape``, a shard of a tensor of
    ``tensor_rows`` rows (``None`` for fewer than two dimensions, or columns that do not split into
    at least two equal bands)."""
    if len(shape) < 2 or not shape[0]:
        return None
    bands = next((b for b in (MAX_BANDS, 4, 2) if shape[1] % b == 0), 1)
    if bands == 1:
        return None
    row_bytes = math.prod(shape[1:]) * itemsize
    whole_tensor = _power_of_two_below(tensor_rows * bands // MIN_PIECES)  # >= MIN_PIECES tiles in the tensor
    rows_per_tile = max(1, min(TILE_BYTES * bands // row_bytes, whole_tensor))
    table = np.frombuffer(raw, np.uint8).reshape(shape[0], bands, row_bytes // bands)
    crcs = []
    for first in range(0, shape[0], rows_per_tile):
        tiles = np.ascontiguousarray(table[first : first + rows_per_tile].transpose(1, 0, 2))
        crcs += [crc(tile) for tile in tiles]
    return BandChecks(rows_per_tile, bands, row_bytes, shape[0], tuple(crcs))


@dataclass(frozen=True)
class ItemChecks:
    """The pieces of one item: bytes ``[offset, offset + length)`` of ``file``, cut at ``start``
    (where the raw tensor bytes begin; ``offset`` for a bytes item) and every ``piece`` after it."""

    file: str
    offset: int
    length: int
    start: int
    crcs: tuple[int, ...]
    piece: int = PIECE_BYTES
    bands: BandChecks | None = None  # tiles of the raw tensor bytes (from ``start``), when recorded
    cuts: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        end = self.offset + self.length
        cuts = [self.offset] + ([self.start] if self.offset < self.start < end else [])
        cuts += range(self.start + self.piece, end, self.piece)
        cuts.append(end)
        object.__setattr__(self, "cuts", cuts)
        if len(self.crcs) != len(cuts) - 1 or not self.offset <= self.start <= end:
            raise SeedckptError(
                f"the manifest's checksums of the item at byte {self.offset} of {self.file} do not "
                "fit the item; the manifest is damaged"
            )

    @property
    def end(self) -> int:
        return self.offset + self.length

    def covering(self, lo: int, hi: int, data_end: int | None = None) -> tuple[int, int]:
        """The piece indices ``[first, last)`` a read of bytes ``[lo, hi)`` must check: the pieces it
        touches, plus the head when it starts at the raw data, plus the item's tail when it ends at
        ``data_end`` (so the ranks that together read an item check all of it)."""
        first = bisect.bisect_right(self.cuts, lo) - 1
        last = bisect.bisect_left(self.cuts, hi) if hi > lo else first + 1
        if first == 1 and lo == self.start:
            first = 0
        if hi == data_end:
            last = len(self.cuts) - 1
        return max(first, 0), min(last, len(self.cuts) - 1)

    def mismatch(self, index: int, got: int, what: str) -> SeedckptError:
        lo, hi = self.cuts[index], self.cuts[index + 1]
        return SeedckptError(
            f"{what} is corrupt: bytes {lo}..{hi} of {self.file} have CRC32C {got:08x}, {self.crcs[index]:08x} was "
            "written; the checkpoint is damaged -- restore or write it again (`seedckpt verify` checks all of it)"
        )


class PieceHasher:
    """CRC32C of an item's pieces as it is written, in order; ``mark_start`` when the raw tensor
    bytes begin (the bytes before them become the head piece)."""

    def __init__(self, file: str, offset: int, piece: int = PIECE_BYTES):
        self.file, self.offset, self.piece = file, offset, piece
        self.start = self.pos = self.closed = offset
        self.next_cut = offset + piece
        self.crcs: list[int] = []
        self.value = 0
        self.bands: BandChecks | None = None  # set by the writer from the tensor it writes

    def mark_start(self, piece: int) -> None:
        """The raw tensor bytes begin here, cut into pieces of ``piece`` bytes (``piece_bytes``)."""
        if self.crcs:  # an implausibly long head: plain pieces
            return
        if self.pos > self.offset:
            self._close()
        self.piece, self.start, self.next_cut = piece, self.pos, self.pos + piece

    def update(self, view: memoryview) -> None:
        while view.nbytes:
            take = min(view.nbytes, self.next_cut - self.pos)
            self.value = crc(view[:take], self.value)
            self.pos += take
            view = view[take:]
            if self.pos == self.next_cut:
                self._close()
                self.next_cut += self.piece

    def _close(self) -> None:
        self.crcs.append(self.value)
        self.value, self.closed = 0, self.pos

    def finish(self) -> ItemChecks:
        if self.pos > self.closed or not self.crcs:
            self._close()
        return ItemChecks(
            self.file, self.offset, self.pos - self.offset, self.start, tuple(self.crcs), self.piece, self.bands
        )


def checksums_record(items: list[ItemChecks], metadata_crc: int, file_sizes: dict[str, int]) -> dict:
    """The manifest's ``checksums`` entry (format version 2: each item's piece size in its entry)."""
    by_file: dict[str, list] = {}
    bands: dict[str, list] = {}
    for item in sorted(items, key=lambda i: (i.file, i.offset)):
        by_file.setdefault(item.file, []).append([item.offset, item.length, item.start, item.piece, list(item.crcs)])
        if item.bands is not None:
            b = item.bands
            bands.setdefault(item.file, []).append(
                [item.offset, b.rows_per_tile, b.bands, b.row_bytes, b.num_rows, list(b.crcs)]
            )
    return {
        "algorithm": ALGORITHM,
        "metadata": metadata_crc,
        "files": file_sizes,
        "items": by_file,
        "bands": bands,
    }


@dataclass
class Checksums:
    """A checkpoint's recorded checksums: ``items[(file, offset)]``, ``.metadata``'s CRC, file sizes."""

    items: dict[tuple[str, int], ItemChecks]
    metadata: int
    files: dict[str, int]

    @classmethod
    def from_manifest(cls, manifest: dict | None, where) -> Checksums | None:
        """``None`` when the checkpoint records none (written before checksums, or by another tool)."""
        record = (manifest or {}).get(CHECKSUMS_KEY)
        if record is None:
            return None
        try:
            if record["algorithm"] != ALGORITHM:
                raise ValueError(f"unknown algorithm {record['algorithm']!r}")
            recorded = _item_entries(record, manifest.get("format_version", 1))
            bands = {
                (file, int(offset)): BandChecks(
                    int(rows), int(count), int(row_bytes), int(num_rows), tuple(map(int, crcs))
                )
                for file, entries in (record.get("bands") or {}).items()
                for offset, rows, count, row_bytes, num_rows, crcs in entries
            }
            items = {}
            for file, offset, length, start, piece, crcs in recorded:
                items[(file, int(offset))] = ItemChecks(
                    file,
                    int(offset),
                    int(length),
                    int(start),
                    tuple(int(c) for c in crcs),
                    int(piece),
                    bands.get((file, int(offset))),
                )
            return cls(items, int(record["metadata"]), {str(f): int(n) for f, n in record["files"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SeedckptError(f"{where}: the manifest's checksums are damaged ({e!r})") from None

    def check_metadata(self, data: bytes, where) -> None:
        got = crc(data)
        if got != self.metadata:
            raise SeedckptError(
                f"{where}/.metadata is corrupt: CRC32C {got:08x}, {self.metadata:08x} was written; "
                "the checkpoint is damaged -- restore or write it again"
            )


def _item_entries(record: dict, version) -> list[tuple]:
    """``(file, offset, length, start, piece, crcs)`` of every recorded item: format version 1 has
    one piece size for all (``piece_bytes``), later versions one per item entry."""
    if version == 1:
        piece = record["piece_bytes"]
        return [(file, *entry[:3], piece, entry[3]) for file, entries in record["items"].items() for entry in entries]
    return [(file, *entry) for file, entries in record["items"].items() for entry in entries]


def data_file(root: Path, name: str) -> Path:
    """A data file named by ``.metadata``: a plain file name inside the checkpoint, nothing else."""
    if not name or name != Path(name).name or name in (".", ".."):
        raise SeedckptError(
            f"{root}/.metadata names the data file {name!r}, which is not inside the checkpoint; "
            "the checkpoint is damaged or crafted"
        )
    return root / name


def check_data_files(root: Path, storage_data, written: dict[str, int] | None = None) -> None:
    """Every data file that ``.metadata``'s items (``storage_data``) point into exists and is long
    enough for them -- and, where the sizes ``written`` are recorded, has exactly that size."""
    needed: dict[str, int] = dict.fromkeys(written or {}, 0)
    for info in (storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, need in sorted(needed.items()):
        try:
            size = data_file(root, name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if written and name in written and size != written[name]:
            problems.append(f"{name} has {size:,} bytes, {written[name]:,} were written")
        elif size < need:
            problems.append(f"{name} has {size:,} bytes, .metadata points up to byte {need:,}")
    if problems:
        raise SeedckptError(
            f"{root} is incomplete: {'; '.join(problems[:5])}; it was not fully written, was "
            "truncated or lost files -- restore or write it again"
        )


def file_sizes(items: list[ItemChecks]) -> dict[str, int]:
    """Each data file's size: its items follow each other from byte 0 to its end."""
    sizes: dict[str, int] = {}
    for item in items:
        sizes[item.file] = max(sizes.get(item.file, 0), item.end)
    return sizes


def verify_item(fd: int, checks: ItemChecks, what: str, on_tensor_bytes=None) -> int:
    """Read all of an item from ``fd`` and check every piece; returns the bytes read.
    ``on_tensor_bytes(view, at)``: each checked piece from the raw tensor bytes on (they start at an
    element), and its offset in the file."""
    buffer = memoryview(bytearray(max(b - a for a, b in zip(checks.cuts, checks.cuts[1:]))))
    for k, (lo, hi) in enumerate(zip(checks.cuts, checks.cuts[1:])):
        view = buffer[: hi - lo]
        done = pread_into(fd, view, lo)
        if done < view.nbytes:
            raise SeedckptError(
                f"{what}: {checks.file} is truncated at byte {lo + done:,}; the checkpoint is "
                "damaged -- restore or write it again"
            )
        got = crc(view)
        if got != checks.crcs[k]:
            raise checks.mismatch(k, got, what)
        if on_tensor_bytes is not None and lo >= checks.start:
            on_tensor_bytes(view, lo)
    if checks.bands is not None:
        _verify_bands(fd, checks, what)
    return checks.length


def _verify_bands(fd: int, checks: ItemChecks, what: str) -> None:
    """Every tile of the item's raw bytes against its recorded CRC32C, one group of rows at a time."""
    bands = checks.bands
    if checks.start + bands.num_rows * bands.row_bytes > checks.end:
        raise SeedckptError(f"{what}: the manifest's band checksums do not fit the item; the manifest is damaged")
    rows = bands.rows_per_tile
    for group, first in enumerate(range(0, bands.num_rows, rows)):
        count = min(rows, bands.num_rows - first)
        raw = os.pread(fd, count * bands.row_bytes, checks.start + first * bands.row_bytes)
        table = np.frombuffer(raw, np.uint8).reshape(count, bands.bands, bands.band_bytes)
        for band, tile in enumerate(np.ascontiguousarray(table.transpose(1, 0, 2))):
            if crc(tile) != bands.crcs[group * bands.bands + band]:
                raise band_mismatch(checks, group, band, what)


def band_mismatch(checks: ItemChecks, group: int, band: int, what: str) -> SeedckptError:
    rows = checks.bands.rows_per_tile
    return SeedckptError(
        f"{what} is corrupt: rows {group * rows}..{(group + 1) * rows} x column band {band} of the tensor in "
        f"{checks.file} do not have the CRC32C that was written; the checkpoint is damaged -- restore or write it "
        "again (`seedckpt verify` checks all of it)"
    )
