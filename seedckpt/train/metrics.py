"""Per-step telemetry: a readable progress line, ``metrics.jsonl``, and optionally TensorBoard,
Weights & Biases and MLflow (``seedckpt.train.mlflow_sink``).

On a GPU the rows also carry model FLOPs utilization, torchtitan's way: ``tflops`` is the model's
FLOPs per token (its family's ``flops_per_token``) times the global tokens per second, divided by the number
of GPUs; ``mfu_pct`` is that against the GPU's dense peak for the parameter dtype
(``peak_tflops``). It counts the model's math only -- no recomputation (activation checkpointing),
no attention masking savings -- so runs with different settings compare on the work they do for
the model. On a CPU, or a GPU the table does not know, both fields are absent, never guessed.
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import time
from pathlib import Path

import torch

from seedckpt.train.mlflow_sink import MlflowSink
from seedckpt.utils.errors import SeedckptError

# Dense (no 2:4 sparsity) peaks in TFLOP/s per GPU, from NVIDIA's datasheets. Their tensor-core
# headline figures are "with sparsity", twice the dense ones; fp32 is the non-tensor rate:
#   H100 SXM 1,979 bf16 / 989 tf32 (sparse), 67 fp32    -> 989.5 / 494.5 / 67 dense
#   H100 NVL 1,671 / 835, 60;  H100 PCIe 1,513 / 756, 51 -> halved likewise
#   H200 (SXM) as H100 SXM; H200 NVL as H100 NVL
#   A100 (SXM and PCIe) 312 bf16 / 156 tf32 dense, 19.5 fp32
#   L40S 362.05 bf16 / 183 tf32 dense (733 / 366 sparse), 91.6 fp32
# fp16 runs at the bf16 rate on all of them. fp32 parameters run the plain fp32 units
# unless float32 matmuls may use TF32 (``torch.set_float32_matmul_precision("high")``).
# ``torch.cuda.get_device_name`` names them e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S": the first entry whose
# words all occur in the name wins, so variants come before their family.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("H100", "NVL"), {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H100", "PCIe"), {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (("H100",), {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (("H200", "NVL"), {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H200",), {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (("A100",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),
)


def peak_tflops(device_name: str, param_dtype: str, tf32: bool = False) -> float | None:
    """The dense peak TFLOP/s of the GPU ``device_name`` for matmuls in ``param_dtype``
    (``training.mixed_precision_param``); ``tf32``: float32 matmuls may use TF32. None for a
    device the table does not know."""
    unit = "bf16" if param_dtype in ("bfloat16", "float16") else "tf32" if tf32 else "fp32"
    for words, peaks in PEAK_TFLOPS:
        if all(word in device_name for word in words):
            return peaks[unit]
    return None


def utilization(flops_per_token: int, tokens_per_s: float, num_gpus: int, peak: float | None) -> dict:
    """``tflops`` (per GPU) and ``mfu_pct`` for a row, or nothing without a known ``peak``."""
    if peak is None:
        return {}
    tflops = flops_per_token * tokens_per_s / num_gpus / 1e12
    return {"tflops": tflops, "mfu_pct": 100 * tflops / peak}


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated on CUDA; peak resident set size (RSS) of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak RSS since it started: Linux's ``VmHWM``, because ``ru_maxrss`` starts at
    the peak of the process that launched it (torchrun's agent, with torch loaded) and would floor
    a small rank's reading there."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


METRICS_FILE = "metrics.jsonl"  # in job.dump_folder
WANDB_RUN_ID = "wandb_run_id"  # in job.dump_folder: the W&B run a resumed run continues
CONSTANT_FIELDS = ("step", "steps")  # the x axis and the run's length: not curves


class MetricsLogger:
    """Written by one rank (the caller decides which). A resumed run continues the file: rows of the
    steps after ``after_step`` (logged by the interrupted run past its last checkpoint, now replayed)
    are dropped first, so the file keeps one row per step."""

    def __init__(
        self,
        dump_folder: str | Path,
        enable_tensorboard: bool = False,
        after_step: int = 0,
        wandb: dict | None = None,
        mlflow: dict | None = None,
    ):
        """``wandb``: ``wandb.init``'s project, name and config, to log to Weights & Biases too;
        ``mlflow``: ``MlflowSink``'s tracking URI, experiment, name and config, to log to MLflow too."""
        self.folder = Path(dump_folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / METRICS_FILE
        self._drop_rows_after(after_step)
        self._file = open(self.path, "a")
        self._tb = None
        if enable_tensorboard:
            self._tb = self.check_tensorboard()(str(self.folder / "tensorboard"))
        self._wandb = self._start_wandb(**wandb) if wandb is not None else None
        self._mlflow = MlflowSink(self.folder, **mlflow) if mlflow is not None else None
        self._first_logged: tuple[int, float] | None = None  # (step, wall clock) of this process's first row

    def _start_wandb(self, project: str, name: str, config: dict):
        """A W&B run in ``dump_folder/wandb``: the one this folder's earlier runs logged to (its id
        is kept in ``dump_folder/wandb_run_id``), so a resumed run continues it."""
        wandb = self.check_wandb()
        id_file = self.folder / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B's id shape
        if not id_file.is_file():
            partial = id_file.with_name(f".{id_file.name}.partial")
            partial.write_text(run_id + "\n")
            os.replace(partial, id_file)
        return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(self.folder), config=config)

    @staticmethod
    def check_wandb():
        """The wandb package, or a clear error (checked before any rendezvous)."""
        try:
            import wandb
        except ImportError:
            raise SeedckptError("metrics.wandb needs the wandb package: pip install 'seedckpt[wandb]'") from None
        return wandb

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
            raise SeedckptError(
                "metrics.enable_tensorboard needs the tensorboard package: pip install tensorboard"
            ) from None
        return SummaryWriter

    def log(self, record: dict) -> None:
        """One row: to metrics.jsonl, TensorBoard (its curves, not the run's constants), W&B and stdout.
        The row gains ``eta_s``, the estimated time to the last step (``remaining_seconds``)."""
        record = {**record, "eta_s": self._remaining_seconds(record)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in CONSTANT_FIELDS and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._mlflow is not None:
            self._mlflow.log(record, CONSTANT_FIELDS)
        print(format_step(record), flush=True)

    def _remaining_seconds(self, record: dict) -> float:
        """The steps left times the mean wall-clock time per step since this process's first row,
        which leaves out the start (building, loading, the first step's compilation); until there is a
        second row, the steps left times this step's time."""
        step, now = record["step"], time.perf_counter()
        if self._first_logged is None:
            self._first_logged = (step, now)
        first_step, first_time = self._first_logged
        per_step = (now - first_time) / (step - first_step) if step > first_step else record["step_time_s"]
        return max(0, record["steps"] - step) * per_step

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()


def _step_of(line: str) -> float:
    """A row's step; a damaged row (a crash mid-line) counts as past every step, so it is dropped."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) else math.inf


def format_step(r: dict) -> str:
    return (
        f"step {r['step']:>5}/{r['steps']}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
        f"grad_norm {r['grad_norm']:.3f}  {r['tokens_per_s']:,.0f} tok/s  step {1e3 * r['step_time_s']:.0f} ms  "
        f"data {1e3 * r['data_wait_s']:.1f} ms  mem {r['peak_mem_bytes'] / 2**20:,.0f} MiB"
        + (
            f"  all-gather {1e3 * r['all_gather_s']:.0f} ms  reduce-scatter {1e3 * r['reduce_scatter_s']:.0f} ms"
            if r.get("all_gather_calls") or r.get("reduce_scatter_calls")
            else ""
        )
        + (f"  {r['tflops']:.0f} TFLOP/s  mfu {r['mfu_pct']:.1f} %" if "tflops" in r else "")
        + (f"  osft_leak {r['osft_leak']:.1e}" if "osft_leak" in r else "")
        + (f"  val_loss {r['val_loss']:.4f}" if "val_loss" in r else "")
        + (f"  eta {format_duration(r['eta_s'])}" if r.get("eta_s") else "")
    )


def format_duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h02m``: a remaining time at the precision a reader plans by."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
