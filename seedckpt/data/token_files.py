"""Token directories: the format of a corpus tokenized once (``seedckpt tokenize``), written, checked,
and read by training one window (or conversation) at a time.

A token directory holds ``tokens.bin`` -- every document's token ids followed by the tokenizer's
eos, little-endian ``uint32``, one document after another -- and ``tokens.json``: the tokenizer
(its directory and the SHA-256 of its ``tokenizer.json``), its vocabulary size, the token and
document counts, the sources, and the CRC32C of ``tokens.bin`` in 64 MiB pieces (``seedckpt
verify`` checks them).

A chat token directory (``seedckpt tokenize --chat``) holds conversations rendered with the
tokenizer's chat template, as ``data.kind = "chat"`` renders them: ``tokens.bin`` (no eos added:
the template ends its turns), ``mask.bin`` -- one byte per token, 1 where it is the assistant's and
carries a label -- and ``documents.bin``: per conversation its token count and the first position
from 1 on with a label, two little-endian ``uint32``. Training packs them as it packs chat, reading
each conversation's tokens and mask when a batch needs them: what a rank holds grows with the number
of conversations (the index and an epoch's packing order), not with their tokens.

Training (``data.kind = "tokens"``) reads each window of ``seq_len + 1`` tokens with one ``pread``
at an offset drawn from (seed, step), the way ``text`` draws its windows: a rank holds its batch
and nothing else, whatever the corpus size. Nothing is memory-mapped: a map reserves address space
for the whole file, which a process under ``ulimit -v`` may not have.

A directory is written (``write_token_directory``; ``seedckpt.data.tokenize`` makes one from a
corpus) under a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from seedckpt.checkpoint.atomic import destination_lock
from seedckpt.checkpoint.integrity import PieceHasher, crc
from seedckpt.checkpoint.untrusted import read_json
from seedckpt.data.chat import PackedSamples
from seedckpt.data.sources import IGNORE_INDEX, Batch, _step_generator
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.files import pread_into

TOKENS_FILE, MANIFEST_FILE, MASK_FILE, DOCUMENTS_FILE = "tokens.bin", "tokens.json", "mask.bin", "documents.bin"
TOKEN_DTYPE, MASK_DTYPE, DOCUMENT_DTYPE = np.dtype("<u4"), np.dtype("u1"), np.dtype("<u4")
# A chat directory's files, each with its dtype (as a string: the tokenize workers receive plain ones)
CHAT_LAYOUT = ((TOKENS_FILE, TOKEN_DTYPE.str), (MASK_FILE, MASK_DTYPE.str), (DOCUMENTS_FILE, DOCUMENT_DTYPE.str))
CHAT_FILES = tuple(name for name, _ in CHAT_LAYOUT)
CHECK_PIECE_BYTES = 64 << 20
MAX_CHECK_PIECE_BYTES = 1 << 30  # the largest piece a manifest may claim: verify reads one piece at a time
FORMAT = "seedckpt-tokens-1"


def write_token_directory(
    output: str | Path, blocks, vocab_size: int, meta: dict | None = None, done=None, names=(TOKENS_FILE,)
) -> Path:
    """Write the token directory ``output`` from ``blocks``: ``({file name: array}, documents, source
    bytes consumed)`` in order, an array for each of ``names`` (``tokens.bin`` first). Under a
    temporary name, renamed when complete; an existing ``output`` is refused."""
    output = Path(output)
    if output.exists():
        raise SeedckptError(f"{output} exists; choose a new output directory (tokens are never overwritten)")
    with destination_lock(output):
        partial = output.parent / f".{output.name}.{os.getpid()}.partial"
        partial.mkdir(parents=True)
        try:
            counts = _write_files(partial, names, blocks, done or (lambda n: None))
            manifest = {"format": FORMAT, "vocab_size": vocab_size, **(meta or {}), **counts}
            (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
            os.rename(partial, output)
        except BaseException:
            for leftover in partial.iterdir():
                leftover.unlink()
            partial.rmdir()
            raise
    return output


def _write_files(directory: Path, names, blocks, done) -> dict:
    """Append each block's arrays to their files, hashing them as they go; the manifest's counts
    and checksums (``tokens.bin``'s at the top, the others' under ``files``)."""
    hashers = {name: PieceHasher(name, 0, CHECK_PIECE_BYTES) for name in names}
    fds = {}
    count = 0
    try:
        for name in names:
            fds[name] = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        for arrays, docs, consumed in blocks:
            for name in names:
                view = memoryview(np.ascontiguousarray(arrays[name])).cast("B")
                hashers[name].update(view)
                written = 0
                while written < view.nbytes:
                    written += os.write(fds[name], view[written:])
            count += docs
            done(consumed)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    sizes = {name: hashers[name].pos for name in names}
    crcs = {name: list(hashers[name].finish().crcs) for name in names}
    return {
        "tokens": sizes[TOKENS_FILE] // TOKEN_DTYPE.itemsize,
        "documents": count,
        "check_piece_bytes": CHECK_PIECE_BYTES,
        "crc32c": crcs[TOKENS_FILE],
        **({"files": {n: {"bytes": sizes[n], "crc32c": crcs[n]} for n in names[1:]}} if len(names) > 1 else {}),
    }


def sha256(path: Path) -> str:
    """The SHA-256 of the file ``path``, in hex (how a directory records its tokenizer)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_token_manifest(path: Path) -> dict:
    """``tokens.json`` of the token directory ``path``, its fields checked and its files' sizes
    checked against the counts it records."""
    if not (path / MANIFEST_FILE).is_file():
        raise SeedckptError(
            f"data.path {path} is not a token directory (no {MANIFEST_FILE}); make one with "
            "`seedckpt tokenize FILES --tokenizer DIR --output DIR`"
        )
    manifest = read_json(path / MANIFEST_FILE, "token manifest")
    try:
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}")
        tokens, documents, vocab, piece = (
            _count(manifest, key) for key in ("tokens", "documents", "vocab_size", "check_piece_bytes")
        )
        content = manifest.get("content", "text")
        if content not in ("text", "chat") or (content == "text") == ("files" in manifest):
            raise ValueError(f"content {content!r} with{'out' * ('files' not in manifest)} a files section")
        if not 0 < piece <= MAX_CHECK_PIECE_BYTES:
            raise ValueError(f"check_piece_bytes {piece}")
        expected = {TOKENS_FILE: tokens * TOKEN_DTYPE.itemsize}
        checks = {TOKENS_FILE: _crc_list(manifest["crc32c"])}
        if content == "chat":
            expected[MASK_FILE], expected[DOCUMENTS_FILE] = tokens, documents * 2 * DOCUMENT_DTYPE.itemsize
            checks.update((name, _crc_list(manifest["files"][name]["crc32c"])) for name in (MASK_FILE, DOCUMENTS_FILE))
            if _count(manifest, "pad_token_id") >= vocab or not isinstance(manifest.get("pad_note"), (str, type(None))):
                raise ValueError(f"pad_token_id {manifest['pad_token_id']} or pad_note {manifest.get('pad_note')!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise SeedckptError(f"{path / MANIFEST_FILE} is damaged ({e}); tokenize the corpus again") from None
    for name, want in expected.items():
        size = (path / name).stat().st_size if (path / name).is_file() else -1
        if size != want:
            raise SeedckptError(
                f"{path / name} has {size:,} bytes but {MANIFEST_FILE} records {tokens:,} tokens and "
                f"{documents:,} documents ({want:,} bytes): it was truncated or replaced; tokenize the corpus again"
            )
    return {
        **manifest,
        "tokens": tokens,
        "documents": documents,
        "vocab_size": vocab,
        "content": content,
        "check_piece_bytes": piece,
        "checks": checks,
    }


def _count(manifest: dict, key: str) -> int:
    """``manifest[key]``, which must be a JSON integer >= 0 (not a float, a bool or ``Infinity``)."""
    value = manifest[key]
    if type(value) is not int or value < 0:
        raise ValueError(f"{key} {value!r}")
    return value


def _crc_list(value) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(v, int) for v in value)):
        raise ValueError("a CRC32C list is not a list of integers")
    return value


