"""What a ``seedckpt tokenize`` worker process runs: on text, the ``tokenizers`` library's encoder of
the tokenizer ``transformers`` built in the parent, and nothing else; on conversations (``--chat``),
the tokenizer loaded with ``transformers`` for its chat template.

The parent loads the tokenizer with ``transformers`` (``load_tokenizer``) and hands each worker its
backend, serialized: the very pipeline ``tokenizer(text)`` runs, so the ids are the same (tested).
This module imports neither torch nor transformers: a spawned worker starts in ~0.1 s of CPU and
peaked at 64 MiB RSS, where one that imported ``seedckpt.data.tokenize`` (torch) and loaded the
tokenizer with transformers took 3-5 s of CPU and 336 MiB (4.7 MB of text, a 32k BPE, 2 workers).
A chat worker imports what rendering needs (``data.chat``: torch, transformers), not the token
directory's writer and the checkpoint package behind it: 1.6 CPU s to start instead of 2.2 (DCP).
"""

from __future__ import annotations

import os
import signal

import numpy as np

_ENCODE = None  # the tokenizer's batch encoder
_EOS: np.ndarray | None = None
_FILE = ""
_TOKENIZER = None  # a chat worker's (transformers'), for its chat template
_CHAT_FILES: tuple[tuple[str, np.dtype], ...] = ()
# Words whose tokens the tokenizer keeps (BPE, Unigram). tokenizers caches 10,000 and, full, caches no
# more: on benchmarks/tokenizing.py's 32 MiB (127 k distinct pre-tokens) one thread encoded 5.9 MB per
# CPU second with 100 k, 5.3 with 10 k, 6.1 with 1 M (interleaved); the whole command took 0.89x the
# CPU (2 workers, paired), a worker ~25 MiB more.
CACHE_WORDS = 100_000


def prepare_process() -> None:
    """What every tokenize worker sets first (text and chat)."""
    # One thread per worker: the pool is the parallelism. A block encoded by the tokenizer's own
    # threads took the same CPU time and grew the worker's address space by 197 MiB instead of 37
    # (each thread's stack and malloc arena), its RSS by 53 MiB instead of 38 (2 MiB in 256 KiB blocks).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group: the parent stops the pool and removes its partial
    # output, and a worker's own KeyboardInterrupt traceback would only bury that one line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A process group of its own: SIGTERM or SIGHUP sent to the command's group (`timeout`, a closed
    # terminal) reaches the parent alone, which stops the pool as on Ctrl-C. A worker killed by one
    # while sending its block left the parent's pool waiting forever on the half-sent result (seen);
    # the pool's own SIGTERM to a worker (a broken pool's cleanup) still ends it.
    os.setpgrp()


def start(tokenizer_json: str, eos_id: int, split_special_tokens: bool, output: tuple[str, str]) -> None:
    """The pool's initializer: the tokenizer from its JSON (``Tokenizer.to_str``), called as
    ``transformers`` calls it (``split_special_tokens``); ``output``: the ids' file name and dtype."""
    global _ENCODE, _EOS, _FILE
    prepare_process()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = split_special_tokens
    resize = getattr(tokenizer.model, "_resize_cache", None)  # a cache's words only, never the ids
    if resize is not None:
        resize(CACHE_WORDS)
    # Without offsets, which nothing here reads: 20 % less time than encode_batch (1 MB, one thread).
    # A tokenizers release older than the method (transformers 4.45 allows 0.20) has encode_batch alone.
    _ENCODE = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    _FILE, dtype = output
    _EOS = np.array([eos_id], dtype)


def encode_block(block: tuple[list[tuple[str, bool]], int]) -> tuple[dict, int, int]:
    """A block's pieces ``(text, last)`` and source bytes -> ``{file: ids}``, each document's last
    piece followed by eos; the documents it ends; the bytes."""
    items, size = block
    encodings = _ENCODE([text for text, _ in items], add_special_tokens=False)
    arrays = []
    for encoding, (_, last) in zip(encodings, items):
        arrays.append(np.array(encoding.ids, _EOS.dtype))
        if last:
            arrays.append(_EOS)
    return {_FILE: np.concatenate(arrays)}, sum(last for _, last in items), size


def start_chat(tokenizer_dir: str, output: tuple[tuple[str, str], ...]) -> None:
    """The pool's initializer for conversations: the tokenizer loaded with transformers; ``output``:
    the ids', label mask's and documents' file names and dtypes."""
    global _TOKENIZER, _CHAT_FILES
    from seedckpt.data.tokenizer import load_tokenizer

    prepare_process()
    _TOKENIZER = load_tokenizer(tokenizer_dir)
    _CHAT_FILES = tuple((name, np.dtype(dtype)) for name, dtype in output)


def encode_conversations(block: tuple[list, int]) -> tuple[dict, int, int]:
    """A block's ``(where, record)`` and source bytes -> ``{file: array}`` (ids, label mask, and each
    sample's length and first label), the samples, the bytes. A record already tokenized is an
    ``(ids, mask)`` sample; a conversation is rendered with the chat template."""
    from seedckpt.data.chat import first_label, render_samples

    records, size = block
    samples = [
        s for where, r in records for s in ([r] if isinstance(r, tuple) else render_samples(_TOKENIZER, r, where))
    ]
    (ids_file, ids_dtype), (mask_file, mask_dtype), (index_file, index_dtype) = _CHAT_FILES
    ids, masks, index = [], [], np.empty((len(samples), 2), index_dtype)
    for row, (tokens, mask) in zip(index, samples):
        row[:] = len(tokens), first_label(np.asarray(mask, bool))
        ids.append(np.asarray(tokens, ids_dtype))
        masks.append(np.asarray(mask, mask_dtype))
    return {ids_file: np.concatenate(ids), mask_file: np.concatenate(masks), index_file: index}, len(samples), size
