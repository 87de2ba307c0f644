"""Reading a range of a file into memory whole, which one ``preadv`` call need not do."""

from __future__ import annotations

import os


def pread_into(fd: int, view: memoryview, at: int) -> int:
    """Fill ``view`` from byte ``at`` of ``fd``; the bytes read, fewer than ``view.nbytes`` only
    where the file ends (the caller names what that means)."""
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], at + done)
        if n == 0:
            break
        done += n
    return done
