"""Token files (``seedckpt tokenize``, ``data.kind = "tokens"``): a corpus tokenized once in
parallel, exactly what the tokenizer gives each document; windows read without holding the corpus,
under an address-space cap smaller than the file; damage and bad input refused in one line."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from seedckpt.cli.main import main as seedckpt
from seedckpt.utils.errors import SeedckptError
from tests.dist import HANG_S
from tests.test_train import REPO, losses, torchrun
from tests.tiny_tokenizers import build_tiny_tokenizer, corpus_of, make_chats

DOCS = corpus_of(make_chats(20, seed=2))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", DOCS * 3, vocab_size=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The documents as JSONL, JSONL.gz (a directory of both) and one plain text file."""
    root = tmp_path_factory.mktemp("corpus")
    half = len(DOCS) // 2
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:half]))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS[half:])
    (root / "plain.txt").write_text(DOCS[0])
    return root


def _expected(tokenizer_dir, docs) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [t for d in docs for t in (*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id)]


def tokenize(sources, tokenizer, output, *options: str) -> int:
    """``seedckpt tokenize``'s exit status."""
    return seedckpt(["tokenize", str(sources), "--tokenizer", str(tokenizer), "--output", str(output), *options])


def test_tokenize_in_parallel_gives_each_documents_ids_then_eos(tmp_path, tokenizer, corpus, capsys):
    sources = f"{corpus / 'a.jsonl'},{corpus / 'b.jsonl.gz'},{corpus / 'plain.txt'}"
    assert tokenize(sources, tokenizer, tmp_path / "t2", "--workers", "2", "--quiet") == 0
    assert "wrote" in capsys.readouterr().out
    got = np.fromfile(tmp_path / "t2" / "tokens.bin", dtype="<u4").tolist()
    assert got == _expected(tokenizer, [*DOCS, DOCS[0]])
    manifest = json.loads((tmp_path / "t2" / "tokens.json").read_text())
    assert manifest["tokens"] == len(got) and manifest["documents"] == len(DOCS) + 1
    # one worker writes the same bytes; `verify` checks them
    assert tokenize(sources, tokenizer, tmp_path / "t1", "--workers", "1", "--quiet") == 0
    assert (tmp_path / "t1" / "tokens.bin").read_bytes() == (tmp_path / "t2" / "tokens.bin").read_bytes()
    assert seedckpt(["verify", str(tmp_path / "t1"), "--quiet"]) == 0
    raw = bytearray((tmp_path / "t1" / "tokens.bin").read_bytes())
    raw[100] ^= 1
    (tmp_path / "t1" / "tokens.bin").write_bytes(bytes(raw))
    assert seedckpt(["verify", str(tmp_path / "t1"), "--quiet"]) == 2
    assert "is corrupt: bytes 0.." in capsys.readouterr().err


