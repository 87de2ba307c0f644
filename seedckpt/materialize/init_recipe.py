"""Per-tensor deterministic initialization.

Every tensor's values are a function of (seed, FQN, recipe) only, never of creation order, stage
layout, sharding or world size. That is what makes three things bitwise equal: the seed
checkpoint, a pipeline stage loaded from it, and the same stage initialized directly on its rank.

How: a tensor is generated as flat fp32 chunks of ``CHUNK_NUMEL`` elements; chunk ``c`` draws from
its own Mersenne-Twister generator keyed by ``(seed, fqn, c)``. Chunks are independent, so they can
be generated in any order or in parallel with identical results.

Why the generator state is set directly: ``torch.Generator.manual_seed`` keeps only 32 bits of the
seed (measured: seeds 1 and 1 + 2**32 give the same stream). With ~10^5 chunks in a 405B model,
32-bit keys would make some chunks bitwise copies of others (birthday bound). We instead fill the
full 19937-bit MT state from SHAKE-256 of the key through ``Generator.set_state``; the state layout
is verified at import and a mismatch fails loudly rather than silently changing the numbers.

Truncated normal is exact rejection sampling: draw N(0, std^2), redraw only the out-of-range
elements from the same generator until none remain: several times faster than
``nn.init.trunc_normal_``'s inverse CDF (``benchmarks/init_rates.py``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from seedckpt.utils.tensors import copy_full_into, local, local_rows, state_tensors

CHUNK_NUMEL = 1 << 20
# v2: torchtitan's distribution (hidden projections truncated at +-2 absolute, not +-2 std).
RECIPE_VERSION = "seedckpt-init-v2"

_MT_WORDS = 624
_MT_OFFSET = 24  # byte offset of the 624 uint64-widened MT words in torch's CPU generator state


def _generator_template() -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(5489)
    state = g.get_state()
    first_words = state[_MT_OFFSET : _MT_OFFSET + 16].view(torch.int64).tolist()
    if state.numel() != 5056 or first_words != [5489, 1301868182]:
        raise RuntimeError(
            "torch.Generator state layout differs from the one seedckpt was written for "
            f"(torch {torch.__version__}); per-tensor init would not be reproducible. "
            "Use the pinned torch version."
        )
    return state


_TEMPLATE = _generator_template()


def chunk_generator(seed: int, fqn: str, chunk: int) -> torch.Generator:
    """A CPU generator whose whole MT19937 state is derived from (seed, fqn, chunk)."""
    key = f"{RECIPE_VERSION}\0{seed}\0{fqn}\0{chunk}".encode()
    words = torch.frombuffer(bytearray(hashlib.shake_256(key).digest(_MT_WORDS * 4)), dtype=torch.int32)
    state = _TEMPLATE.clone()
    state[_MT_OFFSET : _MT_OFFSET + _MT_WORDS * 8] = (words.to(torch.int64) & 0xFFFFFFFF).view(torch.uint8)
    g = torch.Generator()
    g.set_state(state)
    return g


@dataclass(frozen=True)
class TensorInit:
    """One tensor's recipe: ``normal`` / ``trunc_normal`` (N(0, std^2), cut at +-cutoff*std) / ``ones``
    / ``zeros`` / ``uniform`` (U(low, high)) / ``log_uniform`` (the log of U(low, high): a decay rate's
    log, as Gated DeltaNet's ``A_log``).

    ``key``: the FQN whose values the tensor takes when not its own (a tied output projection on
    the last pipeline stage is drawn under the embedding's FQN)."""

    kind: str
    std: float = 1.0
    cutoff: float | None = None
    key: str | None = None
    low: float = 0.0
    high: float = 1.0

    def key_for(self, fqn: str) -> str:
        return self.key or fqn

    def fill_chunk(self, out: torch.Tensor, generator: torch.Generator) -> None:
        if self.kind in ("ones", "zeros"):
            out.fill_(1.0 if self.kind == "ones" else 0.0)
            return
        if self.kind in ("uniform", "log_uniform"):
            out.uniform_(self.low, self.high, generator=generator)
            if self.kind == "log_uniform":
                out.log_()
            return
        out.normal_(0.0, self.std, generator=generator)
        if self.kind == "trunc_normal":
            bound = self.cutoff * self.std
            low, high = torch.aminmax(out)  # one pass without temporaries; resampling is rare
            bad = (out.abs() > bound).nonzero().squeeze(1) if low < -bound or high > bound else out[:0].long()
            while bad.numel():
                redraw = torch.empty(bad.numel(), dtype=out.dtype).normal_(0.0, self.std, generator=generator)
                out[bad] = redraw
                bad = bad[redraw.abs() > bound]
        elif self.kind != "normal":
            raise ValueError(f"unknown init kind {self.kind!r}")


def generate(spec: TensorInit, shape: torch.Size | tuple, seed: int, fqn: str) -> torch.Tensor:
    """The full fp32 tensor for ``fqn``, on CPU."""
    numel = math.prod(shape)
    return generate_flat(spec, seed, fqn, numel, 0, numel).view(shape)


def generate_flat(
    spec: TensorInit, seed: int, fqn: str, numel: int, start: int, stop: int, allocate=torch.empty
) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened fp32 tensor ``fqn`` of ``numel`` elements.

    Only the generator chunks that overlap the range are drawn, each over its full length (a
    chunk's values depend on its length, so the last chunk ends at ``numel``, never at ``stop``):
    the chunks inside the range straight into the result, the one or two it cuts into a scratch
    chunk, of which only the overlap is kept. So the memory is the range plus at most one chunk;
    a range on chunk boundaries draws nothing it does not keep, which is how the streaming seed
    writer cuts blocks. ``allocate(numel, dtype=)`` provides the result (the seed writer reuses its
    blocks' buffers).
    """
    if stop <= start:
        return torch.empty(0, dtype=torch.float32)
    out = allocate(stop - start, dtype=torch.float32)
    for chunk in range(start // CHUNK_NUMEL, (stop - 1) // CHUNK_NUMEL + 1):
        lo, hi = chunk * CHUNK_NUMEL, min(numel, (chunk + 1) * CHUNK_NUMEL)
        kept = out[max(lo, start) - start : min(hi, stop) - start]
        whole = kept if kept.numel() == hi - lo else torch.empty(hi - lo, dtype=torch.float32)
        spec.fill_chunk(whole, None if spec.kind in ("ones", "zeros") else chunk_generator(seed, fqn, chunk))
        if whole is not kept:
            kept.copy_(whole[max(lo, start) - lo : min(hi, stop) - lo])
    return out


class Initializer:
    """The ``init`` object handed to every module's ``init_weights``.

    It finds each tensor's FQN, records its recipe, refuses a second initialization of the same
    tensor, and (unless ``materialize=False``, used on ``meta`` to read the recipe without
    allocating) fills it with ``generate(...)``; a DTensor keeps only its shard of the full tensor,
    which is generated whole (one tensor at a time) and sliced.
    """

    def __init__(self, module: nn.Module, seed: int, materialize: bool = True):
        self.seed = seed
        self.materialize = materialize
        self.fqn_of = {id(t): fqn for fqn, t in state_tensors(module).items()}
        self.specs: dict[str, TensorInit] = {}

    def normal_(self, tensor: torch.Tensor, std: float, key: str | None = None) -> None:
        self._apply(tensor, TensorInit("normal", std=std, key=key))

    def trunc_normal_(self, tensor: torch.Tensor, std: float, cutoff: float = 2.0, key: str | None = None) -> None:
        self._apply(tensor, TensorInit("trunc_normal", std=std, cutoff=cutoff, key=key))

    def uniform_(self, tensor: torch.Tensor, low: float, high: float, log: bool = False) -> None:
        self._apply(tensor, TensorInit("log_uniform" if log else "uniform", low=low, high=high))

    def ones_(self, tensor: torch.Tensor) -> None:
        self._apply(tensor, TensorInit("ones"))

    def zeros_(self, tensor: torch.Tensor) -> None:
        self._apply(tensor, TensorInit("zeros"))

    def _apply(self, tensor: torch.Tensor, spec: TensorInit) -> None:
        fqn = self.fqn_of.get(id(tensor))
        if fqn is None:
            raise RuntimeError(
                "init_weights passed a tensor that is not a parameter or persistent "
                "buffer of the module being initialized"
            )
        if fqn in self.specs:
            raise RuntimeError(
                f"{fqn} was initialized twice: init_weights must not recurse into "
                "children that have their own init_weights"
            )
        self.specs[fqn] = spec
        if self.materialize:
            key = spec.key_for(fqn)
            with torch.no_grad():
                rows = local_rows(tensor)
                if rows is None:  # not a row block of the full tensor: generate whole, keep our part
                    copy_full_into(tensor, generate(spec, tensor.shape, self.seed, key))
                else:  # an FSDP row shard: draw only its own rows (the chunked RNG allows any range)
                    width = math.prod(tensor.shape[1:])
                    block = generate_flat(spec, self.seed, key, tensor.numel(), rows[0] * width, rows[1] * width)
                    local(tensor).copy_(block.view(rows[1] - rows[0], *tensor.shape[1:]))


def init_model(module: nn.Module, seed: int, materialize: bool = True) -> dict[str, TensorInit]:
    """Run every ``init_weights`` once; return the recipe by FQN.

    Raises if any parameter or persistent buffer was left without a recipe, so a module whose
    init was forgotten cannot slip into a seed with ``to_empty`` garbage.
    """
    init = Initializer(module, seed, materialize)
    with torch.no_grad():
        for mod in module.modules():
            if hasattr(mod, "init_weights"):
                mod.init_weights(init)
    missing = sorted(set(init.fqn_of.values()) - set(init.specs))
    if missing:
        raise RuntimeError(f"no init recipe for {missing}: give their modules an init_weights")
    return init.specs
