"""Progress output: a live bar on a terminal, a few complete lines in a log or pipe, nothing when disabled."""

from __future__ import annotations

import io
import threading

from seedckpt.utils import progress
from seedckpt.utils.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_short_job_adds_one_complete_line_to_a_log():
    log = io.StringIO()
    bar = Progress(3 * 2**20, "seed debug", stream=log)
    for _ in range(3 * 1024):
        bar.update(1024)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.splitlines() == [text.strip()]  # one line: the work was done in well under 30 s
    assert text.startswith("seed debug: 100.0% 3.00MB/3.00MB")  # binary units: 3 MiB


def test_a_long_job_prints_a_line_per_30_seconds_and_one_at_the_end(monkeypatch):
    clock = iter([0.0, 10.0, 31.0, 45.0, 62.0, 70.0, 80.0, 81.0])  # start, each update, close
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    bar = Progress(60, "convert", unit="x", stream=log)
    for _ in range(6):
        bar.update(10)
    bar.close()
    assert [line.split("%")[0] for line in log.getvalue().splitlines()] == [
        "convert:  33.3",  # 31 s: the first 30 s passed
        "convert:  66.7",  # 62 s: another 30 s
        "convert: 100.0",  # done
    ]


def test_a_job_that_stops_early_says_where_when_closed():
    log = io.StringIO()
    bar = Progress(100, "convert", stream=log)
    bar.update(55)
    bar.close()
    assert [line.split("%")[0] for line in log.getvalue().splitlines()] == ["convert:  55.0"]


def test_disabled_prints_nothing():
    for stream in (io.StringIO(), _Terminal()):
        bar = Progress(10, "verify", enabled=False, stream=stream)
        bar.update(10)
        bar.close()
        assert stream.getvalue() == ""


def test_a_terminal_gets_a_live_bar():
    terminal = _Terminal()
    bar = Progress(2**20, "verify", stream=terminal)
    bar.update(2**19)
    bar.update(2**19)
    bar.close()
    text = terminal.getvalue()
    assert "\r" in text and "|" in text  # redrawn in place
    assert "verify: 100.0%" in text and "1.00MB/1.00MB" in text.splitlines()[-1]


def test_updates_from_threads_add_up():
    """The checkpoint writer's worker threads report their bytes concurrently: none may be lost."""
    threads, updates = 8, 2000
    log = io.StringIO()
    bar = Progress(threads * updates, "seed", unit="it", stream=log)
    workers = [threading.Thread(target=lambda: [bar.update(1) for _ in range(updates)]) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[-1].startswith("seed: 100.0% 16.0kit/16.0kit")  # 100 %: none lost