def verify_tokens(path: Path) -> int:
    """Read every file of the token directory and check it against the CRC32C pieces recorded; the
    tokens read."""
    manifest = read_token_manifest(path)
    piece = manifest["check_piece_bytes"]
    for name, crcs in manifest["checks"].items():
        with open(path / name, "rb") as f:
            _check_pieces(path / name, iter(lambda: f.read(piece), b""), crcs, piece)
    return manifest["tokens"]


def _check_pieces(file: Path, pieces, crcs: list[int], piece: int) -> None:
    """Raise unless ``pieces`` -- ``file``'s bytes, ``piece`` at a time -- have the CRC32Cs ``crcs``."""
    for k, data in enumerate(pieces):
        if k >= len(crcs) or crc(data) != crcs[k]:
            raise SeedckptError(
                f"{file} is corrupt: bytes {k * piece:,}..{k * piece + len(data):,} do not have "
                "the CRC32C written with them; tokenize the corpus again"
            )


def token_dataset(data, vocab_size: int, seq_len: int, seed: int, row_tokens: int):
    """The dataset of the token directory ``data.path``: windows of a text corpus, or packed
    conversations of a chat one (``row_tokens``: the length of a packed row; 0: ``seq_len``)."""
    if not data.path:
        raise SeedckptError("data.kind = 'tokens' needs data.path: a directory made by `seedckpt tokenize`")
    manifest = read_token_manifest(Path(data.path))
    if data.tokenizer and sha256(Path(data.tokenizer) / "tokenizer.json") != manifest.get("tokenizer_sha256"):
        raise SeedckptError(
            f"data.tokenizer {data.tokenizer} is not the tokenizer {data.path} was made with (its tokenizer.json "
            f"differs from the one recorded, {manifest.get('tokenizer', 'unknown')}); give that one, or tokenize "
            "again with this one"
        )
    if manifest["content"] == "chat":
        return TokenChatData(data, vocab_size, seq_len, seed, row_tokens)
    if row_tokens not in (0, seq_len):
        raise SeedckptError(
            f"training.max_tokens_per_rank packs SFT samples into rows, but {data.path} holds text "
            "(windows of seq_len tokens); set it to 0, or tokenize conversations with `seedckpt tokenize --chat`"
        )
    return TokenFileData(data.path, vocab_size, seq_len, seed)


