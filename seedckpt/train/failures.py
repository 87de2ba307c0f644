"""One report per failure of a multi-rank run, and Ctrl-C as one line with exit status 130.

A failure rarely stays on one rank. The rank that hits it stops, and every other rank's next
collective then fails with an error of its own ("Connection closed by peer" on gloo): one cause,
a traceback per rank. So the ranks agree through the process group's store, which every rank
already reaches: the first to fail takes the report (an atomic counter) and prints its line; a
rank failing later with the same message stays quiet, one with a different message prints it (it
is news), and a rank whose collective broke because a peer stopped prints nothing -- except rank
0, which says once which rank it stopped for. A rank that dies without a word (killed by a
signal) leaves the others with broken collectives and no report: the first of them says so. A
first failure that is none of these (a bug) keeps its traceback.

Ctrl-C reaches every rank of a terminal's job at once. The first SIGINT becomes a
``KeyboardInterrupt``; a second one, arriving while the first unwinds through collectives that
its peers have left, is ignored, so the unwinding finishes: a synchronous save in progress is
removed, an asynchronous one is drained (``BackgroundSaver.drain``).
"""

from __future__ import annotations

import datetime
import signal
import sys

import torch.distributed as dist

from seedckpt.utils.errors import SeedckptError, interrupted

EXIT_ERROR, EXIT_INTERRUPTED = 2, 130
_COUNT, _FIRST = "seedckpt/failures", "seedckpt/first_failure"
# How long a rank waits for a peer's report to reach the store: the reporting rank writes it
# before it leaves, so a rank whose collective broke because of that leaving finds it at once.
_REPORT_WAIT = datetime.timedelta(seconds=5)

# What a rank says when its collective broke and no rank had reported a failure: the peer died
# without a word (killed by a signal -- the out-of-memory killer's SIGKILL -- or crashed in C++).
_PEER_LEFT = "train.py: stopped: a peer rank left without reporting an error (killed by a signal, or crashed)"
_PEER_LEFT_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

_sigint_seen = False


def _on_sigint(signum, frame) -> None:
    global _sigint_seen
    if not _sigint_seen:
        _sigint_seen = True
        raise KeyboardInterrupt


def stop_at_first_sigint() -> None:
    """Turn the first SIGINT into ``KeyboardInterrupt`` and ignore the rest (see the module docstring)."""
    signal.signal(signal.SIGINT, _on_sigint)


def _user_facing_line(error: BaseException) -> str | None:
    """The one line for a failure the user can act on (bad input, disk full, ...), or None: a
    collective broken by a peer, or a bug. (Saves already name a full disk with their path.)"""
    return str(error) if isinstance(error, (SeedckptError, OSError)) else None


def _peer_left(error: BaseException) -> bool:
    """A collective that failed because a peer process is gone (gloo says so in its message)."""
    return isinstance(error, dist.DistError) or any(sign in str(error) for sign in _PEER_LEFT_SIGNS)


def report_failure(error: BaseException, rank: int, interrupted_line: str) -> int:
    """Print what this rank's failure needs printed (see the module docstring); the exit status.
    ``interrupted_line``: what an interrupted run says (where it stands, how to resume). A bug
    that is the first failure is raised again, for its traceback."""
    stopped_by_ctrl_c = _sigint_seen or interrupted(error)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late Ctrl-C must not cut the report short
    interrupted_report = f"train.py: {interrupted_line}"
    user_line = None if stopped_by_ctrl_c else _user_facing_line(error)
    broken = not stopped_by_ctrl_c and user_line is None and _peer_left(error)
    report = (
        interrupted_report
        if stopped_by_ctrl_c
        else f"train.py: error: {user_line}"
        if user_line is not None
        else _PEER_LEFT
        if broken
        else None
    )
    store = _store()
    # No rank in a report: a collective read or save (DCP) raises one rank's failure on every rank.
    if _claim(store, rank, report or "crashed"):  # the first to fail: its line (or traceback) is the report
        if report is None:
            raise error
        print(report, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED if stopped_by_ctrl_c else EXIT_ERROR
    first = _first_report(store)  # the first rank records its report right after claiming
    first_report = first[1] if first is not None else None
    if report is None or broken:  # a collective broken because the first failing rank left
        if rank == 0 and first is not None and first_report != _PEER_LEFT:
            why = "was interrupted" if first_report == interrupted_report else "failed (its error is above)"
            print(f"train.py: stopped: rank {first[0]} {why}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED if first_report == interrupted_report else EXIT_ERROR
    if first_report != report:  # news, not the first rank's failure seen again
        print(report, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED if stopped_by_ctrl_c else EXIT_ERROR


def _store():
    """The default group's store, where ``init_process_group`` rendezvoused (None if it is gone)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _claim(store, rank: int, line: str) -> bool:
    """Whether this rank is the first to fail (and so prints); records its report for the others."""
    if store is None:
        return True
    try:
        first = store.add(_COUNT, 1) == 1
        if first:
            store.set(_FIRST, f"{rank}\n{line}")
        return first
    except RuntimeError:  # the store's host (rank 0 outside torchrun) is gone
        return True


def _first_report(store) -> tuple[int, str] | None:
    """(rank, line) of the first failure, once it reaches the store; None if none does."""
    if store is None:
        return None
    try:
        store.wait([_FIRST], _REPORT_WAIT)
        rank, _, line = store.get(_FIRST).decode().partition("\n")
        return int(rank), line
    except RuntimeError:  # no report within the wait, or the store is gone
        return None
