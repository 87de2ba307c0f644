"""Chat SFT data and tokenized text: assistant-only labels, packing with per-conversation attention,
determinism across epochs and resumes, overflow handling, and bad input with its location."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.common.decoder import Transformer
from models.llama3.args import ModelArgs
from seedckpt.config.job_config import Data
from seedckpt.data.chat import PADDING_DOCUMENT, ChatData, render_samples
from seedckpt.data.datasets import make_dataset
from seedckpt.data.sources import IGNORE_INDEX
from seedckpt.data.tokenizer import load_tokenizer
from seedckpt.utils.errors import SeedckptError
from tests.tiny_tokenizers import build_tiny_tokenizer, chat_template, corpus_of, make_chats

CHATS = make_chats(40, seed=1)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", corpus_of(CHATS) * 3, vocab_size=300)


def _write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _data(tmp_path, tokenizer_dir, records=CHATS, seq_len=64, vocab=304, **kw) -> ChatData:
    path = _write(tmp_path / "chats.jsonl", records)
    return ChatData(Data(kind="chat", path=path, tokenizer=str(tokenizer_dir), **kw), vocab, seq_len, 0)


def _samples(data) -> list[tuple[list[int], list[int]]]:
    return [tuple(t.tolist() for t in data.sample(i)) for i in range(len(data.lengths))]


def test_labels_are_exactly_the_assistant_tokens(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "1 + 1 = 2."},
    ]
    ((ids, mask),) = render_samples(tok, messages, "test")
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    # Expected independently: each assistant turn is its content's tokens then <|eot_id|>, right
    # after the assistant header; everything else (headers, system, user) has no label.
    kept = [i for i, m in zip(ids, mask) if m]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    answers = [
        tok("2 + 3 = 5.", add_special_tokens=False)["input_ids"] + [eot],
        tok("1 + 1 = 2.", add_special_tokens=False)["input_ids"] + [eot],
    ]
    assert kept == answers[0] + answers[1]
    header = tok("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)["input_ids"]
    for answer in answers:  # each masked run sits right after an assistant header
        at = next(i for i in range(len(ids)) if mask[i] and ids[i : i + len(answer)] == answer)
        assert ids[at - len(header) : at] == header and not any(mask[at - len(header) : at])
        assert all(mask[at : at + len(answer)])


THINKING = [  # the first and last turns reason; a template like Qwen3's drops the first one's reasoning
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2 + 3 = 5."},
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "1 + 1 = 2."},
    {"role": "user", "content": "What is 4 + 4?"},
    {"role": "assistant", "content": "<think>\nsum\n</think>\n\n4 + 4 = 8."},
]


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Tokenizers of one vocabulary with the template variants, by (drop_past_thinking, generation_markers)."""
    root, corpus = tmp_path_factory.mktemp("templates"), corpus_of(CHATS + [{"messages": THINKING}]) * 3
    return {
        flags: load_tokenizer(build_tiny_tokenizer(root / f"{flags}", corpus, chat_template=chat_template(*flags)))
        for flags in [(False, False), (True, False), (False, True), (True, True)]
    }


def _labelled_runs(tok, ids, mask) -> list[str]:
    """The decoded runs of labelled tokens."""
    runs, run = [], []
    for token, labelled in zip(ids + [None], mask + [False]):
        if labelled:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


def test_a_template_that_drops_past_reasoning_trains_each_rewritten_turn_against_its_own_prefix(templates):
    tok = templates[True, False]
    whole = tok.apply_chat_template(THINKING, tokenize=False)
    assert "add them" not in whole and "sum" in whole  # the template does rewrite the first turn
    samples = render_samples(tok, THINKING, "test")
    texts = [tok.apply_chat_template(THINKING[:2], tokenize=False), whole]
    assert [ids for ids, _ in samples] == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # The first turn, with its reasoning, as generated after its own prefix; the turns the whole
    # conversation keeps intact (the second has no reasoning to drop) train there, each once.
    assert [_labelled_runs(tok, *s) for s in samples] == [
        [THINKING[1]["content"] + "<|eot_id|>"],
        [THINKING[3]["content"] + "<|eot_id|>", THINKING[5]["content"] + "<|eot_id|>"],
    ]


