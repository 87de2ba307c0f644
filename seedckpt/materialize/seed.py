"""Create a seed checkpoint: the full model, initialized with the real recipe, on CPU, streamed.

The model is built on ``meta`` and run through every ``init_weights`` without allocating, which
yields each tensor's recipe by FQN. Nothing else is materialized up front: a ``LazySavePlanner``
cuts every tensor into row blocks (DCP "chunks", exactly as a sharded save would) and generates a
block only when the writer asks for it, from (seed, FQN, recipe) via ``seedckpt.materialize.init_recipe`` -- the same
function a rank uses to initialize its stage directly, so the values are bitwise identical. The
``StreamingFileSystemWriter`` keeps only a few blocks in flight, so peak memory is bounded by the
block size times the blocks in flight (``IN_FLIGHT_BYTES``, whatever the worker count), not by the
model: a 405B seed needs no more RAM than a 1B one. Every usable core works (``--workers``): each
worker writes its own data file, generating the next block on a thread (torch ops, checksums and
writes release the GIL) while the previous one is written, so seeding runs at the speed of all the
cores' RNG or of the disk, whichever is slower.

Everything runs on the CPU; the command line also hides GPUs (``CUDA_VISIBLE_DEVICES=""``) so a
GPU host does not even create a CUDA context. The result is an ordinary DCP checkpoint plus
``seedckpt.json``. ``--dtype bfloat16`` generates
every block in fp32 and casts it, so a bf16 seed is exactly the fp32 seed rounded.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
from pathlib import Path

import torch

from seedckpt.checkpoint import LazySavePlanner, check_destination, make_manifest, write_checkpoint
from seedckpt.checkpoint.writer import BlockPool
from seedckpt.config.job_config import DTYPES, JobConfig
from seedckpt.config.resolve import default_world_size, resolve
from seedckpt.materialize.init_recipe import CHUNK_NUMEL, RECIPE_VERSION, generate_flat, init_model
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.progress import Progress
from seedckpt.utils.tensors import state_tensors

BLOCK_NUMEL = 16 * CHUNK_NUMEL  # target elements per written block (64 MiB in fp32)
# Generated blocks in flight are bounded by this many fp32 bytes, whatever the worker count: each
# worker holds two blocks (one generated, one written), so more workers write smaller blocks.
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
    """Rows per block of about ``target`` elements: whole generator chunks per block where the row
    width allows it.

    A block of ``r`` rows spans elements ``[k*r*w, (k+1)*r*w)``; when ``r*w`` is a multiple of
    ``CHUNK_NUMEL`` every block starts on a chunk boundary and no random number is drawn twice.
    """
    width = math.prod(shape[1:])
    aligned = CHUNK_NUMEL // math.gcd(width, CHUNK_NUMEL)  # fewest rows spanning whole chunks
    if aligned * width <= 4 * target:
        return aligned * max(1, target // (aligned * width))
    return max(1, target // width)


def check_free_space(output: Path, nbytes: int) -> None:
    """Refuse, before any byte is written, a seed larger than the free space where it goes (hours
    of a 405B seed would otherwise end in a full disk)."""
    where = next(p for p in (output, *output.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if nbytes > free:
        raise SeedckptError(
            f"the seed needs {_size(nbytes)} at {output}, but {where} has {_size(free)} free; "
            "free space, choose another --output, or write --dtype bfloat16 (half the bytes)"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


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
    ensure_single_process()
    workers = usable_cores() if workers is None else workers
    if workers < 1:
        raise SeedckptError(f"--workers {workers}: give at least 1 (default: the {usable_cores()} usable cores)")
    if dtype not in DTYPES:
        raise SeedckptError(f"--dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
    output = check_destination(output, force)
    torch_dtype = DTYPES[dtype]
    run = resolve(cfg, default_world_size(cfg), local_world_size=0)
    with torch.device("meta"):
        model = run.family.model(run.args)
    specs = init_model(model, seed, materialize=False)
    state = {fqn: torch.empty(t.shape, dtype=torch_dtype, device="meta") for fqn, t in state_tensors(model).items()}
    tied = run.family.tied_weights(run.args)
    check_free_space(output, sum(t.numel() * t.element_size() for fqn, t in state.items() if fqn not in tied))
    bar = Progress(
        sum(t.numel() for t in state.values()) * torch_dtype.itemsize, f"seed {cfg.model.flavor}", enabled=progress
    )

    pool = BlockPool(keep=2 * workers + 2)  # two blocks in flight per worker
    target = block_numel(workers)

    def produce(fqn: str, row_start: int, row_stop: int) -> torch.Tensor:
        shape = state[fqn].shape
        width = math.prod(shape[1:])
        spec = specs[fqn]
        block = generate_flat(
            spec, seed, spec.key_for(fqn), shape.numel(), row_start * width, row_stop * width, allocate=pool.take
        )
        bar.update(block.numel() * torch_dtype.itemsize)
        return block.view(row_stop - row_start, *shape[1:])

    manifest = make_manifest(
        "seed",
        cfg.model.name,
        cfg.model.flavor,
        run.args.to_dict(),
        seed=seed,
        dtype=dtype,
        init={"recipe": RECIPE_VERSION, "chunk_numel": CHUNK_NUMEL},
    )
    # The writer's threads do the parallelism; intra-op threads would only contend with them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Each block allocates small Python objects, which trigger the cyclic GC's scans of torch's
    # large object graph: ~4 % of the 1B seed's CPU time (perf). The write makes no cycles to collect.
    collecting = gc.isenabled()
    gc.disable()
    try:
        # One data file per worker, each with one generating thread one block ahead of its writer.
        path = write_checkpoint(
            output,
            state,
            manifest,
            force=force,
            planner=LazySavePlanner(produce, lambda shape: block_rows(shape, target), pool),
            lookahead=1,
            parallel_files=workers,
            resolvers=1,
            aliases=tied,
        )
    finally:
        if collecting:
            gc.enable()
        torch.set_num_threads(threads)
        bar.close()
    return path
