"""A training run's checkpoint folder: ``folder/step-N/``, the complete ones, pruning."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from seedckpt.checkpoint.manifest import MANIFEST_NAME, read_manifest
from seedckpt.utils.errors import SeedckptError


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def step_dirs(folder: str | os.PathLike) -> dict[int, Path]:
    """Every ``step-N`` directory in ``folder``, complete or not: a resume must look at each (a
    ``step-N`` copied in part is an error to report, not a directory to skip). A writer's hidden
    ``.step-N.<pid>.partial`` and ``.step-N.lock`` never match ``step-N``."""
    folder = Path(folder)
    out = {}
    if folder.is_dir():
        for child in folder.iterdir():
            number = child.name.removeprefix("step-")
            if child.name.startswith("step-") and number.isdigit() and child.is_dir():
                out[int(number)] = child
    return out


def complete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """The ``step-N`` directories in ``folder`` that finished writing (``.metadata`` and manifest)."""
    return {
        n: path
        for n, path in step_dirs(folder).items()
        if (path / ".metadata").is_file() and (path / MANIFEST_NAME).is_file()
    }


def prune_steps(folder: str | os.PathLike, keep: int, saved: int, keep_best: bool = False) -> int | None:
    """Delete all but the newest ``keep`` complete step checkpoints up to ``saved``, the step just
    written (``keep <= 0`` keeps all). Newer ones (left by a run resumed at an earlier
    ``checkpoint.load_step``) are kept: they are not this run's to count, and not older than its own.
    ``keep_best``: the step whose manifest records the lowest ``val_loss`` is kept too; it is returned
    (None without ``keep_best`` or a recorded loss)."""
    steps = {n: path for n, path in complete_steps(folder).items() if n <= saved}
    best = best_step(steps) if keep_best else None
    for step in sorted(steps)[:-keep] if keep > 0 else ():
        if step != best:
            shutil.rmtree(steps[step], ignore_errors=True)
    return best


def best_step(steps: dict[int, Path]) -> int | None:
    """Of ``steps``, the one whose manifest records the lowest finite ``val_loss`` (the earliest of
    equals); None when none records one."""
    losses = {}
    for n, path in steps.items():
        try:
            value = (read_manifest(path) or {}).get("val_loss")
        except SeedckptError:  # a damaged manifest records nothing to compare; pruning goes on
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            losses[n] = value
    return min(losses, key=lambda n: (losses[n], n)) if losses else None