def test_a_parquet_corpus_tokenizes_to_the_ids_of_the_same_jsonl(tmp_path, tokenizer, corpus, capsys, monkeypatch):
    """A "text" column read a record batch at a time (batches smaller than the file: 3 rows), alone and
    in a directory beside JSONL; a file without the column, a null row or a damaged file is one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seedckpt.data import sources

    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 3)
    mixed = tmp_path / "mixed"
    shutil.copytree(corpus, mixed, ignore=shutil.ignore_patterns("*.txt", "b.jsonl.gz"))
    half = len(DOCS) // 2
    pq.write_table(pa.table({"id": list(range(len(DOCS) - half)), "text": DOCS[half:]}), mixed / "b.parquet")
    assert tokenize(mixed / "b.parquet", tokenizer, tmp_path / "alone", "--quiet") == 0
    assert np.fromfile(tmp_path / "alone" / "tokens.bin", dtype="<u4").tolist() == _expected(tokenizer, DOCS[half:])
    assert tokenize(mixed, tokenizer, tmp_path / "dir", "--quiet") == 0  # a.jsonl then b.parquet
    assert np.fromfile(tmp_path / "dir" / "tokens.bin", dtype="<u4").tolist() == _expected(tokenizer, DOCS)

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "no_text.parquet")
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "null.parquet")
    (tmp_path / "damaged.parquet").write_bytes((mixed / "b.parquet").read_bytes()[:-40])
    capsys.readouterr()
    for name, message in (
        ("no_text.parquet", 'no "text" column (columns: content)'),
        ("null.parquet", 'row 2: "text" is NoneType, not a string'),
        ("damaged.parquet", "not a readable parquet file"),
    ):
        assert tokenize(tmp_path / name, tokenizer, tmp_path / f"out-{name}", "--quiet") == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / f"out-{name}").exists()


def test_inputs_are_several_arguments_and_a_name_with_a_comma_is_one_file(tmp_path, tokenizer, corpus):
    odd = tmp_path / "web,2024.jsonl"
    shutil.copy(corpus / "a.jsonl", odd)
    assert (
        seedckpt(
            [
                "tokenize",
                str(odd),
                str(corpus / "b.jsonl.gz"),
                "--tokenizer",
                str(tokenizer),
                "--output",
                str(tmp_path / "t"),
                "--quiet",
            ]
        )
        == 0
    )
    half = len(DOCS) // 2
    assert np.fromfile(tmp_path / "t" / "tokens.bin", dtype="<u4").tolist() == _expected(
        tokenizer, DOCS[:half] + DOCS[half:]
    )


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, tokenizer, corpus, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    out = tmp_path / "tokens"
    assert tokenize(bad, tokenizer, out, "--quiet") == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, no partial, no lock
    out.mkdir()
    assert tokenize(corpus / "a.jsonl", tokenizer, out) == 2
    assert "exists; choose a new output directory" in capsys.readouterr().err


def test_training_reads_windows_of_the_token_file(tmp_path, tokenizer, corpus, debug_seed):
    from seedckpt.data.token_files import TokenFileData

    out = tmp_path / "tokens"
    assert tokenize(corpus / "a.jsonl", tokenizer, out, "--quiet") == 0
    steps = ["--training.steps", "2", "--data.kind", "tokens", "--data.path", str(out)]
    run = torchrun(tmp_path / "run", debug_seed, 1, "--parallelism.pipeline_parallel_degree", "1", *steps)
    assert f"data: tokens {out}" in run.stdout and len(losses(tmp_path / "run")) == 2
    # configs/debug.toml's 3 warmup steps in a 2-step run: the one warning line that says so
    assert "warning: training.warmup_steps = 3 is longer than the run's 2 steps" in run.stdout
    ids = torch.from_numpy(np.fromfile(out / "tokens.bin", dtype="<u4").astype(np.int64))
    data = TokenFileData(str(out), 512, 16, seed=3)
    batch = data.global_batch(7, 4)
    for inputs, labels in zip(batch.inputs, batch.labels):
        starts = [s for s in range(len(ids) - 16) if torch.equal(ids[s : s + 16], inputs)]
        assert starts and torch.equal(ids[starts[0] + 1 : starts[0] + 17], labels)
    assert torch.equal(data.global_batch(7, 4).inputs, batch.inputs)  # a function of (seed, step)
    with pytest.raises(SeedckptError, match="vocabulary of 300 tokens but the model's vocab_size is 256"):
        TokenFileData(str(out), 256, 16, seed=3)
    with open(out / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(SeedckptError, match="it was truncated or replaced"):
        TokenFileData(str(out), 512, 16, seed=3)


CAPPED = """
import os, resource, sys
import numpy as np
from seedckpt.data.token_files import TokenFileData
data = TokenFileData(sys.argv[1], 1 << 20, 2048, seed=0)
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
cap = vm + (48 << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
for step in range(1, 21):
    data.global_batch(step, 8)
try:
    np.fromfile(os.path.join(sys.argv[1], "tokens.bin"), dtype="<u4")
except MemoryError:
    print("whole file refused under the cap; 20 batches read")
"""


def test_a_token_file_larger_than_the_address_space_cap_trains(tmp_path):
    """A 256 MiB token file, read by a process capped (RLIMIT_AS) at 48 MiB above what it had mapped
    once its imports were done: batches are read, the whole file cannot be."""
    from seedckpt.data.token_files import write_token_directory

    rng = np.random.default_rng(0)
    blocks = (({"tokens.bin": rng.integers(0, 1 << 20, 1 << 24, dtype=np.uint32)}, 1, 0) for _ in range(4))
    write_token_directory(tmp_path / "big", blocks, vocab_size=1 << 20)
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED, str(tmp_path / "big")], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "whole file refused under the cap; 20 batches read" in proc.stdout


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory, tokenizer, corpus):
    """Three token directories (web, code, math: one corpus tokenized once, each its own copy)."""
    root = tmp_path_factory.mktemp("sources")
    assert tokenize(corpus / "a.jsonl", tokenizer, root / "web", "--quiet", "--workers", "1") == 0
    for name in ("code", "math"):
        shutil.copytree(root / "web", root / name)
    return root


def test_a_mixture_draws_each_source_at_its_weight_as_a_function_of_the_step(three_sources):
    from seedckpt.data.mixture import MixedData

    entries = [f"{three_sources / 'web'}:7", f"{three_sources / 'code'}:2", f"{three_sources / 'math'}:1"]
    data = MixedData(entries, 512, 16, seed=0)
    assert data.description == "mixture of web 70%, code 20%, math 10%"
    counts = {"web": 0, "code": 0, "math": 0}
    for step in range(1, 301):
        batch = data.global_batch(step, 8)
        assert sum(data.consumption.values()) == 8 and batch.inputs.shape == (8, 16)
        for name, rows in data.consumption.items():
            counts[name] += rows
    realized = {name: n / 2400 for name, n in counts.items()}
    assert realized == pytest.approx({"web": 0.7, "code": 0.2, "math": 0.1}, abs=0.03), realized
    again = MixedData(entries, 512, 16, seed=0)  # a fresh process resuming at step 123 draws the same rows
    assert torch.equal(again.global_batch(123, 8).inputs, data.global_batch(123, 8).inputs)
    assert not torch.equal(
        MixedData(entries, 512, 16, seed=1).global_batch(123, 8).inputs, again.global_batch(123, 8).inputs
    )
    for entry, message in (("web", "DIRECTORY:WEIGHT"), (f"{three_sources / 'web'}:0", "a weight > 0")):
        with pytest.raises(SeedckptError, match=message):
            MixedData([entry], 512, 16, seed=0)


def test_a_mixed_run_logs_each_sources_rows_and_resumes_to_the_same_losses(tmp_path, three_sources, debug_seed):
    mix = [
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--training.steps",
        "4",
        "--checkpoint.interval",
        "2",
        "--data.kind",
        "tokens",
        "--data.sources",
        ",".join(f"{three_sources / name}:{w}" for name, w in (("web", 0.5), ("code", 0.3), ("math", 0.2))),
    ]
    torchrun(tmp_path / "straight", debug_seed, 1, *mix)
    torchrun(tmp_path / "resumed", debug_seed, 1, *mix, "--training.stop_after_step", "2")
    torchrun(tmp_path / "resumed", debug_seed, 1, *mix)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rows_web"] + r["rows_code"] + r["rows_math"] == 8 for r in rows), rows


def test_data_sources_without_token_data_is_refused_by_the_config():
    from seedckpt.config.job_config import load_config

    with pytest.raises(SeedckptError, match="data.sources mixes token directories: set data.kind = 'tokens'"):
        load_config(None, ["--data.sources", "tokens/web:1"])
    with pytest.raises(SeedckptError, match="write it as DIRECTORY:WEIGHT"):
        load_config(None, ["--data.kind", "tokens", "--data.sources", "tokens/web:lots"])


def test_sources_as_toml_tables_are_the_strings_mixture(tmp_path, three_sources):
    """``[[data.sources]]`` tables with path and weight (the names the docs give) draw exactly the rows
    of the ``"PATH:WEIGHT"`` strings; a table that is not a token mixture is one line."""
    from seedckpt.config.job_config import load_config
    from seedckpt.data.mixture import MixedData

    config = tmp_path / "mix.toml"
    tables = "".join(
        f'[[data.sources]]\npath = "{three_sources / name}"\nweight = {weight}\n'
        for name, weight in (("web", 7), ("code", 2), ("math", 1))
    )
    config.write_text('[data]\nkind = "tokens"\n' + tables)
    sources = load_config(str(config), []).data.sources
    strings = [f"{three_sources / 'web'}:7", f"{three_sources / 'code'}:2", f"{three_sources / 'math'}:1"]
    from_tables, from_strings = MixedData(sources, 512, 16, seed=0), MixedData(strings, 512, 16, seed=0)
    assert torch.equal(from_tables.global_batch(9, 8).inputs, from_strings.global_batch(9, 8).inputs)
    for table, message in (
        ({"path": "x", "weight": -1}, "give path (a token directory) and weight"),
        ({"path": "x", "weight": 1, "kind": "chat"}, "mixes token directories only"),
        ({"path": "x", "weight": 1, "wieght": 2}, "unknown keys ['wieght']"),
    ):
        with pytest.raises(SeedckptError, match=re.escape(message)):
            MixedData([table], 512, 16, seed=0)


def test_progress_counts_the_bytes_read_from_each_source(tmp_path, corpus, monkeypatch):
    """The bar's total is the sources' sizes on disk, so its blocks report bytes read -- compressed
    bytes for gzip, a row share of the file for parquet -- never characters, which overshoot a
    gzipped file's size several times."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seedckpt.data import sources
    from seedckpt.data.tokenize import BLOCK_CHARS, _blocks, _sft_blocks

    monkeypatch.setattr(sources, "READ_REPORT_LINES", 2)
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 3)
    big = tmp_path / "big.jsonl.gz"
    with gzip.open(big, "wt") as f:  # compresses ~100x: characters would be far more than the bytes read
        f.writelines(json.dumps({"text": "word " * 4000}) + "\n" for _ in range(60))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "c.parquet")
    files = [corpus / "a.jsonl", corpus / "b.jsonl.gz", corpus / "plain.txt", tmp_path / "c.parquet", big]
    blocks = list(_blocks(files))
    assert sum(size for _, size in blocks) == sum(f.stat().st_size for f in files)
    assert sum(len(text) for items, _ in blocks for text, _ in items) > 20 * big.stat().st_size
    assert (
        all(items for items, _ in blocks) and max(sum(len(t) for t, _ in items) for items, _ in blocks) <= BLOCK_CHARS
    )

    chats = tmp_path / "chats.jsonl.gz"
    with gzip.open(chats, "wt") as f:
        f.writelines(json.dumps(c) + "\n" for c in make_chats(10, seed=5))
    assert sum(size for _, size in _sft_blocks([chats], 300)) == chats.stat().st_size


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """3 MiB of plain text, 12 of DOCS' words a line: one document, too large to encode whole under
    the cap below."""
    rng = np.random.default_rng(0)
    words = np.array(sorted({w for d in DOCS for w in d.split()}))
    text = "".join(" ".join(row) + "\n" for row in rng.choice(words, (48_000, 12)))
    path = tmp_path_factory.mktemp("lines") / "lines.txt"
    path.write_text(text)
    return path


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizers() -> dict:
    """GPT-2's byte-level pre-tokenizer (as its tokenizer.json has it, and adding a prefix space),
    Llama 3's pattern before a byte-level one, and metaspace."""
    from tokenizers import Regex, pre_tokenizers

    return {
        "gpt2": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "gpt2_prefix_space": pre_tokenizers.ByteLevel(add_prefix_space=True),
        "llama3": pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        "metaspace": pre_tokenizers.Metaspace(prepend_scheme="always"),
    }


