"""Token files: a corpus tokenized once (``seedckpt tokenize``), read by training one window at a time.

A token directory holds ``tokens.bin`` -- every document's token ids followed by the tokenizer's
eos, little-endian ``uint32``, one document after another -- and ``tokens.json``: the tokenizer
(its directory and the SHA-256 of its ``tokenizer.json``), its vocabulary size, the token and
document counts, the sources, and the CRC32C of ``tokens.bin`` in 64 MiB pieces (``seedckpt
tokenize --verify`` checks them).

Training (``data.kind = "tokens"``) reads each window of ``seq_len + 1`` tokens with one ``pread``
at an offset drawn from (seed, step), the way ``text`` draws its windows: a rank holds its batch
and nothing else, whatever the corpus size. Nothing is memory-mapped: a map reserves address space
for the whole file, which a process under ``ulimit -v`` may not have.

Tokenizing runs on a pool of processes (each with its own tokenizer), over blocks of documents
taken in order; the parent writes their ids in that order, so the file is the same for any number
of workers. It is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from seedckpt.checkpoint.atomic import destination_lock
from seedckpt.checkpoint.integrity import PieceHasher, crc
from seedckpt.checkpoint.untrusted import read_json
from seedckpt.data.sources import TEXT_SUFFIXES, Batch, _step_generator, data_files, documents
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.progress import Progress

TOKENS_FILE, MANIFEST_FILE = "tokens.bin", "tokens.json"
TOKEN_DTYPE = np.dtype("<u4")
CHECK_PIECE_BYTES = 64 << 20
BLOCK_CHARS = 1 << 20  # documents are handed to the workers in blocks of about this many characters
FORMAT = "seedckpt-tokens-1"


def tokenize_corpus(
    sources: str, tokenizer_dir: str, output: str | Path, workers: int | None = None, progress: bool = True
) -> Path:
    """Tokenize ``sources`` (``data.path``'s syntax: files, comma-separated, or a directory of
    ``*.jsonl`` / ``*.jsonl.gz`` / ``*.parquet``; a plain text file is one document) into the token
    directory ``output``."""
    from seedckpt.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.eos_token_id is None:
        raise SeedckptError(f"the tokenizer in {tokenizer_dir} has no eos token to separate documents")
    files = data_files(sources, TEXT_SUFFIXES)
    meta = {
        "tokenizer": str(Path(tokenizer_dir).resolve()),
        "tokenizer_sha256": _sha256(Path(tokenizer_dir) / "tokenizer.json"),
        "eos_token_id": tokenizer.eos_token_id,
        "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
    }
    meter = Progress(sum(f.stat().st_size for f in files), f"tokenize {len(files)} file(s)", enabled=progress)
    context = multiprocessing.get_context("spawn")
    try:
        with context.Pool(workers or len(os.sched_getaffinity(0)), _start_worker, (tokenizer_dir,)) as pool:
            blocks = pool.imap(_tokenize_block, _blocks(files))
            return write_token_directory(output, blocks, len(tokenizer), meta, meter.update)
    finally:
        meter.close()


def write_token_directory(output: str | Path, blocks, vocab_size: int, meta: dict | None = None, done=None) -> Path:
    """Write the token directory ``output`` from ``blocks``: ``(uint32 ids, documents, source bytes
    consumed)`` in order. Under a temporary name, renamed when complete; an existing ``output`` is
    refused."""
    output = Path(output)
    if output.exists():
        raise SeedckptError(f"{output} exists; choose a new output directory (tokens are never overwritten)")
    with destination_lock(output):
        partial = output.parent / f".{output.name}.{os.getpid()}.partial"
        partial.mkdir(parents=True)
        try:
            counts = _write_tokens(partial / TOKENS_FILE, blocks, done or (lambda n: None))
            manifest = {"format": FORMAT, "vocab_size": vocab_size, **(meta or {}), **counts}
            (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
            os.rename(partial, output)
        except BaseException:
            for leftover in partial.iterdir():
                leftover.unlink()
            partial.rmdir()
            raise
    return output


def _write_tokens(path: Path, blocks, done) -> dict:
    hasher = PieceHasher(TOKENS_FILE, 0, CHECK_PIECE_BYTES)
    tokens = documents_written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for ids, docs, consumed in blocks:
            view = memoryview(np.ascontiguousarray(ids, dtype=TOKEN_DTYPE)).cast("B")
            hasher.update(view)
            written = 0
            while written < view.nbytes:
                written += os.write(fd, view[written:])
            tokens += view.nbytes // TOKEN_DTYPE.itemsize
            documents_written += docs
            done(consumed)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {
        "tokens": tokens,
        "documents": documents_written,
        "check_piece_bytes": CHECK_PIECE_BYTES,
        "crc32c": list(hasher.finish().crcs),
    }


def _blocks(files) -> Iterator[tuple[list[str], int]]:
    """``(texts, bytes of source consumed)`` in order: documents grouped up to ``BLOCK_CHARS``."""
    block, size = [], 0
    for file in files:
        for text in documents(file):
            block.append(text)
            size += len(text)
            if size >= BLOCK_CHARS:
                yield block, size
                block, size = [], 0
    if block:
        yield block, size


_TOKENIZER = None


def _start_worker(tokenizer_dir: str) -> None:
    global _TOKENIZER
    from seedckpt.data.tokenizer import load_tokenizer

    _TOKENIZER = load_tokenizer(tokenizer_dir)


def _tokenize_block(block: tuple[list[str], int]) -> tuple[np.ndarray, int, int]:
    texts, size = block
    encoded = _TOKENIZER(texts, add_special_tokens=False)["input_ids"]
    eos = _TOKENIZER.eos_token_id
    ids = np.fromiter((t for doc in encoded for t in (*doc, eos)), dtype=TOKEN_DTYPE)
    return ids, len(texts), size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_token_manifest(path: Path) -> dict:
    """``tokens.json`` of the token directory ``path``, checked against ``tokens.bin``'s size."""
    if not (path / MANIFEST_FILE).is_file():
        raise SeedckptError(
            f"data.path {path} is not a token directory (no {MANIFEST_FILE}); make one with "
            "`seedckpt tokenize --tokenizer DIR --output DIR FILES`"
        )
    manifest = read_json(path / MANIFEST_FILE, "token manifest")
    try:
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}")
        tokens, vocab = int(manifest["tokens"]), int(manifest["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise SeedckptError(f"{path / MANIFEST_FILE} is damaged ({e}); tokenize the corpus again") from None
    size = (path / TOKENS_FILE).stat().st_size if (path / TOKENS_FILE).is_file() else -1
    if size != tokens * TOKEN_DTYPE.itemsize:
        raise SeedckptError(
            f"{path / TOKENS_FILE} has {size:,} bytes but {MANIFEST_FILE} records {tokens:,} tokens "
            f"({tokens * TOKEN_DTYPE.itemsize:,} bytes): it was truncated or replaced; tokenize the corpus again"
        )
    return {**manifest, "tokens": tokens, "vocab_size": vocab}


def verify_tokens(path: Path) -> int:
    """Read all of ``tokens.bin`` and check it against the CRC32C pieces recorded; the tokens read."""
    manifest = read_token_manifest(path)
    piece, crcs = int(manifest["check_piece_bytes"]), manifest["crc32c"]
    with open(path / TOKENS_FILE, "rb") as f:
        for k, data in enumerate(iter(lambda: f.read(piece), b"")):
            if k >= len(crcs) or crc(data) != crcs[k]:
                raise SeedckptError(
                    f"{path / TOKENS_FILE} is corrupt: bytes {k * piece:,}..{k * piece + len(data):,} do not have "
                    "the CRC32C written with them; tokenize the corpus again"
                )
    return manifest["tokens"]


class TokenFileData:
    """Random windows of ``seq_len + 1`` tokens of a token directory, read with one ``pread`` each."""

    def __init__(self, path: str, vocab_size: int, seq_len: int, seed: int):
        if not path:
            raise SeedckptError("data.kind = 'tokens' needs data.path: a directory made by `seedckpt tokenize`")
        self.path = Path(path)
        manifest = read_token_manifest(self.path)
        if manifest["vocab_size"] > vocab_size:
            raise SeedckptError(
                f"{path} was tokenized with a vocabulary of {manifest['vocab_size']:,} tokens but the model's "
                f"vocab_size is {vocab_size:,}; raise model.vocab_size or tokenize with the model's tokenizer"
            )
        self.tokens, self.vocab_size, self.seq_len, self.seed = manifest["tokens"], vocab_size, seq_len, seed
        if self.tokens <= seq_len + 1:
            raise SeedckptError(f"{path} holds {self.tokens:,} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.fd = os.open(self.path / TOKENS_FILE, os.O_RDONLY)
        self.description = f"tokens {path} ({self.tokens:,} tokens, {manifest['documents']:,} documents)"

    def global_batch(self, step: int, batch_size: int) -> Batch:
        g = _step_generator(self.seed, step)
        starts = torch.randint(0, self.tokens - self.seq_len - 1, (batch_size,), generator=g).tolist()
        rows = np.empty((batch_size, self.seq_len + 1), TOKEN_DTYPE)
        for row, start in zip(rows, starts):
            view, at = memoryview(row).cast("B"), start * TOKEN_DTYPE.itemsize
            done = 0
            while done < view.nbytes:
                n = os.preadv(self.fd, [view[done:]], at + done)
                if n == 0:
                    raise SeedckptError(f"{self.path / TOKENS_FILE} was truncated while training; tokenize again")
                done += n
        batch = torch.from_numpy(rows.astype(np.int64))
        if int(batch.max()) >= self.vocab_size:
            raise SeedckptError(
                f"{self.path / TOKENS_FILE} holds token id {int(batch.max())}, beyond the model's vocab_size "
                f"{self.vocab_size}: the file is damaged (`seedckpt tokenize --verify {self.path}`)"
            )
        return Batch.from_rows(batch)
