"""Tokenizing a corpus once (``seedckpt tokenize``) into a token directory (``token_files``).

Tokenizing runs on a pool of processes (each with its own tokenizer), over blocks of documents or
conversations taken in order; the parent writes their ids in that order, so the directory is the
same for any number of workers. A text worker runs the ``tokenizers`` library alone, on the
tokenizer transformers built here (``tokenize_worker``): it starts in a tenth of a second and
encodes pieces of about 4 Ki characters without offsets, caching 100 k words: 1.9x
``encode_batch``'s MB per CPU second on 32 MiB of text and code (benchmarks/tokenizing.py; the
parent's share is negligible). Memory is bounded whatever the corpus: a document is read and
tokenized in pieces (``sources.pieces``), a block holds at most ``BLOCK_CHARS`` characters of them
(unless one conversation is longer), and at most ``AHEAD`` blocks a worker are in flight. A worker
that dies (the kernel's OOM killer, a signal) ends the command with one error and nothing written:
``concurrent.futures`` reports a dead worker, where ``multiprocessing.Pool`` starts a new one and
waits forever for the lost block. The progress bar counts the source bytes read (compressed bytes
for gzip), against the sources' sizes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from seedckpt.data import tokenize_worker
from seedckpt.data.chat import chat_tokenizer, conversation, pretokenized_record
from seedckpt.data.sources import IGNORE_INDEX, JSONL_SUFFIXES, TEXT_SUFFIXES, data_files, jsonl_records, pieces
from seedckpt.data.token_files import (
    CHAT_FILES,
    CHAT_LAYOUT,
    TOKEN_DTYPE,
    TOKENS_FILE,
    sha256,
    write_token_directory,
)
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.progress import Progress

# Documents are handed to the workers in blocks of at most this many characters; a worker holds a
# block's encodings at once: over 4 MiB of 12-word lines in 256 KiB blocks a tokenizer (on its own
# threads) grew by 54 MiB, in 1 MiB blocks by 128 MiB, and was no faster.
BLOCK_CHARS = 1 << 18
AHEAD = 2  # blocks in flight per worker: one being tokenized, one queued behind it
INPUT = "input"  # what errors call the command's inputs


def tokenize_corpus(
    sources: str | list[str],
    tokenizer_dir: str,
    output: str | Path,
    workers: int | None = None,
    progress: bool = True,
    chat: bool = False,
) -> Path:
    """Tokenize ``sources`` (``data.path``'s syntax, or a list of such: files, comma-separated, or a
    directory; each file once) into the token directory ``output``: documents (``*.jsonl`` /
    ``*.jsonl.gz`` / ``*.parquet``; a plain text file, ``*.txt`` in a directory, is one document;
    each read and tokenized in pieces, ``sources.pieces``), or with ``chat`` JSONL conversations with
    their label mask (records already tokenized, Mini Trainer's ``{"input_ids", "labels"}``, are
    written as they are)."""
    from seedckpt.data.tokenizer import load_tokenizer, pad_token_id

    tokenizer = chat_tokenizer(tokenizer_dir) if chat else load_tokenizer(tokenizer_dir)
    meta = {"content": "chat" if chat else "text", "tokenizer": str(Path(tokenizer_dir).resolve())}
    meta["tokenizer_sha256"] = sha256(Path(tokenizer_dir) / "tokenizer.json")
    if chat:
        files = data_files(sources, JSONL_SUFFIXES, INPUT)
        meta["pad_token_id"], meta["pad_note"] = pad_token_id(tokenizer)
        blocks, work, names = _sft_blocks(files, len(tokenizer)), tokenize_worker.encode_conversations, CHAT_FILES
        start = tokenize_worker.start_chat, (tokenizer_dir, CHAT_LAYOUT)
    else:
        if tokenizer.eos_token_id is None:
            raise SeedckptError(f"the tokenizer in {tokenizer_dir} has no eos token to separate documents")
        files = data_files(sources, TEXT_SUFFIXES, INPUT)
        meta["eos_token_id"] = tokenizer.eos_token_id
        blocks, work, names = _blocks(files), tokenize_worker.encode_block, (TOKENS_FILE,)
        start = tokenize_worker.start, _text_worker_args(tokenizer)
    meta["sources"] = [{"path": str(f), "bytes": f.stat().st_size} for f in files]
    meter = Progress(sum(f.stat().st_size for f in files), f"tokenize {len(files)} file(s)", enabled=progress)
    workers = workers or len(os.sched_getaffinity(0))
    try:
        with _pool(workers, *start) as pool:
            results = _in_order(pool, work, blocks, AHEAD * workers)
            return write_token_directory(output, results, len(tokenizer), meta, meter.update, names)
    finally:
        meter.close()


@contextlib.contextmanager
def _pool(workers: int, initializer, initargs: tuple) -> Iterator[ProcessPoolExecutor]:
    """``workers`` spawned processes, each started with ``initializer(*initargs)`` (the tokenizer
    loaded); on the way out after an error, the blocks not yet started are dropped rather than
    tokenized for nothing."""
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, context, initializer, initargs)
    try:
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)


def _in_order(pool: ProcessPoolExecutor, work, blocks, ahead: int) -> Iterator:
    """``work(block)`` for each of ``blocks``, in order, with at most ``ahead`` blocks submitted and
    not yet taken: the reader never runs further ahead of the writer than that."""
    pending: deque[Future] = deque()
    for block in blocks:
        pending.append(pool.submit(work, block))
        if len(pending) >= ahead:
            yield _result(pending.popleft())
    while pending:
        yield _result(pending.popleft())


def _result(future: Future):
    """The block's result; a worker that died or ran out of memory is one error saying what to do."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise SeedckptError(
            "a tokenizer worker process ended abruptly (killed by a signal or the kernel; out of memory is the "
            "usual cause, see `dmesg`), so nothing was written; run again with fewer --workers or more free memory"
        ) from None
    except MemoryError:
        raise SeedckptError(
            "a tokenizer worker ran out of memory (MemoryError), so nothing was written; run again with fewer "
            "--workers or more memory (a higher `ulimit -v`)"
        ) from None


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
    to ``BLOCK_CHARS`` characters (an item longer than that alone): the bytes drive the progress bar,
    so a gzipped or parquet source is measured in what is read from disk, not in the characters it holds."""
    block, chars = [], 0
    for item, n in items:
        if block and chars + n > BLOCK_CHARS:
            yield block, read.take()
            block, chars = [], 0
        block.append(item)
        chars += n
    if block:
        yield block, read.take()


def _blocks(files) -> Iterator[tuple[list[tuple[str, bool]], int]]:
    """``([(text, last), ...], source bytes)`` in order: the files' documents in pieces, grouped."""
    read = _BytesRead()
    return _grouped(((piece, len(piece[0])) for file in files for piece in pieces(file, read)), read)


def _text_worker_args(tokenizer) -> tuple:
    """``tokenize_worker.start``'s arguments: the backend ``tokenizer(text)`` runs, serialized, and how
    it is called; the ids' file and dtype."""
    backend = tokenizer.backend_tokenizer.to_str()
    return backend, tokenizer.eos_token_id, tokenizer.split_special_tokens, (TOKENS_FILE, TOKEN_DTYPE.str)


def _sft_blocks(files: list[Path], vocab_size: int) -> Iterator[tuple[list, int]]:
    """``([(where, record), ...], source bytes)`` in order, grouped: each record a conversation's
    messages, or the ``(ids, label mask)`` of a record already tokenized (Mini Trainer's format)."""
    read = _BytesRead()

    def records():
        for file in files:
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