def _bpe(pre_tokenizer, texts: list[str], vocab_size: int = 400, special: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special), show_progress=False, initial_alphabet=alphabet
    )
    bpe.train_from_iterator(texts, trainer)
    return bpe


def _texts(seed: int = 0) -> dict[str, str]:
    """Prose with assorted separators, indented code (lists of quoted names: long stretches where no
    space follows a non-space), and lines of Chinese (no spaces at all)."""
    import random

    rng = random.Random(seed)
    words = sorted({w for d in DOCS for w in d.split()})
    prose = "".join(d + rng.choice([" ", "  ", "\n", ".\n\n", "\t", ",\n", "!\n "]) for d in DOCS * 4)
    code = []
    for _ in range(60):
        indent = " " * rng.choice((4, 8))
        code += [f"{indent}{rng.choice(words)} = [\n"]
        code += [f'{indent}    "{rng.choice(words)}",\n' for _ in range(rng.randint(3, 12))]
        code += [f"{indent}]  # {rng.choice(words)} {rng.randint(0, 9999)}\n\n"]
    hanzi = "北京是中国的首都东京大阪市人口很多"
    chinese = "".join(
        "".join(rng.choices(hanzi, k=rng.randint(4, 20))) + rng.choice("，。！") + "\n" for _ in range(300)
    )
    return {"prose": prose, "code": "".join(code), "chinese": chinese}


