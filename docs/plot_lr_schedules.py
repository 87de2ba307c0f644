"""Draw docs/images/lr_schedules.png: each ``lr_scheduler.decay_type`` over a 1000-step run with
100 warmup steps, computed by the trainer's own schedule function (``seedckpt.train.optimizer``).

    pip install -e '.[bench]' && python docs/plot_lr_schedules.py   # matplotlib
"""

from __future__ import annotations

from pathlib import Path

from seedckpt.config.job_config import LrScheduler
from seedckpt.train.optimizer import lr_factor

STEPS, WARMUP = 1000, 100
SCHEDULES = {
    "cosine (the default: min_lr_factor 0.1)": LrScheduler(),
    "linear (min_lr_factor 0.1)": LrScheduler(decay_type="linear"),
    "wsd (decay_ratio 0.2, min_lr_factor 0)": LrScheduler(decay_type="wsd", decay_ratio=0.2, min_lr_factor=0.0),
    "constant": LrScheduler(decay_type="constant"),
}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    steps = range(STEPS)
    for label, schedule in SCHEDULES.items():
        factor = lr_factor(schedule, WARMUP, STEPS)
        ax.plot([s + 1 for s in steps], [factor(s) for s in steps], label=label)
    ax.set_xlabel(f"step (training.steps = {STEPS}, training.warmup_steps = {WARMUP})")
    ax.set_ylabel("learning rate / training.lr")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out = Path(__file__).parent / "images" / "lr_schedules.png"
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
