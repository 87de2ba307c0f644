"""SIGTERM and SIGHUP stop a command as Ctrl-C does: its writers clean up on the way out.

Python turns SIGINT into ``KeyboardInterrupt``, and every writer removes its partial output and
its lock while one unwinds. SIGTERM (``kill``, ``timeout``, a scheduler ending a job) and SIGHUP (a
closed terminal or ssh session) end the process at once by default, leaving both behind: a hidden
1.1 GB partial seed was found after one. Inside ``stop_on_signals`` both raise ``Stopped``, a
``KeyboardInterrupt`` that names its signal, so the same cleanup runs, and the command exits with
128 + the signal's number, as a shell reports a process the signal killed. Once one of them (or
Ctrl-C) has been raised, the next are ignored until the block is left, so a second signal cannot
cut the cleanup short. A signal the process was started ignoring (``nohup``) stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """The process was asked to stop by ``signum`` (SIGTERM or SIGHUP; Ctrl-C stays a plain
    ``KeyboardInterrupt``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def how_stopped(interrupt: KeyboardInterrupt) -> tuple[str, int]:
    """The words for an interrupted command and its exit status (128 + the signal's number)."""
    if isinstance(interrupt, Stopped):
        return f"stopped by {signal.Signals(interrupt.signum).name}", 128 + interrupt.signum
    return "interrupted", 128 + signal.SIGINT


@contextlib.contextmanager
def stop_on_signals():
    """Inside, the first SIGINT, SIGTERM or SIGHUP raises (``KeyboardInterrupt``, ``Stopped``) and the
    later ones are ignored; the previous handlers are back on the way out. A no-op off the main thread
    (only it receives Python's signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def stop(signum, frame):
        nonlocal raised
        if not raised:
            raised = True
            raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    defaults = (signal.SIG_DFL, signal.default_int_handler)  # never a signal ignored, or the caller's handler
    previous = {s: h for s in STOP_SIGNALS if (h := signal.getsignal(s)) in defaults}
    for s in previous:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
