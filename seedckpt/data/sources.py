"""Training data that is a pure function of (seed, step): the same global batch at step s for
every parallel layout, each data-parallel rank taking its slice, and nothing to restore on resume
but the step. Every dataset returns a ``Batch``.

* ``synthetic``: each row repeats a random motif (length 4-16, from a 32-token alphabet). A model
  first learns the alphabet (loss falls from ln(vocab) to ~ln 32) and then to copy the motif
  (loss falls further towards 0) -- a learnable task that needs no files.
* ``text``: byte-level language modelling (token = byte, so vocab_size >= 256) on random windows
  of a local file, or, with no ``data.path``, of a built-in corpus made from the Python standard
  library's own source files (real text, present on every machine, no downloads). With
  ``data.tokenizer`` the files (plain text, or JSONL ``{"text": ...}``) are tokenized with that
  Hugging Face tokenizer and joined with its eos token instead.
* ``chat``: supervised fine-tuning on chat conversations (``seedckpt.data.chat``).
* ``tokens``: random windows of a corpus tokenized once by ``seedckpt tokenize``, read from disk
  window by window (``seedckpt.data.token_files``).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import io
import json
import re
import warnings
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from seedckpt.utils.errors import SeedckptError

IGNORE_INDEX = -100  # a label that carries no loss (cross_entropy's ignore_index)
MAX_LINE_BYTES = 16 << 20  # longest JSONL line read: a bound on what a hostile file can make us parse
# Text is handed to a tokenizer in pieces of about PIECE_CHARS characters, cut where its pre-tokenizer
# splits anyway (``cut_pieces``). Short pieces encode faster -- a long text's alignments outgrow the
# caches: with a 32k byte-level BPE (Llama 3's pattern) on 2 threads, encode_batch took 1.6-1.7x the
# CPU on 64 Ki-character pieces that it took on lines; one thread encoded English prose at 5.2 MB per
# CPU second in 4 Ki pieces, 3.7 in 1 Ki, 3.3 in 16 Ki, 2.7 in 64 Ki and 2.7 by lines (Python source:
# 4.5, 3.6, 2.6, 2.7, 2.7; benchmarks/tokenizing.py).
PIECE_CHARS = 1 << 12
# The longest piece, where no such cut comes sooner: a bound on a tokenizer's memory. Encoding holds
# ~200 bytes per character (the fast tokenizer's offsets and alignments, then the ids): a 10 MB plain
# text file encoded whole peaked at 2.0 GB RSS, a 20 MB one at 3.7 GB. Encoding 1 MiB of 12-word lines
# in pieces of 64 KiB grew a process by 103 MiB, in one piece by 213 MiB (a 600-token byte-level BPE).
MAX_PIECE_CHARS = 1 << 16
READ_REPORT_LINES = 1024  # a reader's progress callback hears of the bytes read this many lines at a time

ALPHABET = 32
MOTIF_LENGTHS = (4, 16)
# Modules whose source makes up the built-in text corpus (~1 MB of Python and prose).
CORPUS_MODULES = (
    "argparse",
    "dataclasses",
    "difflib",
    "textwrap",
    "functools",
    "pathlib",
    "shutil",
    "tempfile",
    "json.decoder",
    "json.encoder",
    "csv",
    "heapq",
    "bisect",
    "enum",
    "string",
)


@dataclass
class Batch:
    """Rows of next-token prediction: ``labels[i, t]`` is the target after ``inputs[i, :t + 1]``."""

    inputs: torch.Tensor  # (B, S) token ids
    labels: torch.Tensor  # (B, S) targets; IGNORE_INDEX where there is no loss
    positions: torch.Tensor | None = None  # (B, S) RoPE positions; None: 0..S-1 in every row
    document_ids: torch.Tensor | None = None  # (B, S) attention stays within a document; None: one per row

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> Batch:
        """``(B, S + 1)`` token rows -> inputs ``[:, :-1]``, labels ``[:, 1:]``."""
        return cls(rows[:, :-1], rows[:, 1:])

    def rows(self, start: int, stop: int) -> Batch:
        return self._map(lambda t: t[start:stop])

    def to(self, device) -> Batch:
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> Batch:
        return replace(self, **{k: fn(v) for k, v in vars(self).items() if v is not None})

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def _step_generator(seed: int, step: int) -> torch.Generator:
    return keyed_generator("seedckpt-data", seed, step)


def keyed_generator(*key) -> torch.Generator:
    digest = hashlib.sha256("\0".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


# The files a directory of documents is read for (``pieces``): what ``seedckpt tokenize --help`` lists,
# plain text as ``*.txt``. Chat data is JSONL only.
TEXT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".txt")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def data_files(path: str | list[str], suffixes: tuple[str, ...], name: str = "data.path") -> list[Path]:
    """``path``: one file, several comma-separated, or a directory (its files ending in one of
    ``suffixes``, sorted); or a list of such. A path that exists as written is not split at its
    commas. A file given twice (twice over, or alone and in its directory) is refused: it would be
    read twice. Errors and warnings call the paths ``name``: the config key, or a command's input."""
    files, given_as = [], {}
    given = path if isinstance(path, list) else [path]
    parts = [q.strip() for p in given for q in ([p] if Path(p).exists() else p.split(",")) if q.strip()]
    for part in parts:
        p = Path(part)
        if p.is_dir():
            found = _directory_files(p, suffixes, name)
        elif p.is_file():
            found = [p]
        else:
            raise SeedckptError(f"{name} {p} does not exist; give a file, comma-separated files or a directory")
        for file in found:
            if file.resolve() in given_as:
                raise SeedckptError(
                    f"{name} gives {file} twice (as {given_as[file.resolve()]} and as {part}); give each file once"
                )
            given_as[file.resolve()] = part
            files.append(file)
    if not files:
        raise SeedckptError(f"{name} is empty; give the data file(s)")
    return files


