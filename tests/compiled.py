"""An eager model and its compiled twin, for the tests that compare them and count the graphs
``training.compile`` (``apply_compile``) builds, and batches of other documents to feed them."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from models.common.decoder import Transformer
from seedckpt.materialize.init_recipe import init_model
from seedckpt.parallel.parallelize import apply_activation_checkpointing, apply_compile


def compile_with_aot_eager(monkeypatch) -> None:
    """``torch.compile`` with ``aot_eager``, dynamo's caches and graph counters emptied: dynamo and
    AOT autograd decide the graphs these tests count; inductor's C++ code generation (tens of seconds
    to minutes of a busy CPU) is not what they check."""
    torch._dynamo.reset()
    counters.clear()
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_with(fn, backend="aot_eager", **kw))


def eager_and_compiled(args, ac: str = "none", model=Transformer) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two ``model``s of ``args`` with the same weights (the init recipe's, seed 0), the second under
    activation checkpointing ``ac`` (every block) with its blocks compiled as ``training.compile``
    compiles them."""
    eager, compiled = model(args), model(args)
    init_model(eager, 0)
    compiled.load_state_dict(eager.state_dict())
    apply_activation_checkpointing(compiled, ac, 1)
    apply_compile(compiled)
    return eager, compiled


def graph_count() -> int:
    """The graphs dynamo has compiled since the counters were last emptied."""
    return counters["stats"]["unique_graphs"]


def random_layouts(count: int, bsz: int, seq: int, longest: int) -> list[torch.Tensor]:
    """``count`` batches of (bsz, seq) document ids, each row documents of 1 to ``longest`` tokens
    (seeded), so that batches differ in documents, length classes and their sizes."""
    gen = torch.Generator().manual_seed(1)
    return [
        torch.stack([torch.cumsum(torch.rand(seq, generator=gen) < 2 / longest, 0) for _ in range(bsz)])
        for _ in range(count)
    ]
