"""``StoredParts``: how a name adapter says that one stored tensor holds several of ours.

It sits in the foundation layer because both sides use it: a family's name adapter (``models/``)
returns it, and the checkpoint formats (``seedckpt.checkpoint``) read and write by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoredParts:
    """A stored tensor that is not one of ours as it is, but holds ``fqns`` rearranged: another
    tool's experts stored transposed, or two of our tensors fused into one (gpt-oss's gate and up
    projections, interleaved). Dim 0 is the experts' on both sides, so any block of stored dim-0
    rows gives the same rows of each of ours: ``split(rows) -> (ours, ...)`` (one per ``fqns``, in
    order) and ``join((ours, ...)) -> rows``, its inverse. A rank then reads only its experts."""

    fqns: tuple[str, ...]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    join: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]


@dataclass(frozen=True)
class StoredSplit:
    """``StoredParts``' converse: one of ours (``fqn``) that another tool stores as several tensors
    (``keys``), such as one projection of ours kept as three by a tool that runs them apart.
    ``join((stored, ...)) -> ours`` (in ``keys``' order) and ``split(ours) -> (stored, ...)``, its
    inverse, move whole dim-0 rows only, so a rank that holds some rows of ours reads only the stored
    rows they come from. A name adapter's ``from_stored`` gives it for each of ``keys``, and its
    ``to_stored(fqn)`` is the first of them."""

    fqn: str
    keys: tuple[str, ...]
    join: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]

    @property
    def fqns(self) -> tuple[str, ...]:
        """Ours among the stored tensors, as ``StoredParts`` names them: the one."""
        return (self.fqn,)
