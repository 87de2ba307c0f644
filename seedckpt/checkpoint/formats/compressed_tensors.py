"""4-bit integer weights in compressed-tensors' ``pack-quantized`` format, read dequantized to float32
(Kimi-K2-Thinking's routed experts; ``quant_method: "compressed-tensors"``).

A quantized ``X.weight`` ``[R, C]`` is stored as three tensors:

* ``X.weight_packed``, int32 ``[R, C / 8]``: eight 4-bit values a word, value ``i`` of a word in its
  bits ``4i .. 4i + 3`` (the first value in the lowest bits), each stored as ``q + 8`` for the
  signed integer ``q`` in ``[-8, 7]`` (compressed-tensors' ``pack_to_int32``);
* ``X.weight_scale`` ``[R, C / G]`` (bfloat16 in the release; float16 or float32 read too): one
  scale per group of ``G`` consecutive values of a row (``group_size``, 32 in the release);
* ``X.weight_shape``, ``[2]`` integers: ``[R, C]``.

Element ``(r, c)`` is ``q[r, c] * scale[r, c // G]``: symmetric, no zero point. In float32 that
product is exact (a 4-bit integer times a bfloat16 scale), so the reader and the definition agree
bitwise. On a little-endian machine (x86-64 and ARM, torch's wheels) a word's bytes hold its values
in order, two a byte, the first in the low nibble, so the values are read a byte at a time rather than
shifted out of each word eight times: one Kimi K2 expert weight (2048 x 7168) in 23-47 ms against
40-80 ms (1.7x; one core of a busy 2-core machine, best and median of 5 interleaved runs).

What is quantized is decided by the tensors present, as for the other quantized formats; the
``quantization_config`` must describe them: ``pack-quantized``, every config group's weights
4-bit symmetric integers in groups of one size (the size the scales' shape implies), and no stored
packed weight among the modules its ``ignore`` list names. Refused in one line, naming the tensor or
field: a packed weight without its scale or shape beside it, a zero point or a column permutation
(``weight_zero_point``, ``weight_g_idx``: asymmetric or act-order schemes, not read here), shapes
that do not fit each other, a ``weight_shape`` other than the packed words' (a padded row is not
read), a scale that is not a finite number > 0 (zero would read its group as zeros, a negative one
flip its signs).

Each rank reads only the rows under its own: a layer's experts are one stored tensor each, so an
expert-parallel rank reads its experts' words and scales and no other's (``hf``). A load holds the
words and scales it asked for until the read ends -- half a byte a value and a scale per group,
beside the destination's four bytes -- and unpacks at most ``quantized.CHUNK_VALUES`` values at a time.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from seedckpt.checkpoint.formats import quantized
from seedckpt.checkpoint.formats.quantized import Quantized, Stored, quantization_settings, refuse_impossible_scales
from seedckpt.checkpoint.load import RowWindow
from seedckpt.checkpoint.manifest import dtype_name
from seedckpt.utils.errors import SeedckptError

METHOD, FORMAT = "compressed-tensors", "pack-quantized"
PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"  # X.weight_packed, X.weight_scale, X.weight_shape
UNREAD = ("_zero_point", "_g_idx")  # asymmetric and act-order schemes' tensors
BITS = 4
PER_WORD = 32 // BITS  # values a 32-bit word packs
OFFSET = 1 << (BITS - 1)  # q is stored as q + 8
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHAPE_DTYPES = (torch.int32, torch.int64)


class PackedInt4(Quantized):
    """``X.weight_packed`` (int32 ``[R, C / 8]``) times ``X.weight_scale`` (``[R, C / group]``), with
    ``X.weight_shape`` beside them: ``X.weight`` is ``[R, C]``."""

    def __init__(self, name: str, values: Stored, scales: Stored, shape_part: Stored, group: int):
        rows, words = values.info.shape
        super().__init__(name, values, scales, (rows, words * PER_WORD))
        self.shape_part, self.group = shape_part, group

    @property
    def parts(self) -> tuple[Stored, ...]:
        return self.values, self.scales, self.shape_part

    def windows(self, start: int, stop: int) -> dict:
        """The rows' words and scales, and ``weight_shape`` (16 bytes at most), checked when read."""
        return {
            **super().windows(start, stop),
            self.shape_part.name: RowWindow(torch.empty(2, dtype=self.shape_part.info.dtype), 0),
        }

    def dequantize_into(self, stored: dict[str, torch.Tensor], dest: torch.Tensor, start: int) -> None:
        self.check_shape(stored[self.shape_part.name])
        words, scales = stored[self.values.name], stored[self.scales.name]
        self.check_scales(scales, start)
        rows, cols = dest.shape
        step = max(1, quantized.CHUNK_VALUES // max(1, cols))
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            pairs = words[lo:hi].view(torch.uint8)  # [n, C / 2]: value 2j in byte j's low nibble
            codes = torch.stack((pairs & 0xF, pairs >> BITS), dim=-1).view(hi - lo, -1, self.group)
            values = codes.float().sub_(OFFSET).mul_(scales[lo:hi].float().unsqueeze(-1))
            dest[lo:hi].copy_(values.view(hi - lo, cols))

    def check_shape(self, shape: torch.Tensor) -> None:
        """``weight_shape`` must be the packed words' ``[R, 8 x words]``: a row that compressed-tensors
        padded to whole words, or a file that says another shape, is refused."""
        said = [int(v) for v in shape.tolist()]
        if said != list(self.info.shape):
            raise SeedckptError(
                f"{self.shape_part.file}: {self.shape_part.name} = {said}, but {self.values.name} "
                f"{list(self.values.info.shape)} packs {list(self.info.shape)} values ({PER_WORD} a word); seedckpt "
                "reads rows of whole words only -- the checkpoint is damaged or padded"
            )

    def check_scales(self, scales: torch.Tensor, first: int) -> None:
        """Every scale (rows from ``first`` on) is a finite number > 0 (a group's largest magnitude
        over the integers' range, which a quantizer keeps positive); the first other one is named."""
        rule = f"each group of {self.group} values has a finite scale > 0"
        refuse_impossible_scales(self.scales, scales, first, rule, "group")


def packed_tensors(stored: dict[str, Stored], config: dict, where: Path) -> dict[str, PackedInt4]:
    """The pack-quantized tensors among ``stored`` (a directory's tensors by name), by the name each
    stands for (``X.weight``), checked against each other and ``config`` (``config.json``)."""
    bases = [name.removesuffix(PACKED) for name in stored if name.endswith(PACKED)]
    if not bases:
        _refuse_orphans(stored)
        return {}
    group = _group_size(config, where, stored[bases[0] + PACKED])
    ignored = _ignored(config, where)
    found = {}
    for base in bases:
        module = base.rpartition(".")[0]
        if ignored(module):
            raise SeedckptError(
                f"{stored[base + PACKED].file}: {base + PACKED} is stored quantized, but {where}/config.json's "
                f"quantization_config.ignore names {module} as unquantized -- the config is not this checkpoint's"
            )
        found[base] = _packed(stored, base, group)
    return found


def _packed(stored: dict[str, Stored], base: str, group: int) -> PackedInt4:
    """``base``'s words, scales and shape, checked against each other."""
    words = stored[base + PACKED]
    lacking = [base + s for s in (SCALE, SHAPE) if base + s not in stored]
    if lacking:
        raise SeedckptError(
            f"{words.file}: {words.name} has no {lacking[0]} beside it in the checkpoint; pack-quantized weights "
            "need their scales and shape -- restore the file that holds it"
        )
    unread = [base + s for s in UNREAD if base + s in stored]
    if unread:
        raise SeedckptError(
            f"{words.file}: {words.name} has {unread[0]} beside it (an asymmetric or act-order scheme); seedckpt "
            "reads symmetric pack-quantized weights only"
        )
    scales, shape = stored[base + SCALE], stored[base + SHAPE]
    w, s, n = words.info, scales.info, shape.info
    cols = w.shape[-1] * PER_WORD if len(w.shape) == 2 else 0
    if w.dtype != torch.int32 or len(w.shape) != 2 or cols % group or s.shape != (w.shape[0], cols // group):
        raise SeedckptError(
            f"{words.file}: {words.name} is {dtype_name(w.dtype)} {list(w.shape)} and {scales.name} "
            f"{dtype_name(s.dtype)} {list(s.shape)}; pack-quantized weights are int32 [rows, columns / {PER_WORD}] "
            f"with scales [rows, columns / {group}] (group_size {group}) -- the checkpoint is damaged"
        )
    if s.dtype not in SCALE_DTYPES or n.dtype not in SHAPE_DTYPES or n.shape != (2,):
        raise SeedckptError(
            f"{scales.file}: {scales.name} is {dtype_name(s.dtype)} and {shape.name} {dtype_name(n.dtype)} "
            f"{list(n.shape)}; pack-quantized scales are floats and a weight's shape two integers -- the checkpoint "
            "is damaged"
        )
    return PackedInt4(base, words, scales, shape, group)


def _refuse_orphans(stored: dict[str, Stored]) -> None:
    """A ``weight_shape`` with no packed weight: the file holding the weight is missing."""
    for name, part in stored.items():
        if name.endswith(".weight" + SHAPE):
            raise SeedckptError(
                f"{part.file}: {name} has no {name.removesuffix(SHAPE)}{PACKED} beside it in the checkpoint; "
                "restore the file that holds it"
            )


def _group_size(config: dict, where: Path, example: Stored) -> int:
    """The one group size every config group's 4-bit symmetric integer weights use."""
    settings = quantization_settings(config, where, METHOD, f"its files store {example.name}, pack-quantized weights")
    groups = settings.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise SeedckptError(f"{where}/config.json's quantization_config has no config_groups object; restore it")
    sizes = {_weights(settings, key, group, where) for key, group in groups.items()}
    if len(sizes) > 1:
        raise SeedckptError(
            f"{where}/config.json's quantization_config groups weights in sizes {sorted(sizes)}; seedckpt reads "
            "pack-quantized checkpoints of one group size"
        )
    return sizes.pop()


# a config group's weight settings seedckpt computes, by field
WEIGHTS = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group"}


def _weights(settings: dict, key: str, group, where: Path) -> int:
    """One config group's weights checked (``WEIGHTS``, the format): their group size."""
    field = f"{where}/config.json has quantization_config.config_groups.{key}"
    if not isinstance(group, dict):
        raise SeedckptError(f"{field} = {group!r}; it must be an object (targets, weights)")
    fmt = group.get("format")
    if (fmt or settings.get("format")) != FORMAT:
        raise SeedckptError(
            f"{field} in format {fmt or settings.get('format')!r}; seedckpt reads compressed-tensors' {FORMAT!r}"
        )
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise SeedckptError(f"{field}.weights = {weights!r}; it must be the weights' quantization object")
    for name, value in WEIGHTS.items():
        if weights.get(name) != value:
            raise SeedckptError(f"{field}.weights.{name} = {weights.get(name)!r}; seedckpt reads {value!r} only")
    size = weights.get("group_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SeedckptError(f"{field}.weights.group_size = {size!r}; it must be an integer >= 1")
    return size


def _ignored(config: dict, where: Path):
    """``module name -> bool``: whether ``quantization_config.ignore`` names it (a name, or ``re:`` and a
    pattern matched from the name's start, as compressed-tensors matches them)."""
    entries = config["quantization_config"].get("ignore") or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise SeedckptError(f"{where}/config.json has quantization_config.ignore = {entries!r}; it must list names")
    try:
        patterns = [re.compile(e[3:]) for e in entries if e.startswith("re:")]
    except re.error as e:
        raise SeedckptError(f"{where}/config.json's quantization_config.ignore holds a bad pattern ({e})") from None
    names = {e for e in entries if not e.startswith("re:")}
    return lambda module: module in names or any(p.match(module) for p in patterns)
