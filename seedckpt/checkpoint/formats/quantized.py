"""Quantized Hugging Face tensors, read dequantized to float32: FP8 blocks and MXFP4.

Two formats of released checkpoints, told apart by the tensors a directory stores:

* **FP8 blocks** (DeepSeek-V3's hub weights; ``quant_method: "fp8"``, ``weight_block_size: [128,
  128]``): ``X.weight`` in float8 e4m3 with ``X.weight_scale_inv`` (float32) beside it, one scale per
  128 x 128 block: element (r, c) is ``fp8[r, c] * scale_inv[r // 128, c // 128]``. A side that is not
  a multiple of 128 ends in a partial block with a scale of its own (576 x 7168 has a 5 x 56 grid).
* **MXFP4** (gpt-oss's experts; ``quant_method: "mxfp4"``): ``X_blocks`` (uint8 ``[E, R, G, 16]``,
  two 4-bit e2m1 values a byte, the low nibble first; e2m1 is a sign bit, two exponent bits and a
  mantissa bit: +-0, 0.5, 1, 1.5, 2, 3, 4, 6) and ``X_scales`` (uint8 ``[E, R, G]``, e8m0
  exponents: each group of 32 values is multiplied by ``2 ** (s - 127)``). Dequantized, a row is
  ``[E, R, G * 32]``; the tensor ``X`` is that with its last two dimensions swapped, ``[E, G * 32,
  R]``: the layout the unquantized model stores under ``X`` (gpt-oss's ``gate_up_proj`` is ``[E, D,
  2F]``), which is what ``transformers`` makes of the same bytes.

What is quantized is decided by the tensors present (a weight with its scales beside it), not by
``quantization_config``'s lists of modules; the config must name the method and block size those
tensors use, and the scales must fit the weight they scale. A scale no quantizer writes is refused
when read, naming it: an FP8 ``scale_inv`` that is not a finite number > 0 (a zero would read its
block as zeros, a negative one flip its signs), MXFP4's byte 255 (e8m0's NaN). The reader then presents ``X`` under
its plain name, as a float32 tensor, so a model family maps it as it maps an unquantized one.

Each rank reads only the stored rows under its own: the FP8 rows of its rows and the rows of
scales covering them (a block row straddling two ranks is read by both); for MXFP4, its experts'
blocks and scales. A load holds the stored rows it asked for until the read ends (a byte a value
for FP8, half a byte for MXFP4, beside the destination's four). A whole-tensor read (``verify``,
``convert``, ``diff``) goes ``SLAB_BYTES`` of rows at a time, reading each slab's stored rows alone:
each holds a slab or two, never the tensor dequantized. Writing these formats is not supported: a converted
checkpoint is dequantized.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from seedckpt.checkpoint.formats.safetensors_file import read_safetensor_rows
from seedckpt.checkpoint.load import RowWindow, row_bounds
from seedckpt.checkpoint.manifest import TensorInfo, dtype_name
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import copy_full_into, local, local_rows

FP8_BLOCK = 128  # rows and columns of one scale's block: the block size DeepSeek-V3 releases
FP8_SCALE = "_scale_inv"  # X.weight's scales are X.weight_scale_inv
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16)  # both widen to float32 exactly
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
MX_BYTES = 16  # one scale's group: 16 bytes of two 4-bit values, 32 values
# Values dequantized at a time: few enough for the temporaries to stay small, many enough that each
# parallel op is long (a loop of 128-row steps spent most of its time in thread hand-offs here, 2 busy cores)
CHUNK_VALUES = 2**22
E8M0_BIAS = 127
E8M0_NAN = 255  # the one e8m0 byte that is no power of two


@dataclass(frozen=True)
class Stored:
    """One stored tensor: the file holding it, its name there, its shape and dtype."""

    file: Path
    name: str
    info: TensorInfo


class Quantized:
    """A tensor stored as quantized ``values`` and their ``scales``: ``name`` and ``info`` (float32)
    are the tensor it stands for; dim 0 of it is dim 0 of both stored tensors' row blocks."""

    def __init__(self, name: str, values: Stored, scales: Stored, shape: tuple[int, ...]):
        self.name, self.values, self.scales = name, values, scales
        self.info = TensorInfo(shape, torch.float32)

    @property
    def parts(self) -> tuple[Stored, Stored]:
        return self.values, self.scales

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        """The rows of ``scales`` that rows ``[start, stop)`` of the tensor need."""
        return start, stop

    def windows(self, start: int, stop: int) -> dict[str, RowWindow]:
        """The stored rows that rows ``[start, stop)`` of the tensor are made of, as load requests."""
        lo, hi = self.scale_rows(start, stop)
        return {
            self.values.name: _window(self.values.info, start, stop),
            self.scales.name: _window(self.scales.info, lo, hi),
        }

    def dequantize_into(self, stored: dict[str, torch.Tensor], dest: torch.Tensor, start: int) -> None:
        """Rows ``[start, start + len(dest))`` of the tensor into ``dest`` (any float dtype), from the
        stored rows ``windows`` asked for (``{name: rows}``)."""
        raise NotImplementedError

    def read(self) -> torch.Tensor:
        """The whole tensor in float32, read by this process alone (conversion): the stored rows of
        one slab at a time, so beside the output only a slab's stored bytes are held."""
        out = torch.empty(self.info.shape, dtype=torch.float32)
        for start, stop in self.slab_bounds():
            self.read_rows_into(out[start:stop], start)
        return out

    def slabs(self) -> Iterator[torch.Tensor]:
        """The whole tensor in float32, ``SLAB_BYTES`` of rows at a time (one row at least: a whole
        MXFP4 expert), each read from its stored rows alone into one buffer, which the next slab
        overwrites: a command that only looks at the values (``verify``) holds one slab, not the tensor."""
        bounds = self.slab_bounds()
        buffer = torch.empty((bounds[0][1], *self.info.shape[1:]) if bounds else 0, dtype=torch.float32)
        for start, stop in bounds:
            self.read_rows_into(buffer[: stop - start], start)
            yield buffer[: stop - start]

    def slab_bounds(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of each slab of dim-0 rows: ``SLAB_BYTES`` of float32, one row at least --
        ``row_bounds``' cut, read as it is called, so the memory estimates count these very slabs."""
        return row_bounds(self.info.shape, self.info.dtype.itemsize)

    def read_rows_into(self, dest: torch.Tensor, start: int) -> None:
        """Rows ``[start, start + len(dest))`` of the tensor into ``dest``, read from the files."""
        windows = self.windows(start, start + dest.shape[0])
        parts = {part.name: part for part in self.parts}
        stored = {name: _read_rows(parts[name], w.start, len(w.dest)) for name, w in windows.items()}
        self.dequantize_into(stored, dest, start)


def refuse_impossible_scales(part: Stored, scales: torch.Tensor, first: int, rule: str, unit: str) -> None:
    """Refuse the first of ``scales`` (rows ``first`` on of ``part``, 2-D) that is not a finite number
    > 0, naming it, the ``rule`` it breaks and what it would do to its ``unit`` of values."""
    wide = scales.float()
    impossible = ~((wide > 0) & (wide < math.inf))  # NaN fails both
    if bool(impossible.any()):
        row, col = (int(i) for i in impossible.nonzero()[0])
        raise SeedckptError(
            f"{part.file}: {part.name}[{first + row}, {col}] = {wide[row, col].item()}, an impossible scale: {rule} "
            f"(0 would zero the {unit}, a negative one flip its signs) -- the checkpoint is damaged"
        )


def _read_rows(part: Stored, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` (dim 0) of the stored tensor ``part``, their bytes alone."""
    return read_safetensor_rows(part.file, part.name, part.info, start, count)


def _window(info: TensorInfo, start: int, stop: int) -> RowWindow:
    return RowWindow(torch.empty((stop - start, *info.shape[1:]), dtype=info.dtype), start)


class BlockFP8(Quantized):
    """``X.weight`` (float8 e4m3, ``[R, C]``) times ``X.weight_scale_inv`` per 128 x 128 block."""

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start // FP8_BLOCK, -(-stop // FP8_BLOCK)

    def dequantize_into(self, stored: dict[str, torch.Tensor], dest: torch.Tensor, start: int) -> None:
        codes, scales = stored[self.values.name].view(torch.uint8), stored[self.scales.name]
        first = start // FP8_BLOCK
        self.check_scales(scales, first)
        # each scale row spread over its block's columns ([scale rows, C]: 1/128 of the values), times
        # the 2^8 that the float16 below is short of
        spread = scales.float().repeat_interleave(FP8_BLOCK, dim=1)[:, : codes.shape[1]] * 2.0**8
        step = max(1, CHUNK_VALUES // max(1, codes.shape[1]))
        for lo in range(0, dest.shape[0], step):
            hi = min(dest.shape[0], lo + step)
            # e4m3's sign, exponent and mantissa bits moved into float16's: the same value times 2^-8,
            # subnormals included -- 3-4x faster here than torch's float8 -> float32 cast, and exact.
            # Sign-extended and shifted by 7, the sign lands in bit 15 and again in bit 14, the top of
            # float16's exponent, which is cleared (0xBF80 as an int16).
            x = codes[lo:hi].view(torch.int8).to(torch.int16)
            half = ((x << 7) & -0x4080).view(torch.float16)
            row_scales = spread.index_select(0, torch.arange(start + lo, start + hi) // FP8_BLOCK - first)
            torch.mul(half, row_scales, out=dest[lo:hi])
        # e4m3's NaN codes (0x7F, 0xFF), which float16's bits would make 480
        if codes.numel() and int((codes & 0x7F).max()) == 0x7F:
            dest[(codes & 0x7F) == 0x7F] = float("nan")

    def check_scales(self, scales: torch.Tensor, first: int) -> None:
        """Every scale (rows from ``first`` on) is a finite number > 0: the block's largest magnitude /
        448, which a quantizer keeps positive even for an all-zero block (``transformers``' writes 1
        there). A zero would read the block as zeros, a negative one flip its signs, NaN or Inf make
        every value of it non-finite -- whatever the values say; the first such scale is named."""
        rule = f"each {FP8_BLOCK} x {FP8_BLOCK} block's scale_inv is a finite number > 0"
        refuse_impossible_scales(self.scales, scales, first, rule, "block")


class MXFP4(Quantized):
    """``X_blocks`` (``[E, R, G, 16]``, e2m1 pairs) scaled by ``X_scales`` (``[E, R, G]``, e8m0):
    ``X`` is ``[E, G * 32, R]``."""

    def dequantize_into(self, stored: dict[str, torch.Tensor], dest: torch.Tensor, start: int) -> None:
        blocks, scales = stored[self.values.name], stored[self.scales.name]
        self.check_scales(scales, start)
        # 2 ** (s - 127) for every byte s; exact in float32 (2 ** -127 is a subnormal, 2 ** 128 is inf)
        powers = torch.ldexp(torch.ones(256), torch.arange(256) - E8M0_BIAS)
        rows, step = blocks.shape[1], max(1, CHUNK_VALUES // (blocks.shape[2] * 2 * MX_BYTES))
        for e in range(dest.shape[0]):
            for r in range(0, rows, step):
                part = blocks[e, r : r + step].to(torch.int16)
                # e2m1's sign, exponent and mantissa bits moved into float16's: the value times 2^-14,
                # 0.5 (e2m1's one subnormal) included -- twice as fast here as looking each code up.
                # A nibble shifted to the top and arithmetically back by 3 puts its sign in bit 15 (and
                # copies in 14..12, cleared by 0x8E00 as an int16), exponent and mantissa in 11..9.
                bits = torch.empty((*part.shape[:-1], 2 * MX_BYTES), dtype=torch.int16)
                bits[..., 0::2] = ((part << 12) >> 3) & -0x7200  # the low nibble is the first value
                bits[..., 1::2] = ((part << 8) >> 3) & -0x7200
                half = bits.view(torch.float16)
                values = half.float().mul_(2.0**14).mul_(powers[scales[e, r : r + step].int()].unsqueeze(-1))
                dest[e, :, r : r + step].copy_(values.flatten(-2).T)

    def check_scales(self, scales: torch.Tensor, first: int) -> None:
        """No scale is e8m0's NaN, the byte 255 (the OCP MX format's; ``2 ** 128`` is no float32 either):
        the first one is named. Bytes 253 and 254 are scales (``2 ** 126``, ``2 ** 127``), though a
        value of 4 or 6 times them overflows float32: that is a value, which ``convert`` and ``verify``
        name as one that is not finite."""
        if scales.numel() and int(scales.max()) == E8M0_NAN:
            expert, row, group = (int(i) for i in (scales == E8M0_NAN).nonzero()[0])
            raise SeedckptError(
                f"{self.scales.file}: {self.scales.name}[{first + expert}, {row}, {group}] = {E8M0_NAN}, e8m0's NaN: "
                "not a scale, so that group of 32 values has none -- the checkpoint is damaged"
            )


def quantized_tensors(stored: dict[str, Stored], config: dict, where: Path) -> dict[str, Quantized]:
    """The quantized tensors among ``stored`` (a directory's tensors by name), by the name each stands
    for, checked: the scales fit their values, and ``config`` (``config.json``) names their method.
    A float8 tensor without scales, or scales without values, is refused."""
    found = {}
    for name, part in stored.items():
        if name.endswith(FP8_SCALE):
            found[name.removesuffix(FP8_SCALE)] = _fp8(stored, name.removesuffix(FP8_SCALE), part)
        elif name.endswith(MX_SCALES) or name.endswith(MX_BLOCKS):
            base = name.removesuffix(MX_SCALES).removesuffix(MX_BLOCKS)
            if base not in found:
                found[base] = _mxfp4(stored, base)
    unscaled = [p for n, p in stored.items() if p.info.dtype == torch.float8_e4m3fn and n not in found]
    if unscaled:
        part = unscaled[0]
        raise SeedckptError(
            f"{part.file}: {part.name} is stored in float8 without its scales ({part.name}{FP8_SCALE}) beside "
            "it; the checkpoint is incomplete -- restore the file that holds them"
        )
    kinds = {type(q) for q in found.values()}
    for kind in kinds:
        _check_config(kind, next(q for q in found.values() if type(q) is kind), config, where)
    return found


def _fp8(stored: dict[str, Stored], name: str, scales: Stored) -> BlockFP8:
    """``name`` (float8 ``[R, C]``) and its ``scales``, checked against each other."""
    values = stored.get(name)
    if values is None:
        raise SeedckptError(f"{scales.file}: {scales.name} scales {name}, which no file of the checkpoint stores")
    shape = values.info.shape
    if values.info.dtype != torch.float8_e4m3fn or len(shape) != 2:
        raise SeedckptError(
            f"{values.file}: {name} is {dtype_name(values.info.dtype)} {list(shape)} beside {scales.name}; an FP8 "
            "block-quantized weight is a 2-D F8_E4M3 tensor -- the checkpoint is damaged"
        )
    grid = tuple(-(-side // FP8_BLOCK) for side in shape)
    if scales.info.dtype not in FP8_SCALE_DTYPES or scales.info.shape != grid:
        raise SeedckptError(
            f"{scales.file}: {scales.name} is {dtype_name(scales.info.dtype)} {list(scales.info.shape)}, but {name} "
            f"{list(shape)} in {FP8_BLOCK} x {FP8_BLOCK} blocks needs float32 scales {list(grid)}; the checkpoint "
            "is damaged"
        )
    return BlockFP8(name, values, scales, shape)


def _mxfp4(stored: dict[str, Stored], name: str) -> MXFP4:
    """``name``'s blocks and scales, checked against each other."""
    blocks, scales = stored.get(name + MX_BLOCKS), stored.get(name + MX_SCALES)
    if blocks is None or scales is None:
        there = blocks or scales
        raise SeedckptError(
            f"{there.file}: {there.name} has no {name + (MX_SCALES if scales is None else MX_BLOCKS)} beside it in "
            "the checkpoint; MXFP4 needs both -- restore the file that holds it"
        )
    b, s = blocks.info, scales.info
    if b.dtype != torch.uint8 or s.dtype != torch.uint8 or len(b.shape) != 4 or b.shape != (*s.shape, MX_BYTES):
        raise SeedckptError(
            f"{blocks.file}: {blocks.name} is {dtype_name(b.dtype)} {list(b.shape)} and {scales.name} "
            f"{dtype_name(s.dtype)} {list(s.shape)}; MXFP4 stores uint8 blocks [experts, rows, groups, {MX_BYTES}] "
            "and uint8 scales [experts, rows, groups] -- the checkpoint is damaged"
        )
    experts, rows, groups, _ = b.shape
    return MXFP4(name, blocks, scales, (experts, groups * 2 * MX_BYTES, rows))


def quantization_settings(config: dict, where: Path, method: str, stores: str) -> dict:
    """``config.json``'s ``quantization_config``, which must exist and name ``method``, the one the
    files use (``stores`` says what they store)."""
    settings = config.get("quantization_config")
    if not isinstance(settings, dict):
        raise SeedckptError(
            f"{where}/config.json has no quantization_config object, but {stores}: restore the release's "
            f'quantization_config (quant_method "{method}")'
        )
    if settings.get("quant_method") != method:
        raise SeedckptError(
            f"{where}/config.json has quantization_config.quant_method = {settings.get('quant_method')!r}, but "
            f"{stores} ({method!r}); seedckpt reads 'fp8' (128 x 128 blocks), 'mxfp4' and 'compressed-tensors' "
            "(pack-quantized)"
        )
    return settings


def _check_config(kind: type, example: Quantized, config: dict, where: Path) -> None:
    """``quantization_config`` must describe the tensors found: FP8 in 128 x 128 e4m3 blocks, or MXFP4."""
    method, what = ("fp8", "FP8 blocks") if kind is BlockFP8 else ("mxfp4", "MXFP4")
    settings = quantization_settings(config, where, method, f"its files store {example.scales.name}, {what}")
    if kind is not BlockFP8:
        return
    if settings.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
        raise SeedckptError(
            f"{where}/config.json has quantization_config.weight_block_size = "
            f"{settings.get('weight_block_size')!r}; seedckpt reads FP8 in [{FP8_BLOCK}, {FP8_BLOCK}] blocks only "
            "(DeepSeek-V3's)"
        )
    if settings.get("fmt", "e4m3") != "e4m3":
        raise SeedckptError(
            f"{where}/config.json has quantization_config.fmt = {settings['fmt']!r}; seedckpt reads FP8 e4m3 only"
        )


class DequantizedLoad:
    """A load's requests for quantized tensors, turned into requests for the stored rows under them
    (``requests``) and dequantized into their destinations once those are read (``finish``)."""

    def __init__(self, quantized: dict[str, Quantized]):
        self.quantized = quantized
        self.pending: list = []  # (tensor, stored rows by name, destination, first row, sharded target)

    def requests(self, by_name: dict) -> dict:
        """``by_name`` ({stored name: tensor, DTensor or ``RowWindow``}) with each quantized entry
        replaced by the rows of its values and scales that the destination's rows need. A DTensor
        whose shard is not a block of whole rows reads every row, and keeps its part in ``finish``."""
        out = {}
        for name, target in by_name.items():
            q = self.quantized.get(name)
            if q is None:
                out[name] = target
                continue
            sharded = None
            if isinstance(target, RowWindow):
                dest, start = target.dest, target.start
            elif isinstance(target, DTensor) and local_rows(target) is None:
                dest, start, sharded = torch.empty(target.shape, dtype=target.dtype), 0, target
            else:
                dest, start = local(target), (local_rows(target) or (0,))[0]
            if math.prod(dest.shape) == 0:
                continue
            windows = q.windows(start, start + dest.shape[0])
            out.update(windows)
            self.pending.append((q, {n: w.dest for n, w in windows.items()}, dest, start, sharded))
        return out

    def finish(self) -> None:
        with torch.no_grad():
            for q, stored, dest, start, sharded in self.pending:
                q.dequantize_into(stored, dest, start)
                if sharded is not None:
                    copy_full_into(sharded, dest)
