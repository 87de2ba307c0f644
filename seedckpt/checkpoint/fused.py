"""Tensors another tool stores fused: one stored tensor that holds several of ours (``StoredParts``).

Both readers that meet them -- Hugging Face directories (gpt-oss's ``gate_up_proj``) and DCP
checkpoints in torchtitan's names (its gpt-oss ``mlp1_weight_EGD``) -- read such a tensor once for
every FQN it holds, and a rank whose destinations hold some experts (dim-0 rows: an FSDP or
expert-parallel shard, a ``RowWindow``) requests only those rows of it; the writers join ours into it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from seedckpt.checkpoint.load import RowWindow, destination
from seedckpt.utils.stored_parts import StoredParts
from seedckpt.utils.tensors import copy_full_into, local_rows


def split_shapes(parts: StoredParts, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of ours that a stored tensor of ``shape`` splits into, in ``parts.fqns``' order."""
    return [tuple(t.shape) for t in parts.split(torch.empty(shape, device="meta"))]


def joined_shape(parts: StoredParts, infos: dict) -> tuple[int, ...]:
    """The stored shape of the tensor ``parts`` joins from ours (``infos``: ours by FQN)."""
    missing = [fqn for fqn in parts.fqns if fqn not in infos]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: {' and '.join(parts.fqns)} are stored as one tensor")
    return tuple(parts.join(tuple(torch.empty(infos[fqn].shape, device="meta") for fqn in parts.fqns)).shape)


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


class SplitOnce:
    """Whole reads of our tensors stored fused: the stored tensor is read (and split) once for all
    of them, the others kept until asked for -- a conversion reads them a tensor or two apart."""

    def __init__(self):
        self.unread: dict[str, torch.Tensor] = {}  # the rest of the last split tensor, until read

    def read(self, fqn: str, parts: StoredParts, read_stored) -> torch.Tensor:
        """Our ``fqn`` of ``parts``; ``read_stored()``: the stored tensor, whole."""
        if fqn not in self.unread:
            self.unread = {ours: t.contiguous() for ours, t in zip(parts.fqns, parts.split(read_stored()))}
        return self.unread.pop(fqn)
