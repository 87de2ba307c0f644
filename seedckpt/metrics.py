"""Per-step telemetry: a readable progress line, ``metrics.jsonl`` and optional TensorBoard."""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path

import torch

from seedckpt.errors import SeedckptError


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated on CUDA; peak resident set size (RSS) of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLogger:
    """Written by one rank (the caller decides which). A resumed run continues the file: rows of the
    steps after ``after_step`` (logged by the interrupted run past its last checkpoint, now replayed)
    are dropped first, so the file keeps one row per step."""

    def __init__(self, dump_folder: str | Path, enable_tensorboard: bool = False, after_step: int = 0):
        self.folder = Path(dump_folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.jsonl"
        self._drop_rows_after(after_step)
        self._file = open(self.path, "a")
        self._tb = None
        if enable_tensorboard:
            self._tb = self.check_tensorboard()(str(self.folder / "tensorboard"))

    def _drop_rows_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True) if _step_of(line) <= step]
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text("".join(kept))
        os.replace(partial, self.path)

    @staticmethod
    def check_tensorboard():
        """TensorBoard's ``SummaryWriter``, or a clear error (checked before any rendezvous)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SeedckptError("metrics.enable_tensorboard needs the tensorboard package: "
                                "pip install tensorboard") from None
        return SummaryWriter

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        print(format_step(record), flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _step_of(line: str) -> float:
    """A row's step; a damaged row (a crash mid-line) counts as past every step, so it is dropped."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) else math.inf


def format_step(r: dict) -> str:
    return (f"step {r['step']:>5}/{r['steps']}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
            f"grad_norm {r['grad_norm']:.3f}  {r['tokens_per_s']:,.0f} tok/s  step {1e3 * r['step_time_s']:.0f} ms  "
            f"data {1e3 * r['data_wait_s']:.1f} ms  mem {r['peak_mem_bytes'] / 2**20:,.0f} MiB"
            + (f"  all-gather {1e3 * r['all_gather_s']:.0f} ms  reduce-scatter {1e3 * r['reduce_scatter_s']:.0f} ms"
               if r.get("all_gather_calls") or r.get("reduce_scatter_calls") else "")
            + (f"  osft_leak {r['osft_leak']:.1e}" if "osft_leak" in r else ""))
