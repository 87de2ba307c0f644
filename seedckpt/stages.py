"""Pipeline stages: which layers a stage owns, and building a stage from a checkpoint.

A stage is the full model built on ``meta`` with every block it does not own deleted (the blocks
are an ``nn.ModuleDict``, so surviving ones keep their FQNs) and the top-level modules of the other
end(s) of the pipeline (the embedding, the final norm and output: the family says which) set to
``None``. Then, in order:

1. optional FSDP2 sharding (``shard_fn``), still on ``meta``: nothing is allocated yet;
2. ``to_empty`` on the target device, and every floating tensor is poisoned with NaN;
3. non-persistent buffers are recomputed by the modules' ``init_buffers()``;
4. parameters and persistent buffers are loaded by FQN through DCP (each rank reads only the
   tensors it owns) -- or, for direct init, filled by ``seedckpt.init``. Fine-tuning may grow the
   vocabulary: the checkpoint's rows are loaded and every new row is set to the mean of the old
   ones (Mini Trainer's rule), computed across the FSDP shards. OSFT's target layers are
   ``OSFTLinear`` from the start (on ``meta``); their SVD factors are loaded, or computed from the
   dense weights by a distributed SVD across the ranks that hold the stage (``osft``);
5. ``verify_initialized`` scans every local tensor: any NaN poison left means some tensor was
   never written, and the run stops with the list of FQNs.

Seed, resume and fine-tuning all use this one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from models.registry import family_of
from seedckpt.checkpoint import Checkpoint, RowWindow
from seedckpt.errors import SeedckptError
from seedckpt.init import init_model
from seedckpt.layouts import check_args_match, open_model_checkpoint
from seedckpt.modules import local, local_rows, nonpersistent_buffers, state_tensors
from seedckpt.osft import FROZEN, TRAINABLE, OSFTSpec, convert_to_osft, fill_factors

# Schedules whose stages are placed in a "V": rank r holds stages r and 2*pp - 1 - r.
V_SCHEDULES = {"ZBVZeroBubble", "DualPipeV"}


@dataclass(frozen=True)
class StageSpec:
    stage_id: int
    num_stages: int
    layers: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1


def split_layers(n_layers: int, num_stages: int,
                 split_points: Sequence[str | int] = ()) -> list[tuple[int, ...]]:
    """Layer ids per stage.

    With ``split_points`` (``"layers.4"`` or ``4``: the first layer of each stage after the first)
    the split is explicit. Otherwise the embedding and the output projection each count as one
    layer's weight and the ``n_layers + 2`` units are cut into ``num_stages`` contiguous, nearly
    equal runs -- so the first and last stages get one block fewer. If that would leave a stage
    without a transformer block, the blocks alone are split evenly.
    """
    if num_stages < 1:
        raise SeedckptError(f"number of pipeline stages must be >= 1, got {num_stages}")
    if num_stages > n_layers:
        raise SeedckptError(f"cannot split {n_layers} layers into {num_stages} pipeline stages; "
                            "lower parallelism.pipeline_parallel_degree or "
                            "pipeline_parallel_stages_per_rank")
    if split_points:
        starts = [_split_point_layer(p) for p in split_points]
        if len(starts) != num_stages - 1:
            raise SeedckptError(f"{len(starts)} split points give {len(starts) + 1} stages but the "
                                f"pipeline has {num_stages}; give exactly {num_stages - 1} split points")
        if starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] > n_layers - 1:
            raise SeedckptError(f"split points {list(split_points)} must be strictly increasing layer "
                                f"starts within layers.1..layers.{n_layers - 1}")
        bounds = [0, *starts, n_layers]
        return [tuple(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]
    units = n_layers + 2
    cuts = [(2 * s * units + num_stages) // (2 * num_stages) for s in range(num_stages + 1)]
    stages = [tuple(u - 1 for u in range(cuts[s], cuts[s + 1]) if 1 <= u <= n_layers)
              for s in range(num_stages)]
    if all(stages):
        return stages
    cuts = [(2 * s * n_layers + num_stages) // (2 * num_stages) for s in range(num_stages + 1)]
    return [tuple(range(cuts[s], cuts[s + 1])) for s in range(num_stages)]


def _split_point_layer(point: str | int) -> int:
    text = str(point)
    number = text.removeprefix("layers.")
    if not number.isdigit():
        raise SeedckptError(f"split point {point!r} must look like 'layers.N' (or N)")
    return int(number)


def stage_ids_for_rank(pp_rank: int, pp_degree: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Stages a pipeline rank runs: looped (``r, r + pp, ...``) or V-shaped for V schedules."""
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise SeedckptError(f"{schedule} needs exactly 2 stages per rank; set "
                                "parallelism.pipeline_parallel_stages_per_rank = 2")
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + k * pp_degree for k in range(stages_per_rank)]


