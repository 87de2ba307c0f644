"""Hugging Face tokenizers: loaded with the HF stack (``transformers.AutoTokenizer``), never
re-implemented, from a local directory only (``tokenizer.json`` + ``tokenizer_config.json``).

A *fast* tokenizer is required: chat masking maps characters to tokens through its offsets.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from seedckpt.utils.errors import SeedckptError

# What travels with an exported model so that ``AutoTokenizer.from_pretrained(export)`` works.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tokenizer.model",
)


# What a slow (sentencepiece / tiktoken) tokenizer directory holds instead of tokenizer.json.
SLOW_TOKENIZER_FILES = (
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "tokenizer.tiktoken",
)


def load_tokenizer(path: str | Path):
    """The fast tokenizer in directory ``path`` (chat masking needs its character offsets)."""
    path = Path(path)
    if not path.is_dir():
        raise SeedckptError(
            f"data.tokenizer {path} is not a directory; give the directory of a model download or "
            "of tokenizer.save_pretrained()"
        )
    if not (path / "tokenizer.json").is_file():
        slow = [f.name for f in sorted(path.iterdir()) if f.name in SLOW_TOKENIZER_FILES]
        raise SeedckptError(
            f"data.tokenizer {path} has no tokenizer.json"
            + (f" (only the slow tokenizer's {', '.join(slow)})" if slow else "")
            + "; seedckpt needs a fast tokenizer: save one with AutoTokenizer.from_pretrained(DIR)"
            ".save_pretrained(DIR) where sentencepiece is installed, or give a model download's "
            "directory"
        )
    from transformers import AutoTokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notices about unrelated optional packages
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types, with multi-line texts, for damaged or foreign files
        raise SeedckptError(f"cannot load the tokenizer in {path}: {' '.join(str(e).split())[:300]}") from None
    if not tokenizer.is_fast:
        raise SeedckptError(
            f"the tokenizer in {path} is a slow (Python) tokenizer; seedckpt needs a fast one "
            "(tokenizer.json), which chat masking uses for its character offsets"
        )
    return tokenizer


def pad_token_id(tokenizer) -> tuple[int, str | None]:
    """The pad id: the tokenizer's, else its eos (and a note for the run log), else an error."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id, None
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id, (
            f"the tokenizer has no pad token: padding with eos ({tokenizer.eos_token!r}, "
            f"id {tokenizer.eos_token_id}); padded positions carry no loss"
        )
    raise SeedckptError(
        "the tokenizer has neither a pad nor an eos token; set pad_token or eos_token in its tokenizer_config.json"
    )


def tokenizer_files(path: str | Path) -> list[Path]:
    """The files of tokenizer directory ``path`` that belong next to an exported model."""
    return [Path(path) / name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]


def own_tokenizer(model_dir: str | Path) -> Path | None:
    """The fast tokenizer a model directory carries, or None: an HF download's ``tokenizer.json``
    beside its ``config.json``, else the ``tokenizer/`` folder where a fine-tuning run's ``step-N``
    and ``convert --to dcp`` keep it. Only looks at file names: nothing is loaded."""
    # Imported here: the checkpoint package brings DCP (~0.6 CPU s), which a chat tokenize worker
    # (chat -> this module) never uses.
    from seedckpt.checkpoint.manifest import TOKENIZER_DIR

    for directory in (Path(model_dir), Path(model_dir) / TOKENIZER_DIR):
        if (directory / "tokenizer.json").is_file():
            return directory
    return None


def moved_tokens(tokenizer, base) -> list[tuple[str, int, int | None]]:
    """The tokens of ``base`` whose id ``tokenizer`` changes, as ``(token, base id, tokenizer's id
    or None)`` in id order: empty when ``tokenizer`` keeps every id a model trained with ``base``
    knows, adding tokens or not. An added (special) token of ``base`` may be missing -- renaming a
    reserved token for a chat template is common -- but not moved; a regular one may do neither."""
    added = base.get_added_vocab()
    ids = tokenizer.get_vocab()
    moved = (
        (token, i, ids.get(token))
        for token, i in base.get_vocab().items()
        if ids.get(token) != i and not (token in added and token not in ids)
    )
    return sorted(moved, key=lambda entry: entry[1])
