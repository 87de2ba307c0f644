"""A fingerprint of a checkpoint's weights that costs a few reads: what tells two models apart.

A fine-tuning run records its pretrained source's fingerprint in every ``step-N``, and a resume
compares it with its own source's, so a folder is never resumed by a fine-tune of another model.
Two models of one architecture (a base model and its instruct tune, two random inits) have the same
``config.json`` byte for byte, so the config cannot be the identity; hashing every byte of a
16 GB directory at each start would take tens of seconds. Instead:

* a checkpoint of ours hashes the model it records and its manifest's checksums (the CRC32C of
  every piece of every item and of ``.metadata``, and each file's length): every byte is covered,
  and nothing is read but the manifest;
* anything else (a Hugging Face directory, a foreign DCP checkpoint, one file) hashes its
  ``config.json`` and, for each data file, its name, its length, its first ``HEAD_BYTES`` (a
  safetensors header: tensor names, dtypes, offsets) and ``WINDOWS`` windows of ``WINDOW_BYTES``
  spread evenly over the file: at most 128 KiB read per file, whatever its size. Different weights
  differ in every window of tensor data; two sources that differ only in a few small tensors can
  go unnoticed.

Only the bytes count, not the path or the times: a copy or a moved directory is the same source.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from seedckpt.checkpoint.integrity import CHECKSUMS_KEY
from seedckpt.checkpoint.manifest import read_manifest
from seedckpt.checkpoint.untrusted import MAX_JSON_BYTES, read_bounded

HEAD_BYTES = 64 << 10  # a safetensors header of a few thousand tensors fits
WINDOWS = 16
WINDOW_BYTES = 4 << 10
DATA_SUFFIXES = (".safetensors", ".distcp", ".bin", ".pt", ".pth")


def weights_fingerprint(path: str | Path) -> str | None:
    """The fingerprint of the checkpoint at ``path`` (hex); None when it holds no weights to read."""
    path = Path(path)
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest is not None and isinstance(manifest.get(CHECKSUMS_KEY), dict):
        recorded = {"model": manifest.get("model"), CHECKSUMS_KEY: manifest[CHECKSUMS_KEY]}
        return _digest([json.dumps(recorded, sort_keys=True).encode()])
    files = data_files(path)
    if not files:
        return None
    config = path / "config.json"
    parts = [read_bounded(config, MAX_JSON_BYTES) if config.is_file() else b""]
    return _digest(parts + [sampled_bytes(file) for file in files])


def data_files(path: Path) -> list[Path]:
    """The files that hold ``path``'s weights, in name order: ``path`` itself if it is a file."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(f for f in path.iterdir() if f.is_file() and (f.suffix in DATA_SUFFIXES or f.name == ".metadata"))


def sampled_bytes(file: Path) -> bytes:
    """``file``'s name and length, its head and ``WINDOWS`` windows at offsets fixed by its length."""
    size = file.stat().st_size
    parts = [file.name.encode(), size.to_bytes(8, "little")]
    with file.open("rb") as f:
        parts.append(f.read(HEAD_BYTES))
        for offset in window_offsets(size):
            f.seek(offset)
            parts.append(f.read(WINDOW_BYTES))
    return b"".join(parts)


def window_offsets(size: int) -> list[int]:
    """Where the windows of a ``size``-byte file start: evenly from just after the head to the end
    (none for a file the head already covers)."""
    if size <= HEAD_BYTES:
        return []
    span = max(size - HEAD_BYTES - WINDOW_BYTES, 0)
    return sorted({HEAD_BYTES + span * i // (WINDOWS - 1) for i in range(WINDOWS)})


def _digest(parts: list[bytes]) -> str:
    """Each part hashed with its length, so no two lists of parts run together alike."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]
