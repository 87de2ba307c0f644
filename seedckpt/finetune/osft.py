"""Orthogonal subspace fine-tuning (OSFT, "Sculpting Subspaces", arXiv 2504.07097).

Each target matrix W (m x n) is split by its singular value decomposition W = U diag(S) V^T into
the directions it uses most -- the top ``k`` singular triplets, *frozen* -- and the rest, which
train. Updates then stay orthogonal to what the pretrained model relies on, so it forgets little.

Rank rule (Mini Trainer's rounding, kept so results compare): with r = min(m, n) and the ratio
``osft_unfreeze_rank_ratio``, k = floor(r * (1 - ratio)) triplets are frozen, at most r - 1 (one
direction always trains); the other r - k train.

Stored factors, by FQN under the target module (e.g. ``layers.0.<the block's linear>.U_high``):

==========  ============  =========================================
``U_high``  m x k         left singular vectors, frozen
``S_high``  k             singular values, frozen
``V_high``  n x k         right singular vectors *as columns*, frozen
``U_low``   m x (r - k)   trainable
``S_low``   r - k         trainable
``V_low``   n x (r - k)   trainable
==========  ============  =========================================

V is stored as columns (n x k, not V^T's k x n) so that FSDP2's dim-0 sharding splits both U and V
along the matrix's own dimensions (m and n): the products the projection needs, U_high^T G and
V_high^T G, are then sums over sharded rows -- a local matmul plus one small all-reduce of a
k x (r - k) matrix -- instead of an all-gather of V_high.

Exact projection (``OSFTProjector``): before clipping and the optimizer step the gradients of
U_low and V_low lose their components in span(U_high) and span(V_high); after the step the
parameters are projected again, because AdamW's per-element scaling (and weight decay) move them
out of the complement even when the gradient was in it.

Signs: an SVD is unique only up to the sign of each (u_i, v_i) pair. ``decompose`` flips each pair
so that the entry of largest magnitude of u_i is positive (the first such entry on ties), so the
factors do not depend on which rank, library build or thread count computed them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.moe import moe_modules
from models.family import BLOCKS
from models.registry import family_of
from seedckpt.checkpoint import ModelLayout, OpenedCheckpoint, TensorInfo
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import copy_full_into, splitting_groups

FROZEN = ("U_high", "S_high", "V_high")
TRAINABLE = ("U_low", "S_low", "V_low")


@dataclass(frozen=True)
class OSFTSettings:
    """``[finetune]``'s OSFT settings: the trainable fraction of each target's rank and the targets
    (empty: the model family's default targets)."""

    ratio: float
    patterns: tuple[str, ...] = ()


def osft_record(spec: OSFTSettings) -> dict:
    """The OSFT settings as a manifest's ``finetune`` entry records them (read by ``manifest_osft``)."""
    return {"osft_unfreeze_rank_ratio": spec.ratio, "osft_target_patterns": list(spec.patterns)}


def manifest_osft(manifest: dict | None) -> OSFTSettings | None:
    """The OSFT settings an OSFT run's checkpoint was trained with (its factors' shapes follow)."""
    finetune = (manifest or {}).get("finetune")
    if not isinstance(finetune, dict) or finetune.get("mode") != "osft":
        return None
    try:
        return OSFTSettings(float(finetune["osft_unfreeze_rank_ratio"]), tuple(finetune["osft_target_patterns"]))
    except (KeyError, TypeError, ValueError) as e:
        raise SeedckptError(f"the manifest's OSFT settings are damaged ({e!r})") from None


def frozen_rank(m: int, n: int, ratio: float) -> int:
    """k: how many top singular triplets of an m x n matrix stay frozen (Mini Trainer's rounding)."""
    if not 0.0 < ratio <= 1.0:
        raise SeedckptError(f"finetune.osft_unfreeze_rank_ratio = {ratio}: it must be in (0, 1]")
    r = min(m, n)
    return min(r - 1, math.floor(r * (1.0 - ratio)))


def pattern_matches(module: nn.Module, patterns: Iterable[str]) -> dict[str, list[str]]:
    """Each of ``patterns`` (the model family's default targets when empty) -> the FQNs of the
    ``nn.Linear`` modules inside the transformer blocks it selects: those whose name ends with it (a
    dotted suffix of its name) or that it matches whole (a regular expression). The
    output projection is never a target: its rows follow the vocabulary (which fine-tuning may grow)
    and a tied one is the embedding."""
    patterns = list(patterns) or list(family_of(module.args).osft_targets)
    try:
        compiled = [re.compile(p) for p in patterns]
    except re.error as e:
        raise SeedckptError(
            f"finetune.osft_target_patterns: {e.pattern!r} is not a valid regular expression ({e})"
        ) from None
    found: dict[str, list[str]] = {p: [] for p in patterns}
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear) and name.startswith(BLOCKS + "."):
            for p, c in zip(patterns, compiled):
                if name.endswith("." + p) or c.fullmatch(name):
                    found[p].append(name)
    return found


