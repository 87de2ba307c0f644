"""OSFT core: the rank rule, the sign-fixed SVD split, the factorized layer, exact projection."""

from __future__ import annotations

import pytest
import torch

from models.llama3 import LLAMA3
from seedckpt.finetune.osft import (
    FROZEN,
    TRAINABLE,
    OSFTLinear,
    OSFTProjector,
    convert_to_osft,
    decompose,
    frozen_rank,
    target_fqns,
)
from seedckpt.materialize.init_recipe import init_model
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config


def test_rank_rule_is_mini_trainers_rounding():
    assert frozen_rank(128, 352, 0.25) == 96  # floor(128 * 0.75)
    assert frozen_rank(352, 128, 0.3) == 89  # floor(128 * 0.7) = 89.6 -> 89
    assert frozen_rank(64, 64, 0.001) == 63  # at most r - 1: one direction always trains
    assert frozen_rank(64, 64, 1.0) == 0
    with pytest.raises(SeedckptError, match=r"in \(0, 1\]"):
        frozen_rank(64, 64, 0.0)


def test_split_reconstructs_the_matrix_with_orthonormal_factors_and_fixed_signs():
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(0))
    f = decompose(w, 0.25)
    assert f.U_high.shape == (96, 72) and f.V_high.shape == (160, 72) and f.U_low.shape == (96, 24)
    dense = (f.U_high * f.S_high) @ f.V_high.T + (f.U_low * f.S_low) @ f.V_low.T
    assert (dense - w).abs().max() <= 1e-5
    u = torch.cat([f.U_high, f.U_low], 1)
    v = torch.cat([f.V_high, f.V_low], 1)
    eye = torch.eye(96)
    assert (u.T @ u - eye).abs().max() <= 1e-5 and (v.T @ v - eye).abs().max() <= 1e-5
    columns = torch.arange(96)
    assert (u[u.abs().argmax(0), columns] > 0).all()  # the sign convention
    g = decompose(-w, 0.25)  # same subspaces, signs fixed the same way: U equal, V negated
    assert torch.allclose(g.U_high, f.U_high, atol=1e-5) and torch.allclose(g.V_high, -f.V_high, atol=1e-5)


def _dense_and_osft(ratio: float = 0.25, seed: int = 0, device: str = "cpu"):
    """The dense model and its OSFT twin (the split computed on the CPU), the twin on ``device``."""
    args = tiny_config("--model.n_layers", "2").model_args()
    from models.common.decoder import Transformer

    dense = Transformer(args)
    init_model(dense, seed)
    osft = Transformer(args)
    osft.load_state_dict(dense.state_dict())
    targets = convert_to_osft(osft, [], ratio)
    for fqn in targets:
        osft.get_submodule(fqn).load_factors(decompose(dense.get_submodule(fqn).weight, ratio))
    return args, dense, osft.to(device), targets


def test_targets_are_inside_the_blocks_and_bad_patterns_are_named():
    args, dense, _, _ = _dense_and_osft()
    assert target_fqns(dense, [".*"]) == target_fqns(dense, [])  # never the output projection
    assert "output" not in target_fqns(dense, ["output", r"layers\.1\..*"])
    with pytest.raises(SeedckptError, match="not a valid regular expression"):
        target_fqns(dense, ["attention.w[q"])


def test_every_target_pattern_must_match_and_the_start_log_lists_the_targets(debug_seed):
    from seedckpt.config.resolve import resolve

    def run(*patterns):
        cfg = tiny_config(
            "--finetune.mode",
            "osft",
            "--finetune.pretrained",
            str(debug_seed),
            "--finetune.osft_target_patterns",
            ",".join(patterns),
        )  # the command line's list
        return resolve(cfg, 1)

    with pytest.raises(SeedckptError, match=r"osft_target_patterns: 'nomatch' matches no linear layer"):
        run("attention.wq", "nomatch")
    with pytest.raises(SeedckptError, match=r"'output', 'w9' match no linear layer .* fix or remove them"):
        run("output", "w9", r"layers\.1\..*")  # the output projection is never a target
    notes = run("attention.wq", r"layers\.1\.feed_forward\.w2").notes
    args = tiny_config().model_args()
    k = frozen_rank(args.dim, args.dim, 0.25)
    assert notes[1].startswith(
        f"osft: {args.n_layers + 1} target linears (m x n, frozen rank k at unfreeze ratio 0.25): "
    ), notes
    assert f"attention.wq {args.dim}x{args.dim} k={k} in {args.n_layers} blocks, feed_forward.w2 {args.dim}x" in notes[
        1
    ] and notes[1].endswith(" in 1 block"), notes


def test_the_default_targets_of_a_model_without_dense_feed_forwards_are_its_attention(tmp_path):
    """Every Mixtral layer is a mixture of experts: the family's default targets name dense
    feed-forwards too, which this model lacks; the defaults it has are the targets (before, the
    run was refused as if the user had mistyped them)."""
    from seedckpt.config.resolve import resolve
    from seedckpt.materialize.seed import create_seed_checkpoint

    seed = create_seed_checkpoint(tiny_config("--model.name", "mixtral"), tmp_path / "seed", 0, progress=False)
    cfg = tiny_config("--model.name", "mixtral", "--finetune.mode", "osft", "--finetune.pretrained", str(seed))
    [line] = [note for note in resolve(cfg, 1).notes if note.startswith("osft:")]
    assert "attention.wq" in line and "attention.wo" in line and "feed_forward" not in line, line


