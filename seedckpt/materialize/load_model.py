"""``load_model``: a checkpoint of any family and format as its ``nn.Module``, weights loaded.

What a user calls in a notebook to evaluate a checkpoint. It goes through the same path as a
training rank (``materialize.stages.build_stages``: built on ``meta``, materialized on ``device``,
loaded by FQN, every tensor proven written), as one stage holding the whole model. An OSFT run's
``step-N`` is loaded as the dense model its factors compute.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from seedckpt.config.job_config import DTYPES
from seedckpt.finetune.osft import manifest_osft
from seedckpt.materialize.model_checkpoint import dense_view, open_model_checkpoint, refuse_float64
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from seedckpt.utils.errors import SeedckptError


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    model: str | None = None,
    args=None,
) -> nn.Module:
    """The model the checkpoint at ``path`` holds, with its weights, in eval mode.

    ``path``: a seed, a ``step-N`` (OSFT factors are rebuilt as dense weights), a Hugging Face
    directory, one ``.safetensors`` file or a ``torch.save`` file of ours. ``model``: the family
    (``model.name``) when the checkpoint names none (a file of tensors without our manifest);
    otherwise it is read from the checkpoint. ``args``: the model's configuration where the
    checkpoint records none (a torchtitan checkpoint: ``JobConfig.model_args()`` of the config it
    was trained with). ``dtype``: cast after loading (weights load in
    float32, losslessly from bf16 or fp16 files), a ``torch.dtype`` or its name (``"bfloat16"``).
    ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Checksums are checked as the bytes are read.

        from seedckpt import load_model
        model = load_model("outputs/demo/checkpoints/step-100")
        logits = model(torch.tensor([[1, 2, 3]]))
    """
    device, dtype = _device(device), _dtype(dtype)
    checkpoint = open_model_checkpoint(path, args, model=model)
    refuse_float64(checkpoint, f"cast it once: `seedckpt convert {path} OUT --to dcp --dtype float32`, then load OUT")
    args = checkpoint.require_args()
    if manifest_osft(checkpoint.manifest) is not None:
        checkpoint = dense_view(checkpoint)
    [module] = build_stages(args, plan_rank_stages(args, 0, 1), device, checkpoint=checkpoint)
    if dtype is not None:  # the weights only: ``Module.to(dtype)`` would make the complex RoPE table real
        for parameter in module.parameters():
            parameter.data = parameter.data.to(dtype)
    return module.eval()


def _dtype(dtype) -> torch.dtype | None:
    """``dtype`` as one of the weight dtypes, from a ``torch.dtype`` or its name (``"bfloat16"``,
    ``"torch.bfloat16"``)."""
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, (str, torch.dtype)) else None
    if dtype is not None and name not in DTYPES:
        raise SeedckptError(f"dtype={dtype!r}: give one of {', '.join(DTYPES)} (a name or a torch.dtype), or None")
    return DTYPES[name] if dtype is not None else None


def _device(device) -> torch.device:
    """``device`` as a ``torch.device`` this machine has."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise SeedckptError(f"device={device!r} is not a device: give 'cpu', 'cuda' or 'cuda:N'") from None
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        fix = f"use 'cuda:0'..'cuda:{count - 1}' or 'cpu'" if count else "use device='cpu'"
        raise SeedckptError(f"device={str(device)!r}, but torch sees {count} CUDA device(s) on this machine; {fix}")
    return device
