"""Hugging Face model directories: ``config.json`` + ``*.safetensors`` (+ index).

The model's HF names and row order come from the caller's codec (``codec.hf_names``): names are
mapped to ours and permuted rows (e.g. q/k RoPE heads) put back in our order. A tied model (no
separate output head in the files) gives the tied FQN its source's tensor. ``load`` goes through
DCP's ``HuggingFaceStorageReader`` (reading rows with ``owned_reads.OwnedHFReader``), so each rank
reads only its tensors and rows. A quantized tensor (FP8 blocks, MXFP4: ``quantized``; 4-bit
integers: ``compressed_tensors``) stands under the name it would have unquantized, in float32, and a
rank reads the rows of its values and scales under its own. A stored tensor that holds some of ours
rearranged (``StoredParts``: gpt-oss's fused, interleaved, transposed experts) is split on reading,
a rank reading only its experts' rows of it, and joined again on writing; one of ours stored both
so and one slice (expert) per tensor is refused in one line, as is one that does not split.
``write`` streams ``model-0000k-of-0000n.safetensors`` shards of at most ``shard_bytes``, the index and a
``config.json`` that ``transformers`` loads, with the tokenizer files and ``generation_config.json``
the caller hands it (``WriteJob``).

Weights are read from safetensors files only: a directory holding them as ``pytorch_model.bin``
(a pickle, which runs code when loaded) is refused in one line saying so, as is an index that is
not a JSON object with a ``weight_map``.

A stored tensor the model ``config.json`` describes does not have (a layer, an expert, a shared
expert more than it says) is refused in one line naming it and the field to fix, before anything
is read: left out, the weights would load as another model than the files hold. Only what the
name adapter leaves out on purpose is skipped (``left_out``: RoPE caches, DeepSeek-V3's
multi-token-prediction layer, with a line), and empty tensors the model lacks (no weights to lose).
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from seedckpt.checkpoint.atomic import atomic_output, write_json_synced
from seedckpt.checkpoint.base import (
    OpenedCheckpoint,
    WriteJob,
    group_rows,
    read_in_groups,
    read_stored_rows,
    stored_bounds,
)
from seedckpt.checkpoint.formats.compressed_tensors import packed_tensors
from seedckpt.checkpoint.formats.quantized import DequantizedLoad, Stored, quantized_tensors
from seedckpt.checkpoint.formats.safetensors_file import read_safetensor, read_safetensor_rows, write_safetensors
from seedckpt.checkpoint.fused import PartsRead, SplitOnce, joined_shape, split_shapes
from seedckpt.checkpoint.load import (
    GroupedRows,
    copy_shared,
    load_state,
    one_destination_per_source,
    row_bounds,
    tensor_problems,
)
from seedckpt.checkpoint.manifest import TensorInfo
from seedckpt.checkpoint.model import ModelCodec, ModelLayout, NameAdapter, StoredParts
from seedckpt.checkpoint.owned_reads import OwnedHFReader
from seedckpt.checkpoint.safetensors_header import SAFETENSORS_DTYPES, safetensors_header
from seedckpt.checkpoint.untrusted import read_json
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import copy_full_into, local, local_rows

OUR_NAMES = False  # only the model's dense tensors have HF names
TIED_STORED_ONCE = True  # as HF stores a tied model: no separate output head
TOKENIZER_AT = ""  # beside config.json, where AutoTokenizer.from_pretrained looks
GENERATION_CONFIG = "generation_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")  # pytorch_model.bin and kin: never unpickled here


def detect(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def reader(
    path: Path, codec: ModelCodec | None = None, layout: ModelLayout | None = None, verify: bool = True
) -> HFCheckpoint:
    """HF files carry no checksums (``verify`` has nothing to check) and record their model."""
    return HFCheckpoint(path, codec)


class HFCheckpoint(OpenedCheckpoint):
    kind = "hf"

    def __init__(self, path: Path, codec: ModelCodec | None):
        if codec is None:
            raise SeedckptError(
                f"{path} is a Hugging Face directory: reading it needs the model family (the caller passes its codec)"
            )
        self.config = read_json(path / "config.json", "the model configuration")
        if not isinstance(self.config, dict):
            raise SeedckptError(
                f"{path}/config.json holds a JSON {type(self.config).__name__}, not an object; a model's "
                "config.json is one object of its settings (hidden_size, num_hidden_layers, ...): restore it"
            )
        try:
            layout = codec.hf_layout(self.config)
        except SeedckptError as e:  # another family's model_type, or none the codec knows
            raise SeedckptError(f"{path}: {e}") from None
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            raise SeedckptError(f"{path}/config.json describes no valid model of this family ({e})") from None
        self.names = codec.hf_names(layout)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise _no_safetensors(path)
        self.location: dict[str, tuple[Path, str]] = {}  # our fqn -> (file, hf name)
        self.spans: dict[str, tuple[int, int]] = {}  # our fqn -> its bytes in its file
        # our fqn -> {index: (file, hf name, info)}: a tensor stored one dim-0 slice (expert) per entry
        pieces: dict[str, dict[int, tuple[Path, str, TensorInfo]]] = {}
        self.parts: dict[str, tuple[StoredParts, int]] = {}  # our fqn -> the stored tensor holding it, its place
        self.split_once = SplitOnce()
        infos = {}
        headers = {}
        unaccounted: list[str] = []  # stored names of tensors the model lacks
        skipped: list[str] = []  # stored names the adapter leaves out (``left_out`` says which on purpose)
        for file in files:
            if not isinstance(file, str) or Path(file).name != file or not (path / file).is_file():
                raise SeedckptError(f"{index} lists {file!r}, which is not a file in {path}")
            headers[file] = safetensors_header(path / file)
        self.stored_tensors = _stored(path, headers)  # every tensor of the files, by its name there
        # hf name -> its stored parts
        self.quantized = quantized_tensors(self.stored_tensors, self.config, path)
        self.quantized |= packed_tensors(self.stored_tensors, self.config, path)
        quantized_part = {part.name: q for q in self.quantized.values() for part in q.parts}
        for file, (header, _, data_start) in headers.items():
            for name, entry in header.items():
                info = _info(entry)
                if name in quantized_part:  # stands under its own name, at its values' place
                    if name != quantized_part[name].values.name:
                        continue
                    name, info = quantized_part[name].name, quantized_part[name].info
                try:
                    fqn = self.names.from_stored(name)
                except ValueError:  # a name no model of this family has
                    unaccounted.append(name)
                    continue
                if fqn is None:
                    skipped.append(name)
                    continue
                if not _accounted(fqn, layout.shapes):
                    if math.prod(info.shape):  # an empty one holds no weights (transformers' zero shared experts)
                        unaccounted.append(name)
                    continue
                if isinstance(fqn, tuple):
                    pieces.setdefault(fqn[0], {})[fqn[1]] = (path / file, name, info)
                    continue
                if isinstance(fqn, StoredParts):
                    for k, (ours, shape) in enumerate(zip(fqn.fqns, _parts_shapes(fqn, info, path / file, name))):
                        self.parts[ours] = (fqn, k)
                        self.location[ours] = (path / file, name)
                        infos[ours] = TensorInfo(shape, info.dtype)
                    continue
                self.location[fqn] = (path / file, name)
                self.spans[fqn] = (data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
                infos[fqn] = info
        self._refuse_unaccounted(path, unaccounted, skipped)
        _refuse_two_layouts(path, pieces, self.parts, self.location)
        self.slices = {fqn: _stacked(fqn, found, path) for fqn, found in pieces.items()}
        for fqn, parts in self.slices.items():
            self.location[fqn] = parts[0][:2]
            infos[fqn] = TensorInfo((len(parts), *parts[0][2].shape), parts[0][2].dtype)
        if weight_map is not None:
            stored = {name for header, _, _ in headers.values() for name in header}
            absent = [n for n in weight_map if n not in stored and self._ours(n, index) is not None]
            if absent:
                raise SeedckptError(f"{index} lists tensors that its files do not contain: {absent[:5]}")
        if self._stores_a_distinct_head(layout, infos):
            # transformers keeps such a head (its tying skips a head the files provide): so do we.
            head = self.location[next(iter(layout.aliases))][1]
            warnings.warn(
                f"{path}/config.json sets tie_word_embeddings = true, but its files store a distinct {head}: "
                "loaded untied, as transformers does",
                stacklevel=2,
            )
            self.config = {**self.config, "tie_word_embeddings": False}
            layout = codec.hf_layout(self.config)
        else:  # a stored copy of the embedding is the tie: read once, as the embedding
            infos = {fqn: info for fqn, info in infos.items() if fqn not in layout.aliases}
        super().__init__(path, infos, None, layout)  # config.json records the model
        self.alias_tied(dict(infos))
        for fqn, source in self.aliases.items():
            self.location[fqn] = self.location[source]
        self.dequantized = frozenset(fqn for fqn, (_, name) in self.location.items() if name in self.quantized)

    def _refuse_unaccounted(self, path: Path, unaccounted: list[str], skipped: list[str]) -> None:
        """Refuse the stored tensors the model lacks (``unaccounted``, and those of ``skipped`` the name
        adapter does not leave out on purpose) in one line; else say what it leaves out, if anything."""
        refused, note = self.names.left_out(skipped)
        if unaccounted or refused:
            raise _unaccounted_error(path, self.config, self.names, unaccounted + refused)
        if note is not None:
            warnings.warn(note, stacklevel=3)

    def _stores_a_distinct_head(self, layout, stored: dict[str, TensorInfo]) -> bool:
        """Whether a config that ties the output to the embedding sits over files that also store a
        different output head. A stored copy of the embedding is a tie: every value is compared, as
        transformers compares them (``torch.equal``)."""
        return any(
            fqn in stored
            and source in stored
            and (stored[fqn] != stored[source] or not self._same_values(fqn, source, stored[fqn]))
            for fqn, source in layout.aliases.items()
        )

    def _same_values(self, fqn: str, other: str, info: TensorInfo | None = None) -> bool:
        """Whether ``fqn`` and ``other`` (both ``info``, default ``fqn``'s) hold the same values: their
        bytes where both are stored plain, 1 MiB at a time; else (quantized, or fused with other
        tensors: the bytes are not the values) a slab of rows of each at a time, dequantized."""
        plain = all(name in self.spans and self.location[name][1] not in self.quantized for name in (fqn, other))
        if plain:
            return self._same_bytes(fqn, other)
        bounds = row_bounds((info or self.infos[fqn]).shape, torch.float32.itemsize)
        return all(torch.equal(self.read_rows(fqn, *rows), self.read_rows(other, *rows)) for rows in bounds)

    def _same_bytes(self, fqn: str, other: str) -> bool:
        """Whether the stored bytes of ``fqn`` and ``other`` (of one size) are the same."""
        (begin, end), (other_begin, _) = self.spans[fqn], self.spans[other]
        with open(self.location[fqn][0], "rb") as f, open(self.location[other][0], "rb") as g:
            f.seek(begin)
            g.seek(other_begin)
            sizes = (min(2**20, end - at) for at in range(begin, end, 2**20))
            return all(f.read(size) == g.read(size) for size in sizes)

    def _ours(self, name: str, where: Path) -> str | None:
        try:
            return self.names.from_stored(name)
        except ValueError as e:
            raise SeedckptError(f"{where}: {e}") from None

    def file_of(self, fqn: str) -> Path:
        return self.location[fqn][0]

    def read_tensor(self, fqn: str) -> torch.Tensor:
        if fqn in self.slices:
            return torch.stack([self._read_stored(file, name) for file, name, _ in self.slices[fqn]])
        if fqn in self.parts:
            return self._read_part(fqn)
        file, name = self.location[fqn]
        tensor = self._read_stored(file, name)
        groups = self.names.row_groups(fqn)
        return self.names.from_stored_rows(tensor, groups) if groups else tensor

    def reads_rows(self, fqn: str) -> bool:
        return True

    def read_align(self, fqn: str) -> int:
        names = None if fqn in self.slices or fqn in self.parts else self.names
        return group_rows(names, fqn, self.infos[fqn].shape[0])

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``fqn``: those of the stored tensor under it (dequantized), of the
        fused one holding it (split; dim 0 is the experts of both), or one stored slice (expert) per
        row; where HF permutes rows within groups (RoPE heads), the whole groups around them."""
        if fqn in self.slices:
            return torch.stack([self._read_stored(file, name) for file, name, _ in self.slices[fqn][start:stop]])
        file, name = self.location[fqn]
        if fqn in self.parts:
            rows = lambda: self._read_stored_rows(file, name, start, stop)  # noqa: E731
            return self.split_once.read_rows(fqn, self.parts[fqn][0], (start, stop), rows)
        stored = lambda lo, hi: self._read_stored_rows(file, name, lo, hi)  # noqa: E731
        return read_in_groups(self.names, fqn, start, stop, stored, self.read_align)

    def _read_stored_rows(self, file: Path, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the stored ``name``, their bytes alone (dequantized to float32)."""
        quantized = self.quantized.get(name)
        if quantized is None:
            return read_safetensor_rows(file, name, self.stored_tensors[name].info, start, stop - start)
        out = torch.empty((stop - start, *quantized.info.shape[1:]), dtype=torch.float32)
        quantized.read_rows_into(out, start)
        return out

    def _read_part(self, fqn: str) -> torch.Tensor:
        """Our ``fqn`` of a tensor stored with others (``StoredParts``), read (and dequantized) once for all."""
        return self.split_once.read(fqn, self.parts[fqn][0], lambda: self._read_stored(*self.location[fqn]))

    def stored_reads(self):
        """Every tensor of the files under its name there and its file's, in file order; a quantized
        one once, dequantized a slab at a time (its scales checked), the models' tensors and those it
        leaves out alike."""
        by_values = {q.values.name: q for q in self.quantized.values()}
        scales = {part.name for q in self.quantized.values() for part in q.parts[1:]}
        for name, part in self.stored_tensors.items():
            q = by_values.get(name)
            if q is not None:
                yield f"{q.name} in {part.file.name}", q.info.nbytes, q.slabs
            elif name not in scales:
                yield f"{name} in {part.file.name}", part.info.nbytes, lambda p=part: _stored_slabs(p)

    def _read_stored(self, file: Path, name: str) -> torch.Tensor:
        quantized = self.quantized.get(name)
        return quantized.read() if quantized is not None else read_safetensor(file, name)

    def load(self, state_dict: dict) -> None:
        """Fill ``state_dict`` (our FQNs) through DCP's HF reader: each rank requests only its
        tensors and, for FSDP shards, its rows. Permuted rows (q/k heads) are permuted within each
        group, so a shard reads the whole groups around its rows and keeps its part. A tied output
        is read from the embedding. Lossless casts only (bf16 into fp32)."""
        problems = []
        for fqn, wanted in state_dict.items():
            info = self.infos.get(fqn)
            problems += [f"{fqn}: missing"] if info is None else tensor_problems(fqn, info, wanted)
        if problems:
            raise SeedckptError(f"{self.path} does not cover the model: " + "; ".join(problems))
        fused: dict[str, dict] = {}  # stored name -> {our fqn: destination} of the tensors it holds
        for fqn in [fqn for fqn in state_dict if fqn in self.parts]:
            fused.setdefault(self.location[fqn][1], {})[fqn] = state_dict[fqn]
        plain = {fqn: wanted for fqn, wanted in state_dict.items() if fqn not in self.parts}
        names, shared = one_destination_per_source(plain, lambda fqn: self.location[fqn][1])
        fqn_of = {self.location[fqn][1]: fqn for fqn in plain}
        by_name, permuted, whole = {}, [], []
        split = [PartsRead(self.parts[next(iter(d))][0], d, self.infos, name, by_name) for name, d in fused.items()]
        for name, wanted in names.items():
            groups = self.names.row_groups(fqn_of[name])
            if fqn_of[name] in self.slices:
                whole += self._slices_into(fqn_of[name], wanted, by_name)
            elif groups:
                permuted.append(GroupedRows(wanted, groups))
                if permuted[-1].window is not None:
                    by_name[name] = permuted[-1].window
            else:
                by_name[name] = wanted
        dequantized = DequantizedLoad(self.quantized)  # quantized tensors: their values' and scales' rows
        load_state(dequantized.requests(by_name), OwnedHFReader(self.path), self.path)
        dequantized.finish()
        for grouped in permuted:
            grouped.finish(self.names.from_stored_rows)
        for read in split:
            read.finish()
        with torch.no_grad():
            for wanted, full in whole:
                copy_full_into(wanted, full)
        copy_shared(state_dict, names, shared)

    def _slices_into(self, fqn: str, wanted: torch.Tensor, by_name: dict) -> list:
        """Request the stored slices (experts) of ``fqn`` that this rank's rows of ``wanted`` hold,
        each read straight into its rows: the others are never opened. A shard that is not a block of
        whole rows reads every slice into a full buffer; returned as ``[(wanted, buffer)]`` to copy."""
        parts = self.slices[fqn]
        rows = local_rows(wanted)
        if rows is None and isinstance(wanted, DTensor):
            full = torch.empty(wanted.shape, dtype=wanted.dtype)
            by_name.update((name, full[e]) for e, (_, name, _) in enumerate(parts))
            return [(wanted, full)]
        lo, hi = rows or (0, len(parts))
        by_name.update((parts[e][1], local(wanted)[e - lo]) for e in range(lo, hi))
        return []


def _stored_slabs(part: Stored) -> Iterator[torch.Tensor]:
    """The stored tensor ``part`` in dim-0 slabs of ``SLAB_BYTES``, each read alone."""
    for start, stop in row_bounds(part.info.shape, part.info.dtype.itemsize):
        yield read_safetensor_rows(part.file, part.name, part.info, start, stop - start)


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (``{tensor name: file name}``), checked to be one: a file that is not
    an object holding it is named in one line, what it holds instead said."""
    data = read_json(index, "the safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        held = (
            f"a JSON {type(data).__name__}"
            if not isinstance(data, dict)
            else "a weight_map that is no object of file names"
            if "weight_map" in data
            else "no weight_map"
        )
        raise SeedckptError(
            f"{index} holds {held}, not a safetensors index (an object whose weight_map maps each tensor to its "
            "file): restore it, or remove it to read every *.safetensors file of the directory"
        )
    return weight_map


def _no_safetensors(path: Path) -> SeedckptError:
    """The refusal of a directory with no safetensors file: what it holds instead, and how to read it."""
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        return SeedckptError(
            f"{path} holds its weights as {', '.join(pickles[:3])}{' ...' if len(pickles) > 3 else ''} (pickles, "
            "which run code when loaded): only safetensors are read; save it as safetensors first, e.g. "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) in a trusted environment"
        )
    return SeedckptError(f"{path} has a config.json but no *.safetensors file: restore the model's weights beside it")


def _accounted(fqn: str | tuple[str, int] | StoredParts, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether the model (``shapes``: its tensors) holds what a stored tensor is (``from_stored``'s
    answer): our tensor, an expert within its count, or every tensor a fused one holds."""
    if isinstance(fqn, StoredParts):
        return all(ours in shapes for ours in fqn.fqns)
    if isinstance(fqn, tuple):
        return fqn[0] in shapes and fqn[1] < shapes[fqn[0]][0]
    return fqn in shapes


def _unaccounted_error(path: Path, config: dict, names: NameAdapter, stored: list[str]) -> SeedckptError:
    """One line naming the first of the ``stored`` tensors the model lacks, how many in all, and the
    likely fix: the ``config.json`` field the name adapter suspects (of its candidates, the one the
    file sets), else the file as a whole."""
    stored = sorted(stored, key=_in_layer_order)
    held = stored[0] + (f" (and {len(stored) - 1} more)" if len(stored) > 1 else "")
    fields = names.config_fields(stored[0])
    field = next((f for f in fields if f in config), fields[0] if fields else None)
    if field is None:
        return SeedckptError(
            f"{path}: its files hold {held}, which the model config.json describes does not have: correct "
            "config.json to the model the weights are, or remove those tensors"
        )
    said = f"says {field} = {json.dumps(config[field])}" if field in config else f"leaves {field} out"
    return SeedckptError(f"{path}: config.json {said} but the files hold {held}, which that model lacks: fix {field}")


def _in_layer_order(name: str) -> tuple:
    """A sort key that puts ``model.layers.2`` before ``model.layers.10`` (and expert 2 before 10)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def _info(entry: dict) -> TensorInfo:
    return TensorInfo(tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])


def _stored(path: Path, headers: dict) -> dict[str, Stored]:
    """Every tensor of the directory by its name (``headers``: {file name: its parsed header})."""
    return {
        name: Stored(path / file, name, _info(entry))
        for file, (header, _, _) in headers.items()
        for name, entry in header.items()
    }


def _parts_shapes(parts: StoredParts, info: TensorInfo, file: Path, name: str) -> list[tuple[int, ...]]:
    """The shapes of ours that the stored ``name`` of ``file`` splits into; one line if it cannot."""
    try:
        return split_shapes(parts, info.shape)
    except ValueError as e:
        raise SeedckptError(f"{file} stores {name} as {list(info.shape)}, which is not its layout: {e}") from None


def _refuse_two_layouts(path: Path, pieces: dict, parts: dict, location: dict) -> None:
    """One line if some tensor of ours is stored both one slice (expert) per tensor and within a
    fused one: which to read is not the files' to leave open."""
    both = sorted(set(pieces) & set(parts))
    if both:
        sliced = next(iter(pieces[both[0]].values()))[1]
        raise SeedckptError(
            f"{path} stores {both[0]} twice, one slice (expert) per tensor ({sliced} ...) and within "
            f"{location[both[0]][1]}: keep one layout, removing the other's tensors"
        )


def _stacked(fqn: str, found: dict[int, tuple[Path, str, TensorInfo]], path: Path) -> list:
    """The slices of ``fqn`` in index order, checked: every index from 0, one shape and dtype."""
    if sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))
        raise SeedckptError(f"{path} stores {fqn} one slice (expert) per tensor, but lacks slices {missing[:8]}")
    kinds = {(info.shape, info.dtype) for _, _, info in found.values()}
    if len(kinds) > 1:
        raise SeedckptError(f"{path} stores the slices (experts) of {fqn} with different shapes or dtypes: {kinds}")
    return [found[e] for e in range(len(found))]


