"""Building this rank's pipeline stages from a checkpoint (or by direct init), every tensor accounted for.

A stage is the full model built on ``meta`` with every block it does not own deleted (the blocks
are an ``nn.ModuleDict``, so surviving ones keep their FQNs) and the top-level modules of the other
end(s) of the pipeline (the embedding, the final norm and output: the family says which) set to
``None`` (``stage_models``). The caller parallelizes them (tensor parallel, FSDP2) while they are
still on ``meta``: nothing is allocated yet. Then ``load_stages``, in order:

1. ``to_empty`` on the target device, and every floating tensor is poisoned with NaN;
2. non-persistent buffers are recomputed by the modules' ``init_buffers()``;
3. parameters and persistent buffers are loaded by FQN through DCP (each rank reads only the
   tensors it owns) -- or, for direct init, filled by ``seedckpt.materialize.init_recipe``. Fine-tuning may grow the
   vocabulary: the checkpoint's rows are loaded and every new row is set to the mean of the old
   ones (Mini Trainer's rule), computed across the ranks that split the rows. OSFT's target layers are
   ``OSFTLinear`` from the start (on ``meta``); their SVD factors are loaded, or computed from the
   dense weights by a distributed SVD across the ranks that hold the stage (``osft``);
4. ``verify_initialized`` scans every local tensor: any NaN poison left means some tensor was
   never written, and the run stops with the list of FQNs.

Seed, resume and fine-tuning all use this one path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from models.registry import family_of
from seedckpt.checkpoint import OpenedCheckpoint, RowWindow
from seedckpt.finetune.osft import FROZEN, TRAINABLE, OSFTSettings, convert_to_osft, fill_factors
from seedckpt.materialize.init_recipe import init_model
from seedckpt.materialize.model_checkpoint import check_args_match, open_model_checkpoint
from seedckpt.parallel.pipeline import StageSpec
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import (
    all_finite,
    local,
    local_block,
    nonpersistent_buffers,
    splitting_groups,
    state_tensors,
)


def build_stage_model(args, spec: StageSpec) -> nn.Module:
    """The stage's part of the model ``args`` describes, on ``meta`` (nothing allocated)."""
    family = family_of(args)
    with torch.device("meta"), indexable_sizes(args):
        model = family.model(args)
    return family.prune(model, spec.layers, spec.is_first, spec.is_last)


@contextmanager
def indexable_sizes(args) -> Iterator[None]:
    """Around a build of the model ``args`` on ``meta``: torch's refusal of a tensor it cannot index
    (more than 2**63 bytes, or a size past int64: ``--model.dim 1000000000000``) becomes one line
    naming the args fields that gave it, instead of a traceback from deep inside a module."""
    try:
        yield
    except (RuntimeError, TypeError) as e:
        torch_says = str(e).splitlines()[0] if str(e) else ""
        if "overflow" not in torch_says.lower():
            raise
        raise SeedckptError(
            f"{_culprits(args, torch_says)}: the model would hold a tensor too large for torch to index "
            f"({torch_says}); lower the sizes"
        ) from None


def _culprits(args, torch_says: str) -> str:
    """The int fields of ``args`` among the sizes torch names, or past int64, largest first (none: the
    ``[model]`` sizes)."""
    listed = re.search(r"sizes=\[([\d, ]*)\]", torch_says)
    sizes = {int(n) for n in listed.group(1).split(",") if n.strip()} if listed else set()
    fields = [(v, name) for name, v in args.to_dict().items() if type(v) is int and (v in sizes or v >= 2**63)]
    return ", ".join(f"model.{name} = {v}" for v, name in sorted(fields, reverse=True)) or "the [model] sizes"


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
                    raise SeedckptError(
                        f"non-persistent buffer {fqn} has dtype {t.dtype}: its recompute "
                        "cannot be verified; make it floating point or persistent"
                    )
            for mod in module.modules():
                if hasattr(mod, "init_buffers"):
                    mod.init_buffers()
        stale = [fqn for fqn, buf in nonpersistent_buffers(module).items() if not all_finite(buf)]
        if stale:
            raise SeedckptError(
                f"non-persistent buffers not recomputed after to_empty: {stale}; the "
                "modules that own them must recompute them in init_buffers()"
            )


def verify_initialized(modules: Sequence[nn.Module]) -> None:
    """Stop if any parameter or buffer still holds the NaN poison from ``materialize``, or a value
    that is not finite (a checkpoint with NaN or Inf in it trains NaN from the first step)."""
    bad = [
        fqn
        for module in modules
        for fqn, t in {**state_tensors(module), **nonpersistent_buffers(module)}.items()
        if not all_finite(t)
    ]
    if bad:
        raise SeedckptError(
            f"tensors left uninitialized, or not finite (NaN or Inf) in the checkpoint: {bad}; training from "
            "non-finite weights gives a NaN loss: start from a checkpoint without them -- a run's earlier step-N, "
            "the seed, another download (`seedckpt verify` names the non-finite tensors of any checkpoint)"
        )


def _checkpoint_rows(tensor: torch.Tensor, old_rows: int) -> RowWindow | None:
    """The part of this rank's rows of ``tensor`` that exists in a checkpoint with ``old_rows`` rows."""
    start = local_block(tensor)[0][0]
    keep = old_rows - start
    return RowWindow(local(tensor)[:keep], start) if keep > 0 else None


