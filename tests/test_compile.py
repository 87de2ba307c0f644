"""``training.compile``: one compiled graph shared by every block, the same losses as eager under
pipeline x FSDP2 (and AC, manual FSDP), unchanged checkpoint keys, and resumes across the two; MoE
blocks compiled whole, once whatever the routing, with eager's losses in one process and under EP."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from models.common.decoder import Transformer
from models.common.moe import moe_modules
from seedckpt.finetune.osft import convert_to_osft, decompose
from seedckpt.materialize.init_recipe import init_model
from seedckpt.parallel.parallelize import apply_activation_checkpointing, apply_compile, check_compile_supported
from seedckpt.utils.errors import SeedckptError
from tests.compiled import compile_with_aot_eager, eager_and_compiled, graph_count
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.test_expert_parallel import ONE, ep
from tests.test_moe import MOE, _balance, moe_seed  # noqa: F401 (a fixture)
from tests.test_train import losses, model_state, torchrun

PP2_X_DP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "4",
    "--parallelism.pipeline_parallel_microbatches",
    "2",
    "--training.steps",
    "6",
]
# The resumes re-shard pp2 x dp2's checkpoints onto pp2 alone.
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "8",
    "--parallelism.pipeline_parallel_microbatches",
    "2",
    "--training.steps",
    "6",
]
COMPILE = ["--training.compile", "true"]
AC_FULL = ["--activation_checkpoint.mode", "full"]
LOCAL_BATCH_4 = ["--training.local_batch_size", "4"]


def _close(got: list[float], want: list[float], name: str) -> None:
    assert len(got) == len(want), name
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), f"{name} step {step}: {a} vs {b}"


@pytest.mark.parametrize("osft", [False, True], ids=["dense", "osft"])
def test_every_block_shares_one_compiled_graph(osft):
    """Four blocks, full AC around each compiled forward: dynamo traces one graph, FQNs keep no
    ``_orig_mod.``, and logits and gradients match eager (OSFT's factorized linears too)."""
    torch._dynamo.reset()
    counters.clear()
    args = tiny_config("--model.n_layers", "4").model_args()
    eager, compiled = Transformer(args), Transformer(args)
    init_model(eager, 0)
    if osft:
        dense = eager.state_dict()
        for model in (eager, compiled):
            for fqn in convert_to_osft(model, [], 0.25):
                model.get_submodule(fqn).load_factors(decompose(dense[f"{fqn}.weight"], 0.25))
    compiled.load_state_dict(eager.state_dict())
    apply_activation_checkpointing(compiled, "full", 1)
    apply_compile(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step compiles nothing
        out = compiled(tokens)
        out.square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 1  # not one per block
    assert counters["aot_autograd"]["total"] == 1
    reference = eager(tokens)
    reference.square().mean().backward()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        if p.requires_grad:  # two accumulated steps against one
            torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_compiled_blocks_compute_a_sliding_window():
    """A Mistral with a window of 8 compiled: one graph for its blocks and eager's logits at 300
    positions, where the window runs in blocks of queries (``causal_attention``)."""
    torch._dynamo.reset()
    counters.clear()
    window = ["--model.name", "mistral", "--model.sliding_window", "8", "--model.n_layers", "2"]
    args = tiny_config(*window).model_args()
    eager, compiled = eager_and_compiled(args)
    tokens = torch.randint(0, args.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-5, atol=1e-5)
        assert graph_count() == 1


def test_missing_cpp_compiler_is_refused_with_the_fix(monkeypatch):
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-compiler-seedckpt",))
    with pytest.raises(
        SeedckptError, match=r"needs a C\+\+ compiler .*apt-get install g\+\+.*training.compile = false"
    ):
        check_compile_supported("cpu")


def test_compiled_training_matches_eager_and_resumes_across(tmp_path, debug_seed):
    """pp=2 x dp_shard=2, 6 steps: compiled (full AC) within 1e-4 of eager; both checkpoints hold the
    same keys, so a compiled run resumes from an eager step-3 (and, by the same keys, the reverse).
    Each 4-rank run costs ~30 s of start-up and compile on 2 cores: the suite keeps these three."""
    every3 = [*PP2_X_DP2, "--checkpoint.interval", "3"]
    torchrun(tmp_path / "eager", debug_seed, 4, *every3)
    reference = losses(tmp_path / "eager")
    torchrun(tmp_path / "compiled", debug_seed, 4, *every3, *COMPILE, "--activation_checkpoint.mode", "full")
    _close(losses(tmp_path / "compiled"), reference, "compiled pp2 x dp_shard2")

    eager_state = model_state(tmp_path / "eager" / "ckpt" / "step-3")
    compiled_state = model_state(tmp_path / "compiled" / "ckpt" / "step-3")
    assert eager_state.keys() == compiled_state.keys()
    assert not any("_orig_mod" in key for key in compiled_state)
    target = tmp_path / "compiled_from_eager"
    (target / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "eager" / "ckpt" / "step-3", target / "ckpt" / "step-3")
    run = torchrun(target, debug_seed, 2, *PP2, *COMPILE)  # 2 ranks: cheaper, same data
    assert "resuming from" in run.stdout and "step-3" in run.stdout
    _close(losses(target)[-3:], reference[-3:], "compiled, resumed from eager")


def _grouped_mm_calls(trace) -> tuple[int, int]:
    """(the grouped GEMMs inside a compiled graph's span, all of them) in a profiler trace: the
    ``seedckpt::grouped_mm`` op float32 takes (``models.common.moe.grouped_mm``)."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if "dur" in e]
    graphs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("Torch-Compiled Region")]
    graphs += [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "CompiledFunctionBackward"]
    calls = [e for e in events if e["name"] == "seedckpt::grouped_mm"]
    inside = sum(any(start <= e["ts"] <= end for start, end in graphs) for e in calls)
    return inside, len(calls)


def _eager_and_compiled_moe(monkeypatch, ac: str, *overrides: str):
    """The tiny Qwen3-MoE's args, an eager model and a copy under AC ``ac`` compiled by
    ``apply_compile`` with ``aot_eager`` (inductor's C++ code generation runs in the training test)."""
    compile_with_aot_eager(monkeypatch)
    args = tiny_config("--model.name", "qwen3_moe", *overrides).model_args()
    return args, *eager_and_compiled(args, ac)


def test_moe_blocks_compile_once_whatever_the_routing(monkeypatch):
    """A Qwen3-MoE's blocks compiled whole under full AC: steps whose experts receive other token
    counts reuse the first step's graphs, and so do padded batches whose routed tokens (a
    data-dependent count) differ; eager's logits, gradients and routing records -- one per forward,
    none from AC's recomputation."""
    args, eager, compiled = _eager_and_compiled_moe(monkeypatch, "full")
    for layer in moe_modules(eager) + moe_modules(compiled):
        layer.aux_loss_scale = 0.01  # the aux loss's gradient path, compiled too
    graphs = []
    for step in range(3):
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        logits = [model(tokens) for model in (compiled, eager)]
        for out in logits:
            out.square().mean().backward()
        graphs.append(graph_count())
        torch.testing.assert_close(*logits, rtol=1e-5, atol=1e-6)
    assert graphs[0] == graphs[-1] == 2  # the dense block's and one for the three MoE blocks
    counts = [[c.tolist() for c, _ in layer.routed] for layer in moe_modules(compiled)]
    assert all(len(c) == 3 and c[0] != c[1] != c[2] for c in counts)  # no record from a recomputation
    assert counts == [[c.tolist() for c, _ in layer.routed] for layer in moe_modules(eager)]
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)

    block, h = compiled.layers["1"], torch.randn(2, 16, args.dim, generator=torch.Generator().manual_seed(3))
    padded = []
    for owned_tokens in (16, 9, 4):  # of the second row's 16
        owned = torch.ones(2, 16, dtype=torch.bool)
        owned[1, owned_tokens:] = False
        with torch.no_grad():
            block(h, compiled.freqs_cis[:16], None, owned)
        padded.append(graph_count())
    assert padded[0] == padded[-1] == graphs[-1] + 1  # one graph for a mask, whatever it routes


def test_moe_blocks_compile_with_the_per_expert_loop(monkeypatch):
    """Where the grouped GEMM does not apply (a GPU before sm90, float32 on CUDA; forced here) the
    experts' loop compiles into the block: its counts read on the host become sizes of the graph,
    one graph for steps routing other counts, eager's logits."""
    args, eager, compiled = _eager_and_compiled_moe(monkeypatch, "none", "--model.n_layers", "2")
    for layer in moe_modules(compiled):
        layer.experts.use_grouped_mm = False
    for step in range(3):
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-5, atol=1e-6)
        assert graph_count() == 2  # the dense block's and the MoE block's


@pytest.mark.cuda
def test_compiled_moe_block_on_cuda_is_eagers():
    """A bf16 Qwen3-MoE on the GPU compiled by inductor (the grouped GEMM on sm90 and newer, the
    experts' loop before): one graph for three steps' routings, eager's logits and gradients within
    bf16's precision."""
    torch._dynamo.reset()
    counters.clear()
    args = tiny_config("--model.name", "qwen3_moe", "--model.n_layers", "2").model_args()
    eager, compiled = Transformer(args), Transformer(args)
    init_model(eager, 0)
    compiled.load_state_dict(eager.state_dict())
    eager, compiled = eager.cuda().bfloat16(), compiled.cuda().bfloat16()
    apply_compile(compiled)
    for step in range(3):
        tokens = torch.randint(0, args.vocab_size, (4, 64), generator=torch.Generator().manual_seed(step)).cuda()
        logits = [model(tokens) for model in (compiled, eager)]
        for out in logits:
            out.float().square().mean().backward()
        assert _relative_gap(*logits) < 3e-2
    assert graph_count() == 2  # the dense block's and the MoE block's
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert _relative_gap(p.grad, q.grad) < 5e-2, name


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _expert_parallel_worker(rank, world_size, trace_dir):
    """The tiny Qwen3-MoE with its experts over EP on ``world_size`` ranks, full AC, compiled as
    ``training.compile`` compiles it under EP (``aot_eager``): three steps on this rank's own tokens,
    recompiling refused after the first, the third profiled into ``trace_dir``. Returns each MoE
    layer's tokens per expert by step."""
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.parallel.expert_parallel import apply_expert_parallel

    compile_with = torch.compile
    torch.compile = lambda fn, **kw: compile_with(fn, backend="aot_eager", **kw)
    args = tiny_config("--model.name", "qwen3_moe").model_args()
    model = Transformer(args)
    init_model(model, 0)
    apply_expert_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)), None)
    apply_activation_checkpointing(model, "full", 1)
    apply_compile(model, fullgraph=False)
    for step in range(3):
        tokens = torch.randint(0, args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(10 * rank + step))
        with torch.profiler.profile() if step == 2 else contextlib.nullcontext() as profile:
            model(tokens).square().mean().backward()
        torch._dynamo.config.error_on_recompile = True  # the first step compiled all there is
    profile.export_chrome_trace(str(trace_dir / f"rank{rank}.json"))
    return [[c.tolist() for c, _ in layer.routed] for layer in moe_modules(model)]


