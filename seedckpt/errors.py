"""The one exception type users see without a traceback."""


class SeedckptError(Exception):
    """A user-facing failure: bad input, a mismatched checkpoint, an unsafe operation.

    The message says what is wrong *and* what to do about it. The CLI prints it as one line and
    exits non-zero; library callers can catch it like any exception.
    """
