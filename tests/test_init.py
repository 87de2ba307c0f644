"""Per-tensor deterministic init and the init contract (exactly once, recipe std, truncation)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from models.common.decoder import Transformer
from models.registry import FAMILIES
from seedckpt.materialize.init_recipe import (
    CHUNK_NUMEL,
    Initializer,
    TensorInit,
    chunk_generator,
    generate,
    generate_flat,
    init_model,
)
from seedckpt.materialize.stages import build_stage_model
from seedckpt.parallel.pipeline import StageSpec
from tests.conftest import tiny_config


def _materialized(args) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def _truncated_std(std: float, cutoff: float) -> float:
    """Standard deviation of N(0, std^2) truncated to +-cutoff*std."""
    phi = math.exp(-(cutoff**2) / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(cutoff / math.sqrt(2))
    return std * math.sqrt(1 - 2 * cutoff * phi / mass)


def test_generator_uses_full_key_not_32_bits():
    # torch's manual_seed keeps 32 bits; keys must not collide just because they agree mod 2**32.
    a = torch.randn(8, generator=chunk_generator(1, "w", 0))
    b = torch.randn(8, generator=chunk_generator(1 + 2**32, "w", 0))
    again = torch.randn(8, generator=chunk_generator(1, "w", 0))
    assert torch.equal(a, again)
    assert not torch.equal(a, b)
    assert not torch.equal(a, torch.randn(8, generator=chunk_generator(1, "w", 1)))
    assert not torch.equal(a, torch.randn(8, generator=chunk_generator(1, "v", 0)))


def test_values_depend_on_seed_fqn_recipe_not_order_or_layout():
    args = tiny_config().model_args()
    full = _materialized(args)
    init_model(full, seed=3)
    # Same model, modules initialized in reverse order.
    reverse = _materialized(args)
    init = Initializer(reverse, seed=3)
    with torch.no_grad():
        for mod in reversed(list(reverse.modules())):
            if hasattr(mod, "init_weights"):
                mod.init_weights(init)
    # A pipeline stage that only has layers 2..3.
    stage = build_stage_model(args, StageSpec(1, 3, (2, 3)))
    stage.to_empty(device="cpu")
    init_model(stage, seed=3)
    ref = full.state_dict()
    for fqn, t in reverse.state_dict().items():
        assert torch.equal(t, ref[fqn]), fqn
    for fqn, t in stage.state_dict().items():
        assert torch.equal(t, ref[fqn]), fqn
    other_seed = _materialized(args)
    init_model(other_seed, seed=4)
    assert not torch.equal(other_seed.layers["0"].attention.wq.weight, full.layers["0"].attention.wq.weight)


def test_chunked_generation_is_independent_per_chunk():
    spec = TensorInit("trunc_normal", std=0.02, cutoff=2.0)
    numel = 2 * CHUNK_NUMEL + 123
    whole = generate(spec, (numel,), seed=0, fqn="x")
    # Each chunk regenerated alone equals the corresponding slice (basis for parallel/sharded init).
    for c in range(3):
        part = torch.empty(min(CHUNK_NUMEL, numel - c * CHUNK_NUMEL))
        spec.fill_chunk(part, chunk_generator(0, "x", c))
        assert torch.equal(part, whole[c * CHUNK_NUMEL : (c + 1) * CHUNK_NUMEL])
    # Any sub-range, aligned or not, equals the slice of the whole tensor.
    for start, stop in ((5, 17), (CHUNK_NUMEL - 3, CHUNK_NUMEL + 9), (CHUNK_NUMEL + 1, numel - 1), (numel - 7, numel)):
        assert torch.equal(generate_flat(spec, 0, "x", numel, start, stop), whole[start:stop]), (start, stop)
    # The shape does not matter, only the flat element order.
    assert torch.equal(generate(spec, (numel,), 0, "x"), generate(spec, (1, numel), 0, "x").view(-1))


@pytest.mark.parametrize("std,cutoff", [(0.02, 2.0), (1.0, 3.0), (0.5, 1.0)])
def test_trunc_normal_is_exact_bounds_and_std(std, cutoff):
    x = generate(TensorInit("trunc_normal", std=std, cutoff=cutoff), (1 << 21,), seed=1, fqn="t")
    assert x.abs().max().item() <= cutoff * std
    assert x.abs().max().item() > 0.99 * cutoff * std  # the tails are actually reached
    assert abs(x.std().item() / _truncated_std(std, cutoff) - 1) < 0.02
    assert abs(x.mean().item()) < 0.01 * std


def _expected(fqn: str, args) -> TensorInit:
    """The documented recipe (models/llama.py docstring), written independently of the model."""
    parts = fqn.split(".")
    if fqn == "tok_embeddings.weight":
        return TensorInit("normal", std=1.0)
    if fqn == "output.weight":
        return TensorInit("trunc_normal", std=args.dim**-0.5, cutoff=3.0)
    if parts[-2].endswith("norm"):
        return TensorInit("ones")
    std = 0.02 / math.sqrt(2 * (int(parts[1]) + 1)) if parts[-2] in ("wo", "w2", "w3") else 0.02
    return TensorInit("trunc_normal", std=std, cutoff=2.0 / std)  # nn.init.trunc_normal_'s absolute +-2


def test_every_parameter_initialized_exactly_once_with_recipe_std():
    args = tiny_config("--model.dim", "256", "--model.n_layers", "3", "--model.vocab_size", "1024").model_args()
    model = _materialized(args)
    specs = init_model(model, seed=0)
    params = dict(model.named_parameters())
    assert sorted(specs) == sorted(params)  # each exactly once: a second init raises (below)
    for fqn, p in params.items():
        spec = _expected(fqn, args)
        assert specs[fqn] == spec, fqn
        if spec.kind == "ones":
            assert torch.equal(p, torch.ones_like(p)), fqn
            continue
        want = spec.std if spec.kind == "normal" else _truncated_std(spec.std, spec.cutoff)
        assert p.numel() >= 32768
        assert abs(p.std().item() / want - 1) < 0.02, fqn
        if spec.kind == "trunc_normal":
            assert p.abs().max().item() <= spec.cutoff * spec.std, fqn


@pytest.mark.parametrize("std,bounds", [(0.02, None), (0.02 / math.sqrt(2), None), (0.01, None), (2048**-0.5, 3.0)])
def test_realized_std_matches_torchtitans_init_calls(std, bounds):
    """torchtitan: ``nn.init.trunc_normal_(w, std=s)`` (default a=-2, b=2) for hidden projections and
    ``a, b = -+3 s`` for the output; ours must have the same realized std within 1 %."""
    shape = (2048, 2048)
    a, b = (-bounds * std, bounds * std) if bounds else (-2.0, 2.0)
    torch.manual_seed(0)
    theirs = torch.nn.init.trunc_normal_(torch.empty(shape), std=std, a=a, b=b)
    ours = generate(TensorInit("trunc_normal", std=std, cutoff=b / std), shape, seed=0, fqn="w")
    assert abs(ours.std().item() / theirs.std().item() - 1) < 0.01
    assert ours.abs().max().item() <= b


def test_recursive_init_is_refused():
    class Recursive(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Leafy()

        def init_weights(self, init):
            self.inner.init_weights(init)  # the fms-fsdp mistake: re-initializes a child

    class Leafy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))

        def init_weights(self, init):
            init.ones_(self.w)

    with pytest.raises(RuntimeError, match="inner.w was initialized twice"):
        init_model(Recursive(), seed=0)


def test_parameter_without_recipe_is_refused():
    args = tiny_config().model_args()
    model = _materialized(args)
    model.layers["0"].extra = nn.Linear(2, 2, bias=False)
    with pytest.raises(RuntimeError, match=r"no init recipe for \['layers.0.extra.weight'\]"):
        init_model(model, seed=0)


def test_recipe_can_be_read_on_meta_without_allocation():
    args = tiny_config().model_args()
    with torch.device("meta"):
        model = Transformer(args)
    specs = init_model(model, seed=0, materialize=False)
    assert set(specs) == set(model.state_dict())
    assert all(p.is_meta for p in model.parameters())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_float64_default_dtype_draws_the_float32_values_and_runs_in_float64(name):
    """Values are drawn in float32 whatever the default dtype (a redraw or a chunk's scratch in
    float64 once broke the truncated normal), and a float64 model runs in float64 (the CPU's grouped
    GEMM refuses float64: its experts run the loop)."""
    family = FAMILIES[name]
    args = family.flavors["debug"]
    reference = family.model(args)
    init_model(reference, seed=1)
    with default_dtype(torch.float64):
        model = family.model(args)
        init_model(model, seed=1)
        logits = model(torch.randint(0, args.vocab_size, (1, 8)))
    drawn = dict(reference.named_parameters())
    for fqn, p in model.named_parameters():
        assert p.dtype == torch.float64 and torch.equal(p, drawn[fqn].double()), fqn
    logits = logits[0] if isinstance(logits, tuple) else logits
    assert logits.dtype == torch.float64 and logits.isfinite().all()


def test_a_range_cutting_a_chunk_draws_the_same_values_under_a_float64_default_dtype():
    spec = TensorInit("trunc_normal", std=1.0, cutoff=1.0)  # a third of the draws redrawn
    numel = CHUNK_NUMEL + 5
    expected = generate_flat(spec, 0, "x", numel, CHUNK_NUMEL - 3, numel)
    with default_dtype(torch.float64):
        assert torch.equal(generate_flat(spec, 0, "x", numel, CHUNK_NUMEL - 3, numel), expected)
