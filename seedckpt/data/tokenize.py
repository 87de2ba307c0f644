"""Tokenizing a corpus once (``seedckpt tokenize``) into a token directory (``token_files``).

Tokenizing runs on a pool of processes (each with its own tokenizer), over blocks of documents or
conversations taken in order; the parent writes their ids in that order, so the directory is the
same for any number of workers. The progress bar counts the source bytes read (compressed bytes for
gzip), against the sources' sizes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from seedckpt.data.chat import chat_tokenizer, conversation, first_label, pretokenized_record, render_with_mask
from seedckpt.data.sources import IGNORE_INDEX, JSONL_SUFFIXES, TEXT_SUFFIXES, data_files, documents, jsonl_records
from seedckpt.data.token_files import (
    CHAT_FILES,
    DOCUMENT_DTYPE,
    DOCUMENTS_FILE,
    MASK_DTYPE,
    MASK_FILE,
    TOKEN_DTYPE,
    TOKENS_FILE,
    sha256,
    write_token_directory,
)
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.progress import Progress

BLOCK_CHARS = 1 << 20  # documents are handed to the workers in blocks of about this many characters


def tokenize_corpus(
    sources: str | list[str],
    tokenizer_dir: str,
    output: str | Path,
    workers: int | None = None,
    progress: bool = True,
    chat: bool = False,
) -> Path:
    """Tokenize ``sources`` (``data.path``'s syntax, or a list of such: files, comma-separated, or a
    directory) into the token directory ``output``: documents (``*.jsonl`` / ``*.jsonl.gz`` /
    ``*.parquet``; a plain text file is one document), or with ``chat`` JSONL conversations with
    their label mask (records already tokenized, Mini Trainer's ``{"input_ids", "labels"}``, are
    written as they are)."""
    from seedckpt.data.tokenizer import load_tokenizer, pad_token_id

    tokenizer = chat_tokenizer(tokenizer_dir) if chat else load_tokenizer(tokenizer_dir)
    meta = {"content": "chat" if chat else "text", "tokenizer": str(Path(tokenizer_dir).resolve())}
    meta["tokenizer_sha256"] = sha256(Path(tokenizer_dir) / "tokenizer.json")
    if chat:
        files = data_files(sources, JSONL_SUFFIXES)
        meta["pad_token_id"], meta["pad_note"] = pad_token_id(tokenizer)
        blocks, work, names = _sft_blocks(sources, len(tokenizer)), _tokenize_conversations, CHAT_FILES
    else:
        if tokenizer.eos_token_id is None:
            raise SeedckptError(f"the tokenizer in {tokenizer_dir} has no eos token to separate documents")
        files = data_files(sources, TEXT_SUFFIXES)
        meta["eos_token_id"] = tokenizer.eos_token_id
        blocks, work, names = _blocks(files), _tokenize_block, (TOKENS_FILE,)
    meta["sources"] = [{"path": str(f), "bytes": f.stat().st_size} for f in files]
    meter = Progress(sum(f.stat().st_size for f in files), f"tokenize {len(files)} file(s)", enabled=progress)
    context = multiprocessing.get_context("spawn")
    try:
        with context.Pool(workers or len(os.sched_getaffinity(0)), _start_worker, (tokenizer_dir,)) as pool:
            return write_token_directory(output, pool.imap(work, blocks), len(tokenizer), meta, meter.update, names)
    finally:
        meter.close()


class _BytesRead:
    """A count of source bytes read (the readers' ``read`` callback), taken block by block."""

    def __init__(self):
        self.count = 0

    def __call__(self, n: int) -> None:
        self.count += n

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def _grouped(items, read: _BytesRead) -> Iterator[tuple[list, int]]:
    """``(items, source bytes read for them)`` in order, from ``(item, characters)`` pairs grouped up
    to ``BLOCK_CHARS`` characters: the bytes drive the progress bar, so a gzipped or parquet source
    is measured in what is read from disk, not in the characters it holds."""
    block, chars = [], 0
    for item, n in items:
        block.append(item)
        chars += n
        if chars >= BLOCK_CHARS:
            yield block, read.take()
            block, chars = [], 0
    if block:
        yield block, read.take()


def _blocks(files) -> Iterator[tuple[list[str], int]]:
    """``(texts, source bytes)`` in order: the files' documents, grouped."""
    read = _BytesRead()
    return _grouped(((text, len(text)) for file in files for text in documents(file, read)), read)


_TOKENIZER = None


def _start_worker(tokenizer_dir: str) -> None:
    global _TOKENIZER
    from seedckpt.data.tokenizer import load_tokenizer

    _TOKENIZER = load_tokenizer(tokenizer_dir)


def _tokenize_block(block: tuple[list[str], int]) -> tuple[dict, int, int]:
    texts, size = block
    encoded = _TOKENIZER(texts, add_special_tokens=False)["input_ids"]
    eos = _TOKENIZER.eos_token_id
    ids = np.fromiter((t for doc in encoded for t in (*doc, eos)), dtype=TOKEN_DTYPE)
    return {TOKENS_FILE: ids}, len(texts), size


def _sft_blocks(sources: str | list[str], vocab_size: int) -> Iterator[tuple[list, int]]:
    """``([(where, record), ...], source bytes)`` in order, grouped: each record a conversation's
    messages, or the ``(ids, label mask)`` of a record already tokenized (Mini Trainer's format)."""
    read = _BytesRead()

    def records():
        for file in data_files(sources, JSONL_SUFFIXES):
            for number, record in jsonl_records(file, read):
                where = f"{file}:{number}"
                if isinstance(record, dict) and "input_ids" in record:
                    item = _masked(*pretokenized_record(record, vocab_size, where), where)
                    yield (where, item), len(item[0])
                else:
                    messages = conversation(record, where)
                    yield (where, messages), sum(len(m["content"]) for m in messages)

    return _grouped(records(), read)


def _masked(ids: list[int], labels: list[int], where: str) -> tuple[list[int], list[bool]]:
    """A pre-tokenized record as ids and label mask: a label must be its position's own id, since a
    token directory stores which tokens are learned, not separate targets."""
    if any(label not in (IGNORE_INDEX, token) for token, label in zip(ids, labels)):
        raise SeedckptError(
            f"{where}: a label differs from its input id; a token directory stores labels as a mask over "
            f"the ids (labels[i] = input_ids[i] or {IGNORE_INDEX}): train this file as data.kind = 'pretokenized'"
        )
    return ids, [label != IGNORE_INDEX for label in labels]


def _tokenize_conversations(block: tuple[list, int]) -> tuple[dict, int, int]:
    records, size = block
    ids, masks, index = [], [], np.empty((len(records), 2), DOCUMENT_DTYPE)
    for row, (where, record) in zip(index, records):
        tokens, mask = record if isinstance(record, tuple) else render_with_mask(_TOKENIZER, record, where)
        row[:] = len(tokens), first_label(np.asarray(mask, bool))
        ids.append(np.asarray(tokens, TOKEN_DTYPE))
        masks.append(np.asarray(mask, MASK_DTYPE))
    arrays = {TOKENS_FILE: np.concatenate(ids), MASK_FILE: np.concatenate(masks), DOCUMENTS_FILE: index}
    return arrays, len(records), size