def target_fqns(module: nn.Module, patterns: Iterable[str]) -> list[str]:
    """The FQNs any of ``patterns`` selects (``pattern_matches``), in module order."""
    selected = {fqn for fqns in pattern_matches(module, patterns).values() for fqn in fqns}
    return [name for name, _ in module.named_modules() if name in selected]


def describe_targets(module: nn.Module, fqns: list[str], ratio: float) -> str:
    """One log line: the targets grouped by their name inside a block, each with its m x n, frozen
    rank k and how many blocks hold it."""
    groups: dict[tuple[str, int, int], int] = {}
    for fqn in fqns:
        m, n = module.get_submodule(fqn).weight.shape
        key = (fqn.split(".", 2)[2], m, n)  # <blocks>.<i>.<name in the block>
        groups[key] = groups.get(key, 0) + 1
    parts = [
        f"{name} {m}x{n} k={frozen_rank(m, n, ratio)} in {count} block{'s' * (count != 1)}"
        for (name, m, n), count in groups.items()
    ]
    return f"osft: {len(fqns)} target linears (m x n, frozen rank k at unfreeze ratio {ratio}): " + ", ".join(parts)


@dataclass
class Factors:
    """One matrix's SVD split at ``k``: W = U_high diag(S_high) V_high^T + U_low diag(S_low) V_low^T."""

    U_high: torch.Tensor
    S_high: torch.Tensor
    V_high: torch.Tensor
    U_low: torch.Tensor
    S_low: torch.Tensor
    V_low: torch.Tensor

    def items(self):
        return ((name, getattr(self, name)) for name in FROZEN + TRAINABLE)


def decompose(weight: torch.Tensor, ratio: float) -> Factors:
    """The fp32 SVD of ``weight`` split by the rank rule, with the sign convention above.

    A wide matrix is decomposed as its transpose (W^T = V S U^T): LAPACK took 125 s for an 8B
    ``w2`` (4096 x 14336) and 49 s for ``w1`` (14336 x 4096) here, one thread each."""
    m, n = weight.shape
    k = frozen_rank(m, n, ratio)
    w = weight.detach().to(torch.float32)
    if m < n:
        v, s, uh = _svd(w.T)
        u, vh = uh.T, v.T
    else:
        u, s, vh = _svd(w)
    rows = u.abs().argmax(dim=0)  # first index of the largest magnitude in each column
    signs = torch.sign(u[rows, torch.arange(u.shape[1])])
    signs[signs == 0] = 1.0
    u, v = u * signs, vh.T * signs
    return Factors(
        u[:, :k].contiguous(),
        s[:k].contiguous(),
        v[:, :k].contiguous(),
        u[:, k:].contiguous(),
        s[k:].contiguous(),
        v[:, k:].contiguous(),
    )


# An SVD on CUDA is accepted when it rebuilds the matrix and its singular vectors are orthonormal to
# this relative tolerance (fp32: a few ulps of the matrix's norm, summed over its width).
CUDA_SVD_RTOL = 1e-5


