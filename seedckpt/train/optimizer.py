"""AdamW and its learning-rate schedule, as ``[optimizer]`` and ``[lr_scheduler]`` configure them.

Parameters are grouped by what ``optimizer.weight_decay_exclude`` names (norms, biases, the
embedding), so those groups train without weight decay; with nothing excluded there is one group,
the optimizer every earlier version built. The schedule is a factor of ``training.lr`` per step:
linear warmup, then cosine, linear, warmup-stable-decay or constant -- a plain function of the step,
so a resumed run with a changed schedule continues on the new curve from its next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from seedckpt.config.job_config import LrScheduler, Optimizer

# torch.optim.AdamW's keyword arguments for each optimizer.implementation.
ADAMW_KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def adamw_implementation(implementation: str, device_type: str) -> str:
    """``optimizer.implementation`` on ``device_type``, ``auto`` resolved.

    Chosen explicitly because torch's own default depends on where the parameters live (CUDA:
    foreach, CPU: for-loop) and never picks fused. ``auto`` takes fused on CUDA (the whole update
    in one kernel per group of tensors instead of one per operation; torchtitan's choice) and
    foreach on CPU, where foreach has no kernels of its own and falls back to per-tensor ops: the
    same bits as the for-loop torch ran before this option existed. Fused rounds the update
    differently, so changing the implementation changes the numbers; a resume with the same one is
    bitwise."""
    if implementation == "auto":
        return "fused" if device_type == "cuda" else "foreach"
    return implementation


def parameter_kind(module: nn.Module, name: str) -> str | None:
    """What ``optimizer.weight_decay_exclude`` calls the parameter ``name`` of ``module`` (its
    owner): ``embedding``, ``bias``, ``norm`` -- or None for the matrices that always decay."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if name == "bias":
        return "bias"
    # RMSNorm, LayerNorm and the classes FSDP2 derives from them ("FSDPRMSNorm")
    return "norm" if "norm" in type(module).__name__.lower() else None


def parameter_groups(
    modules: list[nn.Module], trainable: list[nn.Parameter], settings: Optimizer
) -> tuple[list[dict], str]:
    """``trainable`` (what the optimizer steps, parameters of ``modules``) in AdamW's param groups:
    one with weight decay, and one without for the kinds ``settings.weight_decay_exclude`` names
    (none when it is empty: one group, as every earlier version built); and the groups in words,
    for the start log."""
    kinds = {}
    for module in modules:
        for owner in module.modules():
            for name, param in owner.named_parameters(recurse=False):
                kinds.setdefault(id(param), parameter_kind(owner, name))
    excluded = set(settings.weight_decay_exclude)
    decay = [p for p in trainable if kinds.get(id(p)) not in excluded]
    plain = [p for p in trainable if kinds.get(id(p)) in excluded]
    described = f"weight decay {settings.weight_decay} on {len(decay)} tensors"
    if not plain:
        return [{"params": decay, "weight_decay": settings.weight_decay}], described
    counts = {kind: sum(kinds.get(id(p)) == kind for p in plain) for kind in sorted(excluded)}
    described += ", none on " + ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]], described


def build_adamw(groups: list[dict], lr: float, settings: Optimizer, device_type: str) -> torch.optim.AdamW:
    """AdamW over ``groups`` with the configured betas, eps and kernels (``optimizer.implementation``)."""
    kernels = ADAMW_KERNELS[adamw_implementation(settings.implementation, device_type)]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(settings.betas), eps=settings.eps, **kernels)


def apply_settings(optimizer: torch.optim.Optimizer, groups: list[dict], settings: Optimizer) -> None:
    """Set each param group's betas, eps and weight decay to the configured ones (``groups``: as
    ``parameter_groups`` made them): a loaded optimizer state restores the values it was saved
    with, and the config wins (a change is logged)."""
    for group, built in zip(optimizer.param_groups, groups, strict=True):
        group.update(betas=tuple(settings.betas), eps=settings.eps, weight_decay=built["weight_decay"])


def lr_factor(schedule: LrScheduler, warmup: int, total: int) -> Callable[[int], float]:
    """The factor of the peak learning rate for each 0-based step (``LambdaLR``'s lambda).

    Warmup rises linearly over ``warmup`` steps; then ``cosine`` and ``linear`` decay to
    ``min_lr_factor`` over the remaining steps, ``wsd`` holds the peak and decays linearly over the
    last ``decay_ratio`` of them, and ``constant`` stays at the peak."""
    minimum = schedule.min_lr_factor
    after_warmup = max(1, total - warmup)
    decay_steps = max(1, round(schedule.decay_ratio * after_warmup)) if schedule.decay_type == "wsd" else after_warmup
    decay_start = total - decay_steps if schedule.decay_type == "wsd" else warmup

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule.decay_type == "constant" or step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        if schedule.decay_type == "cosine":
            return minimum + (1 - minimum) * 0.5 * (1 + math.cos(math.pi * progress))
        return minimum + (1 - minimum) * (1 - progress)

    return factor
