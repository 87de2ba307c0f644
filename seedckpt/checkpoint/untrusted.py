"""Reading small files that come from other people and tools: bounded before they are read.

A checkpoint's JSON and pickle metadata (``seedckpt.json``, ``config.json``, the safetensors index,
DCP's ``.metadata``) are read whole into memory, so their size is checked first, and parsing
failures of every kind -- deep nesting included -- become one ``SeedckptError`` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from seedckpt.utils.errors import SeedckptError

MAX_METADATA_BYTES = 2**30  # a 405B checkpoint's .metadata is tens of MB
MAX_JSON_BYTES = 256 * 2**20  # a 405B seed's seedckpt.json, checksums included, is ~10 MB


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a metadata file, refusing one larger than ``limit`` before reading it."""
    size = path.stat().st_size
    if size > limit:
        raise SeedckptError(
            f"{path} is {size:,} bytes, more than the {limit:,} a checkpoint's metadata may take; "
            "it is damaged or crafted"
        )
    return path.read_bytes()


def parse_json(text: str | bytes, where, what: str = "JSON"):
    """``json.loads`` with every failure (bad syntax, bad encoding, nesting too deep) as one error."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise SeedckptError(f"{where}: {what} is not valid JSON ({str(e)[:100]})") from None


def read_json(path: Path, what: str = "JSON"):
    """A JSON file of bounded size, parsed; a ``SeedckptError`` naming ``path`` for anything else."""
    try:
        data = read_bounded(path, MAX_JSON_BYTES)
    except OSError as e:
        raise SeedckptError(f"{path} cannot be read ({e.strerror or e})") from None
    return parse_json(data, path, what)
