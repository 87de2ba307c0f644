"""A training run's checkpoint folder: ``folder/step-N/``, the complete ones, pruning."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from seedckpt.checkpoint.manifest import MANIFEST_NAME


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


def prune_steps(folder: str | os.PathLike, keep: int, saved: int) -> None:
    """Delete all but the newest ``keep`` complete step checkpoints up to ``saved``, the step just
    written (``keep <= 0`` keeps all). Newer ones (left by a run resumed at an earlier
    ``checkpoint.load_step``) are kept: they are not this run's to count, and not older than its own."""
    if keep <= 0:
        return
    steps = {n: path for n, path in complete_steps(folder).items() if n <= saved}
    for step in sorted(steps)[:-keep]:
        shutil.rmtree(steps[step], ignore_errors=True)
