"""A dependency-free progress line for long CPU work (seeding a 70B model takes minutes)."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """``done/total`` with rate and ETA on stderr.

    On a terminal the line is redrawn in place; otherwise (logs, CI) a line is printed every 10 %
    so the log stays short.
    """

    def __init__(self, total: float, label: str, unit: str = "B", enabled: bool = True, stream=None):
        self.total, self.label, self.unit, self.enabled = total, label, unit, enabled
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = time.perf_counter()
        self._tty = self.stream.isatty()
        self._last_decile = -1
        self._last_draw = 0.0
        self._lock = threading.Lock()  # updated from the writer's worker threads

    def update(self, amount: float) -> None:
        with self._lock:
            self.done += amount
            if self.enabled:
                self._draw()

    def _draw(self) -> None:
        now = time.perf_counter()
        decile = int(10 * self.done / self.total) if self.total else 10
        if self._tty and (now - self._last_draw > 0.1 or self.done >= self.total):
            self._last_draw = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self._tty and decile > self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line(now) + "\n")

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")

    def _line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(30 * frac)
        return (f"{self.label} [{bar:<30}] {100 * frac:5.1f}% {_human(self.done, self.unit)}/"
                f"{_human(self.total, self.unit)} {_human(rate, self.unit)}/s eta {eta:.0f}s")


def _human(x: float, unit: str) -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(x) < 1024 or prefix == "T":
            return f"{x:.1f}{prefix}{unit}" if prefix else f"{x:.0f}{unit}"
        x /= 1024
    return f"{x}{unit}"
