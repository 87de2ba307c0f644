"""Nothing uninitialized survives: every tensor of a stage is loaded, recomputed, or the run stops."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from seedckpt.checkpoint import DcpCheckpoint, make_manifest, write_checkpoint
from seedckpt.materialize import stages as stages_module
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config

ARGS = tiny_config().model_args()
FULL = plan_rank_stages(ARGS, 0, 1)


def _seed_state(seed_path) -> dict[str, torch.Tensor]:
    reader = DcpCheckpoint(seed_path)
    state = {fqn: torch.zeros(info.shape, dtype=info.dtype) for fqn, info in reader.tensors().items()}
    reader.load(state)
    return state


def _write_variant(path, state):
    return write_checkpoint(path, state, make_manifest("seed", "llama3", "debug", ARGS.to_dict()))


def test_missing_tensor_is_named(debug_seed, tmp_path):
    state = _seed_state(debug_seed)
    del state["layers.2.feed_forward.w3.weight"]
    bad = _write_variant(tmp_path / "missing", state)
    with pytest.raises(SeedckptError, match=r"layers\.2\.feed_forward\.w3\.weight: missing from checkpoint"):
        build_stages(ARGS, FULL, "cpu", checkpoint=bad)


def test_a_stage_names_only_its_own_tensors(debug_seed, tmp_path):
    state = _seed_state(debug_seed)
    del state["layers.4.attention.wq.weight"]  # the last of two stages owns layers 3-5
    bad = _write_variant(tmp_path / "missing", state)
    with pytest.raises(SeedckptError) as failure:
        build_stages(ARGS, plan_rank_stages(ARGS, 1, 2), "cpu", checkpoint=bad)
    message = str(failure.value)
    # The first stage's tensors (layers 0-2, the embedding) are not "tensors this model does not use".
    assert message.endswith("does not cover the model: layers.4.attention.wq.weight: missing from checkpoint"), message


def test_wrong_shape_is_named(debug_seed, tmp_path):
    state = _seed_state(debug_seed)
    state["layers.1.attention.wk.weight"] = torch.zeros(32, ARGS.dim)
    bad = _write_variant(tmp_path / "shape", state)
    with pytest.raises(SeedckptError, match=r"layers\.1\.attention\.wk\.weight: shape \[32, 128\]"):
        build_stages(ARGS, FULL, "cpu", checkpoint=bad)


def test_lossy_dtype_is_named_not_silently_cast(debug_seed, tmp_path):
    state = _seed_state(debug_seed)
    state["norm.weight"] = state["norm.weight"].to(torch.float64)
    bad = _write_variant(tmp_path / "dtype", state)
    with pytest.raises(SeedckptError, match=r"norm\.weight: dtype float64 in checkpoint, float32 in model"):
        build_stages(ARGS, FULL, "cpu", checkpoint=bad)


def test_bfloat16_seed_loads_exactly_into_fp32_parameters(tmp_path):
    from seedckpt.materialize.seed import create_seed_checkpoint

    bf16 = create_seed_checkpoint(tiny_config(), tmp_path / "bf16", seed=0, dtype="bfloat16", progress=False)
    [stage] = build_stages(ARGS, FULL, "cpu", checkpoint=bf16)
    [direct] = build_stages(ARGS, FULL, "cpu", seed=0)
    for fqn, t in stage.state_dict().items():
        assert t.dtype == torch.float32
        assert torch.equal(t, direct.state_dict()[fqn].to(torch.bfloat16).float()), fqn


def test_entries_of_other_stages_are_fine(debug_seed, tmp_path):
    state = _seed_state(debug_seed)
    del state["tok_embeddings.weight"]  # only the first stage needs it
    partial = _write_variant(tmp_path / "no_embed", state)
    [last] = build_stages(ARGS, plan_rank_stages(ARGS, 1, 2), "cpu", checkpoint=partial)
    assert torch.equal(last.output.weight, state["output.weight"])


def test_uncomputed_buffer_is_named(debug_seed):
    def add_buffer_nobody_recomputes(module):
        module.layers["0"].register_buffer("scale", torch.empty(4, device="meta"), persistent=False)

    with pytest.raises(SeedckptError, match=r"not recomputed after to_empty: \['layers\.0\.scale'\]"):
        build_stages(ARGS, FULL, "cpu", checkpoint=debug_seed, shard_fn=add_buffer_nobody_recomputes)


def test_to_empty_garbage_is_never_kept(debug_seed, monkeypatch):
    # Simulate a loader that silently skips a tensor: the NaN poison must be caught.
    original = DcpCheckpoint.load

    def skipping_load(self, state_dict):
        original(self, {k: v for k, v in state_dict.items() if k != "layers.4.ffn_norm.weight"})

    monkeypatch.setattr(DcpCheckpoint, "load", skipping_load)
    with pytest.raises(SeedckptError, match=r"uninitialized.*\['layers\.4\.ffn_norm\.weight'\]"):
        build_stages(ARGS, FULL, "cpu", checkpoint=debug_seed)


def test_a_load_that_writes_nothing_lists_every_tensor(debug_seed, monkeypatch):
    monkeypatch.setattr(DcpCheckpoint, "load", lambda self, state_dict: None)
    with pytest.raises(SeedckptError, match="uninitialized") as err:
        build_stages(ARGS, FULL, "cpu", checkpoint=debug_seed)
    for fqn in ("tok_embeddings.weight", "layers.5.attention.wq.weight", "output.weight"):
        assert fqn in str(err.value)


def test_config_mismatch_fails_before_allocation(debug_seed, monkeypatch):
    def no_allocation(*_):
        raise AssertionError("a stage was built before the manifest check")

    monkeypatch.setattr(stages_module, "build_stage_model", no_allocation)
    args = tiny_config("--model.n_layers", "8", "--model.vocab_size", "1024").model_args()
    with pytest.raises(
        SeedckptError,
        match=r"n_layers: checkpoint 6, config 8; vocab_size: checkpoint 512, "
        r"config 1024.*flavor='debug'",
    ):
        build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=debug_seed)


def test_interrupted_or_foreign_directories_are_refused(tmp_path, debug_seed):
    partial = tmp_path / ".seed.partial"
    partial.mkdir()
    with pytest.raises(SeedckptError, match="interrupted write"):
        DcpCheckpoint(partial)
    no_metadata = tmp_path / "half"
    no_metadata.mkdir()
    (no_metadata / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(SeedckptError, match=r"no \.metadata"):
        DcpCheckpoint(no_metadata)
    with pytest.raises(SeedckptError, match="no checkpoint directory"):
        DcpCheckpoint(tmp_path / "absent")


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EXPLOIT_MARKER']}",))


def _dotted_name_exploit(marker) -> bytes:
    """A pickle that names ``os.system`` through an allowed module (pickle follows dotted names)."""
    payload = pickle.dumps(_Exploit(), protocol=4)
    return payload.replace(
        b"\x8c\x05posix\x94\x8c\x06system", b"\x8c\x25torch.distributed.checkpoint.metadata\x94\x8c\x09os.system"
    )


@pytest.mark.parametrize("dotted", [False, True])
def test_crafted_metadata_pickle_is_not_executed(tmp_path, monkeypatch, dotted):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    payload = _dotted_name_exploit(marker) if dotted else pickle.dumps(_Exploit())
    if dotted:
        assert b"os.system" in payload
        pickle.loads(payload)  # the payload really runs under a plain unpickler
        assert marker.exists()
        marker.unlink()
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(payload)
    with pytest.raises(SeedckptError, match="not allowed in DCP metadata"):
        DcpCheckpoint(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_weight_that_is_not_finite_stops_the_start_naming_it(debug_seed, tmp_path, value):
    """NaN, +Inf or -Inf in a seed (or any checkpoint loaded this way) is one error naming the tensor."""
    state = _seed_state(debug_seed)
    state["layers.3.feed_forward.w2.weight"][5, 7] = value
    bad = _write_variant(tmp_path / "bad", state)
    with pytest.raises(SeedckptError, match=r"not finite.*\['layers\.3\.feed_forward\.w2\.weight'\]"):
        build_stages(ARGS, FULL, "cpu", checkpoint=bad)
