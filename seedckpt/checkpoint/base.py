"""``OpenedCheckpoint``: what every reader offers, whatever the format.

One protocol for every command and the stage builder: the tensor table (our FQNs), the manifest and
the model it records, ``read_rows`` (a slab of rows of one tensor, for convert, diff and verify:
``SLAB_BYTES`` at a time, whatever the tensor) and ``load`` (a state dict in place, each rank
reading only what it asks for), plus the checks that run before anything is allocated. What it knows
of the model comes from its caller (``checkpoint.model``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seedckpt.checkpoint.load import RowWindow, row_bounds, tensor_problems
from seedckpt.checkpoint.manifest import TensorInfo, dtype_name, is_model_key
from seedckpt.checkpoint.model import ModelCodec, ModelLayout, StoredSplit
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import all_finite, copy_full_into

# The dtypes a model weight may be stored in: an integer or float8 tensor under a weight's name is
# not a weight this model can load or convert as it is (quantized checkpoints need their own reader).
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class OpenedCheckpoint:
    """An opened checkpoint. ``infos``: its model tensors by our FQNs; ``layout``: the model it
    records (through the caller's ``codec``), else the one the caller described, else None."""

    kind = ""
    checksums = None  # ``integrity.Checksums`` where the format records them (our DCP checkpoints)
    dequantized: frozenset[str] = frozenset()  # FQNs stored quantized, read dequantized to float32

    def __init__(
        self,
        path: Path,
        infos: dict[str, TensorInfo],
        manifest: dict | None,
        recorded: ModelLayout | None = None,
        layout: ModelLayout | None = None,
    ):
        self.path, self.infos, self.manifest = path, infos, manifest
        self.recorded, self.layout = recorded, recorded or layout
        # FQNs that are not stored but read from another tensor: {fqn: source} (a tied output).
        self.aliases: dict[str, str] = {}
        self._whole, self._whole_lock = (None, None), threading.Lock()  # ``read_rows``' last whole tensor

    @property
    def args(self):
        """The model's configuration object (the model spec's), or None when nobody described it."""
        return self.layout.args if self.layout is not None else None

    def alias_tied(self, stored: dict[str, TensorInfo]) -> None:
        """Give each tied FQN the model declares (``layout.aliases``) and the checkpoint does not store
        its source's entry: a tied checkpoint stores the matrix once (seeds and HF do)."""
        for fqn, source in (self.layout.aliases if self.layout is not None else {}).items():
            if fqn not in stored and source in stored:
                self.infos[fqn] = stored[source]
                self.aliases[fqn] = source

    def refuse_distinct_tied(self, tied: dict[str, str]) -> None:
        """Refuse, in one line naming the fix, a checkpoint that stores apart a matrix (an output
        projection) that the model about to read it ties to another (``tied``: ``{fqn: source}``,
        the embedding), with other values: it was trained untied, and a tied model keeps one of the
        two -- the untied debug seed's logits (at most 4) move by up to 147 -- where the config and
        the checkpoint disagree on the model. Refused, not skipped with a warning: a run or a
        conversion would go on computing another model. A stored copy of the source is the tie
        (torchtitan ties none: a tied model's export holds its embedding twice), read as one. A
        Hugging Face directory storing a distinct head is read untied before this, as transformers
        does (``config.json`` is the model's own word there). Both matrices are read, a slab of each at
        a time where the format reads rows, only where a tied model meets one stored apart."""
        for fqn, source in tied.items():
            if fqn in self.aliases or fqn not in self.infos or source not in self.infos:
                continue  # stored once (a tie), or not here at all (a stage's part, OSFT factors)
            if self.infos[fqn] != self.infos[source] or not self._same_values(fqn, source):
                raise SeedckptError(
                    f"{self.path} stores {self.stored_name(fqn)} apart from {self.stored_name(source)}, with other "
                    "values, but this model ties them: it was trained untied -- set "
                    "model.tie_word_embeddings = false to read it"
                )

    def _same_values(self, fqn: str, other: str) -> bool:
        """Whether ``fqn`` and ``other`` (same shape and dtype) hold the same values, a slab at a time
        (each read whole, once, where the format does not read rows)."""
        if not (self.reads_rows(fqn) and self.reads_rows(other)):
            return torch.equal(self.read_tensor(fqn), self.read_tensor(other))
        return all(torch.equal(x, y) for x, y in zip(self.slabs(fqn), self.slabs(other)))

    def stored_name(self, fqn: str) -> str:
        """The name ``fqn`` is stored under, for messages."""
        return fqn

    def file_of(self, fqn: str) -> Path:
        """The file (or directory) holding ``fqn``, for messages."""
        return self.path

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor entry (training state included where the format has it), by our FQNs."""
        return self.infos

    def read_tensor(self, fqn: str) -> torch.Tensor:
        """One whole tensor on CPU, read by this process alone (a load without a distributed reader)."""
        raise NotImplementedError

    def reads_rows(self, fqn: str) -> bool:
        """Whether ``read_rows`` reads only the rows asked for of ``fqn`` (else it reads the whole
        tensor once and slices it)."""
        return False

    def read_align(self, fqn: str) -> int:
        """The rows ``read_rows`` of ``fqn`` reads in whole multiples of (1: those asked for alone): a
        format that permutes rows within groups as it reads (RoPE heads) reads the whole groups
        around them, and keeps them while the slab lives -- what a memory estimate counts."""
        return 1

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (dim 0) of ``fqn`` on CPU, read by this process alone (convert, diff,
        verify). Here the whole tensor is read and kept until its last row is asked for (a slab is a
        view of it: it goes when that slab does), so the last tensor read is not kept to the end (an
        OSFT checkpoint's dense weight): a format that reads rows alone (``reads_rows``) overrides this."""
        shape = self.infos[fqn].shape
        with self._whole_lock:
            if self._whole[0] != fqn:
                self._whole = (None, None)  # dropped before the next is read
                self._whole = (fqn, self.read_tensor(fqn))
            whole = self._whole[1]
            if not shape or stop >= shape[0]:
                self._whole = (None, None)
        return whole[start:stop] if shape else whole

    def slabs(self, fqn: str, bounds: list[tuple[int, int]] | None = None) -> Iterator[torch.Tensor]:
        """``fqn`` in dim-0 slabs (``bounds``; default ``row_bounds``: ``SLAB_BYTES`` each), which
        concatenated are the tensor: what a conversion holds of it at a time, where the format reads
        rows alone."""
        info = self.infos[fqn]
        for start, stop in bounds or row_bounds(info.shape, info.dtype.itemsize):
            yield self.read_rows(fqn, start, stop)

    def stored_reads(self) -> Iterator[tuple[str, int, Callable[[], Iterable[torch.Tensor]]]]:
        """``(name, bytes, slabs)`` of each tensor the checkpoint stores, in the names it stores them
        under, for a command that reads all of them once (``verify``'s values): ``slabs()`` yields the
        tensor in parts along dim 0 (a quantized one dequantized a bounded slab at a time). By default
        each model tensor stored (a tied one once), in ``slabs``."""
        for fqn, info in self.infos.items():
            if fqn not in self.aliases:
                yield fqn, info.nbytes, lambda fqn=fqn: self.slabs(fqn)

    def load(self, state_dict: dict) -> None:
        """Fill ``state_dict`` (tensors, DTensors, ``RowWindow``s) in place. Formats without a
        distributed reader read each tensor whole and keep this rank's part."""
        self.check_covers(state_dict)
        with torch.no_grad():
            for fqn, wanted in state_dict.items():
                full = self.read_tensor(fqn)
                if isinstance(wanted, RowWindow):
                    wanted.dest.copy_(full[wanted.start : wanted.start + wanted.dest.shape[0]])
                else:
                    copy_full_into(wanted, full)

    def require_args(self):
        if self.layout is None:
            raise SeedckptError(
                f"{self.path} does not record its model configuration; pass --config with the "
                "config it was trained with"
            )
        return self.layout.args

    def check_against_layout(self, complete: bool = True) -> None:
        """The tensors must be the model the layout describes (a manifest that disagrees with the
        tensors beside it is not trusted), its ties included (``refuse_distinct_tied``); with
        ``complete``, all of it (conversion, diff), else what a stage does not need may be absent
        (``check_covers`` names what a load lacks)."""
        if self.layout is None:
            return
        want = self.layout.shapes
        problems = [f"{f}: missing" for f in want if f not in self.infos and complete]
        problems += [
            f"{f}: shape {list(i.shape)}, config implies {list(want[f])}"
            for f, i in self.infos.items()
            if f in want and i.shape != want[f]
        ]
        problems += [
            f"{f}: dtype {dtype_name(i.dtype)} in {self.file_of(f)}; model weights are "
            f"{', '.join(map(dtype_name, WEIGHT_DTYPES))}"
            for f, i in self.infos.items()
            if f in want and i.dtype not in WEIGHT_DTYPES
        ]
        problems = problems[:10] + (["..."] if len(problems) > 10 else [])
        unused = [f for f in self.infos if f not in want]  # loading would silently leave them out
        if unused:
            problems.append(f"it has {len(unused)} model tensors this model does not use, e.g. {', '.join(unused[:4])}")
        if problems:
            raise SeedckptError(f"{self.path}: weights do not match the model configuration: " + "; ".join(problems))
        self.refuse_distinct_tied(self.layout.aliases)

    def check_covers(self, wanted: dict) -> None:
        """Every wanted tensor is in the checkpoint with the same global shape and a dtype that loads
        losslessly; otherwise one error listing what is missing and what the checkpoint has instead."""
        have = self.tensors()
        problems = []
        for fqn, t in wanted.items():
            if not isinstance(t, (torch.Tensor, RowWindow)):
                if not self.has_entry(fqn):
                    problems.append(f"{fqn}: missing from checkpoint")
            elif fqn not in have:
                problems.append(f"{fqn}: missing from checkpoint")
            else:
                problems += tensor_problems(fqn, have[fqn], t)
        if problems:
            # A pipeline stage wants part of the model: the other stages' tensors are not unwanted.
            model = self.layout.shapes if self.layout is not None else {}
            unwanted = sorted(k for k in set(have) - set(wanted) if is_model_key(k) and k not in model)
            if unwanted:
                problems.append(
                    f"it has {len(unwanted)} model tensors this model does not use, e.g. {', '.join(unwanted[:4])}"
                )
            raise SeedckptError(f"checkpoint {self.path} does not cover the model: " + "; ".join(problems))

    def has_entry(self, key: str) -> bool:
        """A non-tensor entry (training state) is present; only DCP checkpoints store them."""
        return False


def stored_bounds(info: TensorInfo, names=None, fqn: str = "") -> list[tuple[int, int]]:
    """The dim-0 slabs in which a writer puts ``fqn`` (``info``) in the rows ``names`` (another
    tool's name adapter) stores it: ``row_bounds``, in whole groups where it permutes rows within
    groups (RoPE heads), so that each slab is read from the same rows of ours."""
    return row_bounds(info.shape, info.dtype.itemsize, align=group_rows(names, fqn, info.shape[0]) if info.shape else 1)


def group_rows(names, fqn: str, rows: int) -> int:
    """The rows of each group within which ``names`` (another tool's name adapter, None: ours)
    permutes ``fqn``'s ``rows`` (RoPE heads): what a read of some of them widens to; 1 where none."""
    groups = names.row_groups(fqn) if names is not None else None
    return rows // groups if groups else 1


def whole_groups(start: int, stop: int, per: int) -> tuple[int, int]:
    """``[start, stop)`` widened to whole groups of ``per`` rows."""
    return start // per * per, -(-stop // per) * per


def read_in_groups(names, fqn: str, start: int, stop: int, read, read_align) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``fqn`` from ``read(lo, hi)``, its stored rows: where ``names``
    permutes rows within groups (of ``read_align(fqn)`` rows), the whole groups around them read, put
    in our order (``from_stored_rows``) and sliced -- bitwise those rows of the whole tensor."""
    if names is None or not names.row_groups(fqn):
        return read(start, stop)
    per = read_align(fqn)
    lo, hi = whole_groups(start, stop, per)
    return names.from_stored_rows(read(lo, hi), (hi - lo) // per)[start - lo : stop - lo]


def stored_split(names, fqn: str) -> StoredSplit | None:
    """The ``StoredSplit`` in which ``names`` (another tool's name adapter, None: ours) stores ``fqn``
    as several tensors (a writer reads it whole, once for its parts), else None; None too where
    ``names`` has no one name for ``fqn`` (an expert weight HF stores one tensor per expert) or refuses
    the export (DeepSeek's, Mixtral's routings): the writer names that in one line, before writing."""
    try:
        parts = names.from_stored(names.to_stored(fqn)) if names is not None else None
    except ValueError:
        return None
    return parts if isinstance(parts, StoredSplit) else None


def read_stored_rows(source: OpenedCheckpoint, fqn: str, names, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``fqn`` of ``source`` as ``names`` stores them (None: ours): where it
    permutes rows within groups, the rows of ours they come from (``to_stored_rows`` applied to the
    row numbers), read and put in its order -- bitwise the rows of the whole tensor permuted."""
    shape = source.infos[fqn].shape
    if names is None or not shape or not names.row_groups(fqn):
        return source.read_rows(fqn, start, stop)
    numbers = torch.arange(shape[0]).reshape(shape[0], *[1] * (len(shape) - 1))
    order = names.to_stored_rows(fqn, numbers).reshape(-1)[start:stop]
    lo = int(order.min())
    return source.read_rows(fqn, lo, int(order.max()) + 1)[order - lo]


def nonfinite_count(tensor: torch.Tensor) -> int:
    """How many values of ``tensor`` are NaN or Inf (0 for an integer tensor): one read pass
    (``all_finite``) when every value is finite, a mask only when some are not."""
    if all_finite(tensor):
        return 0
    return int((~(tensor.float() if tensor.element_size() == 1 else tensor).isfinite()).sum())


@dataclass(frozen=True)
class WriteJob:
    """What a format's ``write(source, dst, job)`` writes: these tensors of ``source`` (our FQNs, in
    file order, each in the dtype given) with this manifest. ``shard_bytes``: the most bytes per file
    for formats that shard (HF); ``codec``: the caller's model knowledge, for formats that name the
    model their way (HF names and ``config.json``, torchtitan's names); ``token_ids``: HF's special
    token ids; ``aliases``: the tied FQNs left
    out of ``infos`` (``{fqn: source}``), for formats that record them (DCP); ``files``: files copied
    into a directory output beside the tensors (``{name inside it: file}``: the tokenizer a
    checkpoint carries); ``generation_config``: HF's ``generation_config.json`` (empty: none)."""

    infos: dict[str, TensorInfo]
    manifest: dict
    force: bool = False
    on_bytes: Callable[[int], None] = lambda nbytes: None
    shard_bytes: int = 5 * 10**9
    codec: ModelCodec | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    # HF: the special token ids (bos, eos -- a list --, pad) the exported tokenizer gives, for
    # config.json and generation_config.json, so that generate() stops where the model ends a turn
    token_ids: dict = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)


def recorded_layout(codec: ModelCodec | None, manifest: dict | None, where) -> ModelLayout | None:
    """The model ``manifest`` records, as the caller's codec reads it (None without either)."""
    if codec is None or manifest is None:
        return None
    try:
        return codec.recorded_layout(manifest)
    except ValueError as e:
        raise SeedckptError(f"{where}: the seedckpt manifest is damaged ({e})") from None