def test_generation_markers_are_used_and_agree_with_the_prefix_method(templates):
    for chat in CHATS + [{"messages": THINKING}]:  # both methods apply to the template keeping every turn
        assert render_samples(templates[False, True], chat["messages"], "t") == render_samples(
            templates[False, False], chat["messages"], "t"
        )
    # With markers, the labels are what they mark: the whole conversation, its first turn as rewritten.
    ((ids, mask),) = render_samples(templates[True, True], THINKING, "test")
    assert (
        ids == templates[True, False](templates[True, False].apply_chat_template(THINKING, tokenize=False))["input_ids"]
    )
    assert _labelled_runs(templates[True, True], ids, mask) == ["2 + 3 = 5.<|eot_id|>"] + [
        m["content"] + "<|eot_id|>" for m in THINKING[3::2]
    ]


def test_chat_data_of_a_rewriting_template_says_so_and_is_deterministic(tmp_path, templates):
    thinking = [{"messages": THINKING[: 2 * k]} for k in (1, 2, 3)] * 4 + CHATS[:8]
    tokenizer = tmp_path / "tokenizer"
    templates[True, False].save_pretrained(tokenizer)
    data = _data(tmp_path, tokenizer, thinking, vocab=310)
    assert len(data.lengths) == 28  # one sample more for each conversation whose first turn is rewritten
    assert data.description.startswith(f"chat {tmp_path / 'chats.jsonl'}: 28 samples, 28 kept")
    assert data.description.endswith(
        "the chat template rewrites earlier turns (e.g. drops <think> blocks): each assistant turn it rewrites "
        "is trained against its own prefix, 20 conversations -> 28 samples"
    )
    again = _data(tmp_path, tokenizer, thinking, vocab=310)
    for step in (1, 3):
        a, b = data.global_batch(step, 4), again.global_batch(step, 4)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("inputs", "labels", "positions", "document_ids"))
    marked = tmp_path / "marked"
    templates[True, True].save_pretrained(marked)
    data = _data(tmp_path, marked, thinking, vocab=310)
    assert len(data.lengths) == 20 and "labels on the chat template's {% generation %} spans" in data.description


def test_a_rewriting_templates_samples_tokenize_once_to_the_same_batches(tmp_path, templates):
    """``seedckpt tokenize --chat`` writes each sample of a conversation as its own document."""
    from seedckpt.cli.main import main as seedckpt

    tokenizer, thinking = tmp_path / "tokenizer", [{"messages": THINKING[: 2 * k]} for k in (1, 2, 3)] * 3
    templates[True, False].save_pretrained(tokenizer)
    chat = _data(tmp_path, tokenizer, thinking, vocab=310)
    argv = ["tokenize", str(tmp_path / "chats.jsonl"), "--chat", "--tokenizer", str(tokenizer), "--output"]
    assert seedckpt([*argv, str(tmp_path / "tokens"), "--quiet", "--workers", "1"]) == 0
    tokens = make_dataset(Data(kind="tokens", path=str(tmp_path / "tokens")), 310, 64, 0)
    assert len(tokens.lengths) == len(chat.lengths) == 15  # 9 conversations: 1 + 2 + 2 samples per 3
    for step in (1, 2):
        got, want = tokens.global_batch(step, 4), chat.global_batch(step, 4)
        assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("inputs", "labels", "positions"))


