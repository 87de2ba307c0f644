"""Loading a state dict through DCP, with the checks stock ``dcp.load`` does not make.

``dcp.load`` silently casts dtypes, ignores extra keys and reports a missing key as a
``BaseException``; ``tensor_problems`` checks each entry first. ``RowWindow`` lets a rank request
only some rows of a checkpoint tensor that is not its own tensor or a DTensor shard of it.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from seedckpt.checkpoint.manifest import TensorInfo, dtype_name
from seedckpt.checkpoint.safe_pickle import load_plain_values
from seedckpt.utils.errors import SeedckptError, interruption, write_failure
from seedckpt.utils.tensors import local, local_rows

# Bytes of rows a whole-tensor read (convert, diff, verify) holds at a time: a 128k x 16k float32
# embedding is 8 GiB, DeepSeek-V3's fused expert tensors 29 GiB; read in slabs, the command's peak stays
# near a few slabs whatever the tensor (measured in benchmarks/convert.py --big).
SLAB_BYTES = 32 << 20


def row_bounds(
    shape: tuple[int, ...], itemsize: int, align: int = 1, slab_bytes: int | None = None
) -> list[tuple[int, int]]:
    """``[start, stop)`` of each slab of dim-0 rows of a tensor of ``shape``: ``slab_bytes``
    (``SLAB_BYTES``) of ``itemsize``-byte elements, in multiples of ``align`` rows (a transform's whole
    groups), one multiple at least -- so one row larger than a slab (a whole expert) is one slab."""
    rows = shape[0] if shape else 1
    row_bytes = itemsize * math.prod(shape[1:])
    step = max(align, (slab_bytes or SLAB_BYTES) // max(1, row_bytes) // align * align)
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


@dataclass(frozen=True)
class RowWindow:
    """A load destination for rows ``[start, start + len(dest))`` of a checkpoint tensor.

    Used where a rank's tensor is not the checkpoint's tensor or a DTensor shard of it: the rows
    of a grown vocabulary that exist in the checkpoint, or the whole RoPE heads around an FSDP
    shard of an HF ``q_proj``. Only these rows are requested from storage.
    """

    dest: torch.Tensor
    start: int


class GroupedRows:
    """A load of ``wanted`` from a tensor stored with its rows permuted within ``groups`` equal
    groups (RoPE heads in Hugging Face's order, as HF and torchtitan's Qwen3 store q and k): the
    whole groups around this rank's rows are read (``window``; None: the rank holds no rows), then
    ``finish`` puts them in our order and keeps the rank's rows."""

    def __init__(self, wanted: torch.Tensor, groups: int):
        self.wanted, self.group_rows = wanted, wanted.shape[0] // groups
        self.lo, self.hi = local_rows(wanted) or (0, wanted.shape[0])
        first, last = self.lo // self.group_rows, -(-self.hi // self.group_rows)
        buffer = torch.empty(((last - first) * self.group_rows, *wanted.shape[1:]), dtype=wanted.dtype)
        self.window = RowWindow(buffer, first * self.group_rows) if self.hi > self.lo else None

    def finish(self, from_stored_rows) -> None:
        """``from_stored_rows(rows, groups)``: whole groups of stored rows in our order."""
        if self.window is None:
            return
        full = from_stored_rows(self.window.dest, self.window.dest.shape[0] // self.group_rows)
        with torch.no_grad():
            local(self.wanted).copy_(full[self.lo - self.window.start : self.hi - self.window.start])


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Loading ``src`` values into ``dst`` is exact (e.g. a bf16 seed into fp32 parameters)."""
    if src == dst:
        return True
    if not (src.is_floating_point and dst.is_floating_point):
        return False
    s, d = torch.finfo(src), torch.finfo(dst)
    return d.bits > s.bits and d.eps <= s.eps and d.max >= s.max


def tensor_problems(fqn: str, info: TensorInfo, wanted: torch.Tensor | RowWindow) -> list[str]:
    """Why a checkpoint entry cannot fill ``wanted``: a shape mismatch or a lossy dtype change
    (stock ``dcp.load`` would cast silently)."""
    if isinstance(wanted, RowWindow):
        shape, stop = tuple(wanted.dest.shape), wanted.start + wanted.dest.shape[0]
        if not info.shape or info.shape[1:] != shape[1:] or stop > info.shape[0]:
            return [
                f"{fqn}: rows {wanted.start}..{stop} of shape {list(shape)} do not fit the checkpoint's "
                f"shape {list(info.shape)}"
            ]
        wanted = wanted.dest
    elif info.shape != tuple(wanted.shape):
        return [f"{fqn}: shape {list(info.shape)} in checkpoint, {list(wanted.shape)} in model"]
    if not widens(info.dtype, wanted.dtype):
        return [f"{fqn}: dtype {dtype_name(info.dtype)} in checkpoint, {dtype_name(wanted.dtype)} in model"]
    return []


def destination(wanted: torch.Tensor | RowWindow) -> torch.Tensor:
    """The local storage a load destination writes into."""
    return wanted.dest if isinstance(wanted, RowWindow) else local(wanted)


def one_destination_per_source(state_dict: dict, source_of) -> tuple[dict, list[tuple[str, str]]]:
    """Key ``state_dict`` by the stored entry (``source_of(key)``) each destination reads.

    A tied checkpoint stores its matrix once, but a rank may hold two destinations for it (the
    embedding and a separate output copy, when one rank runs the first and the last pipeline
    stage). Such a source is read once; the returned ``(key, source)`` pairs are filled afterwards
    by ``copy_shared``."""
    by_source, shared = {}, []
    for key, wanted in state_dict.items():
        source = source_of(key)
        first = by_source.setdefault(source, wanted)
        if first is not wanted and destination(first) is not destination(wanted):
            shared.append((key, source))
    return by_source, shared


def copy_shared(state_dict: dict, by_source: dict, shared: list[tuple[str, str]]) -> None:
    with torch.no_grad():
        for key, source in shared:
            dst, src = destination(state_dict[key]), destination(by_source[source])
            if dst.shape != src.shape:
                raise SeedckptError(
                    f"{key} and its tied source {source} are laid out differently on this rank "
                    f"({list(dst.shape)} vs {list(src.shape)}); shard them alike"
                )
            dst.copy_(src)


class RowWindowLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, plus ``RowWindow`` entries (those request only their rows), reading
    non-tensor entries as plain values only (stock: ``torch.load(weights_only=False)``, which runs
    whatever code a crafted entry holds)."""

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

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        set_element(self.original_state_dict, self.mappings[fqn], load_plain_values(value, fqn))


def load_state(state_dict: dict, reader, where, no_dist: bool = False) -> None:
    """``dcp.load`` through ``RowWindowLoadPlanner``; DCP's failures become one ``SeedckptError``.

    Collective across the default process group when one is initialized (unless ``no_dist``).
    """
    planner = RowWindowLoadPlanner(state_dict)
    try:
        with quiet_single_process_dcp():
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as e:  # a BaseException carrying each failed rank's exception
        raise root_cause(e, f"reading {where}") from None
    # dcp.load writes back its own value of every entry that is no tensor -- None for a window --,
    # and a tied destination is copied from its source's window afterwards (``copy_shared``).
    state_dict.update(planner.windows)


def root_cause(error: CheckpointException, doing: str, writing: bool = False) -> SeedckptError | KeyboardInterrupt:
    """One line for a failed DCP load or save: our own message where we raised it, else the first
    failed rank's exception (DCP's text embeds every rank's whole traceback); an interruption stays
    one, and a save (``writing``) that failed for the machine's reason says which (``write_failure``)."""
    if not error.failures:
        return SeedckptError(f"{doing} failed: {str(error).splitlines()[-1] if str(error) else 'unknown error'}")
    rank = min(error.failures)
    cause = error.failures[rank][0]
    while isinstance(cause, CheckpointException) and cause.failures:
        cause = cause.failures[min(cause.failures)][0]
    if isinstance(cause, SeedckptError):
        return cause
    if interruption(cause) is not None:
        return interruption(cause)  # Ctrl-C, or the signal that stopped it
    failure = write_failure(cause, f"{doing} (rank {rank})" if dist.is_initialized() else doing) if writing else None
    gone = _removed_while_read(cause) if not writing else None
    return failure or gone or SeedckptError(f"{doing} failed on rank {rank}: {type(cause).__name__}: {cause}")


def _removed_while_read(cause: BaseException) -> SeedckptError | None:
    """A data file whose checkpoint directory vanished after it was opened: deleted under the
    reader, as a training run's ``keep_latest_k`` prunes its older steps."""
    if isinstance(cause, FileNotFoundError) and cause.filename and not Path(cause.filename).parent.exists():
        folder = Path(cause.filename).parent
        return SeedckptError(
            f"{folder} was deleted while it was being read (a training run prunes its older step-N with "
            "checkpoint.keep_latest_k); read a step the run keeps, or copy it first"
        )
    return None


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns on every single-process call that it assumes a single process; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