def test_cut_pieces_end_where_a_pre_token_does_so_the_pieces_ids_are_the_whole_texts():
    """The rule: pieces that join back to the text, each cut before its last space that a non-space
    follows, looking up to the bound for one; else after a line break between non-spaces; else at the
    bound. The pieces' ids joined are the whole text's for GPT-2's and Llama 3's byte-level
    pre-tokenizers on prose, indented code and Chinese, and for a prefix space and metaspace on prose
    and code (a line cut, as in Chinese, gets their prefix). Before, code was cut before a line break
    after a comma, which Llama 3's pattern joins to the comma."""
    import io

    from seedckpt.data.sources import cut_pieces

    def cut(text: str, size: int, limit: int) -> list[str]:
        return list(cut_pieces(io.StringIO(text), size, limit))

    assert cut("ab cd  ef\ngh", 5, 64) == ["ab", " cd ", " ef\ngh"]
    assert cut("abcdefgh ij", 5, 64) == ["abcdefgh", " ij"]  # no space before a non-space within 5: further
    assert cut("abcdefgh ij", 5, 6) == ["abcdef", "gh", " ij"]  # nor within the bound: at the bound
    assert cut("北京是首都\n东京。\n大阪", 3, 7) == ["北京是首都\n", "东京。\n大阪"]  # after a line break
    assert cut("", 5, 8) == [] and cut("   ", 2, 8) == ["   "]

    texts = _texts()
    for name, pre_tokenizer in _pre_tokenizers().items():
        prefixed = name in ("gpt2_prefix_space", "metaspace")
        cases = {kind: text for kind, text in texts.items() if not (prefixed and kind == "chinese")}
        bpe = _bpe(pre_tokenizer, list(cases.values()))
        for (kind, text), (size, limit) in itertools.product(cases.items(), ((24, 64), (61, 200), (200, 600))):
            pieces = cut(text, size, limit)
            assert "".join(pieces) == text and max(map(len, pieces)) <= limit
            joined = [i for e in bpe.encode_batch(pieces) for i in e.ids]
            assert joined == bpe.encode(text).ids, (name, kind, size)


