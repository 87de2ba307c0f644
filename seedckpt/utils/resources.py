"""The disk a command's output may take, checked before it starts: hours of a conversion or a seed
would otherwise end in a full disk."""

from __future__ import annotations

import shutil
from pathlib import Path

from seedckpt.utils.errors import SeedckptError


def check_free_space(output: Path, nbytes: int, what: str = "the seed") -> None:
    """Refuse, before any byte is written, an output of ``nbytes`` larger than the free space where
    ``output`` goes (its nearest existing folder): the whole output, since a replaced one is removed
    only once the new one is complete."""
    where = next(p for p in (output, *output.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if nbytes > free:
        raise SeedckptError(
            f"{what} needs {size_text(nbytes)} at {output}, but {where} has {size_text(free)} free; "
            "free space, choose another output, or write --dtype bfloat16 (half float32's bytes)"
        )


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"
