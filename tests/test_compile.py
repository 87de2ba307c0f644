"""``training.compile``: one compiled graph shared by every block, the same losses as eager under
pipeline x FSDP2 (and AC, manual FSDP), unchanged checkpoint keys, and resumes across the two."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from models.common.decoder import Transformer
from seedckpt.finetune.osft import convert_to_osft, decompose
from seedckpt.materialize.init_recipe import init_model
from seedckpt.parallel.parallelize import apply_activation_checkpointing, apply_compile, check_compile_supported
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
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
    eager, compiled = Transformer(args), Transformer(args)
    init_model(eager, 0)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    tokens = torch.randint(0, args.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-5, atol=1e-5)
        assert counters["stats"]["unique_graphs"] == 1


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
