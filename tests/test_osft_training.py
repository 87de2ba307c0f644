"""OSFT end to end: the distributed SVD, training under pp x FSDP2 from an HF directory, resume
without an SVD, and clipping that sees only projected gradients. Real gloo groups, real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seedckpt.cli.convert import convert
from seedckpt.finetune.osft import FROZEN, TRAINABLE, OSFTSettings, assign_by_cost, decompose
from seedckpt.finetune.pretrained import open_pretrained
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.dist import run_distributed
from tests.test_sft import _hf_llama, chat_inputs, losses, sft  # noqa: F401 (chat_inputs: a fixture)
from tests.test_train import model_state

SPEC = OSFTSettings(0.25)


def test_cost_balanced_assignment_beats_contiguous_blocks():
    costs = {"a": 10, "b": 9, "c": 8, "d": 1}
    assert assign_by_cost(costs, 2) == [["a", "d"], ["b", "c"]]  # loads 11 / 17; contiguous: 19 / 9
    assert assign_by_cost(costs, 1) == [["a", "b", "c", "d"]]
    assert assign_by_cost({"x": 1}, 3) == [["x"], [], []]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _hf_llama(tmp_path_factory.mktemp("osft") / "hf", 256, tie=False)


def _svd_worker(rank, world_size, hf, hsdp=False):
    """Build the whole model (pp=1) FSDP2-sharded over all ranks (HSDP: 2 replicas x 2 shards) with
    OSFT; count this rank's SVDs and return the full factors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import seedckpt.finetune.osft as osft
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages

    calls = []
    original = osft.decompose
    osft.decompose = lambda w, ratio: calls.append(w.shape) or original(w, ratio)
    args = open_model_checkpoint(hf).args
    mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def shard(module):
        for layer in module.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)

    group = None if mesh is None else mesh._flatten().get_group() if hsdp else mesh.get_group()
    [model] = build_stages(
        args,
        plan_rank_stages(args, 0, 1),
        "cpu",
        checkpoint=hf,
        osft=SPEC,
        shard_fn=shard if mesh else None,
        stage_group=group,
    )
    factors = {}
    for fqn, p in model.named_parameters():
        if fqn.rsplit(".", 1)[-1] in FROZEN + TRAINABLE:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            factors[fqn] = full.clone()
    return len(calls), factors


def test_distributed_svd_gives_the_same_factors_on_1_2_and_4_ranks_and_hsdp(hf_dir):
    reference = None
    for world, hsdp in ((1, False), (2, False), (4, False), (4, True)):
        results = run_distributed(_svd_worker, world, str(hf_dir), hsdp)
        counts = [count for count, _ in results]
        assert sum(counts) == 4 * 7, counts  # every target decomposed exactly once, somewhere
        assert min(counts) >= 1  # every rank works
        for _, factors in results:
            if reference is None:
                reference = factors
            assert factors.keys() == reference.keys()
            for fqn, value in factors.items():
                assert torch.equal(value, reference[fqn]), (world, fqn)
    reader = open_model_checkpoint(hf_dir)
    for fqn in ("layers.0.attention.wq", "layers.3.feed_forward.w2"):
        dense = reader.read_tensor(f"{fqn}.weight")
        f = {name: reference[f"{fqn}.{name}"] for name in FROZEN + TRAINABLE}
        rebuilt = (f["U_high"] * f["S_high"]) @ f["V_high"].T + (f["U_low"] * f["S_low"]) @ f["V_low"].T
        assert (rebuilt - dense).abs().max() <= 1e-5


PP2_DP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "4",
    "--parallelism.pipeline_parallel_microbatches",
    "2",
]
OSFT = ["--finetune.mode", "osft", "--finetune.osft_unfreeze_rank_ratio", "0.25", "--metrics.log_freq", "1"]


def _dense(state: dict, fqn: str) -> torch.Tensor:
    f = {name: state[f"{fqn}.{name}"] for name in FROZEN + TRAINABLE}
    return (f["U_high"] * f["S_high"]) @ f["V_high"].T + (f["U_low"] * f["S_low"]) @ f["V_low"].T


