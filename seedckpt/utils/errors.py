"""The one exception type users see without a traceback, and the one line for a failed write."""

import errno


class SeedckptError(Exception):
    """A user-facing failure: bad input, a mismatched checkpoint, an unsafe operation.

    The message says what is wrong *and* what to do about it. The CLI prints it as one line and
    exits non-zero; library callers can catch it like any exception.
    """


# What a failed write's OSError means, by errno, and what to do about it.
_WRITE_FAILURES = {
    errno.ENOSPC: ("no space left on the device", "free space or choose another destination"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or choose another destination"),
    errno.EACCES: ("permission denied", "choose a destination you can write"),
    errno.EPERM: ("operation not permitted", "choose a destination you can write"),
    errno.EROFS: ("the file system is read-only", "choose a writable destination"),
}


def _chain(error: BaseException | None):
    """``error`` and the exceptions it was raised from or while handling."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM, ``signals.Stopped``) behind ``error``, however deep, or None:
    ``torch.save`` turns one raised by its writer into a ``RuntimeError``."""
    return next((e for e in _chain(error) if isinstance(e, KeyboardInterrupt)), None)


def interrupted(error: BaseException) -> bool:
    return interruption(error) is not None


def write_failure(error: BaseException, doing: str) -> SeedckptError | None:
    """One line for a write that failed for the machine's reason (disk full, permission denied,
    read-only) while ``doing`` ("writing PATH"), or None. The OSError is looked for along the
    exception's chain: ``torch.save`` reports a failed write as ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``, with the OSError only as its context."""
    if isinstance(error, SeedckptError):
        return None  # already the line to print
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _WRITE_FAILURES:
            what, fix = _WRITE_FAILURES[e.errno]
            return SeedckptError(f"{what} {doing}; nothing was written there: {fix} and run again")
    return None
