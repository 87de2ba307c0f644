"""``seedckpt convert`` and ``seedckpt diff``: any supported format to any other, a slab at a time.

A conversion is a lookup: the target's format module (``seedckpt.checkpoint.formats``) writes what
the source reads, each tensor in slabs of ``SLAB_BYTES`` of rows (read, dequantized, permuted, cast,
written, freed), so peak memory stays near a few slabs whatever the tensors: a 512 MiB embedding took
0.36 GiB of peak RSS, 0.80 GiB read whole; a 256 MiB one 0.36 against 0.55 (``benchmarks/convert.py
--big``, DCP to HF). ``torch``'s single pickle holds the model, and a source that reads a tensor only whole (an
OSFT checkpoint's dense view) holds it: either is refused up front where it exceeds the memory
available (``refuse_beyond_memory``), and so is a diff or a ``verify`` whose slab does
(``refuse_diff_beyond_memory``, ``refuse_verify_beyond_memory``).

* ``dcp``: a DCP checkpoint with our flat FQNs and a manifest (kind ``converted``);
  ``torchtitan``: the same in torchtitan 0.3's names (``qkv_linear``, ``lm_head``).
* ``hf``: safetensors shards of at most ``--max-shard-size`` in HF's names and row order, the
  index and a ``config.json`` that ``transformers`` loads; a tied model is written tied.
* ``safetensors``: one file with our FQNs; ``torch``: ``torch.save`` of ``{fqn: tensor}``.

A directory output keeps the tokenizer files and ``generation_config.json`` its source carries
(``carried``): an HF download converted to DCP and back can still ``generate()``.

An OSFT run's checkpoint keeps its SVD factors where the target stores our names, else (or with
``--dense``) each target is rebuilt as its dense weight (``osft.DenseOSFT``).

A tensor holding NaN or Inf (a weight, gpt-oss's sinks, DeepSeek-V3's correction bias, values a
quantized tensor's scales overflow) stops the conversion, named in one line, unless
``--allow-non-finite``: each is checked as it is read for writing (``FiniteReads``), one pass over a
slab already in memory, and the output is removed before it is ever published.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from pathlib import Path

import torch

from models.family import ModelFamily
from seedckpt.checkpoint import FORMATS, OpenedCheckpoint, TensorInfo, WriteJob, dtype_name, make_manifest
from seedckpt.checkpoint.base import nonfinite_count, stored_bounds, stored_split, whole_groups
from seedckpt.checkpoint.formats.hf import GENERATION_CONFIG
from seedckpt.checkpoint.load import row_bounds
from seedckpt.checkpoint.manifest import TOKENIZER_DIR
from seedckpt.checkpoint.untrusted import read_json
from seedckpt.config.job_config import DTYPES
from seedckpt.data.chat import render_samples
from seedckpt.data.tokenizer import load_tokenizer, tokenizer_files
from seedckpt.finetune.osft import manifest_osft
from seedckpt.materialize.model_checkpoint import (
    codec_for,
    dense_view,
    family_to_open,
    open_model_checkpoint,
    refuse_float64,
)
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.progress import Progress
from seedckpt.utils.resources import available_memory, check_free_space, size_text

TARGETS = tuple(FORMATS)
# The most bytes a carried file may take. Released tokenizer.json files are tens of MB at most
# (262k-token vocabularies); a larger file under one of those names is not a tokenizer's.
MAX_CARRIED_BYTES = 128 * 2**20
# Disk an output takes beyond its tensors and carried files: safetensors headers, the HF index, DCP's
# .metadata, the manifest -- a few hundred bytes a tensor, a few KiB a file.
OUTPUT_ALLOWANCE, ALLOWANCE_PER_TENSOR = 1 << 20, 1 << 10
# What diff holds a compared value in besides its two reads: both sides in float64, their difference,
# its masked and absolute values (8 bytes each), and four one-byte masks. Measured: float32 slabs of 4 M
# values grew the peak RSS by 187 MiB, 208 by this count.
COMPARE_BYTES = 5 * 8 + 4


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise SeedckptError(f"--max-shard-size {text!r} is not a size like 5GB or 500MiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def _ordered(fqns, family: ModelFamily) -> list[str]:
    """Embedding, blocks in numeric order, final norm and output -- the order HF files and readers
    expect."""
    return sorted(fqns, key=lambda fqn: (*family.position(fqn), fqn))


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    force: bool = False,
    progress: bool = True,
    args=None,
    dense: bool = False,
    verify: bool = True,
    model: str | None = None,
    allow_non_finite: bool = False,
) -> Path:
    """Convert ``src`` (any supported format) into ``dst`` as ``to``; returns ``dst``. An OSFT run's
    checkpoint keeps its factors unless ``dense`` (or the target has no place for them): then each
    target becomes its dense weight, for the next task of a continual-learning sequence. ``verify``:
    check the bytes read against the source's checksums. ``model``: the model family (``model.name``)
    of a source that does not record it, which ``args`` then describes. ``allow_non_finite``: write
    tensors holding NaN or Inf as they are instead of refusing them."""
    if to not in FORMATS:
        raise SeedckptError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    if dtype is not None and dtype not in DTYPES:
        raise SeedckptError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    check_apart(Path(src), Path(dst))
    target = FORMATS[to]
    shard_bytes = parse_size(max_shard_size)
    model = family_to_open(src, args, model)
    codec = codec_for(model)
    source = open_model_checkpoint(src, args, verify=verify, model=model)
    if dtype is None:  # a cast on request is the one way in for float64 weights
        refuse_float64(source, "pass --dtype float32 (or bfloat16) to cast them")
    has_factors = manifest_osft(source.manifest) is not None
    keeps_factors = has_factors and target.OUR_NAMES and not dense
    if keeps_factors and dtype is not None:
        raise SeedckptError(
            f"{src} holds OSFT factors; casting them would break their orthonormality. Pass "
            "--dense to write (and cast) the dense weights, or leave out --dtype"
        )
    if has_factors and not keeps_factors:
        source = dense_view(source)
    if not allow_non_finite:
        source = FiniteReads(source, dst)
    model_args = source.require_args()
    if not source.infos:
        raise SeedckptError(f"{src} holds no model tensors")
    # dequantized values are float32 (bf16 would move them): kept exact, and the rest widened to match
    cast = DTYPES[dtype] if dtype else (torch.float32 if source.dequantized else None)
    infos = {
        f: TensorInfo(source.infos[f].shape, cast or source.infos[f].dtype)
        for f in _ordered(source.infos, codec.family)
    }
    tied = source.layout.aliases if target.TIED_STORED_ONCE else {}  # stored once, as HF and our DCP store it
    for fqn in tied:
        infos.pop(fqn, None)
    largest = max(infos, key=lambda fqn: infos[fqn].nbytes)
    if to == "hf" and shard_bytes < infos[largest].nbytes:
        raise SeedckptError(
            f"--max-shard-size {max_shard_size} is less than the largest tensor, {largest} "
            f"({infos[largest].nbytes:,} bytes): a shard holds whole tensors; give at least that"
        )
    refuse_beyond_memory(source, infos, to, dst, row_order(codec, source, to))
    out_dtype = cast or next(iter(infos.values())).dtype
    bar = Progress(sum(i.nbytes for i in infos.values()), f"convert {source.kind}->{to}", enabled=progress)
    recorded = source.manifest or {}
    flavor = recorded.get("model", {}).get("flavor") or source.layout.flavor
    manifest = make_manifest(
        "converted",
        model,
        flavor,
        model_args.to_dict(),
        dtype=dtype_name(out_dtype),
        seed=recorded.get("seed"),
        source={"format": source.kind, "path": str(src)},
        **({"finetune": recorded["finetune"]} if keeps_factors else {}),
    )
    token_ids = special_token_ids(source) if to == "hf" else {}
    files, generation_config = carried(source, to, token_ids)
    check_free_space(Path(dst), output_bytes(infos, files), f"the {to} conversion")
    job = WriteJob(
        infos,
        manifest,
        force,
        bar.update,
        shard_bytes,
        codec,
        aliases=tied,
        token_ids=token_ids,
        files=files,
        generation_config=generation_config,
    )
    try:
        return target.write(source, Path(dst), job)
    finally:
        bar.close()


def refuse_beyond_memory(source: OpenedCheckpoint, infos: dict[str, TensorInfo], to: str, dst, names) -> None:
    """Refuse, before anything is written, a conversion that must hold more at once than the machine
    has available (``available_memory``: a cgroup's limit counted), rather than meet the OOM killer
    midway: a ``torch`` output (one pickle of every tensor), else the tensor held largest -- read and
    cast whole where the source reads it only whole (an OSFT checkpoint's rebuilt dense weight) or the
    target stores it split, else its largest slab, whole groups of rows where the target's ``names``
    permute rows within them (one group: the tensor)."""
    if to == "torch":
        held = {"--to torch": sum(i.nbytes for i in infos.values())}
    else:
        held = {fqn: _held_at_once(source, fqn, info, names) for fqn, info in infos.items()}
    beyond = _beyond_memory(held)
    if beyond is None:
        return
    largest, need, available = beyond
    if to == "torch":
        what, fix = "--to torch pickles every tensor at once", "--to safetensors writes one slab at a time"
    else:
        what = f"{largest} is held {_how_held(source, largest, names)}, read and cast"
        fix = "free memory, or convert on a machine with more"
    raise SeedckptError(
        f"{source.path}: {what}, {size_text(need)} at once, but {size_text(available)} of memory are "
        f"available: {fix} (nothing was written to {dst})"
    )


def output_bytes(infos: dict[str, TensorInfo], files: dict[str, Path]) -> int:
    """The disk an output of ``infos`` (the target's tensors in its dtype) and carried ``files`` takes."""
    carried_bytes = sum(file.stat().st_size for file in files.values())
    return sum(i.nbytes for i in infos.values()) + carried_bytes + OUTPUT_ALLOWANCE + ALLOWANCE_PER_TENSOR * len(infos)


def row_order(codec, source: OpenedCheckpoint, to: str):
    """The name adapter whose row order a ``to`` output stores (HF's, torchtitan's), None for ours."""
    if to == "hf":
        return codec.hf_names(source.layout)
    return codec.renamings(source.layout).get("torchtitan") if to == "torchtitan" else None


def _held_at_once(source: OpenedCheckpoint, fqn: str, info: TensorInfo, names) -> int:
    """The bytes of ``fqn`` (written as ``info``) a conversion holds at once, its read
    (``slab_held``) and its cast; one the target stores split (``stored_split``) is read whole and
    copied into its parts."""
    read = source.infos[fqn].nbytes
    if stored_split(names, fqn) is not None:
        return 2 * read + info.nbytes
    if not source.reads_rows(fqn) or not info.shape:
        return read + info.nbytes
    bounds = stored_bounds(info, names, fqn)
    rows = max((stop - start for start, stop in bounds), default=0)
    return slab_held(source, fqn, bounds) + info.nbytes * rows // info.shape[0]


def slab_held(side: OpenedCheckpoint, fqn: str, bounds: list[tuple[int, int]]) -> int:
    """The bytes ``side`` holds reading ``fqn`` in the slabs ``bounds``: the whole tensor where it
    reads it no other way, else its largest slab with the whole row groups its read widens to
    (``read_align``: HF's q/k heads, read whole around a slab's rows and kept while the slab lives)."""
    info = side.infos[fqn]
    if not side.reads_rows(fqn) or not info.shape:
        return info.nbytes
    per = side.read_align(fqn)
    rows = max((hi - lo for lo, hi in (whole_groups(start, stop, per) for start, stop in bounds)), default=0)
    return info.nbytes * rows // max(1, info.shape[0])


def _how_held(source: OpenedCheckpoint, fqn: str, names) -> str:
    if stored_split(names, fqn) is not None:
        return "whole and copied into the parts its target stores"
    if not source.reads_rows(fqn):
        return "whole (the source reads it no other way)"
    if names and names.row_groups(fqn):
        return "in slabs of the row groups its target permutes"
    return "in slabs widened to the row groups its source permutes" if source.read_align(fqn) > 1 else "in slabs"


class FiniteReads(OpenedCheckpoint):
    """``source`` whose every tensor is refused, in one line naming it, when it holds NaN or Inf:
    checked as each slab is read for writing, so a refusal comes before the output is published (its
    writer then removes the partial output) and no tensor is read twice. The check is one ``aminmax``
    pass over a slab in memory: a 151 M-parameter seed (605 MB, tmpfs) converted to safetensors took
    1.01x the CPU time of ``--allow-non-finite`` (median of 5 interleaved pairs, busy 2-core machine)."""

    def __init__(self, source: OpenedCheckpoint, dst: str | Path):
        super().__init__(source.path, source.infos, source.manifest, source.recorded, source.layout)
        self.source, self.dst, self.kind = source, dst, source.kind
        self.aliases, self.dequantized = source.aliases, source.dequantized

    def read_tensor(self, fqn: str) -> torch.Tensor:
        return self._checked(fqn, self.source.read_tensor(fqn))

    def reads_rows(self, fqn: str) -> bool:
        return self.source.reads_rows(fqn)

    def read_align(self, fqn: str) -> int:
        return self.source.read_align(fqn)

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        return self._checked(fqn, self.source.read_rows(fqn, start, stop))

    def _checked(self, fqn: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` (of ``fqn``) if all are finite; else the refusal, counting the whole tensor's."""
        if not nonfinite_count(values):
            return values
        bad = sum(map(nonfinite_count, self.source.slabs(fqn)))
        made = ""
        if fqn in self.dequantized:
            made = " (dequantized: a NaN code, or a scale that overflows float32 times a value)"
        raise SeedckptError(
            f"{self.path}: {fqn} holds {bad:,} NaN or Inf values of {self.infos[fqn].numel:,}{made}, read from "
            f"{self.source.file_of(fqn)}; a model with them computes NaN: convert one without them, or pass "
            f"--allow-non-finite to write them as they are (nothing was written to {self.dst})"
        )


def carried(source: OpenedCheckpoint, to: str, token_ids: dict) -> tuple[dict[str, Path], dict]:
    """What a ``to`` output carries beside its tensors: ``(files to copy in, by their names inside
    it; the generation config to write)``. Tokenizer files go where the target keeps them
    (``TOKENIZER_AT``); ``generation_config.json`` goes to the top level as it is, unless special
    token ids were derived for the target (HF): then it is written merged, its own values winning
    (its eos ids, its sampling settings) and the derived ids filling only the keys it lacks. A
    single-file target has no place for either: they are left behind with a warning."""
    found = carried_files(source)
    original = _generation_config(found.get(GENERATION_CONFIG))  # checked whatever the target
    folder = FORMATS[to].TOKENIZER_AT
    if folder is None:
        if found:
            warnings.warn(
                f"--to {to} writes one file, with no place for {', '.join(found)} of {source.path}: "
                "they are not carried (--to hf or dcp keeps them)",
                stacklevel=2,
            )
        return {}, {}
    files = {name if name == GENERATION_CONFIG else str(Path(folder, name)): file for name, file in found.items()}
    if not token_ids:
        return files, {}
    files.pop(GENERATION_CONFIG, None)
    return files, {**token_ids, **original}


def carried_files(source: OpenedCheckpoint) -> dict[str, Path]:
    """``{name: file}``: the tokenizer files (``tokenizer_files``' names) and ``generation_config.json``
    that ``source`` keeps beside its tensors; none for a single file. A link is followed only to a
    file inside the source directory, or into its Hugging Face cache's ``blobs`` (a cache snapshot's
    files are all links there): copying what any link points to could put any file of this machine
    into the output, so other links are left with a warning. A file larger than
    ``MAX_CARRIED_BYTES`` is refused before anything is written."""
    folder = FORMATS[source.kind].TOKENIZER_AT
    if folder is None or not source.path.is_dir():
        return {}
    present = [f for f in (*tokenizer_files(source.path / folder), source.path / GENERATION_CONFIG) if f.is_file()]
    outside = [f.name for f in present if not _inside_source(f, source.path)]
    if outside:
        warnings.warn(
            f"{source.path}: {', '.join(outside)} not carried: links out of the directory are not followed; "
            "copy the files in (`cp -rL`) to keep them",
            stacklevel=3,
        )
    return {f.name: _bounded(f) for f in present if _inside_source(f, source.path)}


def _inside_source(file: Path, source: Path) -> bool:
    """Whether ``file`` is a regular file, or a link to one inside ``source`` or its HF cache's blobs."""
    if not file.is_symlink():
        return True
    root = source.resolve()
    roots = [root, *([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])]
    target = file.resolve()
    return target.is_file() and any(target.is_relative_to(r) for r in roots)


def _bounded(file: Path) -> Path:
    size = file.stat().st_size
    if size > MAX_CARRIED_BYTES:
        raise SeedckptError(
            f"{file} is {size:,} bytes, more than the {MAX_CARRIED_BYTES:,} a tokenizer file or generation "
            "config may take, so it is not one: move it out of the directory to convert without it"
        )
    return file


def _generation_config(file: Path | None) -> dict:
    """The source's ``generation_config.json``, one JSON object (``{}`` without one)."""
    if file is None:
        return {}
    config = read_json(file, "the generation config")
    if not isinstance(config, dict):
        raise SeedckptError(
            f"{file} holds a JSON {type(config).__name__}, not an object; a generation config is one "
            "object of settings (eos_token_id, ...): restore it, or move it away to convert without it"
        )
    return config


def special_token_ids(source: OpenedCheckpoint) -> dict:
    """bos, eos and pad ids of the tokenizer a DCP checkpoint carries (none: ``{}``). With a chat
    template, the eos ids also hold the token that ends an assistant turn: the last token the
    template puts in the assistant's part, which SFT taught the model to emit. A slow tokenizer alone
    (``tokenizer.model``, carried from an HF download) gives none: seedckpt loads fast ones only."""
    directory = source.path / TOKENIZER_DIR if source.path.is_dir() else None
    if directory is None or not (directory / "tokenizer.json").is_file():
        return {}
    tokenizer = load_tokenizer(directory)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if tokenizer.chat_template:
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        ids, assistant = render_samples(tokenizer, turn, str(directory))[-1]
        last = max((i for i, mine in enumerate(assistant) if mine), default=None)
        if last is not None and ids[last] in tokenizer.all_special_ids and ids[last] not in eos:
            eos.append(ids[last])
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos or None, "pad_token_id": tokenizer.pad_token_id}
    return {key: value for key, value in ids.items() if value is not None}


def check_apart(src: Path, dst: Path) -> None:
    """The output must not be the input, lie inside it or contain it: writing there (``--force``
    included) would replace or delete the checkpoint being read."""
    source, output = src.resolve(), dst.resolve()
    if output == source:
        raise SeedckptError(
            f"{dst} is the input checkpoint; write the conversion to another path (--force never replaces the input)"
        )
    if source in output.parents:
        raise SeedckptError(f"{dst} is inside the input checkpoint {src}; choose a destination outside it")
    if output in source.parents:
        raise SeedckptError(
            f"{dst} contains the input checkpoint {src}; replacing it would delete the input: "
            "choose another destination"
        )


def _comparable(sides: list[OpenedCheckpoint], paths) -> tuple[list[OpenedCheckpoint], list[str]]:
    """An OSFT run's checkpoint stores its targets as SVD factors, its dense export as weights.
    Unless both sides hold the same factors (same OSFT settings), each side with factors is seen as
    the dense model it computes, so that the targets meet under their ``.weight`` names; a report
    line names each side so rebuilt."""
    specs = [manifest_osft(side.manifest) for side in sides]
    if specs[0] == specs[1]:
        return sides, []
    rebuilt = [spec is not None for spec in specs]
    return (
        [dense_view(side) if dense else side for side, dense in zip(sides, rebuilt)],
        [
            f"{path}: OSFT factors compared as the dense weights they rebuild"
            for path, dense in zip(paths, rebuilt)
            if dense
        ],
    )


def diff(
    a: str | Path, b: str | Path, atol: float = 0.0, args=None, verify: bool = True, model: str | None = None
) -> tuple[bool, list[str]]:
    """Compare two checkpoints of any formats tensor by tensor; ``(equal, report lines)``. With
    ``atol`` above 0 values are compared after casting to the wider dtype and a dtype mismatch alone
    is no difference (a bf16 export can equal its fp32 source within ``atol``); with ``atol`` 0 it is one."""
    model = family_to_open(a, args, model)
    opened = [open_model_checkpoint(path, args, verify=verify, model=model) for path in (a, b)]
    codec = codec_for(model)
    (left, right), lines = _comparable(opened, (a, b))
    refuse_diff_beyond_memory(left, right)
    equal = True
    casts = Counter()  # (left dtype, right dtype) -> tensors compared after casting
    for fqn in _ordered(set(left.infos) | set(right.infos), codec.family):
        if fqn not in right.infos or fqn not in left.infos:
            lines.append(f"{fqn}: only in {a if fqn in left.infos else b}")
            equal = False
            continue
        li, ri = left.infos[fqn], right.infos[fqn]
        if li.shape != ri.shape:
            lines.append(f"{fqn}: shape {list(li.shape)} vs {list(ri.shape)}")
            equal = False
            continue
        delta, nan_apart = _compared(left, right, fqn)
        note = ""
        if li.dtype != ri.dtype and atol == 0:
            note = f" (dtype {dtype_name(li.dtype)} vs {dtype_name(ri.dtype)})"
        elif li.dtype != ri.dtype:
            casts[li.dtype, ri.dtype] += 1
        note += " (NaN in different places)" if nan_apart else ""
        if delta > atol or note:
            equal = False
            lines.append(f"{fqn}: max |delta| {delta:.3g}{note}")
    if casts:
        lines.append(
            "; ".join(
                f"{n} tensors differ in dtype ({dtype_name(p)} vs {dtype_name(q)}): compared after "
                f"casting to {dtype_name(torch.promote_types(p, q))}"
                for (p, q), n in casts.items()
            )
        )
    lines.append(
        f"{'equal' if equal else 'different'}: {len(set(left.infos) | set(right.infos))} tensors compared"
        f" ({left.kind} vs {right.kind}, atol {atol:g})"
    )
    return equal, lines


def refuse_diff_beyond_memory(left: OpenedCheckpoint, right: OpenedCheckpoint) -> None:
    """Refuse, before comparing, a diff that must hold more at once than the memory available
    (``available_memory``): it holds a slab of rows of both sides, widened to float64, but a row is
    never split (one expert of a 3-D MoE tensor is one row, however large) and a side that reads a
    tensor only whole (an OSFT target rebuilt dense) holds it whole instead."""
    beyond = _beyond_memory({fqn: _diff_held(left, right, fqn) for fqn in left.infos if fqn in right.infos})
    if beyond is not None:
        largest, need, available = beyond
        raise SeedckptError(
            f"diff of {left.path} and {right.path}: {largest} takes {size_text(need)} at once "
            f"(its slab of rows of both sides, compared in float64), but {size_text(available)} of memory "
            "are available: free memory, or diff on a machine with more"
        )


def refuse_verify_beyond_memory(source: OpenedCheckpoint) -> None:
    """Refuse, before reading, a ``verify`` of every value (a checkpoint without checksums) that must
    hold more at once than the memory available: it reads each tensor a slab at a time, but a row is
    never split (a whole expert), a quantized one is dequantized to float32 slabs, and a tensor its
    format reads only whole is held whole."""
    held = {
        fqn: slab_held(source, fqn, row_bounds(info.shape, info.dtype.itemsize))
        for fqn, info in source.infos.items()
        if fqn not in source.aliases
    }
    beyond = _beyond_memory(held)
    if beyond is not None:
        largest, need, available = beyond
        raise SeedckptError(
            f"verify of {source.path}: {largest} takes {size_text(need)} at once (its largest slab as read), "
            f"but {size_text(available)} of memory are available: free memory, or verify on a machine with more"
        )


def _beyond_memory(held: dict[str, int]) -> tuple[str, int, int] | None:
    """``(the tensor held largest, its bytes, the memory available)`` where it needs more than is
    available (``available_memory``), else None."""
    largest = max(held, key=held.get, default=None)
    available = available_memory()
    if largest is None or available is None or held[largest] <= available:
        return None
    return largest, held[largest], available


def _diff_held(left: OpenedCheckpoint, right: OpenedCheckpoint, fqn: str) -> int:
    """The bytes ``_compared`` holds at once for ``fqn``: each side's read (``slab_held``), and
    ``COMPARE_BYTES`` per value of a slab."""
    li, ri = left.infos[fqn], right.infos[fqn]
    if li.shape != ri.shape:
        return 0
    bounds = row_bounds(li.shape, torch.float64.itemsize)
    rows = max((stop - start for start, stop in bounds), default=1)
    values = li.numel * rows // max(1, li.shape[0]) if li.shape else li.numel
    return values * COMPARE_BYTES + slab_held(left, fqn, bounds) + slab_held(right, fqn, bounds)


def _compared(left: OpenedCheckpoint, right: OpenedCheckpoint, fqn: str) -> tuple[float, bool]:
    """``(max |delta| where neither side is NaN, whether NaN stands in different places)`` of ``fqn``,
    compared in float64 (exact for every float dtype) a slab of rows at a time: whole, a 1 GiB float32
    tensor took over 5.9 GiB (both sides widened, masked and indexed) and met the OOM killer here."""
    info = left.infos[fqn]
    bounds = row_bounds(info.shape, torch.float64.itemsize)
    delta, nan_apart = 0.0, False
    for x, y in zip(left.slabs(fqn, bounds), right.slabs(fqn, bounds)):
        x, y = x.double(), y.double()
        nan_x, nan_y = x.isnan(), y.isnan()
        if x.numel():  # 0 where either is NaN or both are equal (Inf too); a mask's indexing took 3x as long
            delta = max(delta, torch.where(nan_x | nan_y | (x == y), 0.0, x - y).abs().max().item())
        nan_apart = nan_apart or bool((nan_x != nan_y).any())
    return delta, nan_apart
