"""Chat token directories (``seedckpt tokenize --chat``): conversations rendered and masked once, in
parallel, then packed by training into exactly the batches of the JSONL they came from; damage
and bad input refused in one line, leaving nothing behind."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest
import torch

from seedckpt.cli.main import main as seedckpt
from seedckpt.config.job_config import Data
from seedckpt.data.chat import ChatData
from seedckpt.data.datasets import make_dataset
from seedckpt.utils.errors import SeedckptError
from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

CHATS = make_chats(60, seed=3)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tokenizer with a chat template and the chats as two files: JSONL and JSONL.gz."""
    root = tmp_path_factory.mktemp("chat_tokens")
    tokenizer = build_tiny_tokenizer(root / "tokenizer", corpus_of(CHATS) * 3, vocab_size=300)
    (root / "a.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[:25]))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(c) + "\n" for c in CHATS[25:])
    return root, tokenizer


def tokenize(output, tokenizer, *inputs, options=("--quiet",)) -> int:
    """``seedckpt tokenize --chat``'s exit status."""
    return seedckpt(
        ["tokenize", *map(str, inputs), "--chat", "--tokenizer", str(tokenizer), "--output", str(output), *options]
    )


@pytest.fixture(scope="module")
def chat_tokens(inputs):
    root, tokenizer = inputs
    assert (
        tokenize(
            root / "tokens", tokenizer, root / "a.jsonl", root / "b.jsonl.gz", options=("--quiet", "--workers", "2")
        )
        == 0
    )
    return root / "tokens"


def _pair(inputs, chat_tokens, seq_len=48, row_tokens=0, **options):
    """The same conversations as ``chat`` (JSONL) and as ``tokens`` (the chat token directory)."""
    root, tokenizer = inputs
    jsonl = f"{root / 'a.jsonl'},{root / 'b.jsonl.gz'}"
    chat = ChatData(Data(kind="chat", path=jsonl, tokenizer=str(tokenizer), **options), 304, seq_len, 0, row_tokens)
    tokens = make_dataset(Data(kind="tokens", path=str(chat_tokens), **options), 304, seq_len, 0, row_tokens)
    return chat, tokens


@pytest.mark.parametrize(
    "options,seq_len,row_tokens",
    [
        ({}, 48, 0),
        ({"packing": False}, 48, 0),
        ({"overflow": "drop"}, 40, 0),
        ({}, 32, 128),  # truncation, and a token budget's longer rows
    ],
    ids=["packed", "one-per-row", "drop", "truncate-budget"],
)
def test_batches_equal_the_chat_jsonls(inputs, chat_tokens, options, seq_len, row_tokens):
    chat, tokens = _pair(inputs, chat_tokens, seq_len, row_tokens, **options)
    assert type(tokens).__name__ == "TokenChatData"
    assert tokens.description.split(": ", 1)[1] == chat.description.split(": ", 1)[1]  # the same counts
    assert np.array_equal(chat.lengths, tokens.lengths) and np.array_equal(chat.indices, tokens.indices)
    for step in (1, 2, 7, 30):  # 30: several epochs in
        got, want = tokens.global_batch(step, 4), chat.global_batch(step, 4)
        for name in ("inputs", "labels", "positions", "document_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)


def test_one_worker_writes_the_same_files_and_verify_checks_each(tmp_path, inputs, chat_tokens, capsys):
    root, tokenizer = inputs
    assert tokenize(tmp_path / "one", tokenizer, root / "a.jsonl", root / "b.jsonl.gz", options=("--workers", "1")) == 0
    out = capsys.readouterr().out
    assert "60 conversations, vocabulary 300" in out and f"--data.kind tokens --data.path {tmp_path / 'one'}" in out
    for name in ("tokens.bin", "mask.bin", "documents.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (chat_tokens / name).read_bytes(), name
    manifest = json.loads((chat_tokens / "tokens.json").read_text())
    assert manifest["content"] == "chat" and manifest["documents"] == 60
    index = np.fromfile(chat_tokens / "documents.bin", dtype="<u4").reshape(-1, 2)
    assert int(index[:, 0].sum()) == manifest["tokens"]
    assert seedckpt(["verify", str(tmp_path / "one")]) == 0
    mask = bytearray((tmp_path / "one" / "mask.bin").read_bytes())
    mask[10] ^= 1
    (tmp_path / "one" / "mask.bin").write_bytes(bytes(mask))
    capsys.readouterr()
    assert seedckpt(["verify", str(tmp_path / "one")]) == 2
    assert f"{tmp_path / 'one' / 'mask.bin'} is corrupt: bytes 0.." in capsys.readouterr().err


def _crafted(src, dst, index=None, **fields):
    """A copy of the chat token directory ``src`` with ``index`` as its documents.bin -- its CRC32C
    recorded, as a crafted directory would have it -- and manifest ``fields`` replaced (None: removed)."""
    from seedckpt.checkpoint.integrity import crc

    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((dst / "tokens.json").read_text())
    if index is not None:
        index.astype("<u4").tofile(dst / "documents.bin")
        manifest["files"]["documents.bin"]["crc32c"] = [crc((dst / "documents.bin").read_bytes())]
    manifest.update(fields)
    manifest = {k: v for k, v in manifest.items() if v is not None}
    (dst / "tokens.json").write_text(json.dumps(manifest))
    return dst


def test_damaged_and_crafted_directories_are_refused_in_one_line(tmp_path, inputs, chat_tokens):
    def refused(path, message, **data):
        with pytest.raises(SeedckptError, match=message):
            make_dataset(Data(kind="tokens", path=str(path), **data), 304, 48, 0).global_batch(1, 8)

    truncated = _crafted(chat_tokens, tmp_path / "truncated")
    with open(truncated / "mask.bin", "r+b") as f:
        f.truncate(50)
    refused(truncated, r"mask.bin has 50 bytes but tokens.json records .* it was truncated or replaced")

    index = np.fromfile(chat_tokens / "documents.bin", dtype="<u4").reshape(-1, 2)
    damaged = _crafted(chat_tokens, tmp_path / "damaged")  # the index changed, its CRC32C not
    swapped = index.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the lengths still add up
    assert not np.array_equal(swapped, index)
    (damaged / "documents.bin").write_bytes(swapped.tobytes())
    refused(damaged, "documents.bin is corrupt: bytes 0..")
    longer = index.copy()
    longer[0, 0] += 1
    refused(_crafted(chat_tokens, tmp_path / "longer", longer), "documents.bin does not describe")
    early = index.copy()
    early[:, 1] = 1  # labels claimed from position 1 on: the mask says otherwise
    refused(_crafted(chat_tokens, tmp_path / "early", early), "disagrees with documents.bin")

    bad_mask = _crafted(chat_tokens, tmp_path / "bad_mask")
    (bad_mask / "mask.bin").write_bytes(b"\x07" * (bad_mask / "mask.bin").stat().st_size)
    refused(bad_mask, "holds a byte other than 0 or 1")

    for n, (fields, message) in enumerate(
        (
            ({"pad_token_id": 10**6}, "pad_token_id 1000000"),
            ({"pad_token_id": True}, "pad_token_id True"),
            ({"tokens": float("inf")}, "tokens inf"),
            ({"documents": 60.5}, "documents 60.5"),
            ({"check_piece_bytes": 1 << 40}, "check_piece_bytes"),
            ({"crc32c": "x"}, "not a list of integers"),
            ({"content": "audio"}, "content 'audio'"),
            ({"content": None}, "content 'text' with a files section"),  # chat files read as text
        )
    ):
        refused(_crafted(chat_tokens, tmp_path / f"fields{n}", **fields), re.escape(message) + ".*tokenize the corpus")

    other = build_tiny_tokenizer(tmp_path / "other", corpus_of(CHATS), vocab_size=280)
    refused(chat_tokens, "is not the tokenizer .* was made with", tokenizer=str(other))
    same = make_dataset(Data(kind="tokens", path=str(chat_tokens), tokenizer=str(inputs[1])), 304, 48, 0)
    assert same.global_batch(1, 8).num_label_tokens > 0  # the tokenizer it was made with is accepted


def test_chat_tokens_train_alone_and_text_tokens_take_no_budget(tmp_path, inputs, chat_tokens):
    from seedckpt.data.mixture import MixedData

    with pytest.raises(SeedckptError, match="holds conversations .* not in data.sources"):
        MixedData([f"{chat_tokens}:1"], 304, 16, 0)
    text = tmp_path / "text"
    root, tokenizer = inputs
    assert (
        seedckpt(["tokenize", str(root / "a.jsonl"), "--tokenizer", str(tokenizer), "--output", str(text), "--quiet"])
        == 2
    )  # not {"text": ...}
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": m["content"]}) + "\n" for c in CHATS for m in c["messages"]))
    assert seedckpt(["tokenize", str(corpus), "--tokenizer", str(tokenizer), "--output", str(text), "--quiet"]) == 0
    with pytest.raises(SeedckptError, match="max_tokens_per_rank packs SFT samples into rows, but .* holds text"):
        make_dataset(Data(kind="tokens", path=str(text)), 304, 16, 0, row_tokens=64)


def test_bad_conversations_and_tokenizers_are_one_line_and_leave_nothing(tmp_path, inputs, capsys):
    root, tokenizer = inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHATS[0]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    no_template = build_tiny_tokenizer(tmp_path / "plain", corpus_of(CHATS), vocab_size=300, chat_template=None)
    for tok, message in (
        (tokenizer, f"{bad}:2: the conversation has no assistant turn"),
        (no_template, "has no chat template"),
    ):
        assert tokenize(tmp_path / "out", tok, bad) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "plain"]  # no output, partial or lock


def test_mini_trainer_records_tokenize_to_the_same_files_as_their_conversations(tmp_path, inputs, chat_tokens, capsys):
    """The chats rendered as Mini Trainer writes them ({"input_ids", "labels"}, -100 off the assistant's
    tokens), alone or interleaved with conversations, give byte for byte the conversations' directory;
    a label that is not its position's id cannot be a mask and is refused, naming the line."""
    from seedckpt.data.chat import render_samples
    from seedckpt.data.tokenizer import load_tokenizer

    root, tokenizer = inputs
    tok = load_tokenizer(str(tokenizer))
    records = []
    for i, chat in enumerate(CHATS):
        ((ids, mask),) = render_samples(tok, chat["messages"], f"chat {i}")
        records.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]})
    (tmp_path / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    mixed = [r if i % 2 else c for i, (r, c) in enumerate(zip(records, CHATS))]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    for name in ("mini", "mixed"):
        assert tokenize(tmp_path / f"{name}_tokens", tokenizer, tmp_path / f"{name}.jsonl") == 0
        for file in ("tokens.bin", "mask.bin", "documents.bin"):
            assert (tmp_path / f"{name}_tokens" / file).read_bytes() == (chat_tokens / file).read_bytes(), (name, file)

    shifted = {"input_ids": [5, 6, 7], "labels": [-100, 7, -100]}  # a target that is the next id, not its own
    (tmp_path / "shifted.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps(shifted) + "\n")
    capsys.readouterr()
    assert tokenize(tmp_path / "shifted_tokens", tokenizer, tmp_path / "shifted.jsonl") == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path / 'shifted.jsonl'}:2: a label differs from its input id" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "shifted_tokens").exists()
