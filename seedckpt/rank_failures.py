"""One report per failure of a multi-rank run, and Ctrl-C as one line with exit status 130.

A failure rarely stays on one rank. The rank that hits it stops, and every other rank's next
collective then fails with an error of its own ("Connection closed by peer" on gloo): one cause,
a traceback per rank. So the ranks agree through the process group's store, which every rank
already reaches: the first to fail takes the report (an atomic counter) and prints its line; a
rank failing later with the same message stays quiet, one with a different message prints it (it
is news), and a rank whose collective broke because a peer stopped prints nothing -- except rank
0, which says once which rank it stopped for. Only an error that is nobody's known failure (a bug)
keeps its traceback.

Ctrl-C reaches every rank of a terminal's job at once. The first SIGINT becomes a
``KeyboardInterrupt``; a second one, arriving while the first unwinds through collectives that
its peers have left, is ignored, so the unwinding finishes and the step being saved is removed.
"""

from __future__ import annotations

import datetime
import signal
import sys

import torch.distributed as dist

from seedckpt.errors import SeedckptError, interrupted

EXIT_ERROR, EXIT_INTERRUPTED = 2, 130
_COUNT, _FIRST = "seedckpt/failures", "seedckpt/first_failure"
# How long a rank waits for a peer's report to reach the store: the reporting rank writes it
# before it leaves, so a rank whose collective broke because of that leaving finds it at once.
_REPORT_WAIT = datetime.timedelta(seconds=5)

_sigint_seen = False


def _on_sigint(signum, frame) -> None:
    global _sigint_seen
    if not _sigint_seen:
        _sigint_seen = True
        raise KeyboardInterrupt


def stop_at_first_sigint() -> None:
    """Turn the first SIGINT into ``KeyboardInterrupt`` and ignore the rest (see the module docstring)."""
    signal.signal(signal.SIGINT, _on_sigint)


def user_facing_line(error: BaseException) -> str | None:
    """The one line for a failure the user can act on (bad input, disk full, ...), or None: a
    collective broken by a peer, or a bug. (Saves already name a full disk with their path.)"""
    return str(error) if isinstance(error, (SeedckptError, OSError)) else None


def report_failure(error: BaseException, rank: int, interrupted_line: str) -> int:
    """Print what this rank's failure needs printed (see the module docstring); the exit status.
    ``interrupted_line``: what an interrupted run says (where it stands, how to resume).
    Re-raises an error that is nobody's known failure, for its traceback."""
    stopped_by_ctrl_c = _sigint_seen or interrupted(error)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late Ctrl-C must not cut the report short
    line = interrupted_line if stopped_by_ctrl_c else user_facing_line(error)
    status = EXIT_INTERRUPTED if stopped_by_ctrl_c else EXIT_ERROR
    store = _store()
    if line is None:  # a collective broken by a peer that stopped first, or a bug
        first = _first_report(store)
        if first is None:
            _claim(store, rank, "crashed")
            raise error
        peer, peer_line = first
        if rank == 0:
            why = "was interrupted" if peer_line == interrupted_line else "failed (its error is above)"
            print(f"train.py: stopped: rank {peer} {why}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED if peer_line == interrupted_line else EXIT_ERROR
    # No rank in the line: a collective read or save (DCP) raises one rank's failure on every rank.
    if _claim(store, rank, line) or (_first_report(store) or (None, None))[1] != line:
        print(f"train.py: {line if stopped_by_ctrl_c else f'error: {line}'}", file=sys.stderr, flush=True)
    return status


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
