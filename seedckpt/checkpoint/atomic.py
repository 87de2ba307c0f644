"""Publishing outputs atomically: write into a hidden sibling, rename when complete.

A checkpoint (or converted file) is written into ``.NAME.partial`` and renamed to ``NAME`` only
when complete and fsynced, so any path with the final name is complete, and a killed writer leaves
only a ``.partial`` that no reader accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from seedckpt.errors import SeedckptError

PARTIAL_SUFFIX = ".partial"


def partial_of(path: Path) -> Path:
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def check_destination(path: str | os.PathLike, force: bool) -> Path:
    """Fail early (before any work) when ``path`` exists and ``force`` is not set."""
    path = Path(path)
    if path.exists() and not force:
        raise SeedckptError(f"{path} already exists; pass --force to replace it or choose another destination")
    return path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, force: bool = False, directory: bool = True):
    """Yield a hidden ``.NAME.partial`` sibling to write into; publish it as ``NAME`` on success.

    On any error the partial output is removed, so a failed or rejected write leaves nothing behind.
    """
    path = check_destination(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_of(path)
    remove(partial)
    if directory:
        partial.mkdir()
    try:
        yield partial
        _publish(partial, path)
    except BaseException:
        remove(partial)
        raise


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def write_json_synced(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _publish(partial: Path, path: Path) -> None:
    """Rename the complete ``partial`` to ``path``, replacing an existing one last."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        remove(old)
        path.rename(old)
    partial.rename(path)
    remove(old)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
