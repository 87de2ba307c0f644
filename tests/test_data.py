"""Training data: a pure function of (seed, step), learnable, and sliced the same way for every layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seedckpt.config.job_config import Data
from seedckpt.data.datasets import held_out_dataset, make_dataset
from seedckpt.data.sources import ALPHABET, SyntheticData, TextData, builtin_corpus
from seedckpt.utils.errors import SeedckptError


def test_synthetic_batches_depend_only_on_seed_and_step():
    data = SyntheticData(vocab_size=512, seq_len=64, seed=0)
    a, b = data.global_batch(3, 8), SyntheticData(512, 64, 0).global_batch(3, 8)
    assert torch.equal(a.inputs, b.inputs) and a.inputs.shape == (8, 64)
    assert torch.equal(a.inputs[:, 1:], a.labels[:, :-1])  # labels are the next tokens
    assert not torch.equal(a.inputs, data.global_batch(4, 8).inputs)
    assert not torch.equal(a.inputs, SyntheticData(512, 64, 1).global_batch(3, 8).inputs)


def test_synthetic_rows_repeat_a_motif():
    b = SyntheticData(vocab_size=512, seq_len=64, seed=0).global_batch(1, 16)
    batch = torch.cat([b.inputs, b.labels[:, -1:]], 1)
    assert int(batch.max()) < ALPHABET
    for row in batch:
        period = next(p for p in range(4, 17) if torch.equal(row[p:], row[:-p]))
        assert 4 <= period <= 16  # everything after one period is predictable by copying


def test_text_windows_come_from_the_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 20)
    data = TextData.bytes(str(path), vocab_size=512, seq_len=32, seed=0)
    batch = data.global_batch(5, 4)
    raw = path.read_bytes()
    for inputs, labels in zip(batch.inputs, batch.labels):
        assert bytes(inputs.tolist() + labels[-1:].tolist()) in raw
    assert torch.equal(batch.inputs, TextData.bytes(str(path), 512, 32, 0).global_batch(5, 4).inputs)


def test_builtin_corpus_is_real_text():
    corpus = builtin_corpus()
    assert len(corpus) > 200_000 and b"def " in corpus


@pytest.mark.parametrize(
    "kind,path,vocab,message",
    [
        ("text", "", 128, "vocab_size >= 256"),
        ("text", "/nonexistent.txt", 512, "is not a file"),
        ("video", "", 512, "choose synthetic, text, tokens, chat or pretokenized"),
    ],
)
def test_bad_data_settings(kind, path, vocab, message):
    with pytest.raises(SeedckptError, match=message):
        make_dataset(Data(kind=kind, path=path), vocab, 32, 0)


@pytest.mark.parametrize(
    "data,path,message",
    [
        (Data(kind="text"), "/nonexistent.txt", "validation.path /nonexistent.txt is not a file"),
        (Data(kind="chat", tokenizer="configs/sft_demo/tokenizer"), "/no.jsonl", "validation.path /no.jsonl does not"),
        (
            Data(kind="tokens", path="{tmp}"),
            "{tmp}/held_out",
            "validation.path {tmp}/held_out is not a token directory",
        ),
        (Data(kind="tokens", path="{tmp}"), "", "data.kind = 'tokens' needs validation.path"),
    ],
    ids=["text", "chat", "tokens", "none"],
)
def test_bad_held_out_data_names_validation_path(tmp_path, data, path, message):
    """The held-out data is read as the training data is, and a problem with it names the key that
    points at it: never ``data.path``, which may be fine."""
    (tmp_path / "held_out").mkdir()
    data = dataclasses.replace(data, path=data.path.format(tmp=tmp_path))
    with pytest.raises(SeedckptError, match=message.format(tmp=tmp_path)) as refused:
        held_out_dataset(data, path.format(tmp=tmp_path), 1024, 32, 0)
    assert "data.path" not in str(refused.value)