def test_default_targets_are_the_attention_and_ffn_projections():
    args, dense, osft, targets = _dense_and_osft()
    assert len(targets) == 2 * len(LLAMA3.osft_targets)
    assert all(isinstance(osft.get_submodule(t), OSFTLinear) for t in targets)
    assert target_fqns(dense, ["attention.wq"]) == ["layers.0.attention.wq", "layers.1.attention.wq"]
    names = {n for n, _ in osft.named_parameters()}
    assert "layers.0.attention.wq.U_high" in names and "layers.0.attention.wq.weight" not in names
    assert not osft.get_submodule("layers.0.attention.wq").U_high.requires_grad


def test_osft_model_computes_the_dense_model():
    args, dense, osft, _ = _dense_and_osft()
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (osft(tokens) - dense(tokens)).abs().max() <= 1e-4
        for fqn in ("layers.0.feed_forward.w2", "layers.1.attention.wk"):
            w = dense.get_submodule(fqn).weight
            assert (osft.get_submodule(fqn).dense_weight() - w).abs().max() <= 1e-5


def _train(osft, args, steps: int, project: bool):
    projector = OSFTProjector([osft])
    optimizer = torch.optim.AdamW([p for p in osft.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, args.vocab_size, (4, 33), generator=g).to(next(osft.parameters()).device)
    losses = []
    for _ in range(steps):
        logits = osft(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        if project:
            projector.project_gradients()
        torch.nn.utils.clip_grad_norm_(osft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if project:
            projector.project_parameters()
        losses.append(loss.item())
    return losses, projector


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fifty_steps_stay_in_the_orthogonal_complement(device):
    args, _, osft, targets = _dense_and_osft(device=device)
    before = {t: osft.get_submodule(t).dense_weight().detach().clone() for t in targets}
    frozen = {n: p.detach().clone() for n, p in osft.named_parameters() if not p.requires_grad}
    losses, projector = _train(osft, args, 50, project=True)
    assert losses[-1] < 0.8 * losses[0]
    for name, value in frozen.items():
        assert torch.equal(dict(osft.named_parameters())[name], value), name
    assert projector.worst_leak() <= 1e-5
    for fqn in targets:
        layer = osft.get_submodule(fqn)
        delta = layer.dense_weight().detach() - before[fqn]
        scale = torch.linalg.norm(delta)
        assert scale > 0
        assert torch.linalg.norm(layer.U_high.T @ delta) / scale <= 1e-4, fqn
        assert torch.linalg.norm(delta @ layer.V_high) / scale <= 1e-4, fqn


def test_without_projection_adamw_leaks_into_the_frozen_subspace():
    """The reason for projecting the parameters after every step (Mini Trainer issue #90)."""
    args, _, osft, _ = _dense_and_osft()
    _, projector = _train(osft, args, 5, project=False)
    assert projector.worst_leak() > 1e-3


def test_a_flavor_reshaped_by_model_keys_may_describe_the_pretrained_checkpoint():
    """``--model.flavor debug --model.n_layers 2`` describes a 2-layer debug checkpoint; a key that
    still disagrees is named."""
    from seedckpt.config.job_config import load_config
    from seedckpt.finetune.pretrained import with_model_keys

    args = load_config(None, ["--model.n_layers", "2"]).model_args()
    with_model_keys(load_config(None, ["--model.flavor", "debug", "--model.n_layers", "2"]), args, "ckpt")
    with pytest.raises(SeedckptError, match=r"model.n_layers = 3 \(the checkpoint: 2\)"):
        with_model_keys(load_config(None, ["--model.flavor", "debug", "--model.n_layers", "3"]), args, "ckpt")


@pytest.mark.cuda
def test_factors_computed_on_cuda_agree_with_the_cpus():
    """OSFT's SVDs run on the training device. With well-separated singular values (so each singular
    vector is well defined) the CUDA factors, signs fixed by the same convention, agree with the
    CPU's within 1e-4 relative and rebuild W within 1e-5 relative."""
    g = torch.Generator().manual_seed(3)
    q1, _ = torch.linalg.qr(torch.randn(192, 192, generator=g))
    q2, _ = torch.linalg.qr(torch.randn(320, 192, generator=g))
    w = (q1 * torch.linspace(10.0, 1.0, 192)) @ q2.T
    cpu, gpu = decompose(w, 0.25), decompose(w.cuda(), 0.25)
    for name in FROZEN + TRAINABLE:
        a, b = getattr(cpu, name), getattr(gpu, name).cpu()
        assert getattr(gpu, name).is_cuda and (a - b).abs().max() <= 1e-4 * a.abs().max(), name
    dense = (gpu.U_high * gpu.S_high) @ gpu.V_high.T + (gpu.U_low * gpu.S_low) @ gpu.V_low.T
    assert (dense.cpu() - w).abs().max() <= 1e-5 * w.abs().max()


def test_the_cuda_svd_check_accepts_an_exact_svd_and_refuses_a_wrong_one():
    """The check that sends a CUDA ``gesvda`` result to ``gesvd``: an SVD to fp32 precision passes; a
    singular value off by 0.1 %, a column that is not orthonormal, or a NaN fails."""
    from seedckpt.finetune.osft import CUDA_SVD_RTOL, _svd_error

    w = torch.randn(512, 128, generator=torch.Generator().manual_seed(0))
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    assert _svd_error(w, u, s, vh) <= CUDA_SVD_RTOL
    assert _svd_error(w, u, s * 1.001, vh) > CUDA_SVD_RTOL
    skewed = u.clone()
    skewed[:, 0] += 1e-3 * u[:, 1]
    assert _svd_error(w, skewed, s, vh) > CUDA_SVD_RTOL
    assert _svd_error(w, u, s.index_fill(0, torch.tensor([3]), float("nan")), vh) == float("inf")
