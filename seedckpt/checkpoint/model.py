"""What the checkpoint layer knows of a model: only what its caller hands down.

This layer moves tensors by name and checks bytes; it imports no model and no fine-tuning method.
Where a format needs model knowledge -- the tensors a model has, which FQN reads another tensor
(a tied output), the names and row order another tool uses, the model a manifest or an HF
``config.json`` records -- the caller supplies it as a ``ModelLayout`` and a ``ModelCodec``
(``seedckpt.materialize.model_checkpoint`` builds both from the model spec). A caller that passes neither still gets
every tensor by its stored name: ``inspect`` of a foreign checkpoint, ``verify``, a training-state
load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from seedckpt.utils.stored_parts import StoredParts, StoredSplit


@dataclass(frozen=True)
class ModelLayout:
    """One model's tensors. ``args`` is the model's own configuration object, opaque here and
    handed back to callers (``OpenedCheckpoint.args``); ``record`` is the same as a manifest stores it."""

    args: Any
    record: dict
    shapes: dict[str, tuple[int, ...]]  # every tensor the model has, by FQN
    aliases: dict[str, str] = field(default_factory=dict)  # {FQN: stored FQN it reads} (a tied output)
    flavor: str | None = None  # the released shapes the args match, if any


class NameAdapter(Protocol):
    """Another tool's names (and row order) for a model's tensors."""

    def to_stored(self, fqn: str) -> str: ...

    def from_stored(self, name: str) -> str | tuple[str, int] | StoredParts | StoredSplit | None:
        """Our FQN for a stored name; ``(fqn, index)`` for a stored tensor that is slice ``index``
        along dim 0 of our ``fqn`` (another tool stores one tensor per expert where we store a
        layer's experts as one 3-D tensor); ``StoredParts`` for one that holds ours rearranged
        (``to_stored`` of each of its ``fqns`` is its name); ``StoredSplit`` for a part of one of ours
        stored as several (DCP only); None for stored tensors the model does
        not keep (an HF directory's reader asks ``left_out`` which of them it may skip); a
        ``ValueError`` for a name no model of the family has."""

    def left_out(self, skipped: list[str]) -> tuple[list[str], str | None]:
        """Of the stored names ``from_stored`` gave None: those the model should hold (refused), and
        one line naming what is left out on purpose, or None (HF directories)."""

    def config_fields(self, name: str) -> tuple[str, ...]:
        """The ``config.json`` fields that likely left the stored tensor ``name`` out of the model
        (the fix a refusal names), most likely first; () when none does (HF directories)."""

    def stacked_names(self, fqn: str, count: int) -> list[str] | None:
        """The stored names of ``fqn``'s ``count`` dim-0 slices, when it is stored one slice per
        tensor; None when it is stored whole."""

    def row_groups(self, fqn: str) -> int | None:
        """Stored rows of ``fqn`` are permuted within this many equal groups (None: rows as ours)."""

    def to_stored_rows(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def from_stored_rows(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        """Whole groups of stored rows (``row_groups``) in our order."""

    def unkept_unless_zero(self, fqn: str) -> str | None:
        """Why ``fqn`` has no place on the other side unless it is zero, where its zero is the same
        model as its absence (an expert bias: a zero one routes as none); None for the others. Such
        a tensor is left out once its values are read and found zero, else refused with the reason."""

    def zero_filled(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{stored name: (shape, dtype)}``: tensors the other tool's model has and ours lacks,
        written as zeros (zero being the same model as their absence)."""


class ModelCodec(Protocol):
    """The caller's knowledge of a model family, for formats that record a model or rename it."""

    def renamings(self, layout: ModelLayout | None) -> dict:
        """``{tool: NameAdapter}``: other tools' DCP names for the model ``layout`` describes (None:
        nobody described it), read as they are (torchtitan 0.3's)."""

    def recorded_layout(self, manifest: dict) -> ModelLayout | None:
        """The model a manifest records (None: it records none); ``ValueError`` if damaged."""

    def hf_layout(self, config: dict) -> ModelLayout:
        """The model an HF ``config.json`` describes; ``ValueError`` if it describes none."""

    def hf_names(self, layout: ModelLayout) -> NameAdapter: ...

    def hf_config(self, layout: ModelLayout, dtype: torch.dtype) -> dict: ...
