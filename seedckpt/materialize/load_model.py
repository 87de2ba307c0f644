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

from seedckpt.finetune.osft import manifest_osft
from seedckpt.materialize.model_checkpoint import dense_view, open_model_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, model: str | None = None
) -> nn.Module:
    """The model the checkpoint at ``path`` holds, with its weights, in eval mode.

    ``path``: a seed, a ``step-N`` (OSFT factors are rebuilt as dense weights), a Hugging Face
    directory, one ``.safetensors`` file or a ``torch.save`` file of ours. ``model``: the family
    (``model.name``) when the checkpoint names none (a file of tensors without our manifest);
    otherwise it is read from the checkpoint. ``dtype``: cast after loading (weights load in
    float32, losslessly from bf16 or fp16 files). Checksums are checked as the bytes are read.

        from seedckpt import load_model
        model = load_model("outputs/demo/checkpoints/step-100")
        logits = model(torch.tensor([[1, 2, 3]]))
    """
    checkpoint = open_model_checkpoint(path, model=model)
    args = checkpoint.require_args()
    if manifest_osft(checkpoint.manifest) is not None:
        checkpoint = dense_view(checkpoint)
    [module] = build_stages(args, plan_rank_stages(args, 0, 1), device, checkpoint=checkpoint)
    if dtype is not None:  # the weights only: ``Module.to(dtype)`` would make the complex RoPE table real
        for parameter in module.parameters():
            parameter.data = parameter.data.to(dtype)
    return module.eval()