def plan_rank_stages(args, pp_rank: int, pp_degree: int, stages_per_rank: int = 1,
                     schedule: str = "1F1B", split_points: Sequence[str | int] = ()) -> list[StageSpec]:
    num_stages = pp_degree * stages_per_rank
    layers = split_layers(args.n_layers, num_stages, split_points)
    return [StageSpec(s, num_stages, layers[s])
            for s in stage_ids_for_rank(pp_rank, pp_degree, stages_per_rank, schedule)]


def build_stage_model(args, spec: StageSpec) -> nn.Module:
    """The stage's part of the model ``args`` describes, on ``meta`` (nothing allocated)."""
    family = family_of(args)
    with torch.device("meta"):
        model = family.model(args)
    return family.prune(model, spec.layers, spec.is_first, spec.is_last)


def materialize(modules: Sequence[nn.Module], device: torch.device | str) -> None:
    """``to_empty`` + NaN poison + recompute non-persistent buffers, verifying the recompute."""
    for module in modules:
        module.to_empty(device=device)
        if hasattr(module, "tie_weights"):  # to_empty replaces parameters one module at a time
            module.tie_weights()
        derived = nonpersistent_buffers(module)
        with torch.no_grad():
            for fqn, t in {**state_tensors(module), **derived}.items():
                if t.is_floating_point() or t.is_complex():
                    local(t).fill_(float("nan"))
                elif fqn in derived:
                    raise SeedckptError(f"non-persistent buffer {fqn} has dtype {t.dtype}: its recompute "
                                        "cannot be verified; make it floating point or persistent")
            for mod in module.modules():
                if hasattr(mod, "init_buffers"):
                    mod.init_buffers()
        stale = [fqn for fqn, buf in nonpersistent_buffers(module).items() if _has_nan(buf)]
        if stale:
            raise SeedckptError(f"non-persistent buffers not recomputed after to_empty: {stale}; the "
                                "modules that own them must recompute them in init_buffers()")


def verify_initialized(modules: Sequence[nn.Module]) -> None:
    """Stop if any parameter or buffer still holds the NaN poison from ``materialize``."""
    bad = [fqn for module in modules
           for fqn, t in {**state_tensors(module), **nonpersistent_buffers(module)}.items() if _has_nan(t)]
    if bad:
        raise SeedckptError(f"tensors left uninitialized (or NaN in the checkpoint): {bad}")


def _checkpoint_rows(tensor: torch.Tensor, old_rows: int) -> RowWindow | None:
    """The part of this rank's rows of ``tensor`` that exists in a checkpoint with ``old_rows`` rows."""
    lo, hi = local_rows(tensor) or (0, tensor.shape[0])
    keep = min(hi, old_rows) - lo
    return RowWindow(local(tensor)[:keep], lo) if keep > 0 else None


def _fill_new_rows_with_mean(tensors, old_rows: int) -> None:
    """Rows ``>= old_rows`` := the mean of rows ``< old_rows``. Each rank sums the old rows it holds
    (in float64) and the sums are all-reduced over the mesh dimensions that shard the rows, so a
    rank holding only new rows gets the same mean as everyone else."""
    seen = set()
    with torch.no_grad():
        for tensor in tensors:
            if id(tensor) in seen:  # tied: embedding and output are one parameter
                continue
            seen.add(id(tensor))
            lo, hi = local_rows(tensor) or (0, tensor.shape[0])
            rows = local(tensor)
            total = rows[:max(0, min(hi, old_rows) - lo)].double().sum(0)
            if isinstance(tensor, DTensor):
                for dim, placement in enumerate(tensor.placements):
                    if isinstance(placement, Shard):
                        dist.all_reduce(total, group=tensor.device_mesh.get_group(dim))
            rows[max(0, old_rows - lo):] = (total / old_rows).to(rows.dtype)


