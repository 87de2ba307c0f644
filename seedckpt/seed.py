"""Create a seed checkpoint: the full model, initialized with the real recipe, on CPU, streamed.

The model is built on ``meta`` and run through every ``init_weights`` without allocating, which
yields each tensor's recipe by FQN. Nothing else is materialized up front: ``SeedSavePlanner``
cuts every tensor into row blocks (DCP "chunks", exactly as a sharded save would) and generates a
block only when the writer asks for it, from (seed, FQN, recipe) via ``seedckpt.init`` -- the same
function a rank uses to initialize its stage directly, so the values are bitwise identical. The
``StreamingFileSystemWriter`` keeps only a few blocks in flight, so peak memory is bounded by the
block size (~64 MiB) times the lookahead, not by the model: a 405B seed needs no more RAM than a
1B one. Blocks are generated on worker threads (torch ops release the GIL) while the previous
block is written, so seeding runs at the speed of the RNG or the disk, whichever is slower.

The result is an ordinary DCP checkpoint plus ``seedckpt.json``. ``--dtype bfloat16`` generates
every block in fp32 and casts it, so a bf16 seed is exactly the fp32 seed rounded.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from seedckpt.checkpoint import check_destination, make_manifest, write_checkpoint
from seedckpt.config import JobConfig
from seedckpt.errors import SeedckptError
from seedckpt.init import CHUNK_NUMEL, RECIPE_VERSION, InitSpec, generate_flat, init_model
from seedckpt.modules import state_tensors
from seedckpt.progress import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK_NUMEL = 16 * CHUNK_NUMEL  # target elements per written block (64 MiB in fp32)


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


def block_rows(shape: torch.Size) -> int:
    """Rows per block: whole generator chunks per block where the row width allows it.

    A block of ``r`` rows spans elements ``[k*r*w, (k+1)*r*w)``; when ``r*w`` is a multiple of
    ``CHUNK_NUMEL`` every block starts on a chunk boundary and no random number is drawn twice.
    """
    width = math.prod(shape[1:])
    aligned = CHUNK_NUMEL // math.gcd(width, CHUNK_NUMEL)  # fewest rows spanning whole chunks
    if aligned * width <= 4 * BLOCK_NUMEL:
        return aligned * max(1, BLOCK_NUMEL // (aligned * width))
    return max(1, BLOCK_NUMEL // width)


class SeedSavePlanner(DefaultSavePlanner):
    """Plans each tensor as row blocks and generates a block's values in ``resolve_data``."""

    def __init__(self, specs: dict[str, InitSpec], seed: int, dtype: torch.dtype, progress: Progress):
        super().__init__()
        self.specs, self.seed, self.dtype, self.progress = specs, seed, dtype, progress

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, meta in self.state_dict.items():
            shape = meta.shape
            rows = block_rows(shape) if len(shape) > 1 else max(1, shape[0] if shape else 1)
            for start in range(0, shape[0] if shape else 1, rows):
                offsets = torch.Size([start] + [0] * (len(shape) - 1))
                sizes = torch.Size([min(rows, shape[0] - start), *shape[1:]]) if shape else torch.Size([])
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                properties=TensorProperties(dtype=self.dtype), size=shape)))
        self.plan = SavePlan(items, planner_data=self.mappings)  # FQN mapping, as the default planner
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        fqn = write_item.index.fqn
        chunk = write_item.tensor_data.chunk
        width = math.prod(chunk.sizes[1:])
        start = chunk.offsets[0] * width if len(chunk.offsets) else 0
        block = generate_flat(self.specs[fqn], self.seed, fqn, start, start + math.prod(chunk.sizes))
        self.progress.update(block.numel() * self.dtype.itemsize)
        return block.view(chunk.sizes).to(self.dtype)


def create_seed_checkpoint(cfg: JobConfig, output: str | os.PathLike, seed: int,
                           dtype: str = "float32", force: bool = False, progress: bool = True) -> Path:
    ensure_cpu_only_single_process()
    if dtype not in DTYPES:
        raise SeedckptError(f"--dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
    output = check_destination(output, force)
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        model = cfg.build_model()
    specs = init_model(model, seed, materialize=False)
    state = {fqn: torch.empty(t.shape, dtype=torch_dtype, device="meta")
             for fqn, t in state_tensors(model).items()}
    bar = Progress(sum(t.numel() for t in state.values()) * torch_dtype.itemsize, f"seed {cfg.model.flavor}",
                   enabled=progress)
    manifest = make_manifest("seed", cfg.model.name, cfg.model.flavor, cfg.model_args(), seed=seed, dtype=dtype,
                             init={"recipe": RECIPE_VERSION, "chunk_numel": CHUNK_NUMEL})
    # The writer's threads do the parallelism; intra-op threads would only contend with them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = write_checkpoint(output, state, manifest, force=force,
                                planner=SeedSavePlanner(specs, seed, torch_dtype, bar))
    finally:
        torch.set_num_threads(threads)
        bar.close()
    return path