def _directory_files(directory: Path, suffixes: tuple[str, ...], name: str) -> list[Path]:
    """The files of ``directory`` ending in one of ``suffixes``, sorted; a warning names the rest."""
    found = sorted(f for suffix in suffixes for f in directory.glob(f"*{suffix}") if f.is_file())
    names = ", ".join(f"*{suffix}" for suffix in suffixes)
    if not found:
        raise SeedckptError(
            f"{name} {directory} holds no {names} file; give a directory that does, or the files by name"
        )
    skipped = sorted(f.name for f in directory.iterdir() if f not in found)
    if skipped:  # a directory read in part says so: a .bin or .png beside the data is not data
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        warnings.warn(
            f"{name} {directory}: read its {len(found)} {names} file(s); skipped {', '.join(skipped[:5])}{more}",
            stacklevel=3,
        )
    return found


def jsonl_records(path: Path, read=None):
    """``(line number, object)`` per non-blank line, of a ``.jsonl`` file or a gzipped one (read as a
    stream); a malformed line is an error naming it, a file without any an error calling it empty.
    ``read(n)``, when given, is told the file's bytes as they are read (compressed bytes for gzip),
    ``READ_REPORT_LINES`` lines at a time: all of them once the file is done."""
    gzipped = path.name.endswith(".gz")
    empty = True
    try:
        with (gzip.open if gzipped else open)(path, "rb") as f:
            position, reported = (f.fileobj.tell if gzipped else f.tell), 0
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(line) > MAX_LINE_BYTES:
                    raise SeedckptError(
                        f"{path}:{number}: line longer than {MAX_LINE_BYTES >> 20} MiB; split the record, or give "
                        "the text as a plain text file, which is read in pieces"
                    )
                if read and number % READ_REPORT_LINES == 0:
                    read(position() - reported)
                    reported = position()
                if not line.strip():
                    continue
                empty = False
                try:
                    yield number, json.loads(line)
                except (ValueError, UnicodeDecodeError) as e:
                    raise SeedckptError(f"{path}:{number}: not valid JSON ({e})") from None
            if read:
                read(path.stat().st_size - reported)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise SeedckptError(f"{path} is not a complete gzip file ({e}); compress it again") from None
    if empty:
        raise SeedckptError(f"{path} is empty: it holds no JSON lines")


