"""Tensors another tool stores fused: one stored tensor that holds several of ours (``StoredParts``),
or one of ours stored as several tensors (``StoredSplit``).

Both readers that meet fused ones -- Hugging Face directories (gpt-oss's ``gate_up_proj``) and DCP
checkpoints in torchtitan's names (its gpt-oss ``mlp1_weight_EGD``) -- read such a tensor once for
every FQN it holds, and a rank whose destinations hold some experts (dim-0 rows: an FSDP or
expert-parallel shard, a ``RowWindow``) requests only those rows of it; the writers join ours into it.
The DCP reader joins split ones (torchtitan's Qwen3.5 keeps a linear layer's q, k and v apart) from
the stored rows a rank's rows come from, and the writer splits ours back.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.tensor import DTensor

from seedckpt.checkpoint.load import RowWindow, destination
from seedckpt.utils.stored_parts import StoredParts, StoredSplit
from seedckpt.utils.tensors import copy_full_into, local_rows


def split_shapes(parts: StoredParts | StoredSplit, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes ``parts.split`` cuts a tensor of ``shape`` into: ours of a stored ``StoredParts``
    tensor (``parts.fqns``' order), or the stored ones of ours for a ``StoredSplit`` (``parts.keys``')."""
    return [tuple(t.shape) for t in parts.split(torch.empty(shape, device="meta"))]


def joined_shape(parts: StoredParts, infos: dict) -> tuple[int, ...]:
    """The stored shape of the tensor ``parts`` joins from ours (``infos``: ours by FQN)."""
    return _joined_shape(parts.fqns, parts.join, infos, "as one tensor")


def split_joined_shape(split: StoredSplit, infos: dict) -> tuple[int, ...]:
    """The shape of ours that ``split`` joins from the stored tensors (``infos``: theirs by key)."""
    return _joined_shape(split.keys, split.join, infos, f"parts of {split.fqn}")


def _joined_shape(names: tuple[str, ...], join, infos: dict, what: str) -> tuple[int, ...]:
    """The shape ``join`` gives the tensors ``names`` of ``infos``; ``ValueError`` naming those missing."""
    missing = [name for name in names if name not in infos]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: {' and '.join(names)} are stored {what}")
    return tuple(join(tuple(torch.empty(infos[name].shape, device="meta") for name in names)).shape)


def _rows(wanted: torch.Tensor | RowWindow, count: int) -> tuple[int, int] | None:
    """The dim-0 rows (experts) of the full tensor that ``wanted`` holds; None for a shard that is
    not a block of whole rows (it needs every row)."""
    if isinstance(wanted, RowWindow):
        return wanted.start, wanted.start + wanted.dest.shape[0]
    return local_rows(wanted) or (None if isinstance(wanted, DTensor) else (0, count))


class PartsRead:
    """A load of ``wanted`` ({our fqn: destination}), some of the tensors ``parts`` rearranges from
    the stored tensor ``name``: the stored experts (dim-0 rows) that this rank's destinations hold
    are requested (``by_name``), then split into them. A destination that is not a block of whole
    rows takes every expert."""

    def __init__(self, parts: StoredParts, wanted: dict, infos: dict, name: str, by_name: dict):
        self.parts, self.wanted = parts, wanted
        self.experts = infos[parts.fqns[0]].shape[0]
        spans = [_rows(t, self.experts) for t in wanted.values()]
        whole = None in spans or not spans
        self.lo = 0 if whole else min(lo for lo, _ in spans)
        hi = self.experts if whole else max(hi for _, hi in spans)
        shape = (hi - self.lo, *joined_shape(parts, infos)[1:])
        self.buffer = torch.empty(shape, dtype=destination(next(iter(wanted.values()))).dtype)
        if hi > self.lo:
            by_name[name] = RowWindow(self.buffer, self.lo) if (self.lo, hi) != (0, self.experts) else self.buffer

    def finish(self) -> None:
        ours = dict(zip(self.parts.fqns, self.parts.split(self.buffer)))
        with torch.no_grad():
            for fqn, wanted in self.wanted.items():
                rows = _rows(wanted, self.experts)
                if rows is None:
                    copy_full_into(wanted, ours[fqn])
                elif rows[1] > rows[0]:
                    destination(wanted).copy_(ours[fqn][rows[0] - self.lo : rows[1] - self.lo])


