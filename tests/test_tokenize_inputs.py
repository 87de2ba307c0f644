"""``seedckpt tokenize``'s inputs: read as ``--help`` lists them -- a directory's ``*.txt`` too, and a
warning names what it skips -- and the rest named: a file given twice and an empty file are refused
in one line naming them, leaving nothing; invalid UTF-8 is read as U+FFFD with a warning naming the
file, how many and the first one's byte offset. Errors call the paths the command's input, not
``data.path`` (a training key)."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from seedckpt.cli.main import main as seedckpt
from tests.test_token_files import _expected
from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

DOCS = corpus_of(make_chats(12, seed=4))
SUFFIXES = "*.jsonl, *.jsonl.gz, *.parquet, *.txt"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", DOCS * 3, vocab_size=300)


def tokenize(tokenizer, output, *inputs) -> int:
    return seedckpt(["tokenize", *map(str, inputs), "--tokenizer", str(tokenizer), "--output", str(output), "--quiet"])


def _ids(output) -> list[int]:
    return np.fromfile(output / "tokens.bin", dtype="<u4").tolist()


def _refused(capsys, code: int) -> str:
    """The one line of a refusal (exit 2)."""
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_a_directory_is_read_for_what_help_lists_and_names_what_it_skips(tmp_path, tokenizer, capsys):
    """Before, the .txt beside the JSONL was skipped, and a directory of .txt alone was refused as
    "data.path ... without *.jsonl, *.jsonl.gz, *.parquet files"."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:3]))
    (mixed / "b.txt").write_text(DOCS[3])
    for name in ("blob.bin", "logo.png"):
        (mixed / name).write_bytes(b"not read")
    skipped = f"input {mixed}: read its 2 {SUFFIXES} file(s); skipped blob.bin, logo.png"
    with pytest.warns(UserWarning, match=re.escape(skipped)) as caught:
        assert tokenize(tokenizer, tmp_path / "mixed-tokens", mixed) == 0
    assert _ids(tmp_path / "mixed-tokens") == _expected(tokenizer, DOCS[:4])
    # the command prints its warnings as one line each, like its errors
    assert warnings.formatwarning(caught[0].message, UserWarning, "x.py", 1) == f"warning: {skipped}\n"

    texts = tmp_path / "texts"
    texts.mkdir()
    for name, doc in (("2.txt", DOCS[5]), ("1.txt", DOCS[4])):  # read in name order
        (texts / name).write_text(doc)
    assert tokenize(tokenizer, tmp_path / "text-tokens", texts) == 0
    assert _ids(tmp_path / "text-tokens") == _expected(tokenizer, DOCS[4:6])

    for name in ("b.txt", "a.jsonl"):
        (mixed / name).unlink()
    err = _refused(capsys, tokenize(tokenizer, tmp_path / "none", mixed))
    assert f"input {mixed} holds no {SUFFIXES} file; give a directory that does, or the files by name" in err
    assert not (tmp_path / "none").exists()
    err = _refused(capsys, tokenize(tokenizer, tmp_path / "none", tmp_path / "absent.jsonl"))
    assert f"input {tmp_path / 'absent.jsonl'} does not exist" in err


def test_a_file_given_twice_is_refused_naming_it(tmp_path, tokenizer, capsys):
    """Twice by name, by a comma list, or by name and in its directory: once it was tokenized twice."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    a, b = corpus / "a.jsonl", corpus / "b.txt"
    a.write_text(json.dumps({"text": DOCS[0]}) + "\n")
    b.write_text(DOCS[1])
    for inputs, given in (
        ([a, a], f"{a} twice (as {a} and as {a})"),
        ([f"{a},{b},{a}"], f"{a} twice (as {a} and as {a})"),
        ([corpus, b], f"{b} twice (as {corpus} and as {b})"),
    ):
        err = _refused(capsys, tokenize(tokenizer, tmp_path / "tokens", *inputs))
        assert f"input gives {given}; give each file once" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # no output, no partial, no lock


def test_an_empty_file_is_refused_naming_it(tmp_path, tokenizer, capsys):
    """Once an empty text file was a document of eos alone, and a parquet file without rows no
    document at all, without a word; an empty JSONL file was already refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty.txt").write_bytes(b"")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    for name in ("empty.txt", "empty.parquet", "empty.jsonl"):
        err = _refused(capsys, tokenize(tokenizer, tmp_path / "tokens", tmp_path / name))
        assert f"{tmp_path / name} is empty" in err
        assert not (tmp_path / "tokens").exists()


def test_invalid_utf8_is_read_as_the_replacement_character_naming_the_file_and_offset(tmp_path, tokenizer):
    """Each invalid byte sequence reads as U+FFFD (as Python's errors="replace"), and one warning names
    the file, how many and where the first is; once they were replaced without a word."""
    raw = DOCS[0].encode() + b" \xff\xfe " + DOCS[1].encode() + b" \xe2\x82 end"
    (tmp_path / "latin.txt").write_bytes(raw)
    text = raw.decode("utf-8", errors="replace")
    first = len(DOCS[0].encode()) + 1
    named = f"{tmp_path / 'latin.txt'}: 3 invalid UTF-8 sequence(s), the first at byte {first:,}, read as U+FFFD"
    with pytest.warns(UserWarning, match=re.escape(named)):
        assert tokenize(tokenizer, tmp_path / "tokens", tmp_path / "latin.txt") == 0
    assert text.count("\ufffd") == 3 and _ids(tmp_path / "tokens") == _expected(tokenizer, [text])
