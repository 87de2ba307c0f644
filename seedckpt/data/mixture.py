"""A weighted mixture of token directories (``data.sources``): 70 % web, 20 % code, 10 % math.

Each row of a step's global batch draws its source with the weights, from a generator keyed by
(seed, step), and then a window of that source, from the source's own keyed windows: the batch is
a pure function of (seed, step, sources), so losses stay comparable across layouts and a resumed run
sees exactly the batches of an uninterrupted one. The rows each source gave to the last batch are
``consumption``, which the trainer logs per step.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from seedckpt.data.sources import Batch, keyed_generator
from seedckpt.data.token_files import TokenFileData
from seedckpt.utils.errors import SeedckptError


def parse_sources(entries: list) -> list[tuple[str, float]]:
    """``data.sources`` as ``[(path, weight), ...]``: each entry a ``[[data.sources]]`` table
    (``path``, ``weight``, optionally ``kind = "tokens"``) or a string ``"PATH:WEIGHT"`` (a path may
    hold ``:``; the weight follows the last one)."""
    return [_table_source(entry) if isinstance(entry, dict) else _text_source(entry) for entry in entries]


def _table_source(entry: dict) -> tuple[str, float]:
    path, weight, kind = entry.get("path"), entry.get("weight"), entry.get("kind", "tokens")
    unknown = sorted(set(entry) - {"path", "weight", "kind"})
    ok_weight = (
        isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0
    )
    if unknown or not isinstance(path, str) or not path or not ok_weight or kind != "tokens":
        raise SeedckptError(
            f"[[data.sources]] entry {entry!r}: give path (a token directory) and weight (> 0)"
            + (f"; unknown keys {unknown}" if unknown else "")
            + (
                f'; kind {kind!r}: this version mixes token directories only (kind = "tokens")'
                if kind != "tokens"
                else ""
            )
        )
    return path, float(weight)


def _text_source(entry) -> tuple[str, float]:
    path, sep, weight = str(entry).rpartition(":")
    try:
        value = float(weight)
    except ValueError:
        value = math.nan
    if not isinstance(entry, str) or not sep or not path or not (math.isfinite(value) and value > 0):
        raise SeedckptError(
            f"data.sources entry {entry!r}: write it as DIRECTORY:WEIGHT with a weight > 0, e.g. tokens/web:0.7"
        )
    return path, value


class MixedData:
    """Rows from several token directories in proportion to their weights (normalized to 1)."""

    def __init__(self, entries: list, vocab_size: int, seq_len: int, seed: int):
        sources = parse_sources(entries)
        total = sum(weight for _, weight in sources)
        self.names = [Path(path).name or path for path, _ in sources]
        if len(set(self.names)) != len(self.names):
            raise SeedckptError(f"data.sources: two sources share a directory name ({self.names}); rename one")
        # Each source draws its windows from its own keyed stream: two sources never share offsets.
        self.sources = [
            TokenFileData(path, vocab_size, seq_len, _source_seed(seed, name))
            for (path, _), name in zip(sources, self.names)
        ]
        self.weights = torch.tensor([weight / total for _, weight in sources], dtype=torch.float64)
        self.seed = seed
        self.consumption: dict[str, int] = {}
        self.description = "mixture of " + ", ".join(
            f"{name} {weight:.0%}" for name, weight in zip(self.names, self.weights.tolist())
        )

    def global_batch(self, step: int, batch_size: int) -> Batch:
        choice = torch.multinomial(
            self.weights, batch_size, replacement=True, generator=keyed_generator("seedckpt-mix", self.seed, step)
        )
        rows = torch.empty(batch_size, self.sources[0].seq_len + 1, dtype=torch.int64)
        self.consumption = {}
        for k, (source, name) in enumerate(zip(self.sources, self.names)):
            where = (choice == k).nonzero().flatten()
            self.consumption[name] = len(where)
            if len(where):
                part = source.global_batch(step, len(where))
                rows[where] = torch.cat([part.inputs, part.labels[:, -1:]], dim=1)
        return Batch.from_rows(rows)


def _source_seed(seed: int, name: str) -> int:
    return int(keyed_generator("seedckpt-source", seed, name).initial_seed())