def test_a_template_whose_generation_prompt_is_not_its_turns_beginning_names_the_fixes(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = chat_template().replace(
        "<|end_header_id|>\n\n{% endif %}", "<|end_header_id|>\n\n<think>\n{% endif %}"
    )
    with pytest.raises(
        SeedckptError,
        match=r"^x:3: the chat template's generation prompt is not how it begins .*"
        r"\{% generation %\} .*\(data.kind = \"pretokenized\"",
    ):
        render_samples(tok, THINKING, "x:3")


def test_packing_keeps_conversations_apart_and_each_once_per_epoch(tmp_path, tokenizer_dir):
    data = _data(tmp_path, tokenizer_dir, seq_len=128)
    rows = data.rows(0)
    assert sorted(i for row in rows for i in row) == list(range(len(data.lengths)))  # each once
    assert len(rows) < len(data.lengths)  # several per row
    batch = data.global_batch(1, len(rows))
    for b, row in enumerate(rows):
        at = 0
        for doc, i in enumerate(row):
            x, y = data.sample(i)
            assert torch.equal(batch.inputs[b, at : at + len(x)], x) and torch.equal(
                batch.labels[b, at : at + len(x)], y
            )
            assert batch.positions[b, at : at + len(x)].tolist() == list(range(len(x)))
            assert set(batch.document_ids[b, at : at + len(x)].tolist()) == {doc}
            at += len(x)
        assert (batch.labels[b, at:] == IGNORE_INDEX).all()  # padding carries no loss
        assert set(batch.document_ids[b, at:].tolist()) <= {PADDING_DOCUMENT}  # owned by no document
    assert 0 < data.padding_fraction < 0.3 and "padding" in data.description


def test_packed_row_losses_equal_conversations_run_alone(tmp_path, tokenizer_dir):
    data = _data(tmp_path, tokenizer_dir, seq_len=128)
    torch.manual_seed(0)
    model = Transformer(
        ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=304, multiple_of=32, max_seq_len=256)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    batch = data.global_batch(1, 1)
    logits = model(batch.inputs, positions=batch.positions, document_ids=batch.document_ids)
    packed = F.cross_entropy(logits[0], batch.labels[0], ignore_index=IGNORE_INDEX, reduction="none")
    at = 0
    for i in data._row(0):
        x, y = data.sample(i)
        alone = F.cross_entropy(model(x[None])[0], y, ignore_index=IGNORE_INDEX, reduction="none")
        torch.testing.assert_close(packed[at : at + len(x)], alone, rtol=1e-5, atol=1e-5)
        at += len(x)
    assert at > data.lengths[data._row(0)[0]]  # the row really held several conversations


def test_batches_are_a_pure_function_of_seed_and_step_across_epochs(tmp_path, tokenizer_dir):
    data = _data(tmp_path, tokenizer_dir)
    epoch_rows = len(data.rows(0))
    late = 3 * epoch_rows // 4 + 1  # a step well past the first epochs
    fresh = _data(tmp_path, tokenizer_dir)  # a resumed run builds the dataset anew
    for k, step in enumerate((1, 2, late, 1)):  # 1 again: its epoch was let go and is packed again
        if k == 3:
            assert sorted(data._packed) == [2, 3]  # KEPT_EPOCHS: the last two, not every epoch so far
        a, b = data.global_batch(step, 4), fresh.global_batch(step, 4)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("inputs", "labels", "positions", "document_ids"))
    assert data.rows(1) != data.rows(0)  # epochs reshuffle
    assert sorted(i for r in data.rows(1) for i in r) == list(range(len(data.lengths)))
    other_seed = ChatData(
        Data(kind="chat", path=str(tmp_path / "chats.jsonl"), tokenizer=str(tokenizer_dir)), 304, 64, 1
    )
    assert not torch.equal(other_seed.global_batch(1, 4).inputs, data.global_batch(1, 4).inputs)


def test_overflow_truncates_or_drops_and_counts(tmp_path, tokenizer_dir):
    long_chat = {
        "messages": [
            {"role": "user", "content": "What is the capital of France? " * 3},
            {"role": "assistant", "content": "Paris. " * 30},
        ]
    }
    hopeless = {
        "messages": [{"role": "user", "content": "What is 1 + 1? " * 30}, {"role": "assistant", "content": "2."}]
    }
    records = CHATS[:5] + [long_chat, hopeless]
    truncating = _data(tmp_path, tokenizer_dir, records, seq_len=128)
    assert "1 truncated, 1 dropped" in truncating.description  # the hopeless one has no assistant token left
    assert max(truncating.lengths) == 128
    dropping = _data(tmp_path, tokenizer_dir, records, seq_len=128, overflow="drop")
    assert "0 truncated, 2 dropped" in dropping.description and len(dropping.lengths) == 5


