"""Chat SFT data: JSONL conversations rendered with the tokenizer's chat template, loss on the
assistant's tokens only, packed into rows with per-conversation attention.

Format: one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line (OpenAI / HF messages),
roles ``system``, ``user``, ``assistant``, ``tool``.

* **Masking.** A template that marks the assistant's part with ``{% generation %}`` ...
  ``{% endgeneration %}`` says where the labels are: the conversation is one sample, labelled on the
  marked tokens (transformers' ``return_assistant_tokens_mask``). Otherwise the spans come from
  partial renders: for every assistant turn i the render of ``messages[:i]`` plus the generation
  prompt ends where the assistant's text starts, and the render of ``messages[:i + 1]`` ends where
  its turn (content + end-of-turn token) ends. A text that begins with both carries that turn; a
  token carries a label when it starts inside such a span (character offsets of one tokenization),
  so the mask is exactly the assistant's tokens of the rendered template.
* **Templates that rewrite earlier turns.** Qwen3's drops the ``<think>`` block of an assistant
  turn once a later user message follows, so the whole conversation no longer begins with that
  turn as it was generated, and training it there would teach answers without their reasoning.
  Each assistant turn, from the last back, is trained in the first text that carries it: the whole
  conversation, a sample already made for a later turn, else a sample of its own, the render of
  ``messages[:i + 1]`` -- the turn as the model generates it, after the earlier turns as the
  template shows them at that point. A turn the template keeps
  intact trains in the whole conversation, every turn trains once, and the run log says how many
  samples the conversations gave. A template whose generation prompt is not how its assistant
  turns begin is refused, naming the fixes: ``{% generation %}`` markers, or ``data.kind =
  "pretokenized"``.
* **Samples.** A sample of tokens t gives inputs ``t[:-1]`` and labels ``t[1:]`` (masked).
  Longer than ``seq_len + 1`` tokens: ``overflow = "truncate"`` keeps the start, ``"drop"`` drops
  it; a truncated conversation left without any assistant label is dropped too.
* **Packing.** Samples are placed first-fit (over a window of ``OPEN_ROWS`` open rows, in the
  epoch's shuffled order) into rows of ``seq_len`` tokens. Each sample is its own document: its
  positions restart at 0 and attention never crosses documents (``Transformer.forward``'s
  ``document_ids``), so a packed row computes what its conversations compute alone. The rest of
  a row is padding: no labels, and document id ``PADDING_DOCUMENT``, owned by no document, so
  attention keeps it to itself and a mixture of experts routes none of it (it counts in no expert
  statistic or auxiliary loss, and trains no weight). Measured on the demo set (configs/sft_demo:
  200 conversations of 28-98 tokens; tested): 9.6 % / 6.3 % of the tokens are padding at seq_len
  128 / 256 packed, against 61.6 % / 80.8 % with one conversation per row (``packing = false``).
* **Determinism.** Epoch e is a permutation drawn from (seed, e), packed in that order; the row
  stream is epoch 0's rows, then epoch 1's, ...; step s takes rows ``[(s - 1) B, s B)``. So a batch
  is a pure function of (seed, step): the same for every layout, and a resume mid-epoch is bitwise.
"""

from __future__ import annotations

import bisect
import re

import numpy as np
import torch

from seedckpt.data.sources import IGNORE_INDEX, JSONL_SUFFIXES, Batch, data_files, jsonl_records, keyed_generator
from seedckpt.data.tokenizer import load_tokenizer, pad_token_id
from seedckpt.utils.errors import SeedckptError

ROLES = ("system", "user", "assistant", "tool")
OPEN_ROWS = 64  # rows first-fit packing keeps open: more wastes less padding, costs more per sample
PADDING_DOCUMENT = -1  # the document id of padding: a negative id is owned by no document
KEPT_EPOCHS = 2  # packed epochs held at once: the current one and the one a step may straddle into


def read_conversations(path: str):
    """``(where, messages)`` for every conversation of the JSONL file(s), validated, one at a time."""
    for file in data_files(path, JSONL_SUFFIXES):
        for number, record in jsonl_records(file):
            where = f"{file}:{number}"
            yield where, conversation(record, where)


def conversation(record, where: str) -> list[dict]:
    """The validated messages of one ``{"messages": [...]}`` record."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise SeedckptError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise SeedckptError(f"{where}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise SeedckptError(f"{where}: a {m['role']} message's content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise SeedckptError(f"{where}: the conversation has no assistant turn, so nothing to learn")
    return messages


def chat_tokenizer(path: str):
    """The tokenizer in ``path``, which must have a chat template."""
    tokenizer = load_tokenizer(path)
    if tokenizer.chat_template is None:
        raise SeedckptError(
            f"the tokenizer in {path} has no chat template; add one to its "
            'tokenizer_config.json ("chat_template") or chat_template.jinja'
        )
    return tokenizer


GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # how transformers finds the tag


def marks_generation(tokenizer) -> bool:
    """Whether the chat template marks the assistant's part with ``{% generation %}``."""
    return bool(GENERATION_MARKER.search(tokenizer.get_chat_template()))


