"""Progress of long CPU work (seeding a 70B model, converting or verifying a checkpoint takes minutes).

On a terminal it is tqdm's live bar. Anywhere else (a log file, a pipe, CI) a redrawn bar would
leave one ``\\r``-joined line per update in the log, so it prints a complete line each time another
10 % is done instead: at most 11 lines, the last one at 100 %. Both show the same fields, formatted
by tqdm: done/total in binary units, rate and ETA.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

_STATS = "{n_fmt}{unit}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}]"
_BAR_FORMAT = "{desc}: {percentage:5.1f}%|{bar}| " + _STATS
_LINE_FORMAT = "{desc}: {percentage:5.1f}% " + _STATS


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
    one complete line per 10 % reached, formatted by ``tqdm.format_meter``."""

    def __init__(self, total: float, label: str, unit: str, divisor: int, stream):
        self.total, self.label, self.unit, self.divisor, self.stream = total, label, unit, divisor, stream
        self.done = 0.0
        self.start = time.perf_counter()
        self.printed_decile = -1  # the first update prints where the work starts

    def update(self, amount: float) -> None:
        self.done += amount
        decile = min(10, int(10 * self.done / self.total)) if self.total else 10
        if decile > self.printed_decile:
            self.printed_decile = decile
            line = tqdm.format_meter(
                self.done,
                self.total,
                time.perf_counter() - self.start,
                prefix=self.label,
                unit=self.unit,
                unit_scale=True,
                unit_divisor=self.divisor,
                bar_format=_LINE_FORMAT,
            )
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Nothing to finish: every line is already complete (the 100 % one came with the last update)."""
