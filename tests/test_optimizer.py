"""``[optimizer]`` and ``[lr_scheduler]``: the schedules' shapes, the default being the previous
warmup-cosine bit for bit, parameter groups without weight decay, and a run whose settings reach
the optimizer, are saved with it, and change on resume with a line saying so. Real ``train.py``
runs and DCP checkpoints for the last."""

from __future__ import annotations

import math

import pytest
import torch

from seedckpt.checkpoint import DcpCheckpoint
from seedckpt.config.job_config import LrScheduler, Optimizer, load_config
from seedckpt.train.optimizer import build_adamw, lr_factor, parameter_groups
from tests.test_resume import rows, train


def previous_warmup_cosine(warmup: int, total: int, step: int) -> float:
    """The only schedule of earlier versions, as it was written: unchanged configs must keep it."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@pytest.mark.parametrize("warmup,total", [(0, 1), (2, 10), (100, 3000), (5, 5)])
def test_the_default_schedule_is_the_previous_warmup_cosine_bitwise(warmup, total):
    factor = lr_factor(LrScheduler(), warmup, total)
    assert [factor(s) for s in range(total + 2)] == [previous_warmup_cosine(warmup, total, s) for s in range(total + 2)]


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    factor = lr_factor(LrScheduler(decay_type="wsd", decay_ratio=0.25, min_lr_factor=0.0), 2, 42)
    values = [factor(s) for s in range(42)]
    assert values[:2] == [1 / 3, 2 / 3]
    assert values[2:32] == [1.0] * 30  # 40 steps after warmup: the last 10 decay
    assert values[32:] == pytest.approx([1 - k / 10 for k in range(10)])


def test_linear_and_constant_schedules():
    linear = lr_factor(LrScheduler(decay_type="linear", min_lr_factor=0.2), 0, 10)
    assert [linear(s) for s in range(11)] == pytest.approx([0.2 + 0.8 * (1 - k / 10) for k in range(10)] + [0.2])
    constant = lr_factor(LrScheduler(decay_type="constant"), 3, 10)
    assert [constant(s) for s in range(10)] == [0.25, 0.5, 0.75] + [1.0] * 7


@pytest.mark.parametrize(
    "exclude,undecayed",
    [
        ([], set()),
        (["norm"], {"norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"}),
        (["bias"], {"layers.0.attention.wq.bias", "layers.0.attention.wk.bias", "layers.0.attention.wv.bias"}),
        (["embedding"], {"tok_embeddings.weight"}),
    ],
)
def test_parameter_groups_leave_out_of_weight_decay_what_is_named(exclude, undecayed):
    cfg = load_config(None, ["--model.name", "qwen2", "--model.n_layers", "1"])  # Qwen2: q/k/v biases
    with torch.device("meta"):
        model = cfg.build_model()
    names = {id(p): n for n, p in model.named_parameters()}
    groups, described = parameter_groups([model], list(model.parameters()), Optimizer(weight_decay_exclude=exclude))
    assert [g["weight_decay"] for g in groups] == ([0.1, 0.0] if exclude else [0.1])
    assert {names[id(p)] for p in groups[-1]["params"]} == (undecayed or set(names.values()))
    assert described.startswith(f"weight decay 0.1 on {len(names) - len(undecayed)} tensors")
    if exclude:
        assert described.endswith(f"none on {len(undecayed)} {exclude[0]}")
    adamw = build_adamw(groups, 1e-3, Optimizer(betas=[0.8, 0.9], eps=1e-6), "cpu")
    assert {g["betas"] for g in adamw.param_groups} == {(0.8, 0.9)} and adamw.defaults["eps"] == 1e-6


def saved_group_values(step, fqn: str) -> dict:
    keys = {k: f"optimizer.param_groups.{fqn}.{k}" for k in ("betas", "eps", "weight_decay")}
    state = dict.fromkeys(keys.values())
    DcpCheckpoint(step).load(state)
    return {k: state[key] for k, key in keys.items()}


def test_optimizer_settings_reach_the_optimizer_and_a_resume_applies_changed_ones(tmp_path, debug_seed):
    run = tmp_path / "run"
    settings = [
        "--optimizer.betas",
        "0.8,0.9",
        "--optimizer.weight_decay",
        "0.05",
        "--optimizer.weight_decay_exclude",
        "norm,embedding",
        "--lr_scheduler.decay_type",
        "wsd",
        "--lr_scheduler.decay_ratio",
        "0.5",
        "--lr_scheduler.min_lr_factor",
        "0",
        "--training.warmup_steps",
        "0",
    ]
    first = train(run, debug_seed, *settings, "--training.stop_after_step", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "weight decay 0.05 on" in first.stdout and "none on 1 embedding, 13 norm" in first.stdout, first.stdout
    step2 = run / "ckpt" / "step-2"
    assert saved_group_values(step2, "layers.0.attention.wq.weight") == {
        "betas": (0.8, 0.9),
        "eps": 1e-8,
        "weight_decay": 0.05,
    }
    assert saved_group_values(step2, "norm.weight")["weight_decay"] == 0.0
    assert saved_group_values(step2, "tok_embeddings.weight")["weight_decay"] == 0.0

    changed = [*settings, "--lr_scheduler.decay_type", "linear", "--optimizer.betas", "0.85,0.9"]
    second = train(run, debug_seed, *changed)
    assert second.returncode == 0, second.stderr[-3000:]
    for line in ("optimizer.betas [0.8, 0.9] -> [0.85, 0.9]", "lr_scheduler.decay_type 'wsd' -> 'linear'"):
        assert f"changed setting, applied from step 3: {line}" in second.stdout, second.stdout
    assert saved_group_values(run / "ckpt" / "step-4", "layers.0.attention.wq.weight")["betas"] == (0.85, 0.9)
    # The lr column is the rate each step used: wsd holds the peak for the first half of 4 steps
    # (cosine would have decayed), then the resume's linear decay to 0 takes over at step 3.
    lr = [r["lr"] for r in rows(run)]
    assert lr == pytest.approx([3e-3, 3e-3, 3e-3 / 2, 3e-3 / 4]), lr