def test_osft_on_pp2_x_dp_shard2_from_hf_keeps_the_frozen_subspace(tmp_path, chat_inputs, hf_dir):
    tokenizer, chats, _ = chat_inputs
    run = sft(tmp_path / "run", hf_dir, tokenizer, chats, 4, *PP2_DP2, *OSFT, "--training.steps", "20")
    assert "osft from" in run.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert max(r["osft_leak"] for r in rows) <= 1e-5
    early = model_state(tmp_path / "run" / "ckpt" / "step-10")
    late = model_state(tmp_path / "run" / "ckpt" / "step-20")
    targets = sorted({k.rsplit(".", 1)[0] for k in late if k.endswith(".U_high")})
    assert len(targets) == 4 * 7
    reader = open_model_checkpoint(hf_dir)
    for fqn in targets:
        for name in FROZEN:  # frozen: bitwise untouched by 10 more steps of AdamW
            assert torch.equal(early[f"{fqn}.{name}"], late[f"{fqn}.{name}"]), (fqn, name)
        assert not torch.equal(early[f"{fqn}.U_low"], late[f"{fqn}.U_low"]), fqn
        # The frozen part is the pretrained matrix's top-k part (sign-free product, computed here).
        top = decompose(reader.read_tensor(f"{fqn}.weight"), SPEC.ratio)
        kept = (late[f"{fqn}.U_high"] * late[f"{fqn}.S_high"]) @ late[f"{fqn}.V_high"].T
        assert (kept - (top.U_high * top.S_high) @ top.V_high.T).abs().max() <= 1e-5, fqn
        delta = _dense(late, fqn) - _dense(early, fqn)
        scale = torch.linalg.norm(delta)
        assert scale > 0
        assert torch.linalg.norm(late[f"{fqn}.U_high"].T @ delta) / scale <= 1e-4, fqn
        assert torch.linalg.norm(delta @ late[f"{fqn}.V_high"]) / scale <= 1e-4, fqn
    _exports_compute_the_osft_model(tmp_path, tmp_path / "run" / "ckpt" / "step-20")


def _exports_compute_the_osft_model(tmp_path: Path, step: Path) -> None:
    """HF export (dense, loads in transformers), a dense DCP for the next task, and a factor-keeping
    DCP copy all compute the OSFT model's logits."""
    import transformers

    from seedckpt.cli.convert import diff
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages

    args = open_model_checkpoint(step).args
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    [osft_model] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=step, osft=SPEC)
    convert(step, tmp_path / "hf_export", "hf", progress=False)
    convert(step, tmp_path / "dense", "dcp", dense=True, progress=False)
    convert(step, tmp_path / "factors", "dcp", progress=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_export").eval()
    [dense] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=tmp_path / "dense")
    assert "layers.0.attention.wq.weight" in open_model_checkpoint(tmp_path / "dense").infos
    assert diff(step, tmp_path / "factors")[0]
    with torch.no_grad():
        reference = osft_model(tokens)
        assert (exported(tokens).logits - reference).abs().max() <= 1e-5
        assert (dense(tokens) - reference).abs().max() <= 1e-5


def _resume_build_worker(rank, world_size, step_dir):
    """Build pp=2 stages from an OSFT run's step checkpoint, counting SVDs."""
    import seedckpt.finetune.osft as osft
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages

    calls = []
    original = osft.decompose
    osft.decompose = lambda w, ratio: calls.append(1) or original(w, ratio)
    reader = open_model_checkpoint(step_dir)
    args = reader.args
    [stage] = build_stages(args, plan_rank_stages(args, rank, 2), "cpu", checkpoint=step_dir, osft=SPEC)
    saved = {k: reader.read_tensor(k) for k in stage.state_dict()}
    return len(calls), all(torch.equal(t, saved[k]) for k, t in stage.state_dict().items())


