"""Per-step telemetry: a readable progress line, ``metrics.jsonl`` and optional TensorBoard."""

from __future__ import annotations

import json
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
    """Written by one rank (the caller decides which); appends, so a resumed run continues the file."""

    def __init__(self, dump_folder: str | Path, enable_tensorboard: bool = False):
        self.folder = Path(dump_folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.jsonl"
        self._file = open(self.path, "a")
        self._tb = None
        if enable_tensorboard:
            self._tb = self.check_tensorboard()(str(self.folder / "tensorboard"))

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


def format_step(r: dict) -> str:
    return (f"step {r['step']:>5}/{r['steps']}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
            f"grad_norm {r['grad_norm']:.3f}  {r['tokens_per_s']:,.0f} tok/s  step {1e3 * r['step_time_s']:.0f} ms  "
            f"data {1e3 * r['data_wait_s']:.1f} ms  mem {r['peak_mem_bytes'] / 2**20:,.0f} MiB"
            + (f"  osft_leak {r['osft_leak']:.1e}" if "osft_leak" in r else ""))