def test_gzipped_chats_are_read_and_empty_files_are_called_empty(tmp_path, tokenizer_dir):
    import gzip

    plain = _data(tmp_path, tokenizer_dir)
    packed = tmp_path / "chats.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in CHATS))
    zipped = ChatData(Data(kind="chat", path=str(packed), tokenizer=str(tokenizer_dir)), 304, 64, 0)
    assert _samples(zipped) == _samples(plain)
    assert "no pad token: padding with eos" in zipped.description  # the note, in the run's data line
    for name, text in [("empty.jsonl", ""), ("blank.jsonl", "\n  \n")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(SeedckptError, match=f"{name} is empty: it holds no JSON lines"):
            ChatData(Data(kind="chat", path=str(tmp_path / name), tokenizer=str(tokenizer_dir)), 304, 64, 0)
    packed.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(SeedckptError, match="chats.jsonl.gz is not a complete gzip file"):
        ChatData(Data(kind="chat", path=str(packed), tokenizer=str(tokenizer_dir)), 304, 64, 0)


def test_the_overflow_advice_names_only_what_is_not_set(tmp_path, tokenizer_dir):
    with pytest.raises(SeedckptError, match=r"\(data.overflow = truncate\); raise training.seq_len$"):
        _data(tmp_path, tokenizer_dir, CHATS[:3], seq_len=4)
    with pytest.raises(
        SeedckptError,
        match=r"\(data.overflow = drop\); raise training.seq_len or use "
        r"data.overflow = truncate$",
    ):
        _data(tmp_path, tokenizer_dir, CHATS[:3], seq_len=4, overflow="drop")


@pytest.mark.parametrize(
    "record,message",
    [
        ("{not json", "chats.jsonl:2: not valid JSON"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "chats.jsonl:2: unknown role 'wizard'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chats.jsonl:2: the conversation has no assistant turn"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "must be a string"),
        ({"text": "hello"}, 'chats.jsonl:2: expected {"messages"'),
    ],
)
def test_bad_chat_lines_name_their_location(tmp_path, tokenizer_dir, record, message):
    with pytest.raises(SeedckptError, match=message.replace("{", r"\{").replace("+", r"\+")):
        _data(tmp_path, tokenizer_dir, [CHATS[0], record])


def test_bad_tokenizers_and_paths(tmp_path, tokenizer_dir):
    no_template = build_tiny_tokenizer(tmp_path / "plain", corpus_of(CHATS), chat_template=None)
    with pytest.raises(SeedckptError, match="has no chat template"):
        _data(tmp_path, no_template)
    with pytest.raises(SeedckptError, match="nowhere is not a directory"):
        _data(tmp_path, tmp_path / "nowhere")
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(b"\x0a\x05")  # a sentencepiece model, no tokenizer.json
    (slow / "tokenizer_config.json").write_text("{}")
    with pytest.raises(
        SeedckptError,
        match=r"slow has no tokenizer.json \(only the slow tokenizer's "
        r"tokenizer.model\); seedckpt needs a fast tokenizer",
    ):
        _data(tmp_path, slow)
    with pytest.raises(SeedckptError, match="does not exist"):
        ChatData(Data(kind="chat", path=str(tmp_path / "missing.jsonl"), tokenizer=str(tokenizer_dir)), 304, 64, 0)


def test_tokenized_text_windows_and_vocab_check(tmp_path, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    texts = [c["messages"][-1]["content"] for c in CHATS]
    path = _write(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    data = make_dataset(Data(kind="text", path=path, tokenizer=str(tokenizer_dir)), 304, 16, 0)
    stream = []
    for t in texts:
        stream += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert data.tokens.tolist() == stream
    batch = data.global_batch(3, 4)
    assert torch.equal(batch.inputs[:, 1:], batch.labels[:, :-1])
    with pytest.raises(SeedckptError, match="has 300 tokens but the model's vocab_size is 256"):
        make_dataset(Data(kind="text", path=path, tokenizer=str(tokenizer_dir)), 256, 16, 0)


@pytest.mark.parametrize("packing", [True, False])
def test_mini_trainers_pretokenized_format_gives_the_batches_of_the_same_chats(tmp_path, tokenizer_dir, packing):
    """The chats written as Mini Trainer writes them (input_ids, and labels with -100 off the
    assistant's tokens) train on exactly the rows, labels, positions and documents of the chats."""
    from seedckpt.data.chat import PretokenizedData

    tokenizer = load_tokenizer(str(tokenizer_dir))
    records = []
    for i, chat in enumerate(CHATS):
        ((ids, mask),) = render_samples(tokenizer, chat["messages"], f"chat {i}")
        records.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]})
    path = _write(tmp_path / "pretokenized.jsonl", records)
    pretokenized = PretokenizedData(Data(kind="pretokenized", path=path, packing=packing), 304, 48, 0)
    chats = _data(tmp_path, tokenizer_dir, seq_len=48, packing=packing)
    assert pretokenized.description.startswith(f"pretokenized {path}: 40 samples, ")
    for step in (1, 2, 9):
        got, want = pretokenized.global_batch(step, 4), chats.global_batch(step, 4)
        for name in ("labels", "positions", "document_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        real = want.document_ids != PADDING_DOCUMENT  # the pad ids differ
        assert torch.equal(got.inputs[real], want.inputs[real])


@pytest.mark.parametrize(
    "record,message",
    [
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "of one length"),
        ({"input_ids": [1, 2, 999], "labels": [-100, 2, 999]}, "token ids in [0, 304)"),
        ({"input_ids": [1, 2, 3], "labels": [-100, -5, 3]}, "labels must be token ids or -100"),
        ({"text": "hello"}, 'expected {"input_ids": [...], "labels": [...]}'),
    ],
)
def test_bad_pretokenized_records_are_one_line_naming_the_line(tmp_path, record, message):
    path = _write(tmp_path / "bad.jsonl", [{"input_ids": [1, 2], "labels": [-100, 2]}, record])
    with pytest.raises(SeedckptError, match=rf"bad.jsonl:2: .*{re.escape(message)}"):
        make_dataset(Data(kind="pretokenized", path=path), 304, 16, 0)