def test_resume_gives_identical_losses_and_runs_no_svd(tmp_path, chat_inputs, hf_dir):
    """pp=2 x dp_shard=2: the frozen factors are FSDP2 DTensors without optimizer state."""
    tokenizer, chats, _ = chat_inputs
    layout = [*PP2_DP2, *OSFT, "--training.steps", "6"]
    sft(tmp_path / "straight", hf_dir, tokenizer, chats, 4, *layout)
    first = sft(tmp_path / "resumed", hf_dir, tokenizer, chats, 4, *layout, "--training.stop_after_step", "3")
    assert "stopping after step 3" in first.stdout
    second = sft(tmp_path / "resumed", hf_dir, tokenizer, chats, 4, *layout)
    assert "resuming from" in second.stdout
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")  # bitwise, 6 steps
    step = tmp_path / "resumed" / "ckpt" / "step-3"
    for svds, loaded_as_saved in run_distributed(_resume_build_worker, 2, str(step)):
        assert svds == 0 and loaded_as_saved
    # Other settings on resume, a factor checkpoint as the next task's start, a cast of the factors:
    # each refused with the fix.
    changed = sft(
        tmp_path / "resumed",
        hf_dir,
        tokenizer,
        chats,
        4,
        *layout,
        "--finetune.osft_unfreeze_rank_ratio",
        "0.5",
        "--training.steps",
        "8",
        check=False,
    )
    # One line from rank 0 before any rendezvous (torchrun itself then exits 1).
    assert changed.returncode != 0 and "train.py: error:" in changed.stderr
    # other OSFT factors than the step holds: another job's step, not this one's to resume
    assert "of another job" in changed.stderr and "a checkpoint.folder of its own" in changed.stderr
    with pytest.raises(SeedckptError, match="--to dcp --dense"):
        open_pretrained(str(step))
    with pytest.raises(SeedckptError, match="casting them would break their orthonormality"):
        convert(step, tmp_path / "cast", "dcp", dtype="bfloat16", progress=False)
    assert not (tmp_path / "cast").exists()


def _clip_sees_projected_worker(rank, world_size, hf, tokenizer, chats, folder):
    """One OSFT step in process; at clipping time the U_low/V_low gradients must already be free of
    any component in span(U_high)/span(V_high)."""
    import seedckpt.train.trainer as train
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve
    from seedckpt.finetune.osft import OSFTLinear

    cfg = load_config(
        "configs/sft_debug.toml",
        [
            "--finetune.mode",
            "osft",
            "--finetune.pretrained",
            hf,
            "--data.tokenizer",
            tokenizer,
            "--data.path",
            chats,
            "--checkpoint.folder",
            folder,
            "--job.dump_folder",
            folder,
            "--training.steps",
            "1",
            "--training.seq_len",
            "64",
            "--training.global_batch_size",
            "8",
            "--training.local_batch_size",
            str(8 // world_size),
            "--parallelism.pipeline_parallel_degree",
            "1",
            "--checkpoint.interval",
            "0",
        ],
    )
    leaks = []
    original = train.clip_grad_norm_

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def clip(params, *args, **kwargs):
        for layer in (m for module in trainer.modules for m in module.modules() if isinstance(m, OSFTLinear)):
            for high, low in ((layer.U_high, layer.U_low), (layer.V_high, layer.V_low)):
                grad = full(low.grad)
                leaks.append((torch.linalg.norm(full(high).T @ grad) / torch.linalg.norm(grad)).item())
        return original(params, *args, **kwargs)

    train.clip_grad_norm_ = clip
    trainer = train.Trainer(resolve(cfg, world_size).with_start())
    trainer.run()
    return leaks


@pytest.mark.parametrize("world", [1, 2], ids=["one_rank", "fsdp2_two_shards"])
def test_clipping_sees_only_projected_gradients(tmp_path, chat_inputs, hf_dir, world):
    """Under FSDP2 the projection's sums run over sharded rows: checked on the full gradients."""
    tokenizer, chats, _ = chat_inputs
    for leaks in run_distributed(
        _clip_sees_projected_worker, world, str(hf_dir), str(tokenizer), str(chats), str(tmp_path / "run")
    ):
        assert len(leaks) == 2 * 4 * 7
        assert max(leaks) <= 1e-5
