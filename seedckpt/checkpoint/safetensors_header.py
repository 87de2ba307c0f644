"""Parsing an untrusted safetensors header: bounded, and checked against the file before use."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from seedckpt.utils.errors import SeedckptError

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 block-quantized weights (``formats.quantized``)
}
# The rest of the format's dtypes (safetensors 0.4+): named as such when a file holds them.
UNREAD_DTYPES = ("F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64", "U16", "U32", "U64")


def safetensors_header(path: Path) -> tuple[dict, dict, int]:
    """(tensor entries, ``__metadata__``, data start) of a safetensors file, checked before it is
    trusted: a bounded header, known dtypes, offsets that match shape x dtype and do not overlap,
    data all present."""

    def bad(why: str) -> SeedckptError:
        return SeedckptError(f"{path} is not a valid safetensors file ({why})")

    try:
        size_on_disk = path.stat().st_size
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= min(MAX_HEADER_BYTES, size_on_disk - 8):
                raise bad(f"header length {size} for a file of {size_on_disk} bytes")
            header = json.loads(f.read(size))
    except OSError as e:
        raise bad(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise bad(f"header is not JSON: {str(e)[:100]}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    for name, entry in header.items():
        kind = entry.get("dtype") if isinstance(entry, dict) else None
        if isinstance(kind, str) and kind not in SAFETENSORS_DTYPES:
            known = (
                "a safetensors dtype this version does not read" if kind in UNREAD_DTYPES else "not a safetensors dtype"
            )
            raise bad(f"entry {name!r} has dtype {kind}: {known} (it reads {', '.join(SAFETENSORS_DTYPES)})")
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape, (begin, end) = [int(d) for d in entry["shape"]], entry["data_offsets"]
            numel = 1
            for d in shape:
                numel *= d
            if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
                raise ValueError(f"offsets {begin}..{end} do not hold shape {shape} of {entry['dtype']}")
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"entry {name!r}: {e!r}") from None
    # Entries sharing bytes would read as one tensor under two names (the safetensors library
    # refuses them too); empty tensors take no bytes and cannot overlap.
    spans = sorted(
        (e["data_offsets"][0], e["data_offsets"][1], n)
        for n, e in header.items()
        if e["data_offsets"][1] > e["data_offsets"][0]
    )
    for (_, first_end, first), (second_begin, _, second) in zip(spans, spans[1:]):
        if second_begin < first_end:
            raise bad(f"entries {first!r} and {second!r} overlap at byte {second_begin} of the data")
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if size_on_disk < 8 + size + end:
        raise SeedckptError(f"{path} is truncated: {size_on_disk} bytes, its header needs {8 + size + end}")
    return header, metadata, 8 + size