def _fill_new_rows_with_mean(tensors, old_rows: int) -> None:
    """Rows ``>= old_rows`` := the mean of rows ``< old_rows``. Each rank sums the old rows it holds
    (in float64) and the sums are all-reduced over every mesh dimension that splits the rows (under
    TP x FSDP two: FSDP's and TP's), so a rank holding only new rows gets the same mean as everyone
    else. The float64 sum's rounding, which depends on how the layout groups the partial sums, lies
    far below float32's precision: every layout gives the new rows the same float32 values."""
    seen = set()
    with torch.no_grad():
        for tensor in tensors:
            if id(tensor) in seen:  # tied: embedding and output are one parameter
                continue
            seen.add(id(tensor))
            rows = local(tensor)
            old_here = max(0, old_rows - local_block(tensor)[0][0])  # the first this many are old rows
            total = rows[:old_here].double().sum(0)
            for group in splitting_groups(tensor, 0):
                dist.all_reduce(total, group=group)
            rows[old_here:] = (total / old_rows).to(rows.dtype)


def build_stages(
    args,
    specs: Sequence[StageSpec],
    device: torch.device | str,
    checkpoint: str | Path | OpenedCheckpoint | None = None,
    seed: int | None = None,
    shard_fn: Callable[[nn.Module], None] | None = None,
    grow_vocab: bool = False,
    osft: OSFTSettings | None = None,
    stage_group=None,
    verify: bool = True,
) -> list[nn.Module]:
    """Build this rank's stage modules and give every tensor a value: ``stage_models``, then
    ``shard_fn`` on each (e.g. FSDP2, still on ``meta``), then ``load_stages``.

    ``checkpoint``: a path (a DCP checkpoint or a Hugging Face directory of the family), opened
    here, or a ``OpenedCheckpoint`` already opened; ``verify``: check the bytes read against the
    checkpoint's checksums. The other arguments are ``load_stages``'.
    """
    if checkpoint is not None and not isinstance(checkpoint, OpenedCheckpoint):
        # ``args`` describes a checkpoint that records no model (a foreign DCP one), so model tensors this
        # model has no place for (extra layers) are refused, not silently left out. A grown vocabulary
        # is not the checkpoint's shape: then only what the checkpoint records is checked.
        checkpoint = open_model_checkpoint(
            checkpoint, None if grow_vocab else args, complete=False, verify=verify, model=family_of(args).name
        )
    if checkpoint is not None:
        check_args_match(checkpoint, args, grow_vocab)  # before anything is built
    modules, targets = stage_models(args, specs, osft)
    if shard_fn is not None:
        for module in modules:
            shard_fn(module)
    load_stages(modules, args, device, checkpoint, seed, grow_vocab, osft, targets, stage_group)
    return modules


def stage_models(args, specs: Sequence[StageSpec], osft: OSFTSettings | None = None) -> tuple[list[nn.Module], dict]:
    """This rank's stage modules on ``meta``, and OSFT's targets in them (``{FQN: OSFTLinear}``):
    with ``osft``, the target linears are ``OSFTLinear`` from the start."""
    modules = [build_stage_model(args, spec) for spec in specs]
    targets = {}
    if osft is not None:
        for module in modules:
            targets.update((f, module.get_submodule(f)) for f in convert_to_osft(module, osft.patterns, osft.ratio))
    return modules, targets


def load_stages(
    modules: Sequence[nn.Module],
    args,
    device: torch.device | str,
    checkpoint: OpenedCheckpoint | None = None,
    seed: int | None = None,
    grow_vocab: bool = False,
    osft: OSFTSettings | None = None,
    osft_targets: dict | None = None,
    stage_group=None,
) -> None:
    """Materialize the (sharded) stage modules on ``device`` and give every tensor a value.

    Exactly one of ``checkpoint`` (load by FQN, the normal path; checked against ``args`` by the
    caller with ``check_args_match`` before the modules were built) or ``seed`` (direct per-rank
    init, bitwise equal to loading the seed made with that seed) must be given. ``grow_vocab``: ``args.vocab_size`` may
    exceed the checkpoint's; the new rows get the mean of the checkpoint's rows (collective over
    the shards of the first and last stages). ``osft``: a checkpoint that stores the factors of the
    targets (an OSFT run's ``step-N``) loads them like any tensor; from dense weights they are
    computed by ``osft.fill_factors`` across ``stage_group`` (the ranks holding these stages;
    ``None``: this rank alone).
    """
    if (checkpoint is None) == (seed is None):
        raise ValueError("give exactly one of checkpoint= or seed=")
    if osft is not None and checkpoint is None:
        raise SeedckptError("OSFT starts from pretrained weights: give a checkpoint")
    materialize(modules, device)
    if checkpoint is None:
        for module in modules:
            init_model(module, seed)
    else:
        _load(modules, args, checkpoint, grow_vocab, osft, osft_targets or {}, stage_group, device)
    verify_initialized(modules)


def _load(modules, args, reader: OpenedCheckpoint, grow_vocab: bool, osft, targets: dict, stage_group, device) -> None:
    state = {}
    for module in modules:
        state.update(module.state_dict())
    stored = reader.tensors()
    decompose = {f: layer for f, layer in targets.items() if f"{f}.U_high" not in stored}
    for fqn in decompose:  # their factors come from the dense weights, after the load below
        for name in FROZEN + TRAINABLE:
            del state[f"{fqn}.{name}"]
    vocab_fqns = family_of(args).vocab_fqns
    old_vocab = stored[vocab_fqns[0]].shape[0] if grow_vocab else args.vocab_size
    grown = {fqn: state.pop(fqn) for fqn in vocab_fqns if fqn in state and old_vocab < args.vocab_size}
    for fqn, tensor in grown.items():
        window = _checkpoint_rows(tensor, old_vocab)
        if window is not None:  # else this shard holds only new rows
            state[fqn] = window
    reader.load(state)
    _fill_new_rows_with_mean(grown.values(), old_vocab)
    if decompose:
        fill_factors(decompose, lambda fqn: reader.read_tensor(f"{fqn}.weight"), osft.ratio, stage_group, device)