def _has_nan(t: torch.Tensor) -> bool:
    t = local(t)
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False
    # min and max propagate NaN: one read pass without a temporary, where isnan(t).any() writes a
    # mask a quarter of t's size (1B shapes, 4 ranks on 2 cores: the check took 1.0-1.6 s per rank).
    low, high = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
    return bool(low.isnan() or high.isnan())


def build_stages(args, specs: Sequence[StageSpec], device: torch.device | str,
                 checkpoint: str | Path | Checkpoint | None = None, seed: int | None = None,
                 shard_fn: Callable[[nn.Module], None] | None = None, grow_vocab: bool = False,
                 osft: OSFTSpec | None = None, stage_group=None, verify: bool = True) -> list[nn.Module]:
    """Build this rank's stage modules and give every tensor a value.

    Exactly one of ``checkpoint`` (load by FQN, the normal path: a DCP checkpoint or a Hugging Face
    directory of the family; a path, or a ``Checkpoint`` already opened as below, as the trainer's start is)
    or ``seed`` (direct per-rank init, bitwise equal to loading the seed made with that seed) must
    be given. The checkpoint is checked against ``args`` before anything is
    allocated. ``shard_fn`` (e.g. activation checkpointing + FSDP2) is applied on ``meta``.
    ``grow_vocab``: ``args.vocab_size`` may exceed the checkpoint's; the new rows get the mean of
    the checkpoint's rows (collective over the FSDP shards of the first and last stages).
    ``osft``: the target linears become ``OSFTLinear`` (on ``meta``, before sharding). A checkpoint
    that stores their factors (an OSFT run's ``step-N``) loads them like any tensor; from dense
    weights they are computed by ``osft.fill_factors`` across ``stage_group`` (the ranks holding
    these stages; ``None``: this rank alone). ``verify``: check the bytes read against the
    checkpoint's checksums.
    """
    if (checkpoint is None) == (seed is None):
        raise ValueError("give exactly one of checkpoint= or seed=")
    if osft is not None and checkpoint is None:
        raise SeedckptError("OSFT starts from pretrained weights: give a checkpoint")
    # ``args`` describes a checkpoint that records no model (a foreign DCP one), so model tensors this
    # model has no place for (extra layers) are refused, not silently left out. A grown vocabulary
    # is not the checkpoint's shape: then only what the checkpoint records is checked.
    if checkpoint is None or isinstance(checkpoint, Checkpoint):
        reader = checkpoint
    else:
        reader = open_model_checkpoint(checkpoint, None if grow_vocab else args, complete=False, verify=verify,
                                       model=family_of(args).name)
    if reader is not None:
        check_args_match(reader, args, grow_vocab)
    modules = [build_stage_model(args, spec) for spec in specs]
    targets = {}  # OSFT: FQN -> OSFTLinear
    if osft is not None:
        for module in modules:
            targets.update((f, module.get_submodule(f)) for f in convert_to_osft(module, osft.patterns, osft.ratio))
    if shard_fn is not None:
        for module in modules:
            shard_fn(module)
    materialize(modules, device)
    if reader is not None:
        state = {}
        for module in modules:
            state.update(module.state_dict())
        stored = reader.tensors()
        decompose = {f: layer for f, layer in targets.items() if f"{f}.U_high" not in stored}
        for fqn in decompose:  # their factors come from the dense weights, after the load below
            for name in FROZEN + TRAINABLE:
                del state[f"{fqn}.{name}"]
        vocab_fqns = family_of(args).vocab_fqns
        old_vocab = reader.tensors()[vocab_fqns[0]].shape[0] if grow_vocab else args.vocab_size
        grown = {fqn: state.pop(fqn) for fqn in vocab_fqns if fqn in state and old_vocab < args.vocab_size}
        for fqn, tensor in grown.items():
            window = _checkpoint_rows(tensor, old_vocab)
            if window is not None:  # else this shard holds only new rows
                state[fqn] = window
        reader.load(state)
        _fill_new_rows_with_mean(grown.values(), old_vocab)
        if decompose:
            fill_factors(decompose, lambda fqn: reader.read_tensor(f"{fqn}.weight"), osft.ratio, stage_group, device)
    else:
        for module in modules:
            init_model(module, seed)
    verify_initialized(modules)
    return modules
