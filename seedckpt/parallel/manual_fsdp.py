"""Manual FSDP (``parallelism.fsdp_impl = "manual"``): one flat, sharded parameter per stage module.

Why it exists: FSDP2 hides its collectives behind hooks and DTensors. This wrapper does the same job
with two public collectives on the data-parallel process group -- ``all_gather_single`` and
``reduce_scatter_single`` (torch 2.13's names for ``all_gather_into_tensor`` /
``reduce_scatter_tensor``, which it deprecates in their favour; ``collectives`` falls back to those
on older torch) -- so every byte moved is one call
you can count and time (``collectives.CollectiveTimes``, logged per step; free, so on by default),
and compare against FSDP2 on the same run (``metrics.collective_timing = "on"`` times FSDP2's too).

The scheme (its memory is ZeRO stage 1's rather than FSDP's -- see the limits below):

* **Flatten.** Every parameter of the module, in ``named_parameters()`` order, is laid end to end in
  one vector padded to a multiple of the DP world size. ``named_parameters()`` yields a tied matrix
  (the input embedding is the output projection) once, under its first name, so it is stored and
  stepped once, exactly as FSDP2 does.
* **Shard.** Rank ``r`` of ``W`` keeps elements ``[r S, (r + 1) S)`` of that vector as one fp32
  ``nn.Parameter`` (``shard``). It is the only thing the optimizer sees, so AdamW's moments are
  sharded ``W`` ways.
* **Gather before every forward.** A forward pre-hook all-gathers the shards into ``full_params``
  (in ``mixed_precision_param`` dtype) and every module parameter is a view of its slice of it
  (set once, at wrap time), so the module runs unchanged -- activation checkpointing included.
* **Accumulate, then reduce-scatter once per optimizer step.** A post-accumulate-grad hook adds each
  parameter's gradient into one full flat buffer (``mixed_precision_reduce`` dtype) and frees it, so
  gradient accumulation over micro-batches costs no communication; ``sync_gradients()`` (the trainer
  calls it once per step, before clipping) reduce-scatters that buffer into ``shard.grad`` (fp32),
  averaged over the DP ranks as FSDP2 does: the trainer scales each rank's loss by ``dp`` so the
  average is the global batch's per-token mean.
* **Checkpoints in FSDP2's keys.** ``full_state_dict`` gives the module's own state-dict keys with
  full tensors; ``optimizer_state_dict`` gives the keys ``get_optimizer_state_dict(...,
  flatten_optimizer_state_dict=True)`` produces for the FSDP2 model (``state.<fqn>.exp_avg``,
  ``param_groups.<fqn>.lr``, ...), with full per-FQN tensors. DCP stores a plain full tensor and a
  DTensor's shards alike, so an FSDP2 run resumes from this wrapper's checkpoints and the other
  way round. Loading weights needs nothing here: the stage is built and loaded unsharded by the
  normal loader (``stages.build_stages``) and then wrapped, each rank copying its shard out.

Limits (why FSDP2 stays the default):

* **Memory.** The full parameters (``full_params``) live on every DP rank for the whole run, and the
  full gradient buffer from the first backward of a step to its reduce-scatter: per rank that is
  params + grads of the whole stage, unsharded; only the fp32 master copy and AdamW's moments are
  sharded. Loading materializes the full fp32 stage on every rank; saving and resuming hold the
  full parameters and both full AdamW moments at once (3 x the fp32 model).
* **Communication.** The whole stage is gathered in one call before *every* forward (each
  micro-batch), with no overlap with compute and no per-block prefetch: FSDP2 gathers block by
  block, overlapped with the previous block's compute.
* **Scope.** One optimizer parameter group, every parameter trainable, pure data parallelism: no
  pipeline parallelism, no HSDP, no OSFT (``config`` refuses those before any rendezvous).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from seedckpt.parallel.collectives import CollectiveTimes, all_gather_single

MASTER_DTYPE = torch.float32  # the shard, its gradient and the optimizer state


class FlatShardedModel:
    """Shards ``module``'s parameters over ``group`` as one flat vector (see the module docstring).

    The module itself stays what the rest of the trainer holds: it is called as before, its
    parameters become views into the gathered vector, and its ``state_dict`` keys are the
    checkpoint keys. Use ``shard`` as the optimizer's only parameter, call ``sync_gradients()``
    once per optimizer step after the last backward, and save / load through ``full_state_dict``,
    ``optimizer_state_dict`` and ``load_optimizer_state_dict``.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        times: CollectiveTimes | None = None,
    ):
        """``times``: where the training step's collectives are counted and timed."""
        named = list(module.named_parameters())  # a tied parameter once, under its first FQN
        frozen = [fqn for fqn, p in named if not p.requires_grad]
        if frozen:
            raise ValueError(f"manual FSDP trains every parameter; frozen: {frozen}")
        self.module, self.group = module, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.fqns = [fqn for fqn, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.offsets = [0]
        for _, p in named:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.shard_numel = -(-self.numel // self.world)
        self.device = named[0][1].device
        with torch.no_grad():
            # The fp32 master shard comes from the loaded fp32 values, not from a low-precision copy.
            self.shard = nn.Parameter(self._shard_of([p for _, p in named]))
            self.full_params = torch.zeros(self.shard_numel * self.world, dtype=param_dtype, device=self.device)
            for (_, p), view in zip(named, self.views(self.full_params)):
                view.copy_(p)
                p.data = view  # the module computes with the gathered vector from now on
        self.full_grad: torch.Tensor | None = None  # exists from a step's first backward to sync_gradients
        self._ids = {id(p): i for i, (_, p) in enumerate(named)}
        for i, (_, p) in enumerate(named):
            p.register_post_accumulate_grad_hook(self._accumulate_into_flat_grad(i))
        module.register_forward_pre_hook(lambda _module, _args: self.gather())
        self.times = times or CollectiveTimes()

    # -- layout -----------------------------------------------------------------------------------
    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a full flat vector, in its shape (views, no copies)."""
        return [flat[a:b].view(shape) for a, b, shape in zip(self.offsets, self.offsets[1:], self.shapes)]

    def _shard_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's ``MASTER_DTYPE`` shard of the flat vector made of ``tensors`` (full, one per
        FQN in order), copied piece by piece: the full vector is never built."""
        lo = self.rank * self.shard_numel
        out = torch.zeros(self.shard_numel, dtype=MASTER_DTYPE, device=self.device)
        for t, a, b in zip(tensors, self.offsets, self.offsets[1:]):
            start, stop = max(a, lo), min(b, lo + self.shard_numel)
            if start < stop:
                out[start - lo : stop - lo] = t.detach().reshape(-1)[start - a : stop - a]
        return out

    def _gather_master(self, shard: torch.Tensor) -> torch.Tensor:
        """The full flat vector of a shard-shaped ``MASTER_DTYPE`` tensor, on every rank (uncounted:
        checkpoint traffic, not the training step's)."""
        full = torch.empty(self.shard_numel * self.world, dtype=MASTER_DTYPE, device=self.device)
        all_gather_single(full, shard.detach().contiguous(), group=self.group)
        return full

    # -- the training step ------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the shards into ``full_params``, which the module's parameters view."""
        self.times.all_gather(self.full_params, self.shard.to(self.param_dtype), self.group)

    def _accumulate_into_flat_grad(self, index: int) -> Callable[[torch.Tensor], None]:
        a, b = self.offsets[index], self.offsets[index + 1]

        @torch.no_grad()
        def hook(param: torch.Tensor) -> None:
            if self.full_grad is None:
                self.full_grad = torch.zeros(self.full_params.numel(), dtype=self.reduce_dtype, device=self.device)
            self.full_grad[a:b].add_(param.grad.reshape(-1))  # cast to the reduce dtype on the way
            param.grad = None  # the flat buffer holds it now; param-dtype memory is freed per micro-batch

        return hook

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Reduce-scatter the accumulated full gradient into ``shard.grad``: the mean over DP ranks.

        Once per optimizer step, after the last micro-batch's backward. The buffer is divided by
        the world size before the sum (exact for power-of-two worlds; keeps float16 sums in
        range), then freed until the next step's first backward.
        """
        if self.full_grad is None:  # no backward reached these parameters: a zero gradient
            self.full_grad = torch.zeros(self.full_params.numel(), dtype=self.reduce_dtype, device=self.device)
        self.full_grad.div_(self.world)
        reduced = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        self.times.reduce_scatter(reduced, self.full_grad, self.group)
        self.full_grad = None
        self.shard.grad = reduced.to(MASTER_DTYPE)

    # -- checkpoints ------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` keys (both names of a tied matrix) with full fp32 values from
        the master shards (collective). Every rank returns the same tensors; DCP writes each once."""
        values = self.views(self._gather_master(self.shard))
        return {
            key: values[self._ids[id(t)]] if id(t) in self._ids else t
            for key, t in self.module.state_dict(keep_vars=True).items()
        }

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state under the keys FSDP2's flattened optimizer state dict uses, with
        full per-FQN tensors (collective). A shard-shaped state (AdamW's moments) is gathered and cut
        per FQN; a scalar one (``step``) is the same for every FQN, as in FSDP2. Before the first
        step the state is created first (a zero-gradient step at lr 0), so a resume has tensors of
        the right shapes to load into."""
        [group] = optimizer.param_groups
        if self.shard not in optimizer.state:
            _create_state(optimizer, self.shard)
        out = {}
        for key, value in optimizer.state[self.shard].items():
            if isinstance(value, torch.Tensor) and value.shape == self.shard.shape:
                for fqn, view in zip(self.fqns, self.views(self._gather_master(value))):
                    out[f"state.{fqn}.{key}"] = view
            else:
                for fqn in self.fqns:
                    out[f"state.{fqn}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
        for fqn in self.fqns:
            out.update((f"param_groups.{fqn}.{k}", v) for k, v in group.items() if k != "params")
        return out

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """The inverse of ``optimizer_state_dict``: keep this rank's shard of each per-FQN state.
        The checkpoint's param-group values (lr, betas, ...) are those of the first FQN; FSDP2
        writes the same ones for every FQN of a group."""
        [group] = optimizer.param_groups
        for k in [k for k in group if k != "params"]:
            group[k] = state[f"param_groups.{self.fqns[0]}.{k}"]
        current = optimizer.state[self.shard]
        loaded = {}
        for key, value in current.items():
            per_fqn = [state[f"state.{fqn}.{key}"] for fqn in self.fqns]
            if isinstance(value, torch.Tensor) and value.shape == self.shard.shape:
                loaded[key] = self._shard_of(per_fqn).to(value.dtype)
            else:
                loaded[key] = per_fqn[0].clone() if isinstance(per_fqn[0], torch.Tensor) else per_fqn[0]
        optimizer.state[self.shard] = loaded


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> None:
    """Let ``optimizer`` create its (lazy) state for ``param`` without changing it: one step on a
    zero gradient at lr 0 (AdamW's update and decoupled weight decay are then exact no-ops)."""
    saved_grad, lrs = param.grad, [g["lr"] for g in optimizer.param_groups]
    param.grad = torch.zeros_like(param)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    param.grad = saved_grad