def test_expert_parallel_moe_blocks_compile_once_whatever_the_routing(tmp_path):
    """Under EP the all-to-all (host-synced splits) runs between a block's graphs: the experts'
    graph takes any count of received rows, so steps routing other counts recompile nothing; every
    grouped GEMM runs compiled; one routing record a forward despite AC's recomputation."""
    for rank, counts in enumerate(run_distributed(_expert_parallel_worker, 2, tmp_path)):
        assert all(len(c) == 3 and c[0] != c[1] != c[2] for c in counts), rank
        inside, total = _grouped_mm_calls(tmp_path / f"rank{rank}.json")
        assert inside == total > 0, rank


@pytest.mark.slow
def test_compiled_moe_training_matches_eager_in_one_process_and_under_expert_parallel(tmp_path, moe_seed):
    """train.py on qwen3_moe with ``training.compile`` (inductor): one process, and dp_shard2 x ep2
    with full AC (the all-to-all between two graphs of each block), each within 1e-5 of the eager
    process's losses, with its balance statistics; the last step profiled: every grouped GEMM of
    it, forward and backward, ran inside a compiled graph."""
    torchrun(tmp_path / "eager", moe_seed, 1, *MOE, *ONE)
    reference, balance = losses(tmp_path / "eager"), _balance(tmp_path / "eager")
    # (ranks, options, grouped GEMMs a step: three MoE layers' three forward and six backward, and
    # under full AC three recomputed)
    layouts = {"one process": (1, [], 27), "dp_shard2 x ep2, full AC": (2, [*ep(2), *AC_FULL, *LOCAL_BATCH_4], 36)}
    for name, (nproc, layout, gemms) in layouts.items():
        run = tmp_path / name.replace(" ", "_").replace(",", "")
        torchrun(run, moe_seed, nproc, *MOE, *ONE, *layout, *COMPILE, "--profiling.steps", "6")
        inside, total = _grouped_mm_calls(run / "traces" / "step-6-rank0.json")
        assert inside == total == gemms, name
        for step, (a, b) in enumerate(zip(losses(run), reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"
        for step, (a, b) in enumerate(zip(_balance(run), balance), start=1):
            assert a == pytest.approx(b, rel=1e-5), f"{name} step {step}"