def test_a_plain_text_file_in_pieces_has_the_ids_of_the_whole_text(tmp_path, monkeypatch):
    """Prose, indented code and Chinese in one file, cut into pieces of about 64 characters (at most
    256) in blocks of 512, tokenized by 2 workers with Llama 3's pattern: the ids of the whole text
    encoded at once by transformers, then eos."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from seedckpt.data import sources
    from seedckpt.data import tokenize as tokenizing

    text = "".join(_texts(seed=1).values())
    bpe = _bpe(_pre_tokenizers()["llama3"], [text], vocab_size=600, special=("<|end_of_text|>",))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end_of_text|>").save_pretrained(tmp_path / "tok")
    (tmp_path / "all.txt").write_text(text)
    monkeypatch.setattr(sources, "PIECE_CHARS", 64)
    monkeypatch.setattr(sources, "MAX_PIECE_CHARS", 256)
    monkeypatch.setattr(tokenizing, "BLOCK_CHARS", 512)
    assert tokenize(tmp_path / "all.txt", tmp_path / "tok", tmp_path / "t", "--workers", "2", "--quiet") == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    whole = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert np.fromfile(tmp_path / "t" / "tokens.bin", dtype="<u4").tolist() == whole


def test_workers_encode_as_transformers_calls_the_tokenizer(tmp_path, tokenizer):
    """A worker runs the tokenizer transformers built, without transformers: as it calls it, a special
    token's text in a document is that token, or with ``split_special_tokens`` its characters' ids."""
    from transformers import AutoTokenizer

    text = f"{DOCS[0]} <|eot_id|> {DOCS[1]}"
    (tmp_path / "doc.txt").write_text(text)
    AutoTokenizer.from_pretrained(tokenizer, split_special_tokens=True).save_pretrained(tmp_path / "splits")
    ids = {}
    for name, directory in (("whole", tokenizer), ("split", tmp_path / "splits")):
        assert tokenize(tmp_path / "doc.txt", directory, tmp_path / name, "--quiet", "--workers", "1") == 0
        ids[name] = np.fromfile(tmp_path / name / "tokens.bin", dtype="<u4").tolist()
        assert ids[name] == _expected(directory, [text])
    assert len(ids["split"]) > len(ids["whole"])


# A chat worker as the pool runs it: started, then given a record already tokenized (ids, label mask);
# it prints its arrays and which of the token writer's imports it made.
CHAT_WORKER_PROBE = """
import sys
from seedckpt.data import tokenize_worker
tokenize_worker.start_chat(sys.argv[1], (("tokens.bin", "<u4"), ("mask.bin", "u1"), ("documents.bin", "<u4")))
arrays, samples, size = tokenize_worker.encode_conversations(([("a:1", ([5, 6, 7], [False, False, True]))], 9))
print({name: a.tolist() for name, a in arrays.items()}, samples, size)
heavy = ("torch.distributed.checkpoint", "seedckpt.checkpoint", "seedckpt.data.token_files")
print([m for m in heavy if m in sys.modules])
"""


def test_a_chat_worker_starts_without_the_checkpoint_package(tokenizer):
    """A chat worker loads the tokenizer with transformers and renders with data.chat, but imports
    neither the token directory's writer nor the checkpoint package (DCP: ~0.6 CPU s a worker): before,
    it imported the parent's module, and data.tokenizer imported the package for a folder's name."""
    probe = [sys.executable, "-c", CHAT_WORKER_PROBE, str(tokenizer)]
    proc = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    arrays, imported = proc.stdout.strip().splitlines()[-2:]
    assert arrays == "{'tokens.bin': [5, 6, 7], 'mask.bin': [0, 0, 1], 'documents.bin': [[3, 2]]} 1 9"
    assert imported == "[]"


def test_documents_in_small_pieces_and_blocks_give_the_same_ids_and_a_huge_jsonl_line_is_refused(
    tmp_path, tokenizer, corpus, capsys, monkeypatch
):
    """JSONL, JSONL.gz and plain text cut into 16-character pieces in 64-character blocks: the same ids
    and document count as each document encoded whole (``kind = "text"`` reads them the same way);
    a JSONL line over 16 MiB is one line naming it, and nothing is left behind."""
    from seedckpt.data import sources
    from seedckpt.data import tokenize as tokenizing
    from seedckpt.data.sources import TextData

    monkeypatch.setattr(sources, "PIECE_CHARS", 16)
    monkeypatch.setattr(tokenizing, "BLOCK_CHARS", 64)
    files = [corpus / "a.jsonl", corpus / "b.jsonl.gz", corpus / "plain.txt"]
    assert tokenize(",".join(map(str, files)), tokenizer, tmp_path / "t", "--workers", "2", "--quiet") == 0
    expected = _expected(tokenizer, [*DOCS, DOCS[0]])
    assert np.fromfile(tmp_path / "t" / "tokens.bin", dtype="<u4").tolist() == expected
    assert json.loads((tmp_path / "t" / "tokens.json").read_text())["documents"] == len(DOCS) + 1
    as_text = TextData.tokenized(",".join(map(str, files)), str(tokenizer), 512, 8, seed=0)
    assert as_text.tokens.tolist() == expected

    huge = tmp_path / "huge" / "huge.jsonl"
    huge.parent.mkdir()
    huge.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "word " * (4 << 20)}) + "\n")
    capsys.readouterr()
    assert tokenize(huge, tokenizer, huge.parent / "t", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert f"{huge}:2: line longer than 16 MiB; split the record" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in huge.parent.iterdir()) == ["huge.jsonl"]


# A tokenizer worker (spawned through ``multiprocessing.set_executable``) runs under an address-space
# cap of HEADROOM MiB above this process's once it has what a worker loads: the imports and the tokenizer.
CAPPED_WORKERS = """
import multiprocessing, os, sys
from seedckpt.cli.main import main
from seedckpt.data.tokenizer import load_tokenizer
import seedckpt.data.tokenize
source, tokenizer, output, capped, headroom = sys.argv[1:]
load_tokenizer(tokenizer)
kib = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) + int(headroom) * 1024
with open(capped, "w") as f:
    f.write(f'#!/bin/sh\\nulimit -v {kib}\\nexec {sys.executable} "$@"\\n')
