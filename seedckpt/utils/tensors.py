"""Small views over ``nn.Module`` state that init, stage loading and checks share.

"State" means what a checkpoint holds: parameters and *persistent* buffers, by FQN.
Non-persistent buffers are not in checkpoints and must be recomputed (``init_buffers``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by FQN, as the live objects (not detached copies)."""
    out = dict(module.named_parameters())
    out.update((fqn, buf) for fqn, buf in _named_buffers(module, persistent=True))
    return out


def nonpersistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(_named_buffers(module, persistent=False))


def _named_buffers(module: nn.Module, persistent: bool):
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and (name not in mod._non_persistent_buffers_set) == persistent:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores (the local shard of a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether this rank's part of ``tensor`` holds no NaN or Inf (non-floating tensors: always).

    min and max propagate NaN and hold any Inf, so one ``aminmax`` read pass answers, without the
    mask a quarter of the tensor's size that ``isfinite(t).all()`` writes first (several times slower)."""
    t = local(tensor)
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if t.element_size() == 1:  # the float8 kinds have no aminmax: float32 holds each value exactly
        t = t.float()
    low, high = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
    return bool(low.isfinite() and high.isfinite())


def copy_full_into(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full (unsharded) value ``full`` into ``tensor``, or into this rank's shard of it."""
    full = full.to(device=tensor.device, dtype=tensor.dtype)
    if isinstance(tensor, DTensor):
        # src_data_rank=None: every rank slices its own shard locally, no communication.
        full = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        tensor = tensor.to_local()
    tensor.copy_(full)


def local_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)``: where in the full tensor the block this rank holds of ``tensor`` sits
    (the whole tensor when it is a plain one).

    Read from DCP's own chunk of the shard, which places it whatever the mesh dimensions that split
    it (FSDP2 over tensor parallelism's rows: ``_StridedShard`` then ``Shard``), not from the rank's
    coordinate on one of them."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    [chunk] = tensor.__create_chunk_list__()
    return tuple(chunk.offsets), tuple(chunk.sizes)


def local_rows(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(start, stop)`` rows of the full tensor that this rank's shard holds, when the shard is a
    block of whole rows (FSDP2's dim-0 sharding); ``None`` otherwise, or for a plain tensor."""
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return None
    offsets, sizes = local_block(tensor)
    if any(offsets[1:]) or sizes[1:] != tuple(tensor.shape[1:]):
        return None
    return offsets[0], offsets[0] + sizes[0]


def splitting_groups(tensor: torch.Tensor, dim: int) -> list[ProcessGroup]:
    """The process groups of the mesh dimensions that split ``tensor`` along ``dim``: this rank's
    block summed along ``dim`` and all-reduced over each of them is the full tensor's sum along
    ``dim`` (for the block's part of the other dimensions).

    ``_StridedShard`` counts: it is FSDP2's placement on the data-parallel dimension when tensor
    parallelism already splits ``dim`` (the vocabulary rows of an embedding under TP x FSDP). In
    torch 2.13 it is no subclass of ``Shard`` and its ``is_shard()`` is False, so a test for ``Shard``
    alone sums over the TP ranks only and misses the FSDP shards."""
    if not isinstance(tensor, DTensor):
        return []
    return [
        tensor.device_mesh.get_group(mesh_dim)
        for mesh_dim, placement in enumerate(tensor.placements)
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim
    ]