class SyntheticData:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < ALPHABET:
            raise SeedckptError(f"synthetic data needs vocab_size >= {ALPHABET}")
        self.seq_len, self.seed = seq_len, seed
        self.description = f"synthetic repeated motifs (alphabet {ALPHABET}, lengths {MOTIF_LENGTHS})"

    def global_batch(self, step: int, batch_size: int) -> Batch:
        g = _step_generator(self.seed, step)
        lo, hi = MOTIF_LENGTHS
        periods = torch.randint(lo, hi + 1, (batch_size, 1), generator=g)
        motifs = torch.randint(0, ALPHABET, (batch_size, hi), generator=g)
        positions = torch.arange(self.seq_len + 1).expand(batch_size, -1) % periods
        return Batch.from_rows(motifs.gather(1, positions))


class TextData:
    """Random windows of ``seq_len + 1`` tokens of one token stream."""

    def __init__(self, tokens: torch.Tensor, description: str, seq_len: int, seed: int):
        if tokens.numel() <= seq_len + 1:
            raise SeedckptError(f"{description} is shorter than seq_len + 1 = {seq_len + 1} tokens")
        self.tokens, self.description, self.seq_len, self.seed = tokens, description, seq_len, seed

    @classmethod
    def bytes(cls, path: str, vocab_size: int, seq_len: int, seed: int) -> TextData:
        if vocab_size < 256:
            raise SeedckptError(f"text data is byte-level and needs model.vocab_size >= 256 (got {vocab_size})")
        if path:
            if not Path(path).is_file():
                raise SeedckptError(
                    f"data.path {path} is not a file; give a local text file or leave it empty for the built-in corpus"
                )
            raw = Path(path).read_bytes()
            description = f"text {path} ({len(raw):,} bytes)"
        else:
            raw = builtin_corpus()
            description = f"built-in text corpus: Python stdlib sources ({len(raw):,} bytes)"
        return cls(torch.frombuffer(bytearray(raw), dtype=torch.uint8), description, seq_len, seed)

    @classmethod
    def tokenized(cls, path: str, tokenizer_dir: str, vocab_size: int, seq_len: int, seed: int) -> TextData:
        """Plain text files (one document each) or JSONL ``{"text": ...}``, joined with eos."""
        from seedckpt.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        if len(tokenizer) > vocab_size:
            raise SeedckptError(
                f"the tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens but the model's "
                f"vocab_size is {vocab_size}; raise model.vocab_size"
            )
        if tokenizer.eos_token_id is None:
            raise SeedckptError(f"the tokenizer in {tokenizer_dir} has no eos token to separate documents")
        if not path:
            raise SeedckptError("data.tokenizer needs data.path: the text or JSONL files to tokenize")
        ids = []
        for file in data_files(path, TEXT_SUFFIXES):
            for text, last in pieces(file):
                ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * last
        return cls(
            torch.tensor(ids, dtype=torch.int64),
            f"text {path} tokenized with {tokenizer_dir} ({len(ids):,} tokens)",
            seq_len,
            seed,
        )

    def global_batch(self, step: int, batch_size: int) -> Batch:
        g = _step_generator(self.seed, step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (batch_size, 1), generator=g)
        return Batch.from_rows(self.tokens[starts + torch.arange(self.seq_len + 1)].long())


def pieces(file: Path, read=None):
    """``(text, last)`` for the documents of ``file`` -- each JSONL record's ``"text"`` (a ``.jsonl`` or
    ``.jsonl.gz`` file, streamed), each row's ``text`` column of a ``.parquet`` file (streamed by
    record batch), or the whole of any other file, read as UTF-8 text (``PlainText``) -- in pieces
    (``cut_pieces``), ``last`` true on a document's final piece. A document is tokenized piece by
    piece, its ids joined. ``read(n)`` is told the file's bytes as they are read (``jsonl_records``)."""
    if file.name.endswith(".parquet"):
        texts = parquet_texts(file, read)
    elif file.name.endswith(JSONL_SUFFIXES):
        texts = _jsonl_texts(file, read)
    else:
        yield from _plain_text_pieces(file, read)
        return
    for text in texts:
        yield from _ending(cut_pieces(io.StringIO(text)))