os.chmod(capped, 0o755)
multiprocessing.set_executable(capped)
sys.exit(main(["tokenize", source, "--tokenizer", tokenizer, "--output", output, "--workers", "1", "--quiet"]))
"""
ENCODE_WHOLE = """
import sys
from seedckpt.data.tokenizer import load_tokenizer
import seedckpt.data.tokenize
tokenizer = load_tokenizer(sys.argv[1])
text = open(sys.argv[2]).read()
print("loaded", flush=True)
tokenizer(text, add_special_tokens=False)
"""


def test_a_plain_text_file_larger_than_a_workers_memory_cap_tokenizes_in_pieces(tmp_path, tokenizer, lines):
    """3 MiB of 12-word lines (one document) tokenized by a worker capped (RLIMIT_AS) at 256 MiB above
    its footprint once loaded: encoded whole the text needs ~200 bytes a character, and a process under
    the same cap fails to (a worker dying so once hung the command); pieces and blocks fit. This
    byte-level BPE ends a pre-token at each line break, so the ids are the lines' ids joined, then eos."""
    capped, out = tmp_path / "capped-python", tmp_path / "tokens"
    driver = [sys.executable, "-c", CAPPED_WORKERS, str(lines), str(tokenizer), str(out), str(capped), "256"]
    run = subprocess.run(driver, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-2000:]
    whole = subprocess.run(
        [str(capped), "-c", ENCODE_WHOLE, str(tokenizer), str(lines)], cwd=REPO, capture_output=True, timeout=HANG_S
    )
    assert whole.stdout == b"loaded\n" and whole.returncode != 0, whole.stderr[-2000:]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    text = lines.read_text().splitlines(keepends=True)
    expected = [t for k in range(0, len(text), 4096) for ids in tok(text[k : k + 4096])["input_ids"] for t in ids]
    assert np.fromfile(out / "tokens.bin", dtype="<u4").tolist() == [*expected, tok.eos_token_id]
    assert json.loads((out / "tokens.json").read_text())["documents"] == 1


