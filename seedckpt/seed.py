"""Create a seed checkpoint: the full model, initialized with the real recipe, on CPU.

The model is built on ``meta`` and run through every ``init_weights`` without allocating, which
yields each tensor's recipe by FQN. Each tensor is then generated from (seed, FQN, recipe) by
``seedckpt.init`` -- the same function a rank would use to initialize its stage directly -- and the
result is written as a DCP checkpoint with flat FQNs plus a ``seedckpt.json`` manifest.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from seedckpt.checkpoint import check_destination, make_manifest, write_checkpoint
from seedckpt.config import JobConfig
from seedckpt.errors import SeedckptError
from seedckpt.init import CHUNK_NUMEL, RECIPE_VERSION, generate, init_model
from seedckpt.modules import state_tensors
from seedckpt.progress import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ensure_cpu_only_single_process() -> None:
    """Seeding is a one-process CPU job; refuse torchrun and never touch CUDA.

    Hiding GPUs before any CUDA call keeps a GPU host from creating a context (and from pinning
    memory) for a job that only needs the CPU and the disk.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise SeedckptError(f"seed creation runs in one process, but WORLD_SIZE={world}; run it with "
                            "plain `python create_seed_checkpoint.py ...`, not torchrun")
    if not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def create_seed_checkpoint(cfg: JobConfig, output: str | os.PathLike, seed: int,
                           dtype: str = "float32", force: bool = False, progress: bool = True) -> Path:
    ensure_cpu_only_single_process()
    if dtype not in DTYPES:
        raise SeedckptError(f"--dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
    output = check_destination(output, force)
    args = cfg.model_args()
    with torch.device("meta"):
        model = cfg.build_model()
    specs = init_model(model, seed, materialize=False)
    shapes = {fqn: t.shape for fqn, t in state_tensors(model).items()}
    torch_dtype = DTYPES[dtype]
    total = sum(s.numel() for s in shapes.values()) * torch_dtype.itemsize
    bar = Progress(total, f"seed {cfg.model.flavor}", enabled=progress)
    state = {}
    for fqn, shape in shapes.items():
        state[fqn] = generate(specs[fqn], shape, seed, fqn, dtype=torch_dtype)
        bar.update(state[fqn].numel() * torch_dtype.itemsize)
    bar.close()
    manifest = make_manifest("seed", cfg.model.name, cfg.model.flavor, args, seed=seed, dtype=dtype,
                             init={"recipe": RECIPE_VERSION, "chunk_numel": CHUNK_NUMEL})
    return write_checkpoint(output, state, manifest, force=force)