def _jsonl_texts(file: Path, read=None):
    for number, record in jsonl_records(file, read):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SeedckptError(f'{file}:{number}: expected an object with a string "text"')
        yield record["text"]


def _plain_text_pieces(file: Path, read=None):
    """A plain text file as one document, read a piece at a time: any size, with or without line
    breaks, in bounded memory. An empty file is refused (it would be a document of eos alone); invalid
    UTF-8 is read as U+FFFD, and a warning names the file, how many and where the first is."""
    with open(file, "rb") as f:
        text = PlainText(f, read)
        for piece in _ending(cut_pieces(text)):
            if not text.position:
                raise SeedckptError(f"{file} is empty: it holds no document; remove it from the inputs")
            yield piece
    if text.invalid:
        warnings.warn(
            f"{file}: {text.invalid:,} invalid UTF-8 sequence(s), the first at byte {text.first_invalid:,}, read as "
            "U+FFFD; if the file is in another encoding, convert it (iconv -f ENCODING -t UTF-8)",
            stacklevel=2,
        )


class PlainText:
    """A UTF-8 file as a text stream (``read(n)``, for ``cut_pieces``), with universal newlines, as
    ``open(file, encoding="utf-8", errors="replace")`` reads it -- each invalid byte sequence becomes
    U+FFFD -- but counting the sequences replaced and keeping the first one's byte offset, which a
    text file object cannot tell. ``report(n)`` is told the bytes as they are read."""

    def __init__(self, f, report=None):
        self.f, self.report = f, report or (lambda n: None)
        self.position = 0  # bytes read
        self.pending = b""  # the start of a character that the next bytes complete
        self.newlines = io.IncrementalNewlineDecoder(None, translate=True)
        self.invalid, self.first_invalid = 0, -1

    def read(self, n: int) -> str:
        """Up to ``n`` characters; "" only at the end."""
        while True:
            raw = self.f.read(n)
            self.report(len(raw))
            data = self.pending + raw
            decoded, used = self._decode(memoryview(data), self.position - len(self.pending), final=not raw)
            self.position += len(raw)
            self.pending = data[used:]
            text = self.newlines.decode(decoded, final=not raw)
            if text or not raw:
                return text

    def _decode(self, data: memoryview, offset: int, final: bool) -> tuple[str, int]:
        """``data`` (at byte ``offset`` of the file) decoded, and the bytes used: an unfinished
        character at its end waits for the next bytes unless ``final``."""
        parts, at = [], 0
        while True:
            try:
                text, used = codecs.utf_8_decode(data[at:], "strict", final)
                return "".join([*parts, text]), at + used
            except UnicodeDecodeError as e:
                parts += (str(data[at : at + e.start], "utf-8"), "\ufffd")
                self.invalid += 1
                self.first_invalid = offset + at + e.start if self.first_invalid < 0 else self.first_invalid
                at += e.end


def _ending(texts):
    """``(text, last)`` for ``texts``, ``last`` true on the final one (an empty document is one ``""``)."""
    previous = ""
    for i, text in enumerate(texts):
        if i:
            yield previous, False
        previous = text
    yield previous, True


# Where a piece may end, searched on the reversed text (so the first match is the last place): just
# before a space that a non-whitespace character follows (the last space of its run); failing that,
# just after a line break between two non-whitespace characters. A space at the end of the text read
# so far is no place: what follows it is not known yet.
_SPACE_BEFORE_NON_SPACE, _LINE_BREAK_BETWEEN = re.compile(r"(?<=\S) "), re.compile(r"(?<=\S)\n(?=\S)")