def _worker_pids(pid: int) -> list[int]:
    """The tokenizer workers of process ``pid``: its children started by ``multiprocessing``'s spawn."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            children += map(int, open(f"/proc/{pid}/task/{task}/children").read().split())
    return [c for c in children if b"spawn_main" in _read(f"/proc/{c}/cmdline")]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_worker_killed_mid_run_ends_the_command_in_one_line_leaving_nothing(tmp_path, tokenizer, lines):
    """A worker SIGKILLed (as the OOM killer does) once the first block is written: the command exits 2
    with one line saying what happened and what to do, the other worker is gone, and neither the
    partial directory nor the lock is left (``multiprocessing.Pool`` waited forever for the lost block)."""
    out = tmp_path / "tokens"
    command = ["-m", "seedckpt.cli.main", "tokenize", str(lines), "--tokenizer", str(tokenizer), "--output", str(out)]
    proc = subprocess.Popen(
        [sys.executable, *command, "--workers", "2", "--quiet"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + HANG_S
        while not any(p.stat().st_size for p in tmp_path.glob(".tokens.*.partial/tokens.bin")):
            assert proc.poll() is None and time.monotonic() < deadline, f"no block written; exit {proc.poll()}"
            time.sleep(0.01)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()  # a command that hangs (as it did) must not outlive the test
    err = stderr.decode().strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and not stdout, err
    assert "tokenize: error: a tokenizer worker process ended abruptly" in err and "fewer --workers" in err
    assert list(tmp_path.iterdir()) == []
    assert all(_read(f"/proc/{pid}/stat").split(b") ")[-1][:1] in (b"", b"Z") for pid in workers)