def test_sft_trains_on_a_pretokenized_file(tmp_path, debug_seed):
    from tests.test_train import losses, torchrun

    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(24):
        ids = torch.randint(0, 512, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
        records.append({"input_ids": ids, "labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2 :]})
    path = _write(tmp_path / "train.jsonl", records)
    data = ["--data.kind", "pretokenized", "--data.path", path, "--training.steps", "3"]
    sft = [
        "--finetune.mode",
        "sft",
        "--finetune.pretrained",
        str(debug_seed),
        "--parallelism.pipeline_parallel_degree",
        "1",
    ]
    run = torchrun(tmp_path / "run", debug_seed, 1, *sft, *data)
    assert f"data: pretokenized {path}: 24 samples, 24 kept" in run.stdout, run.stdout
    assert len(losses(tmp_path / "run")) == 3


@pytest.mark.parametrize(
    "packing,seq_len,padding", [(True, 128, "9.6%"), (True, 256, "6.3%"), (False, 128, "61.6%"), (False, 256, "80.8%")]
)
def test_the_demo_sets_padding_is_what_the_docs_say(packing, seq_len, padding):
    """The figures docs/benchmarks.md gives for the shipped chat set (200 conversations of 28-98 tokens)."""
    demo = Path(__file__).resolve().parents[1] / "configs" / "sft_demo"
    data = ChatData(
        Data(kind="chat", path=str(demo / "chats.jsonl"), tokenizer=str(demo / "tokenizer"), packing=packing),
        600,
        seq_len,
        0,
    )
    assert len(data.lengths) == 200 and (min(data.lengths) + 1, max(data.lengths) + 1) == (28, 98)
    assert f"{data.padding_fraction:.1%}" == padding
