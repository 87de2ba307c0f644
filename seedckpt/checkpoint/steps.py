"""A training run's checkpoint folder: ``folder/step-N/``, the complete ones, pruning."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from seedckpt.checkpoint.manifest import MANIFEST_NAME


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def complete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """Training checkpoints in ``folder`` that finished writing: a writer's hidden
    ``.step-N.<pid>.partial`` and ``.step-N.lock`` never match ``step-N``."""
    folder = Path(folder)
    out = {}
    if folder.is_dir():
        for child in folder.iterdir():
            number = child.name.removeprefix("step-")
            if (child.name.startswith("step-") and number.isdigit() and (child / ".metadata").is_file()
                    and (child / MANIFEST_NAME).is_file()):
                out[int(number)] = child
    return out


def prune_steps(folder: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` complete step checkpoints (``keep <= 0`` keeps all)."""
    if keep <= 0:
        return
    steps = complete_steps(folder)
    for step in sorted(steps)[:-keep]:
        shutil.rmtree(steps[step], ignore_errors=True)