def cut_pieces(stream: io.TextIOBase, size: int | None = None, limit: int | None = None):
    """The text of ``stream`` in pieces of about ``size`` (``PIECE_CHARS``) characters that join back
    to it, each cut where the pre-tokenizers of byte-level BPE and SentencePiece split anyway, so the
    pieces' ids joined are the ids of the whole text: just before the last space that a
    non-whitespace character follows -- looking further, up to ``limit`` (``MAX_PIECE_CHARS``)
    characters, where there is none within ``size``; failing that, just after the last line break
    between two non-whitespace characters; failing that, at ``limit``.

    Why there: in GPT-2's, Llama 3's, Qwen2's, DeepSeek-V3's and o200k's patterns a space before a
    non-space begins a pre-token (" word", " (") and the whitespace before it is a pre-token of its
    own, before that space as at the end of a text ("\\s+(?!\\S)" stops short of the space,
    "\\s*[\\r\\n]+" ends at a line break); metaspace splits before every space; and a text that
    begins with a space gets no prefix (ByteLevel's ``add_prefix_space``, metaspace's
    ``prepend_scheme``). So prose and indented code cut there give the whole text's ids (tested with
    GPT-2's, Llama 3's and metaspace). A line break between non-whitespace ends a pre-token in those
    patterns too (Llama 3's joins it to the punctuation before it, not to what follows), but a piece
    after it gets the prefix of ``add_prefix_space`` or metaspace; a cut at the bound may split a
    pre-token; and a tokenizer that prepends to every text (Llama 2's "\u2581" normalizer) differs at
    every cut: a token or two each."""
    size = size or PIECE_CHARS
    limit = max(limit or MAX_PIECE_CHARS, size)
    text, searched = "", 1  # text[1:searched] holds no place to cut (and a cut at 0 is no piece)
    while chunk := stream.read(size):
        text += chunk
        while len(text) >= size:
            window = text[:limit]
            cut = _space_cut(window, searched) or (len(text) >= limit and _line_cut(window))
            if not cut:  # read on, searching only what comes next: linear in text without spaces
                searched = len(window) - 1
                break
            yield text[:cut]
            text, searched = text[cut:], 1
    if text:
        yield text


def _space_cut(text: str, start: int) -> int:
    """The last place in ``text[start:]`` just before a space that a non-whitespace character
    follows, or 0."""
    found = _SPACE_BEFORE_NON_SPACE.search(text[start:][::-1])
    return len(text) - 1 - found.start() if found else 0


def _line_cut(text: str) -> int:
    """The last place just after a line break between two non-whitespace characters, else the end."""
    found = _LINE_BREAK_BETWEEN.search(text[::-1])
    return len(text) - found.start() if found else len(text)


PARQUET_BATCH_ROWS = 1024  # rows read at a time: a file's row groups may be far larger


def parquet_texts(file: Path, read=None):
    """The ``text`` column of a parquet file (as Hugging Face datasets store corpora), a batch of rows
    at a time; a missing column, no rows, a row that is not a string, or a file pyarrow cannot read
    is one error naming the file. ``read(n)`` is told the file's bytes in proportion to the rows read."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SeedckptError(f"{file}: reading parquet needs pyarrow: pip install 'seedckpt[parquet]'") from None
    import pyarrow

    row = reported = 0
    size = file.stat().st_size
    try:
        reader = pq.ParquetFile(file)
        if "text" not in reader.schema_arrow.names:
            raise SeedckptError(f'{file}: no "text" column (columns: {", ".join(reader.schema_arrow.names)})')
        if not reader.metadata.num_rows:
            raise SeedckptError(f"{file} is empty: it holds no rows; remove it from the inputs")
        for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
            for text in batch.column(0).to_pylist():
                row += 1
                if not isinstance(text, str):
                    raise SeedckptError(f'{file}: row {row}: "text" is {type(text).__name__}, not a string')
                yield text
            if read:
                done = size * row // max(reader.metadata.num_rows, 1)
                read(done - reported)
                reported = done
        if read:
            read(size - reported)
    except (pyarrow.ArrowException, OSError) as e:
        raise SeedckptError(f"{file}: not a readable parquet file ({' '.join(str(e).split())[:200]})") from None


def builtin_corpus() -> bytes:
    parts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            parts.append(Path(spec.origin).read_bytes())
    return b"\n".join(parts)