def _svd(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD of a tall (or square) fp32 matrix. On CUDA, cuSOLVER's ``gesvda`` first: on an H100
    it was both the fastest driver and the closest to a float64 SVD (torch's default, Jacobi ``gesvdj``,
    rebuilt a test matrix 47x less accurately and failed the OSFT tolerance; docs/finetuning.md has the
    figures). ``gesvda`` is documented as possibly inaccurate for ill-conditioned matrices, so its result
    is checked (rebuilt matrix, orthonormal columns) and the QR-based ``gesvd`` redoes any it fails."""
    if w.device.type != "cuda":
        return torch.linalg.svd(w, full_matrices=False)
    u, s, vh = torch.linalg.svd(w, full_matrices=False, driver="gesvda")
    if _svd_error(w, u, s, vh) <= CUDA_SVD_RTOL:
        return u, s, vh
    return torch.linalg.svd(w, full_matrices=False, driver="gesvd")


def _svd_error(w: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> float:
    """The worst of the rebuild error (relative to ``w``'s largest entry) and the departure of ``u``'s
    and ``vh``'s rows from orthonormal; inf when anything is not finite. In float64, so that a run
    allowing TF32 matmuls does not blur the check."""
    w, u, s, vh = (t.double() for t in (w, u, s, vh))
    eye = torch.eye(s.numel(), device=w.device, dtype=w.dtype)
    errors = torch.stack(
        [
            ((u * s) @ vh - w).abs().max() / w.abs().max().clamp_min(torch.finfo(w.dtype).tiny),
            (u.T @ u - eye).abs().max(),
            (vh @ vh.T - eye).abs().max(),
        ]
    )
    return float(errors.nan_to_num(nan=float("inf")).max())


class OSFTLinear(nn.Module):
    """A linear layer whose weight is held as frozen and trainable SVD factors; a bias (Qwen2's
    q/k/v) stays a dense trainable parameter under its own name.

    ``forward`` applies the factors without forming W: x -> ((x V) * S) U^T for the high and the
    low part. Why not a dense frozen U_high S_high V_high^T plus the low-rank path: measured on the
    8B shapes (``benchmarks/osft.py``, 2048 tokens, forward + backward) both run within 0.8-1.4x of
    the dense layer's time, but the dense-high variant holds an extra m x n matrix (2.3-3x the dense
    layer's parameter bytes against 1.25-2x), and memory is what OSFT is meant to save.
    Parameters are allocated uninitialized (``meta`` when built under a meta device);
    ``load_factors`` or a checkpoint fills them.
    """

    def __init__(self, in_features: int, out_features: int, ratio: float, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        k = frozen_rank(out_features, in_features, ratio)
        low = min(out_features, in_features) - k
        shapes = {
            "U_high": (out_features, k),
            "S_high": (k,),
            "V_high": (in_features, k),
            "U_low": (out_features, low),
            "S_low": (low,),
            "V_low": (in_features, low),
        }
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape), requires_grad=name in TRAINABLE))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, ratio: float) -> OSFTLinear:
        with torch.device(linear.weight.device):
            return cls(linear.in_features, linear.out_features, ratio, bias=linear.bias is not None)

    def load_factors(self, factors: Factors) -> None:
        with torch.no_grad():
            for name, value in factors.items():
                getattr(self, name).copy_(value)

    def dense_weight(self) -> torch.Tensor:
        """W = U diag(S) V^T (for export and checks; training never forms it)."""
        return (self.U_high * self.S_high) @ self.V_high.T + (self.U_low * self.S_low) @ self.V_low.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        high = F.linear(F.linear(x, self.V_high.T) * self.S_high, self.U_high)
        return high + F.linear(F.linear(x, self.V_low.T) * self.S_low, self.U_low, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"frozen_rank={self.S_high.shape[0]}, trainable_rank={self.S_low.shape[0]}"
        )


def convert_to_osft(model: nn.Module, patterns: Iterable[str], ratio: float) -> list[str]:
    """Replace every target ``nn.Linear`` of ``model`` by an (uninitialized) ``OSFTLinear`` of the
    same shape, on the same device (``meta`` before materialization); returns the targets' FQNs.

    Mixtures of experts are frozen whole, router and experts (no gradient, not in the optimizer):
    their 3-D expert weights are no target (one SVD per expert is not built), and training them
    fully would forget what OSFT is chosen to keep. Their aux-loss-free bias stays too (a frozen
    router's bias is not moved)."""
    targets = target_fqns(model, patterns)
    for fqn in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, OSFTLinear.like(getattr(parent, child), ratio))
    for layer in moe_modules(model):
        layer.requires_grad_(False)
    return targets


def svd_cost(layer: OSFTLinear) -> int:
    """A dense SVD of an m x n matrix costs ~ m * n * min(m, n) flops (up to a constant)."""
    m, n = layer.out_features, layer.in_features
    return m * n * min(m, n)


def assign_by_cost(costs: dict[str, int], workers: int) -> list[list[str]]:
    """Longest processing time first: each matrix, most expensive first, goes to the worker with the
    least work so far (ties: the lowest index). Names break cost ties, so every rank computes the
    same assignment. Mini Trainer instead splits the list into contiguous equal-count blocks, so an
    FFN-heavy block makes everybody wait."""
    loads, plan = [0] * workers, [[] for _ in range(workers)]
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        plan[worker].append(name)
        loads[worker] += costs[name]
    return plan


def fill_factors(
    layers: dict[str, OSFTLinear], read_dense, ratio: float, group=None, device: torch.device | str = "cpu"
) -> int:
    """Decompose every target of ``layers`` ({FQN: layer}, the same on every rank of ``group``: the
    ranks holding one pipeline stage) and give each rank its shards of the factors.

    The targets are assigned by cost (``assign_by_cost``); each rank reads the dense matrices it
    decomposes with ``read_dense(fqn)`` (straight from the pretrained checkpoint) and runs their SVDs in
    fp32 on ``device``, the training device (an H100 ran the 1B shapes' SVDs 2.7-4.9x faster than 16
    CPU threads). In round i every rank decomposes its i-th matrix, then each of those is broadcast in
    the group (over nccl for CUDA tensors) and every rank keeps its shards -- so the SVDs run in
    parallel and a rank holds at most one matrix's factors beyond its shards, never the model.
    Returns how many SVDs this rank ran."""
    workers = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_rank(group)
    plan = assign_by_cost({fqn: svd_cost(layer) for fqn, layer in layers.items()}, workers)
    done = 0
    for i in range(max(map(len, plan), default=0)):
        mine = decompose(read_dense(plan[me][i]).to(device), ratio) if i < len(plan[me]) else None
        done += mine is not None
        for worker, names in enumerate(plan):
            if i >= len(names):
                continue
            layer = layers[names[i]]
            with torch.no_grad():
                for name in FROZEN + TRAINABLE:
                    param = getattr(layer, name)
                    full = (
                        getattr(mine, name)
                        if worker == me
                        else torch.empty(param.shape, dtype=torch.float32, device=device)
                    )
                    if group is not None:
                        dist.broadcast(full, group=group, group_src=worker)
                    copy_full_into(param, full)
    return done


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _coefficients(basis: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """basis^T values for row-sharded ``basis`` (a x k) and ``values`` (a x j) sharded alike: the
    local rows' product, summed over the shards."""
    coefficients = _local(basis).T @ _local(values)
    for group in splitting_groups(basis, 0):
        dist.all_reduce(coefficients, group=group)
    return coefficients


def remove_component(basis: torch.Tensor, values: torch.Tensor) -> None:
    """values -= basis (basis^T values), in place: ``values`` loses its part in span(basis), given
    that ``basis`` has orthonormal columns. Collective when the tensors are sharded."""
    local = _local(values)
    local.sub_(_local(basis) @ _coefficients(basis, values))


class OSFTProjector:
    """Keeps the trainable factors of every ``OSFTLinear`` in ``modules`` orthogonal to the frozen ones."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.layers = [m for module in modules for m in module.modules() if isinstance(m, OSFTLinear)]

    @torch.no_grad()
    def project_gradients(self) -> None:
        """Call after backward, before clipping: clipping then measures only what the step applies."""
        for layer in self.layers:
            for high, low in ((layer.U_high, layer.U_low), (layer.V_high, layer.V_low)):
                if low.grad is not None:
                    remove_component(high, low.grad)

    @torch.no_grad()
    def project_parameters(self) -> None:
        """Call after every optimizer step."""
        for layer in self.layers:
            remove_component(layer.U_high, layer.U_low)
            remove_component(layer.V_high, layer.V_low)

    @torch.no_grad()
    def worst_leak(self) -> float:
        """max over layers of ||U_high^T U_low|| and ||V_high^T V_low|| (Frobenius): 0 is exact."""
        worst = 0.0
        for layer in self.layers:
            for high, low in ((layer.U_high, layer.U_low), (layer.V_high, layer.V_low)):
                worst = max(worst, torch.linalg.norm(_coefficients(high, low)).item())
        return worst


class DenseOSFT(OpenedCheckpoint):
    """An OSFT run's checkpoint seen as the dense model it computes: each target's ``weight`` is
    U_high diag(S_high) V_high^T + U_low diag(S_low) V_low^T, rebuilt (in fp32, then stored in the
    factors' dtype) only when read -- one matrix at a time, as the converters stream."""

    def __init__(self, source: OpenedCheckpoint, dense: ModelLayout | None):
        """``dense``: the model's layout without factors (what the rebuilt checkpoint holds)."""
        self.source, self.kind = source, source.kind
        self.targets = {fqn.removesuffix(".U_high") for fqn in source.infos if fqn.endswith(".U_high")}
        infos = {}
        for fqn, info in source.infos.items():
            base, _, name = fqn.rpartition(".")
            if base not in self.targets or name not in FROZEN + TRAINABLE:  # a target's bias stays as it is
                infos[fqn] = info
            elif name == "U_high":
                infos[f"{base}.weight"] = TensorInfo(
                    (info.shape[0], source.infos[f"{base}.V_high"].shape[0]), info.dtype
                )
        super().__init__(source.path, infos, source.manifest, dense)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        base = fqn.removesuffix(".weight")
        if base not in self.targets:
            return self.source.read_tensor(fqn)
        f = {name: self.source.read_tensor(f"{base}.{name}").float() for name in FROZEN + TRAINABLE}
        dense = (f["U_high"] * f["S_high"]) @ f["V_high"].T + (f["U_low"] * f["S_low"]) @ f["V_low"].T
        return dense.to(self.infos[fqn].dtype)

    def reads_rows(self, fqn: str) -> bool:
        """A target is rebuilt whole (a product of its factors); the other tensors read as stored."""
        return fqn.removesuffix(".weight") not in self.targets and self.source.reads_rows(fqn)

    def read_align(self, fqn: str) -> int:
        return self.source.read_align(fqn)

    def read_rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        if fqn.removesuffix(".weight") in self.targets:
            return super().read_rows(fqn, start, stop)
        return self.source.read_rows(fqn, start, stop)
