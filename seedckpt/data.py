"""Training data that is a pure function of (seed, step): the same global batch at step s for
every parallel layout, each data-parallel rank taking its slice, and nothing to restore on resume
but the step.

* ``synthetic``: each row repeats a random motif (length 4-16, from a 32-token alphabet). A model
  first learns the alphabet (loss falls from ln(vocab) to ~ln 32) and then to copy the motif
  (loss falls further towards 0) -- a learnable task that needs no files.
* ``text``: byte-level language modelling (token = byte, so vocab_size >= 256) on random windows
  of a local file, or, with no ``data.path``, of a built-in corpus made from the Python standard
  library's own source files (real text, present on every machine, no downloads).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch

from seedckpt.errors import SeedckptError

ALPHABET = 32
MOTIF_LENGTHS = (4, 16)
# Modules whose source makes up the built-in text corpus (~1 MB of Python and prose).
CORPUS_MODULES = ("argparse", "dataclasses", "difflib", "textwrap", "functools", "pathlib", "shutil",
                  "tempfile", "json.decoder", "json.encoder", "csv", "heapq", "bisect", "enum", "string")


def _step_generator(seed: int, step: int) -> torch.Generator:
    key = hashlib.sha256(f"seedckpt-data\0{seed}\0{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))


class SyntheticData:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < ALPHABET:
            raise SeedckptError(f"synthetic data needs vocab_size >= {ALPHABET}")
        self.seq_len, self.seed = seq_len, seed
        self.description = f"synthetic repeated motifs (alphabet {ALPHABET}, lengths {MOTIF_LENGTHS})"

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """``(batch_size, seq_len + 1)`` token ids; inputs are ``[:, :-1]``, labels ``[:, 1:]``."""
        g = _step_generator(self.seed, step)
        lo, hi = MOTIF_LENGTHS
        periods = torch.randint(lo, hi + 1, (batch_size, 1), generator=g)
        motifs = torch.randint(0, ALPHABET, (batch_size, hi), generator=g)
        positions = torch.arange(self.seq_len + 1).expand(batch_size, -1) % periods
        return motifs.gather(1, positions)


class TextData:
    def __init__(self, path: str, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < 256:
            raise SeedckptError(f"text data is byte-level and needs model.vocab_size >= 256 (got {vocab_size})")
        if path:
            if not Path(path).is_file():
                raise SeedckptError(f"data.path {path} is not a file; give a local text file or leave it "
                                    "empty for the built-in corpus")
            raw = Path(path).read_bytes()
            self.description = f"text {path} ({len(raw):,} bytes)"
        else:
            raw = builtin_corpus()
            self.description = f"built-in text corpus: Python stdlib sources ({len(raw):,} bytes)"
        if len(raw) <= seq_len + 1:
            raise SeedckptError(f"{self.description} is shorter than seq_len + 1 = {seq_len + 1} bytes")
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.seq_len, self.seed = seq_len, seed

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        g = _step_generator(self.seed, step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (batch_size, 1), generator=g)
        return self.tokens[starts + torch.arange(self.seq_len + 1)].long()


def builtin_corpus() -> bytes:
    parts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            parts.append(Path(spec.origin).read_bytes())
    return b"\n".join(parts)


def make_dataset(kind: str, path: str, vocab_size: int, seq_len: int, seed: int):
    if kind == "synthetic":
        return SyntheticData(vocab_size, seq_len, seed)
    if kind == "text":
        return TextData(path, vocab_size, seq_len, seed)
    raise SeedckptError(f"data.kind = {kind!r}; choose synthetic or text")