def write(source: OpenedCheckpoint, dst: Path, job: WriteJob) -> Path:
    """Shards of at most ``job.shard_bytes`` in HF's names and row order, the index, ``config.json``,
    ``job.generation_config`` and ``job.files`` (the tokenizer); published once the directory reads
    back as an HF model."""
    if job.codec is None or source.layout is None:
        raise SeedckptError(f"{source.path}: writing Hugging Face files needs the model it holds")
    names = job.codec.hf_names(source.layout)
    try:
        kept = {fqn: info for fqn, info in job.infos.items() if not _zero_and_unkept(names, source, fqn)}
        entries = _hf_entries(names, kept)  # hf name -> (our fqn, slice index or None, info)
    except ValueError as e:
        raise SeedckptError(f"{source.path}: {e}") from None
    shards: list[list[str]] = [[]]
    size = 0
    for hf_name, (_, _, info) in entries.items():
        if shards[-1] and size + info.nbytes > job.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(hf_name)
        size += info.nbytes
    experts: list = [None, (0, 0), None]  # the slab of a grouped tensor whose slices are being written

    def slabs_in_hf_layout(hf_name: str) -> Iterator[torch.Tensor]:
        fqn, index, info = entries[hf_name]
        if isinstance(fqn, StoredParts):  # dim 0 (the experts) is dim 0 of each of ours
            bounds = row_bounds(info.shape, info.dtype.itemsize)
            yield from (fqn.join(rows).contiguous() for rows in zip(*(source.slabs(f, bounds) for f in fqn.fqns)))
        elif index is None:
            yield from (read_stored_rows(source, fqn, names, *rows) for rows in stored_bounds(info, names, fqn))
        else:  # one slice (expert) of ours, from a slab of them read once
            if experts[0] != fqn or not experts[1][0] <= index < experts[1][1]:
                experts[:] = [fqn, _slab_around(job.infos[fqn], index), None]  # the last one freed first
                experts[2] = source.read_rows(fqn, *experts[1])
            yield experts[2][index - experts[1][0]]

    weight_map = {}
    dtype = next(iter(job.infos.values())).dtype
    with atomic_output(dst, job.force, check=lambda path: HFCheckpoint(path, job.codec)) as partial:
        for k, hf_names in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(
                partial / file,
                {name: entries[name][2] for name in hf_names},
                slabs_in_hf_layout,
                {"format": "pt"},
                job.on_bytes,
            )
            weight_map.update({name: file for name in hf_names})
        index = {"metadata": {"total_size": sum(i.nbytes for _, _, i in entries.values())}, "weight_map": weight_map}
        write_json_synced(partial / "model.safetensors.index.json", index)
        write_json_synced(partial / "config.json", {**job.codec.hf_config(source.layout, dtype), **job.token_ids})
        if job.generation_config:
            write_json_synced(partial / GENERATION_CONFIG, job.generation_config)
        for name, file in job.files.items():
            shutil.copyfile(file, partial / name)
    return Path(dst)


