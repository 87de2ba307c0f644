"""Progress of long CPU work (seeding a 70B model, converting or verifying a checkpoint takes minutes).

On a terminal it is tqdm's live bar. Anywhere else (a log file, a pipe, CI) a redrawn bar would
leave one ``\\r``-joined line per update in the log, so it prints a complete line at most every
``LOG_INTERVAL_S`` seconds of work and one when the work is done: a command under 30 s adds one
line to a log, and a failing command's error is not buried under progress. Both show the same
fields, formatted by tqdm: done/total in binary units, rate and ETA.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

_STATS = "{n_fmt}{unit}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}]"
_BAR_FORMAT = "{desc}: {percentage:5.1f}%|{bar}| " + _STATS
_LINE_FORMAT = "{desc}: {percentage:5.1f}% " + _STATS
LOG_INTERVAL_S = 30.0  # at most one progress line per this much work in a log


class Progress:
    """``done/total`` with rate and ETA on ``stream`` (default stderr); ``enabled=False`` prints nothing.

    ``update`` may be called from several threads at once (the checkpoint writer's workers report
    the bytes they wrote), so every count goes through one lock.
    """

    def __init__(self, total: float, label: str, unit: str = "B", enabled: bool = True, stream=None):
        stream = stream or sys.stderr
        divisor = 1024 if unit == "B" else 1000  # bytes in KiB/MiB/GiB, anything else in k/M/G
        self._lock = threading.Lock()
        self._meter: tqdm | _PlainLines | None = None
        if enabled and stream.isatty():
            self._meter = tqdm(
                total=total,
                desc=label,
                unit=unit,
                unit_scale=True,
                unit_divisor=divisor,
                file=stream,
                bar_format=_BAR_FORMAT,
                dynamic_ncols=True,
            )
        elif enabled:
            self._meter = _PlainLines(total, label, unit, divisor, stream)

    def update(self, amount: float) -> None:
        if self._meter is not None:
            with self._lock:
                self._meter.update(amount)

    def close(self) -> None:
        if self._meter is not None:
            with self._lock:
                self._meter.close()


class _PlainLines:
    """The same interface as ``tqdm`` (``update``, ``close``) for a stream that is not a terminal:
    a complete line, formatted by ``tqdm.format_meter``, once ``LOG_INTERVAL_S`` passed since the
    last one, and one when the work is done (or closed before that)."""

    def __init__(self, total: float, label: str, unit: str, divisor: int, stream):
        self.total, self.label, self.unit, self.divisor, self.stream = total, label, unit, divisor, stream
        self.done = 0.0
        self.start = self.last_line = time.perf_counter()
        self.finished = False

    def update(self, amount: float) -> None:
        self.done += amount
        now = time.perf_counter()
        if self.done >= self.total or now - self.last_line >= LOG_INTERVAL_S:
            self._line(now)

    def _line(self, now: float) -> None:
        if self.finished:
            return
        self.finished = self.done >= self.total
        self.last_line = now
        line = tqdm.format_meter(
            self.done,
            self.total,
            now - self.start,
            prefix=self.label,
            unit=self.unit,
            unit_scale=True,
            unit_divisor=self.divisor,
            bar_format=_LINE_FORMAT,
        )
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """The last line, where the work stopped, unless the one at 100 % was printed already."""
        self._line(time.perf_counter())
