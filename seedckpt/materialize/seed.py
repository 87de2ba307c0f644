"""Create a seed checkpoint: the full model, initialized with the real recipe, on CPU, streamed.

The model is built on ``meta`` and run through every ``init_weights`` without allocating, which
yields each tensor's recipe by FQN. Nothing else is materialized up front: a ``LazySavePlanner``
cuts every tensor into blocks (DCP "chunks", exactly as a sharded save would; ``blocks``) and
generates a block only when the writer asks for it, from (seed, FQN, recipe) via
``seedckpt.materialize.init_recipe`` -- the same function a rank uses to initialize its stage
directly, so the values are bitwise identical. A block is whole rows, or part of one row where a
single row exceeds the block size (one expert of a grouped expert weight can), so no tensor is
ever held whole. The ``StreamingFileSystemWriter`` keeps only a few blocks in flight, each in a
buffer of the largest block's size reused whatever the block (``BlockPool``, two idle per worker
at most), so peak memory is bounded by the block size times the blocks in flight
(``IN_FLIGHT_BYTES``, whatever the worker count), not by the model: a 405B seed needs no more RAM
than a 1B one, nor a mixture of experts with 3 GB expert tensors (``benchmarks/seed.py
--n-layers``; ``tests/test_seed.py`` checks the peak does not grow with the expert tensors).
Every usable core works (``--workers``): each worker writes its own data file, generating the
next block on a thread (torch ops, checksums and writes release the GIL) while the previous one is
written, so seeding runs at the speed of all the cores' RNG or of the disk, whichever is slower.

Everything runs on the CPU; the command line also hides GPUs (``CUDA_VISIBLE_DEVICES=""``) so a
GPU host does not even create a CUDA context. The result is an ordinary DCP checkpoint plus
``seedckpt.json``. ``--dtype bfloat16`` generates
every block in fp32 and casts it, so a bf16 seed is exactly the fp32 seed rounded.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from seedckpt.checkpoint import LazySavePlanner, check_destination, make_manifest, write_checkpoint
from seedckpt.checkpoint.writer import BlockPool
from seedckpt.config.job_config import DTYPES, JobConfig
from seedckpt.materialize.init_recipe import CHUNK_NUMEL, RECIPE_VERSION, generate_flat, init_model
from seedckpt.materialize.stages import indexable_sizes
from seedckpt.utils.collector import collector_paused
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.progress import Progress
from seedckpt.utils.resources import check_free_space
from seedckpt.utils.tensors import state_tensors

BLOCK_NUMEL = 16 * CHUNK_NUMEL  # target elements per written block (64 MiB in fp32)
# Generated blocks in flight are bounded by this many fp32 bytes, whatever the worker count: each
# worker holds two blocks (one generated, one written), so more workers write smaller blocks. The
# buffers kept idle for reuse are bounded by as many bytes again.
IN_FLIGHT_BYTES = 1 << 30


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: ``taskset``, cgroups' cpusets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def block_numel(workers: int) -> int:
    """Elements per block for ``workers`` workers: ``BLOCK_NUMEL``, smaller where the blocks in
    flight would exceed ``IN_FLIGHT_BYTES`` (but not below one generator chunk for that)."""
    return min(BLOCK_NUMEL, max(CHUNK_NUMEL, IN_FLIGHT_BYTES // (2 * workers * 4)))


def ensure_single_process() -> None:
    """Seeding is a one-process CPU job: refuse to run under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise SeedckptError(
            f"seed creation runs in one process, but WORLD_SIZE={world}; run it with "
            "plain `python create_seed_checkpoint.py ...`, not torchrun"
        )


