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


def parse_sources(entries: list[str]) -> list[tuple[str, float]]:
    """``["web:0.7", "code:0.2"]`` -> ``[("web", 0.7), ("code", 0.2)]`` (a path may hold ``:``; the
    weight follows the last one)."""
    sources = []
    for entry in entries:
        path, sep, weight = entry.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not sep or not path or not (math.isfinite(value) and value > 0):
            raise SeedckptError(
                f"data.sources entry {entry!r}: write it as DIRECTORY:WEIGHT with a weight > 0, e.g. tokens/web:0.7"
            )
        sources.append((path, value))
    return sources


class MixedData:
    """Rows from several token directories in proportion to their weights (normalized to 1)."""

    def __init__(self, entries: list[str], vocab_size: int, seq_len: int, seed: int):
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
