"""Progress output: a live bar on a terminal, a few complete lines in a log or pipe, nothing when disabled."""

from __future__ import annotations

import io
import threading

from seedckpt.utils.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_few_complete_lines_ending_at_100_percent():
    log = io.StringIO()
    bar = Progress(3 * 2**20, "seed debug", stream=log)
    for _ in range(3 * 1024):
        bar.update(1024)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 11  # where it started, then every 10 %
    assert lines[-1].startswith("seed debug: 100.0% 3.00MB/3.00MB")  # binary units: 3 MiB
    assert all(line.startswith("seed debug: ") for line in lines)


def test_a_jump_past_several_tenths_prints_one_line():
    log = io.StringIO()
    bar = Progress(100, "convert", stream=log)
    bar.update(55)
    bar.update(45)
    bar.close()
    assert [line.split("%")[0] for line in log.getvalue().splitlines()] == ["convert:  55.0", "convert: 100.0"]


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
    assert len(lines) == 11 and lines[-1].startswith("seed: 100.0% 16.0kit/16.0kit")