def block_rows(shape: torch.Size, target: int = BLOCK_NUMEL) -> int:
    """Rows per block of at most ``target`` elements (one row when a row is larger): whole
    generator chunks per block where the row width allows it.

    A block of ``r`` rows spans elements ``[k*r*w, (k+1)*r*w)``; when ``r*w`` is a multiple of
    ``CHUNK_NUMEL`` every block starts on a chunk boundary and no random number is drawn twice.
    Otherwise each block draws the chunks at its two ends whole, but holds only its own elements.
    """
    width = math.prod(shape[1:])
    aligned = CHUNK_NUMEL // math.gcd(width, CHUNK_NUMEL)  # fewest rows spanning whole chunks
    if aligned * width <= target:
        return aligned * (target // (aligned * width))
    return max(1, target // width)


def blocks(shape: torch.Size, target: int = BLOCK_NUMEL) -> list[tuple[list[int], list[int]]]:
    """``shape`` cut into blocks ``(offsets, sizes)`` of at most ``target`` elements, each a run of
    consecutive row-major elements: rows of the first dimension whose single slice fits in
    ``target``, at one index of the dimensions before it.

    So a block never exceeds the target because one row does: DeepSeek-V3's ``w1`` holds 256
    experts of 2048 x 7168 elements (59 MB in fp32), cut within each expert when the target is
    smaller (many workers share ``IN_FLIGHT_BYTES``)."""
    dim = next(d for d in range(len(shape)) if d == len(shape) - 1 or math.prod(shape[d + 1 :]) <= target)
    rows, inner = block_rows(shape[dim:], target), list(shape[dim + 1 :])
    return [
        ([*outer, first] + [0] * len(inner), [1] * dim + [min(rows, shape[dim] - first), *inner])
        for outer in itertools.product(*map(range, shape[:dim]))
        for first in range(0, shape[dim], rows)
    ]


@contextlib.contextmanager
def meta_build(args) -> Iterator[None]:
    """Around the build of the model ``args`` on ``meta``, for its shapes and recipe: torch's own
    default inits skipped (``_NoInitOnMeta``), a size torch cannot index one line (``indexable_sizes``)."""
    with torch.device("meta"), _NoInitOnMeta(), indexable_sizes(args):
        yield


class _NoInitOnMeta(TorchFunctionMode):
    """``torch.nn.init``'s functions return their meta tensor untouched: the defaults torch's modules
    apply in their constructors (``nn.Embedding``'s ``normal_``, ``nn.Linear``'s ``kaiming_uniform_``)
    are values a meta tensor does not hold, and ``normal_``'s meta kernel, a Python reference, imports
    ``torch._dynamo`` on its first call (0.6 s of CPU here, 1.6 s on a 16-core GPU host), before
    any worker starts. The seed's values come from the recipe (``init_model``), never from these."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TORCH_INITS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_TORCH_INITS = frozenset(getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and name[0] != "_")


def exit_now(code: int) -> NoReturn:
    """End the seed's process with ``code``: its exit handlers run and its output is flushed, but
    Python's teardown, which frees torch's ~250,000 objects one by one after the checkpoint is
    published, is skipped: a 1-layer seed's whole process took 0.94x the CPU (75 ms less) and
    0.94x the wall of the ordinary exit (paired medians of 10, busy 2-core machine). Where a
    thread still runs, the ordinary exit, which waits for it."""
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def create_seed_checkpoint(
    cfg: JobConfig,
    output: str | os.PathLike,
    seed: int,
    dtype: str = "float32",
    force: bool = False,
    progress: bool = True,
    workers: int | None = None,
) -> Path:
    """Write the seed of ``cfg``'s model to ``output``. ``workers`` (default: every usable core)
    generate blocks and write them into as many data files at once; the values do not depend on
    it, only the file layout does."""
    with collector_paused():  # from the model's build on meta to the last block
        return _write_seed(cfg, output, seed, dtype, force, progress, workers)


def _write_seed(
    cfg: JobConfig, output: str | os.PathLike, seed: int, dtype: str, force: bool, progress: bool, workers: int | None
) -> Path:
    ensure_single_process()
    workers = usable_cores() if workers is None else workers
    if workers < 1:
        raise SeedckptError(f"--workers {workers}: give at least 1 (default: the {usable_cores()} usable cores)")
    if dtype not in DTYPES:
        raise SeedckptError(f"--dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
    output = check_destination(output, force)
    torch_dtype = DTYPES[dtype]
    # The model is all a seed needs: not the fine-tuning source, the data, the tokenizer or the layout.
    family, args = cfg.model_family(), cfg.model_args()
    with meta_build(args):
        model = family.model(args)
    specs = init_model(model, seed, materialize=False)
    state = {fqn: torch.empty(t.shape, dtype=torch_dtype, device="meta") for fqn, t in state_tensors(model).items()}
    tied = family.tied_weights(args)
    check_free_space(output, sum(t.numel() * t.element_size() for fqn, t in state.items() if fqn not in tied))
    bar = Progress(
        sum(t.numel() for t in state.values()) * torch_dtype.itemsize, f"seed {cfg.model.flavor}", enabled=progress
    )

    target = block_numel(workers)
    pool = BlockPool(slot_bytes=target * 4, keep=2 * workers)  # fp32 blocks; a bf16 cast takes a slot too

    def produce(fqn: str, start: int, stop: int) -> torch.Tensor:
        spec = specs[fqn]
        block = generate_flat(spec, seed, spec.key_for(fqn), state[fqn].numel(), start, stop, allocate=pool.take)
        bar.update(block.numel() * torch_dtype.itemsize)
        return block

    manifest = make_manifest(
        "seed",
        cfg.model.name,
        cfg.model.flavor,
        args.to_dict(),
        seed=seed,
        dtype=dtype,
        init={"recipe": RECIPE_VERSION, "chunk_numel": CHUNK_NUMEL},
    )
    # The writer's threads do the parallelism; intra-op threads would only contend with them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # One data file per worker, each with one generating thread one block ahead of its writer.
        path = write_checkpoint(
            output,
            state,
            manifest,
            force=force,
            planner=LazySavePlanner(produce, lambda shape: blocks(shape, target), pool),
            lookahead=1,
            parallel_files=workers,
            resolvers=1,
            aliases=tied,
        )
    finally:
        torch.set_num_threads(threads)
        bar.close()
    return path