def _row_sources(split: StoredSplit, rows: int, dims: int) -> tuple[torch.Tensor, ...]:
    """For each stored tensor of ``split``, the row of ours each of its rows is (split moves rows only)."""
    return tuple(t.reshape(-1) for t in split.split(torch.arange(rows).reshape(rows, *[1] * (dims - 1))))


class SplitRead:
    """A load of ``wanted`` ({our fqn: destination}, the one ``parts`` joins) from the stored tensors
    ``parts.keys``: of each, the span of rows its destination's rows come from is requested
    (``by_name``), and ``finish`` puts them in our order. A destination that is not a block of whole
    rows takes every row. Same arguments as ``PartsRead`` (``infos``: ours by FQN; ``name`` unused).
    Spans, not whole tensors: Qwen3.5-27B's 48 linear layers hold 2.5 G values of ``in_proj_qkv``
    (5.0 GB in bf16), which every FSDP rank would otherwise read whole in one load."""

    def __init__(self, parts: StoredSplit, wanted: dict, infos: dict, name: str, by_name: dict):
        (self.wanted,) = wanted.values()
        self.shape = infos[parts.fqn].shape
        self.lo, hi = _rows(self.wanted, self.shape[0]) or (0, self.shape[0])
        self.dtype = destination(self.wanted).dtype
        self.pieces = []  # (rows of ours from lo, rows of the buffer, the buffer)
        shapes = split_shapes(parts, self.shape)
        for key, shape, sources in zip(parts.keys, shapes, _row_sources(parts, self.shape[0], len(self.shape))):
            at = ((sources >= self.lo) & (sources < hi)).nonzero().flatten()
            if len(at) == 0:
                continue
            start, stop = int(at[0]), int(at[-1]) + 1
            buffer = torch.empty((stop - start, *shape[1:]), dtype=self.dtype)
            by_name[key] = RowWindow(buffer, start) if stop - start < shape[0] else buffer
            self.pieces.append((sources[at] - self.lo, at - start, buffer))
        self.rows = hi - self.lo

    def finish(self) -> None:
        ours = torch.empty((self.rows, *self.shape[1:]), dtype=self.dtype)
        for rows, stored_rows, buffer in self.pieces:
            ours[rows] = buffer[stored_rows]
        with torch.no_grad():
            if _rows(self.wanted, self.shape[0]) is None:
                copy_full_into(self.wanted, ours)
            else:
                destination(self.wanted).copy_(ours)


class SplitOnce:
    """Whole reads of our tensors stored fused: the stored tensor is read (and split) once for all
    of them, the others kept until asked for -- a conversion reads them a tensor or two apart."""

    def __init__(self):
        self.unread: dict[str, torch.Tensor] = {}  # the rest of the last split tensor, until read
        self.lock = threading.Lock()  # a writer resolves its blocks on two threads

    def read(self, fqn: str, parts: StoredParts, read_stored) -> torch.Tensor:
        """Our ``fqn`` of ``parts``; ``read_stored()``: the stored tensor, whole."""
        return self.take(fqn, parts.fqns, parts.split, read_stored)

    def read_rows(self, fqn: str, parts: StoredParts, rows: tuple[int, int], read_stored_rows) -> torch.Tensor:
        """``rows`` (dim 0: the experts) of our ``fqn`` of ``parts``; ``read_stored_rows()``: those rows
        of the stored tensor, split once for every FQN it holds (a conversion's slab)."""
        return self.take((fqn, rows), tuple((f, rows) for f in parts.fqns), parts.split, read_stored_rows)

    def take(self, name: str, names: tuple[str, ...], split, read_whole) -> torch.Tensor:
        """``name`` of the tensors ``split(read_whole())`` gives, in ``names``' order (a writer takes
        the stored tensors a ``StoredSplit`` cuts ours into this way)."""
        with self.lock:
            if name not in self.unread:
                self.unread = {n: t.contiguous() for n, t in zip(names, split(read_whole()))}
            return self.unread.pop(name)
