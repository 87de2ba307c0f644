"""Benchmark SFT batches by token budget (``training.max_tokens_per_rank``) against fixed-count batches
on the shipped chat set (``configs/sft_demo``), in the same run.

A seed of the debug model (``configs/debug.toml``) stands in for the pretrained model; ``train.py``
then fine-tunes it with ``configs/sft_debug.toml`` on one process for ``--steps`` steps, twice: rows of
``seq_len`` = 128 tokens, ``--local-batch-size`` of them (the baseline), and the same tokens per step
as one row of ``local_batch_size x 128`` tokens (``training.max_tokens_per_rank``). Both runs see the
same conversations, truncated at 128 tokens; only how they are packed differs. One JSON line per
run -- padding, assistant (label) tokens per step and per second, step time, from the run's log and
``metrics.jsonl`` -- then one comparing them.

  python benchmarks/sft_batches.py
  python benchmarks/sft_batches.py --local-batch-size 8 --steps 30
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, emit, output_dir, parser, run_checked

SEQ_LEN = 128  # configs/sft_debug.toml's


def fine_tune(seed: Path, run: Path, steps: int, local_batch: int, budget: int) -> dict:
    """One fine-tuning run (``budget`` 0: rows of seq_len); its padding and label tokens per second."""
    cmd = [sys.executable, "train.py", "--config", "configs/sft_debug.toml", "--finetune.pretrained", str(seed)]
    cmd += ["--parallelism.pipeline_parallel_degree", "1", "--checkpoint.enable", "false"]
    cmd += ["--checkpoint.folder", str(run / "ckpt"), "--job.dump_folder", str(run), "--training.steps", str(steps)]
    cmd += ["--training.local_batch_size", str(local_batch), "--training.max_tokens_per_rank", str(budget)]
    log = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env=_env()).stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = rows[len(rows) // 4 :]  # after warm-up
    step_s = statistics.median(r["step_time_s"] for r in steady)
    labels = statistics.mean(r["label_tokens"] for r in rows)
    return {
        "local_batch_size": local_batch,
        "max_tokens_per_rank": budget,
        "padding_pct": float(log.split("% padding")[0].split()[-1]),
        "label_tokens_per_step": labels,
        "step_time_s": step_s,
        "label_tokens_per_s": labels / step_s,
        "final_loss": rows[-1]["loss"],
    }


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local-batch-size", type=int, default=4, help="rows per micro-batch, both runs (default 4)")
    opts = p.parse_args()
    with output_dir(opts.out_dir, "seedckpt-sft-batches-") as work:
        seed = work / "seed"
        run_checked(
            [sys.executable, "create_seed_checkpoint.py", "--config", "configs/debug.toml", "--output", str(seed)]
            + ["--quiet"],
            "seeding",
        )
        budget_tokens = opts.local_batch_size * SEQ_LEN
        runs = {
            "fixed_count": fine_tune(seed, work / "fixed", opts.steps, opts.local_batch_size, 0),
            "token_budget": fine_tune(seed, work / "budget", opts.steps, 1, budget_tokens),
        }
        for name, record in runs.items():
            emit({"variant": name, "steps": opts.steps, **record})
        fixed, budget = runs["fixed_count"], runs["token_budget"]
        emit(
            {
                "comparison": "token_budget vs fixed_count",
                "tokens_per_micro_batch": budget_tokens,
                "label_tokens_per_s_ratio": budget["label_tokens_per_s"] / fixed["label_tokens_per_s"],
                "padding_points_saved": fixed["padding_pct"] - budget["padding_pct"],
            }
        )


if __name__ == "__main__":
    main()
