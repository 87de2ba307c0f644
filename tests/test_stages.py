"""Layer-to-stage assignment and stages built from a seed: equal to the full model, bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from models.common.decoder import Transformer
from seedckpt.checkpoint.owned_reads import OwnedFileSystemReader
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import explicit_split, plan_rank_stages, stage_ids_for_rank
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config


def test_explicit_split_points():
    assert explicit_split(6, 3, ["layers.1", "layers.5"]) == [(0,), (1, 2, 3, 4), (5,)]
    assert explicit_split(6, 2, [4]) == [(0, 1, 2, 3), (4, 5)]


@pytest.mark.parametrize(
    "n_layers,stages,points,match",
    [
        (4, 5, (), "cannot split 4 layers into 5"),
        (6, 3, ["layers.2"], "give exactly 2 split points"),
        (6, 3, ["layers.4", "layers.2"], "strictly increasing"),
        (6, 2, ["layers.0"], "strictly increasing"),
        (6, 2, ["blocks.3"], "must look like 'layers.N'"),
    ],
)
def test_bad_splits_name_the_fix(n_layers, stages, points, match):
    with pytest.raises(SeedckptError, match=match):
        explicit_split(n_layers, stages, points)


def test_stage_placement_loop_and_v():
    assert [stage_ids_for_rank(r, 2, 2, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank(r, 2, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]
    with pytest.raises(SeedckptError, match="stages_per_rank = 2"):
        stage_ids_for_rank(0, 2, 1, "ZBVZeroBubble")


LAYOUTS = {
    # name: (n_layers, pp, stages_per_rank, schedule, split_points)
    "pp1": (6, 1, 1, "1F1B", ()),
    "pp2": (6, 2, 1, "1F1B", ()),
    "pp3": (6, 3, 1, "1F1B", ()),
    "pp4": (6, 4, 1, "1F1B", ()),
    "pp2_uneven_5_layers": (5, 2, 1, "1F1B", ()),
    "pp3_uneven_7_layers": (7, 3, 1, "1F1B", ()),
    "pp3_explicit_split": (6, 3, 1, "1F1B", ("layers.1", "layers.5")),
    "pp2_interleaved_2_per_rank": (6, 2, 2, "Interleaved1F1B", ()),
    "pp2_v_2_per_rank": (6, 2, 2, "ZBVZeroBubble", ()),
}


# Tied embeddings (Llama-3.2 1B/3B): the seed stores the matrix once; a last stage's output copy
# loads it from the embedding, and a V schedule holds both copies on one rank.
TIED_LAYOUTS = ("pp1", "pp2", "pp2_v_2_per_rank")


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """One seed per (layer count, tied) used below."""
    out = {}
    needed = {(LAYOUTS[name][0], False) for name in LAYOUTS} | {(LAYOUTS[name][0], True) for name in TIED_LAYOUTS}
    for n_layers, tied in sorted(needed):
        cfg = tiny_config("--model.n_layers", str(n_layers), "--model.tie_word_embeddings", str(tied).lower())
        out[n_layers, tied] = (
            cfg.model_args(),
            create_seed_checkpoint(
                cfg, tmp_path_factory.mktemp("seed") / f"l{n_layers}{'t' * tied}", seed=7, progress=False
            ),
        )
    return out


@pytest.mark.parametrize("layout, tied", [(name, False) for name in LAYOUTS] + [(name, True) for name in TIED_LAYOUTS])
def test_stages_equal_slices_of_full_model_and_chain_to_its_logits(layout, tied, seeds):
    n_layers, pp, per_rank, schedule, points = LAYOUTS[layout]
    args, seed_path = seeds[n_layers, tied]
    [full] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=seed_path)
    full_state = full.state_dict()
    stages = {}
    for rank in range(pp):
        specs = plan_rank_stages(args, rank, pp, per_rank, schedule, points)
        for spec, module in zip(specs, build_stages(args, specs, "cpu", checkpoint=seed_path)):
            stages[spec.stage_id] = (spec, module)
    assert sorted(stages) == list(range(pp * per_rank))
    owned = []
    for spec, module in stages.values():
        state = module.state_dict()
        owned += state
        assert sorted(module.layers.keys(), key=int) == [str(i) for i in spec.layers]
        for fqn, t in state.items():
            assert torch.equal(t, full_state[fqn]), fqn
        assert torch.equal(module.freqs_cis, full.freqs_cis)
    assert sorted(owned) == sorted(full_state)  # every tensor owned by exactly one stage
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for stage_id in range(pp * per_rank):
        h = stages[stage_id][1](h)
    assert torch.equal(h, full(tokens))


def test_each_stage_reads_only_its_own_tensors(seeds, monkeypatch):
    args, seed_path = seeds[6, False]
    read = []
    original = OwnedFileSystemReader.read_data

    def recording(self, plan, planner):
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(OwnedFileSystemReader, "read_data", recording)
    [stage] = build_stages(args, plan_rank_stages(args, 1, 2), "cpu", checkpoint=seed_path)
    assert sorted(read) == sorted(stage.state_dict())
    assert all(fqn.startswith(("layers.3.", "layers.4.", "layers.5.", "norm.", "output.")) for fqn in read)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rank", [0, 2])
def test_direct_init_equals_seed_loaded_stage(seeds, tied, rank):
    args, seed_path = seeds[6, tied]
    specs = plan_rank_stages(args, rank, 3)
    [loaded] = build_stages(args, specs, "cpu", checkpoint=seed_path)
    [direct] = build_stages(args, specs, "cpu", seed=7)
    for fqn, t in loaded.state_dict().items():
        assert torch.equal(t, direct.state_dict()[fqn]), fqn


def test_tied_seed_stores_the_matrix_once_with_the_output_recipe(seeds):
    args, seed_path = seeds[6, True]
    manifest = json.loads((seed_path / "seedckpt.json").read_text())
    assert "output.weight" not in manifest["tensors"]
    assert manifest["num_params"] == sum(t.numel() for t in Transformer(args).parameters())
    [last] = build_stages(args, plan_rank_stages(args, 1, 2), "cpu", checkpoint=seed_path)
    weight = last.output.weight.detach()
    # The output's recipe: std dim^-0.5, truncated at 3 std (an untied embedding would have std 1).
    assert weight.abs().max() <= 3 * args.dim**-0.5
    assert abs(weight.std().item() / args.dim**-0.5 - 0.986) < 0.03  # std of N(0,1) cut at +-3 is 0.986