def render_samples(tokenizer, messages: list[dict], where: str) -> list[tuple[list[int], list[bool]]]:
    """The conversation's samples (the module docstring): per sample its token ids and, per token,
    whether it is an assistant's token it trains. One sample unless the template rewrites earlier
    turns; the last holds the final assistant turn."""
    if marks_generation(tokenizer):
        marked = _apply_template(tokenizer, messages, where, return_dict=True, return_assistant_tokens_mask=True)
        return [(marked["input_ids"], [bool(m) for m in marked["assistant_masks"]])]
    spans = _turn_spans(tokenizer, messages, where)
    texts = list(spans)[::-1]  # the earliest turn's sample first, the whole conversation last
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    samples = []
    for text, ids, offsets in zip(texts, encoded["input_ids"], encoded["offset_mapping"]):
        if spans[text]:  # the whole conversation trains nothing when every turn is rewritten in it
            samples.append((ids, [any(lo <= start < hi for lo, hi in spans[text]) for start, _ in offsets]))
    return samples


def _turn_spans(tokenizer, messages: list[dict], where: str) -> dict[str, list[tuple[int, int]]]:
    """The texts to train and, per text, the character spans of the assistant turns it carries:
    each turn in the first text that begins with it as generated, the whole conversation first."""
    spans = {_apply_template(tokenizer, messages, where, tokenize=False): []}
    for i in reversed([i for i, m in enumerate(messages) if m["role"] == "assistant"]):
        start = _apply_template(tokenizer, messages[:i], where, tokenize=False, add_generation_prompt=True)
        stop = _apply_template(tokenizer, messages[: i + 1], where, tokenize=False)
        if not stop.startswith(start):
            raise SeedckptError(
                f"{where}: the chat template's generation prompt is not how it begins an assistant turn, so "
                "the assistant's tokens cannot be located; mark them in the template with {% generation %} ... "
                '{% endgeneration %}, or write the samples pre-tokenized (data.kind = "pretokenized", '
                '{"input_ids": [...], "labels": [...]} per line)'
            )
        text = next((t for t in spans if t.startswith(stop)), stop)
        spans.setdefault(text, []).append((len(start), len(stop)))
    return spans


def _apply_template(tokenizer, messages: list[dict], where: str, **options):
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except Exception as e:  # a template may raise on its own terms (jinja's raise_exception)
        raise SeedckptError(f"{where}: the chat template failed: {e}") from None


def first_label(labelled: np.ndarray) -> int:
    """The first position from 1 on that carries a label (position 0 never is a target), or the
    sample's length when none does: a sample cut to ``k`` tokens keeps a label iff this is < k."""
    found = np.flatnonzero(labelled[1:])
    return int(found[0]) + 1 if len(found) else len(labelled)