def _open_tokens(path: Path, vocab_size: int) -> dict:
    """The manifest of the token directory ``path``, whose vocabulary must fit the model's."""
    manifest = read_token_manifest(path)
    if manifest["vocab_size"] > vocab_size:
        raise SeedckptError(
            f"{path} was tokenized with a vocabulary of {manifest['vocab_size']:,} tokens but the model's "
            f"vocab_size is {vocab_size:,}; raise model.vocab_size or tokenize with the model's tokenizer"
        )
    return manifest


def _pread(fd: int, view: memoryview, at: int, path: Path) -> None:
    """Fill ``view`` from ``fd`` at byte ``at``."""
    if pread_into(fd, view, at) < view.nbytes:
        raise SeedckptError(f"{path} was truncated while training; tokenize again")


class TokenFileData:
    """Random windows of ``seq_len + 1`` tokens of a token directory, read with one ``pread`` each."""

    def __init__(self, path: str, vocab_size: int, seq_len: int, seed: int):
        self.path = Path(path)
        manifest = _open_tokens(self.path, vocab_size)
        if manifest["content"] == "chat":
            raise SeedckptError(
                f"{path} holds conversations (`seedckpt tokenize --chat`), which train packed, alone: give it "
                "as data.path, not in data.sources"
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
            _pread(self.fd, memoryview(row).cast("B"), start * TOKEN_DTYPE.itemsize, self.path / TOKENS_FILE)
        batch = torch.from_numpy(rows.astype(np.int64))
        _check_ids(batch, self.vocab_size, self.path)
        return Batch.from_rows(batch)


def _check_ids(ids: torch.Tensor, vocab_size: int, path: Path) -> None:
    if len(ids) and int(ids.max()) >= vocab_size:
        raise SeedckptError(
            f"{path / TOKENS_FILE} holds token id {int(ids.max())}, beyond the model's vocab_size "
            f"{vocab_size}: the file is damaged (`seedckpt verify {path}`)"
        )


class ChatTokens:
    """The conversations of a chat token directory as ``PackedSamples`` reads them: the
    ``documents.bin`` index in memory, each conversation's tokens and mask read when asked for."""

    def __init__(self, path: Path, manifest: dict, vocab_size: int):
        self.path, self.vocab_size = path, vocab_size
        raw, piece = memoryview((path / DOCUMENTS_FILE).read_bytes()), manifest["check_piece_bytes"]
        # Read whole anyway, so checked whole: a damaged index would silently pack the wrong spans.
        checks = manifest["checks"][DOCUMENTS_FILE]
        _check_pieces(path / DOCUMENTS_FILE, (raw[i : i + piece] for i in range(0, len(raw), piece)), checks, piece)
        index = np.frombuffer(raw, DOCUMENT_DTYPE).reshape(-1, 2).astype(np.int64)
        self.lengths, self.first_labels = index[:, 0], index[:, 1]
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        if (
            self.starts[-1] != manifest["tokens"]
            or not ((1 <= self.first_labels) & (self.first_labels <= self.lengths)).all()
        ):
            raise SeedckptError(
                f"{path / DOCUMENTS_FILE} does not describe {path / TOKENS_FILE} (its lengths add up to "
                f"{int(self.starts[-1]):,} tokens, not {manifest['tokens']:,}, or a label position is out of its "
                f"conversation): the directory is damaged (`seedckpt verify {path}`); tokenize again"
            )
        self.tokens_fd = os.open(path / TOKENS_FILE, os.O_RDONLY)
        self.mask_fd = os.open(path / MASK_FILE, os.O_RDONLY)

    def read(self, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` ids of conversation ``index`` and their labels (the id where the mask is set)."""
        start, first = int(self.starts[index]), int(self.first_labels[index])
        ids, mask = np.empty(n, TOKEN_DTYPE), np.empty(n, MASK_DTYPE)
        _pread(self.tokens_fd, memoryview(ids).cast("B"), start * TOKEN_DTYPE.itemsize, self.path / TOKENS_FILE)
        _pread(self.mask_fd, memoryview(mask).cast("B"), start, self.path / MASK_FILE)
        ids = torch.from_numpy(ids.astype(np.int64))
        _check_ids(ids, self.vocab_size, self.path)
        if mask.max(initial=0) > 1 or mask[1:first].any() or (first < n and mask[first] != 1):
            raise SeedckptError(
                f"{self.path / MASK_FILE} holds a byte other than 0 or 1, or disagrees with {DOCUMENTS_FILE} on "
                f"where conversation {index}'s labels start: the directory is damaged (`seedckpt verify "
                f"{self.path}`); tokenize again"
            )
        return ids, torch.where(torch.from_numpy(mask.astype(bool)), ids, IGNORE_INDEX)


class TokenChatData(PackedSamples):
    """The conversations of a chat token directory, packed as ``data.kind = "chat"`` packs them: the
    same batches as the JSONL they were tokenized from."""

    def __init__(self, data, vocab_size: int, seq_len: int, seed: int, row_tokens: int = 0):
        path = Path(data.path)
        manifest = _open_tokens(path, vocab_size)
        samples = ChatTokens(path, manifest, vocab_size)
        what, note = ("chat tokens", "conversations"), manifest.get("pad_note") or ""
        super().__init__(samples, data, seq_len, seed, int(manifest["pad_token_id"]), what, note, row_tokens)
