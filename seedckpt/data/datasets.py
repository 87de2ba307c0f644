"""``make_dataset``: the dataset a ``[data]`` section describes.

Its own module so that the datasets (``data``: synthetic and text; ``chat``: conversations, built
on ``data``'s batches and file readers) never import each other in a circle.
"""

from __future__ import annotations

import re
from dataclasses import replace

from seedckpt.data.chat import ChatData, PretokenizedData
from seedckpt.data.mixture import MixedData
from seedckpt.data.sources import SyntheticData, TextData
from seedckpt.data.token_files import token_dataset
from seedckpt.utils.errors import SeedckptError


def make_dataset(data, vocab_size: int, seq_len: int, seed: int, row_tokens: int = 0):
    """The dataset that the ``[data]`` section ``data`` describes; ``row_tokens``: the length of packed
    SFT rows (``training.row_tokens``; 0: ``seq_len``)."""
    if data.kind == "synthetic":
        return SyntheticData(vocab_size, seq_len, seed)
    if data.kind == "text":
        if data.tokenizer:
            return TextData.tokenized(data.path, data.tokenizer, vocab_size, seq_len, seed)
        return TextData.bytes(data.path, vocab_size, seq_len, seed)
    if data.kind == "chat":
        return ChatData(data, vocab_size, seq_len, seed, row_tokens)
    if data.kind == "pretokenized":
        return PretokenizedData(data, vocab_size, seq_len, seed, row_tokens)
    if data.kind == "tokens" and data.sources:
        return MixedData(data.sources, vocab_size, seq_len, seed)
    if data.kind == "tokens":
        return token_dataset(data, vocab_size, seq_len, seed, row_tokens)
    raise SeedckptError(f"data.kind = {data.kind!r}; choose synthetic, text, tokens, chat or pretokenized")


def held_out_dataset(data, path: str, vocab_size: int, seq_len: int, seed: int, row_tokens: int = 0):
    """``path`` (``validation.path``) read as the ``[data]`` section ``data`` reads its own (its kind,
    tokenizer, packing): the held-out data. The readers name the key they read, ``data.path``; here
    that key is ``validation.path``, and their errors say so."""
    try:
        return make_dataset(replace(data, path=path, sources=[]), vocab_size, seq_len, seed, row_tokens)
    except SeedckptError as e:
        raise SeedckptError(re.sub(r"\bdata\.path\b", "validation.path", str(e))) from None