class SamplesInMemory:
    """Samples held as tensors: ``(ids, labels)`` records, Hugging Face style (``labels[i]`` is the
    target at position ``i``, ``IGNORE_INDEX`` for none), each kept to its first ``keep`` tokens
    (the most a row can take)."""

    def __init__(self, records, keep: int):
        self.records, lengths, first_labels = [], [], []
        for ids, labels in records:
            labels = torch.tensor(labels, dtype=torch.int64)
            self.records.append((torch.tensor(ids[:keep], dtype=torch.int64), labels[:keep]))
            lengths.append(len(ids))
            first_labels.append(first_label((labels != IGNORE_INDEX).numpy()))
        self.lengths, self.first_labels = np.array(lengths, dtype=np.int64), np.array(first_labels, dtype=np.int64)

    def read(self, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` ids and labels of sample ``index``."""
        ids, labels = self.records[index]
        return ids[:n], labels[:n]


class PackedSamples:
    """Samples fitted to ``seq_len + 1`` tokens as ``data.overflow`` says, then packed into rows,
    epoch by epoch (the module docstring).

    ``samples`` gives, per sample, ``lengths`` (tokens), ``first_labels`` (``first_label``) and
    ``read(index, n)``: its first ``n`` ids and labels.
    It holds them in memory (``SamplesInMemory``) or reads them from a chat token directory."""

    def __init__(
        self, samples, data, seq_len: int, seed: int, pad_id: int, what: tuple[str, str], note: str = "", row_tokens=0
    ):
        """``what``: the data and what a sample is, for the log (``("chat", "conversations")``);
        ``row_tokens``: the length of a packed row, a token budget (``training.max_tokens_per_rank``;
        0: ``seq_len``, which bounds each sample either way)."""
        self.pad_id, self.seq_len, self.seed, self.packing = pad_id, seq_len, seed, data.packing
        self.row_tokens = row_tokens or seq_len
        self.samples = samples
        overflows = samples.lengths > seq_len + 1
        kept = np.minimum(samples.lengths, seq_len + 1)  # each input predicts the next token's label
        keep = (samples.first_labels < kept) & ~(overflows & (data.overflow == "drop"))
        self.indices = np.flatnonzero(keep)  # the kept samples' indices in ``samples``
        self.lengths = kept[keep] - 1  # their input tokens
        count, truncated = len(samples.lengths), int((overflows & keep).sum())
        dropped = count - len(self.indices)  # too long, or truncation left no labelled token
        if not len(self.indices):
            fixes = "raise training.seq_len" + (
                "" if data.overflow == "truncate" else " or use data.overflow = truncate"
            )
            raise SeedckptError(
                f"no {what[1][:-1]} of {data.path} fits seq_len = {seq_len} with a labelled token left "
                f"(data.overflow = {data.overflow}); {fixes}"
            )
        self._packed: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the last epochs packed: ``_epoch``
        self._starts = [0]  # first global row of each epoch, then the end of the last one
        rows = len(self._epoch(0)[1]) - 1
        self.padding_fraction = 1 - int(self.lengths.sum()) / (rows * self.row_tokens)
        self.description = (
            f"{what[0]} {data.path}: {count} {what[1]}, {len(self.indices)} kept "
            f"({truncated} truncated, {dropped} dropped, overflow={data.overflow}); "
            f"{rows} rows per epoch, {'packed' if self.packing else 'one per row'}"
            + (
                f" into rows of {self.row_tokens} tokens (training.max_tokens_per_rank)"
                if self.row_tokens != seq_len
                else ""
            )
            + ", "
            f"{self.padding_fraction:.1%} padding" + (f"; {note}" if note else "")
        )

    def rows(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s packed rows, each the kept samples' indices in order."""
        order, bounds = self._epoch(epoch)
        return [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s samples in row order and each row's bounds in that order: arrays, not
        Python lists, and only the last ``KEPT_EPOCHS`` used are held (an older one is packed again if
        asked for), so a long run over millions of conversations holds one epoch's order."""
        while len(self._starts) <= epoch + 1:  # every epoch up to this one is packed once, for its row count
            packed = self._pack_epoch(len(self._starts) - 1)
            self._starts.append(self._starts[-1] + len(packed[1]) - 1)
        if epoch not in self._packed:
            self._pack_epoch(epoch)
        return self._packed[epoch]

    def _pack_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Pack epoch ``epoch`` (and keep it)."""
        order = torch.randperm(len(self.indices), generator=keyed_generator("seedckpt-chat", self.seed, epoch))
        rows = self._pack(order.tolist())
        bounds = np.cumsum([0] + [len(row) for row in rows])
        packed = np.fromiter((i for row in rows for i in row), np.int64, bounds[-1]), bounds
        self._keep(epoch, packed)
        return packed

    def _keep(self, epoch: int, packed: tuple[np.ndarray, np.ndarray]) -> None:
        self._packed[epoch] = packed
        while len(self._packed) > KEPT_EPOCHS:
            del self._packed[next(iter(self._packed))]  # the first kept

    def _pack(self, order: list[int]) -> list[list[int]]:
        """First-fit of samples (in ``order``) into rows of ``row_tokens``, ``OPEN_ROWS`` open at once."""
        if not self.packing:
            return [[i] for i in order]
        lengths = self.lengths.tolist()
        closed, open_rows = [], []  # open: [free tokens, sample indices]
        for i in order:
            length = lengths[i]
            row = next((r for r in open_rows if r[0] >= length), None)
            if row is None:
                if len(open_rows) == OPEN_ROWS:
                    closed.append(open_rows.pop(0)[1])
                row = [self.row_tokens, []]
                open_rows.append(row)
            row[0] -= length
            row[1].append(i)
        return closed + [r[1] for r in open_rows]

    def _row(self, index: int) -> list[int]:
        """Global row ``index`` of the endless stream of epochs."""
        while self._starts[-1] <= index:
            self._epoch(len(self._starts) - 1)
        epoch = bisect.bisect_right(self._starts, index) - 1
        order, bounds = self._epoch(epoch)
        row = index - self._starts[epoch]
        return order[bounds[row] : bounds[row + 1]].tolist()

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept sample ``i``: its inputs and their labels (the next token's, ``IGNORE_INDEX`` for none)."""
        ids, labels = self.samples.read(int(self.indices[i]), int(self.lengths[i]) + 1)
        return ids[:-1], labels[1:]

    def global_batch(self, step: int, batch_size: int) -> Batch:
        shape = (batch_size, self.row_tokens)
        inputs = torch.full(shape, self.pad_id, dtype=torch.int64)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
        positions = torch.zeros(shape, dtype=torch.int64)
        documents = torch.zeros(shape, dtype=torch.int64)
        for b in range(batch_size):
            at = 0
            row = self._row((step - 1) * batch_size + b)
            for doc, i in enumerate(row):
                n = int(self.lengths[i])
                inputs[b, at : at + n], labels[b, at : at + n] = self.sample(i)
                positions[b, at : at + n] = torch.arange(n)
                documents[b, at : at + n] = doc
                at += n
            positions[b, at:] = torch.arange(self.row_tokens - at) % self.seq_len  # no sample is longer
            documents[b, at:] = PADDING_DOCUMENT
        return Batch(inputs, labels, positions, documents)


class ChatData(PackedSamples):
    """``{"messages": [...]}`` conversations, rendered with the tokenizer's chat template; labels on
    the assistant's tokens."""

    def __init__(self, data, vocab_size: int, seq_len: int, seed: int, row_tokens: int = 0):
        tokenizer = chat_tokenizer(data.tokenizer)
        if len(tokenizer) > vocab_size:
            raise SeedckptError(
                f"the tokenizer in {data.tokenizer} has {len(tokenizer)} tokens but the model's "
                f"vocab_size is {vocab_size}"
            )
        pad_id, pad_note = pad_token_id(tokenizer)
        conversations = 0

        def records():
            nonlocal conversations
            for where, messages in read_conversations(data.path):
                conversations += 1
                for ids, mask in render_samples(tokenizer, messages, where):
                    yield ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]

        samples = SamplesInMemory(records(), seq_len + 1)
        what, mode = labelling(tokenizer, conversations, len(samples.lengths))
        note = "; ".join(n for n in (pad_note, mode) if n)
        super().__init__(samples, data, seq_len, seed, pad_id, ("chat", what), note, row_tokens)


def labelling(tokenizer, conversations: int, samples: int) -> tuple[str, str]:
    """What a chat sample is, for the run log, and a note on how its labels were found when not by
    the template's plain prefixes."""
    if marks_generation(tokenizer):
        return "conversations", "labels on the chat template's {% generation %} spans"
    if samples == conversations:
        return "conversations", ""
    return "samples", (
        "the chat template rewrites earlier turns (e.g. drops <think> blocks): each assistant turn it rewrites is "
        f"trained against its own prefix, {conversations} conversations -> {samples} samples"
    )


class PretokenizedData(PackedSamples):
    """Mini Trainer's pre-tokenized SFT format: JSONL ``{"input_ids": [...], "labels": [...]}``, the
    labels aligned with the ids and ``-100`` where there is no loss. No tokenizer is needed; padding
    (its own document, without labels) uses id 0."""

    def __init__(self, data, vocab_size: int, seq_len: int, seed: int, row_tokens: int = 0):
        def records():
            for file in data_files(data.path, JSONL_SUFFIXES):
                for number, record in jsonl_records(file):
                    yield pretokenized_record(record, vocab_size, f"{file}:{number}")

        samples = SamplesInMemory(records(), seq_len + 1)
        super().__init__(samples, data, seq_len, seed, 0, ("pretokenized", "samples"), row_tokens=row_tokens)


def pretokenized_record(record, vocab_size: int, where: str) -> tuple[list[int], list[int]]:
    """One record's ``(input_ids, labels)``, each checked: ids in the vocabulary, labels the same
    length, each a token id or -100."""
    ids = record.get("input_ids") if isinstance(record, dict) else None
    labels = record.get("labels") if isinstance(record, dict) else None
    if not (isinstance(ids, list) and isinstance(labels, list) and ids and len(ids) == len(labels)):
        raise SeedckptError(f'{where}: expected {{"input_ids": [...], "labels": [...]}} of one length')
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise SeedckptError(f"{where}: input_ids must be token ids in [0, {vocab_size}) (the model's vocab_size)")
    if not all(isinstance(t, int) and (t == IGNORE_INDEX or 0 <= t < vocab_size) for t in labels):
        raise SeedckptError(f"{where}: labels must be token ids or {IGNORE_INDEX} (no loss)")
    return ids, labels