def _slab_around(info: TensorInfo, row: int) -> tuple[int, int]:
    """The slab of rows (``row_bounds``) of a tensor of ``info`` that holds ``row``."""
    return next((start, stop) for start, stop in row_bounds(info.shape, info.dtype.itemsize) if row < stop)


def _zero_and_unkept(names, source: OpenedCheckpoint, fqn: str) -> bool:
    """Whether ``fqn`` is a tensor HF's layout has no place for but whose zero is the same model as
    its absence (an expert bias at zero routes as none): left out, once its values are read and
    found zero. Holding anything else, it is refused (``ValueError`` naming the choice)."""
    reason = names.unkept_unless_zero(fqn)
    if reason is not None and any(slab.count_nonzero() for slab in source.slabs(fqn)):
        raise ValueError(reason)
    return reason is not None


def _hf_entries(names, infos: dict[str, TensorInfo]) -> dict:
    """Each HF tensor to write: ``{hf name: (our fqn, dim-0 slice index or None, its info)}``; a
    grouped expert weight becomes one HF tensor per expert, as ``transformers`` stores them, and
    tensors HF stores rearranged in one (``StoredParts``) become it: ``(parts, None, its info)``."""
    entries = {}
    for fqn, info in infos.items():
        stacked = names.stacked_names(fqn, info.shape[0]) if info.shape else None
        if stacked is None:
            name = names.to_stored(fqn)
            parts = names.from_stored(name)
            if isinstance(parts, StoredParts):
                entries[name] = (parts, None, TensorInfo(joined_shape(parts, infos), info.dtype))
            else:
                entries[name] = (fqn, None, info)
            continue
        part = TensorInfo(info.shape[1:], info.dtype)
        entries.update((name, (fqn, e, part)) for e, name in enumerate(stacked))
    return entries
