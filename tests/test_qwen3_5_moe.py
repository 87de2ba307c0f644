"""Qwen3.5-MoE against ``transformers``' ``Qwen3_5MoeForCausalLM``: logits both ways on tiny configs
whose linear layers cross the rule's chunk (the experts, the router and the gated shared expert
included), the multimodal directory's decoder, the releases' fused experts, the auxiliary loss against
transformers', the released flavors' parameter counts, the init recipe, refusals, OSFT's targets, tp2
against one process, and pp2 x dp_shard2 x ep2 training."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.common.moe import moe_modules
from models.qwen3_5_moe import FLAVORS
from models.qwen3_5_moe.hf import args_from_config, config
from models.registry import get_family
from seedckpt import load_model
from seedckpt.checkpoint.load import RowWindow
from seedckpt.checkpoint.owned_reads import OwnedHFReader
from seedckpt.cli.convert import convert
from seedckpt.cli.main import main as cli
from seedckpt.materialize.init_recipe import init_model
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.test_convert import our_logits
from tests.test_deepseek_v3 import _close, assert_both_ways, hf_tensors
from tests.test_qwen3_5 import CASES as DENSE_CASES
from tests.test_qwen3_5 import TINY as DENSE_TINY
from tests.test_qwen3_5 import TOKENS, assert_the_multimodal_directory_reads_its_decoder
from tests.test_train import losses, torchrun

transformers = pytest.importorskip("transformers")

FAMILY = get_family("qwen3_5_moe")
# Qwen3.5's tiny layers (three linear, one full), each with 8 experts of 16, 3 a token, and a shared
# expert of 24 (the class keeps no intermediate_size)
TINY = {k: v for k, v in DENSE_TINY.items() if k != "intermediate_size"} | dict(
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24
)
CASES = {
    "released_pattern": {},
    # full attention first, whole heads turned, biases, tied; one expert a token, a wider shared expert
    "full_first_tied_one_expert": DENSE_CASES["full_first_tied_biases"]
    | dict(num_experts_per_tok=1, shared_expert_intermediate_size=40),
}


def hf_model(path, case: str = "released_pattern"):
    """A random ``Qwen3_5MoeForCausalLM`` saved at ``path``: every tensor random, norms away from their
    identity, the shared expert's gate large enough to matter."""
    torch.manual_seed(6)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TINY | CASES[case]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0, 0.3 if p.dim() == 1 or name.endswith("shared_expert_gate.weight") else 0.08)
    model.eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(tmp_path, case):
    """HF -> DCP -> our model, HF -> our pp=2 stages (a fine-tuning start's load), ``load_model``, and
    DCP -> HF that transformers loads: logits within 1e-5 of ``Qwen3_5MoeForCausalLM``'s each way on 94
    positions, the tensors written back bitwise. The shared expert's gate is computed, not dropped."""
    path = hf_model(tmp_path / "hf", case)
    hf, want = assert_both_ways(path, transformers.Qwen3_5MoeForCausalLM, TOKENS, tmp_path)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.shared_expert_gate.weight.zero_()
        assert (hf(TOKENS).logits - want).abs().max().item() > 1e-3


def test_the_multimodal_directory_reads_its_decoder_and_skips_the_vision_tower(tmp_path):
    """A ``qwen3_5_moe`` directory (``text_config``; the decoder under ``model.language_model.``, a
    vision tower and an MTP module beside it): the text logits within 1e-5, the skip named in one line."""
    assert_the_multimodal_directory_reads_its_decoder(hf_model(tmp_path / "hf"), "qwen3_5_moe", tmp_path)


def released_layout(path, tmp_path, extra: dict | None = None):
    """The transformers directory at ``path`` laid out as the releases are (Qwen3.5-35B-A3B's files):
    transformers' own state dict written by safetensors, so each layer's experts are its fused
    ``mlp.experts.gate_up_proj`` ``[E, 2 ffn, dim]`` and ``down_proj`` ``[E, dim, ffn]``, under the
    multimodal ``model.language_model.`` with a ``qwen3_5_moe`` config.json, and Qwen3.6's fused MTP
    experts beside them; plus ``extra``."""
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path)
    stored = {name.replace("model.", "model.language_model.", 1): t.contiguous() for name, t in hf.state_dict().items()}
    stored |= {"mtp.layers.0.mlp.experts.gate_up_proj": torch.ones(8, 32, 64), **(extra or {})}
    release = tmp_path / f"release{len(list(tmp_path.glob('release*')))}"
    release.mkdir()
    save_file(stored, release / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    return release


def test_the_releases_fused_experts_compute_transformers_logits(tmp_path):
    """A directory laid out as the releases are (fused experts, multimodal prefix, fused MTP experts):
    ``convert`` to DCP, our pp=2 stages straight from it (a fine-tuning start's load) and
    ``load_model`` all give transformers' logits within 1e-5, the MTP skipped in one line; exported
    back, it is written one tensor per expert, as transformers' ``save_pretrained`` writes it."""
    path = hf_model(tmp_path / "hf")
    release = released_layout(path, tmp_path)
    with torch.no_grad():
        want = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            convert(release, tmp_path / "dcp", "dcp", progress=False)
        assert [str(w.message) for w in caught if "multi-token" in str(w.message)][0].startswith("1 tensors")
        for source, pp in ((tmp_path / "dcp", 1), (release, 2)):
            assert (our_logits(source, TOKENS, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        assert (load_model(release)(TOKENS) - want).abs().max().item() <= 1e-5
        convert(release, tmp_path / "back", "hf", progress=False)
        back = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5
    assert hf_tensors(tmp_path / "back").keys() == load_file(path / "model.safetensors").keys()


def test_a_rank_reads_only_its_experts_rows_of_the_fused_tensors(tmp_path, monkeypatch):
    """Experts 4..8 of layer 1 into a rank's rows (an expert-parallel or FSDP shard): only those rows
    of ``gate_up_proj`` and ``down_proj`` are asked of the files, and they equal the whole read's."""
    release = released_layout(hf_model(tmp_path / "hf"), tmp_path)
    asked, read_data = [], OwnedHFReader.read_data
    monkeypatch.setattr(
        OwnedHFReader,
        "read_data",
        lambda self, plan, planner: (
            asked.extend((i.storage_index.fqn, i.storage_offsets[0], i.lengths[0]) for i in plan.items)
            or read_data(self, plan, planner)
        ),
    )
    opened = open_model_checkpoint(release)
    ours = {
        f"layers.1.moe.experts.{w}": torch.empty(4, *opened.infos[f"layers.1.moe.experts.{w}"].shape[1:])
        for w in ("w1", "w3", "w2")
    }
    opened.load({fqn: RowWindow(rows, 4) for fqn, rows in ours.items()})
    stored = "model.language_model.layers.1.mlp.experts."
    assert sorted(asked) == [(stored + "down_proj", 4, 4), (stored + "gate_up_proj", 4, 4)]
    assert all(torch.equal(rows, opened.read_tensor(fqn)[4:]) for fqn, rows in ours.items())


PER_EXPERT = "model.language_model.layers.0.mlp.experts.{e}.{p}_proj.weight"


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {PER_EXPERT.format(e=e, p=p): torch.ones(16, 64) for e in range(8) for p in ("gate", "up")},
            "stores layers.0.moe.experts.w1 twice, one slice (expert) per tensor",
        ),
        ({"model.language_model.layers.1.mlp.experts.gate_up_proj": torch.ones(8, 33, 64)}, "as [8, 33, 64]"),
        ({"model.language_model.layers.1.mlp.experts.gate_up_proj": torch.ones(32)}, "as [32], which is not"),
        ({"model.language_model.layers.1.mlp.experts.down_proj": torch.ones(9, 64, 16)}, "shape [9, 64, 16]"),
    ],
    ids=["both_layouts", "odd_gate_up", "flat_gate_up", "nine_experts"],
)
def test_fused_experts_in_two_layouts_or_lying_shapes_are_refused_in_one_line(tmp_path, capsys, extra, message):
    release = released_layout(hf_model(tmp_path / "hf"), tmp_path, extra)
    capsys.readouterr()  # transformers' progress bars
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli(["convert", str(release), str(tmp_path / "dcp"), "--to", "dcp", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "dcp").exists()


def test_each_rows_aux_loss_is_transformers_load_balancing_loss(tmp_path):
    """Per MoE layer, our auxiliary loss (summed over the rows) is transformers'
    ``load_balancing_loss_func`` on each row's router logits alone, summed: the same softmax scores and
    top-k counts (transformers pools whatever reaches it; ours is per row, whatever the layout)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    path = hf_model(tmp_path / "hf")
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path).eval()
    ours = load_model(path)
    with torch.no_grad():
        router_logits = hf(TOKENS, output_router_logits=True).router_logits
        ours(TOKENS)
    length = TOKENS.shape[1]
    for layer, logits in zip(moe_modules(ours), router_logits):
        rows = [load_balancing_loss_func((logits[r * length : (r + 1) * length],), 8, 3) for r in range(2)]
        assert layer.last_routed[1].item() == pytest.approx(sum(rows).item(), rel=1e-5)


@pytest.mark.parametrize("flavor", sorted(set(FLAVORS) - {"debug"}))
def test_flavors_have_transformers_parameter_counts(flavor):
    """Each released flavor's config.json, loaded by ``Qwen3_5MoeTextConfig``, builds a model with our
    parameter count, and reads back as the flavor."""
    cfg = config(FLAVORS[flavor], torch.bfloat16)
    with torch.device("meta"):
        theirs = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**cfg))
        ours = FAMILY.model(FLAVORS[flavor])
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert args_from_config(transformers.Qwen3_5MoeTextConfig(**cfg).to_dict()) == FLAVORS[flavor]


def test_the_seed_recipe_is_torchtitans():
    """torchtitan 0.3.0's qwen3_5 MoE recipe: the router at the layer's depth-scaled std, the experts'
    and the shared expert's ``w1`` at 0.02 and ``w2``/``w3`` depth-scaled, the shared expert's gate at
    0.02; Qwen3.5's linear layers as the dense family's (``A_log`` the log of U(0.01, 16))."""
    model = FAMILY.model(FLAVORS["debug"])
    recipe = init_model(model, seed=0)
    depth = 0.02 / 6**0.5  # layer 2
    stds = {name: recipe[f"layers.2.moe.{name}"].std for name in ("router.gate.weight", "experts.w1", "experts.w2")}
    assert stds == pytest.approx({"router.gate.weight": depth, "experts.w1": 0.02, "experts.w2": depth})
    shared = {name: recipe[f"layers.2.moe.shared_experts.{name}.weight"].std for name in ("w1", "w3", "gate")}
    assert shared == pytest.approx({"w1": 0.02, "w3": depth, "gate": 0.02})
    assert (recipe["layers.0.attention.A_log"].kind, recipe["layers.0.attention.A_log"].high) == ("log_uniform", 16.0)
    assert model.layers["2"].moe.shared_experts.gate.weight.std() > 0.01


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_experts_per_tok", 9, "num_experts_per_tok = 9; it must be at most num_experts = 8"),
        ("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size = 0"),
        ("moe_intermediate_size", None, "moe_intermediate_size = null, which transformers' Qwen3_5MoeTextConfig"),
        ("router_aux_loss_coef", -1.0, "router_aux_loss_coef = -1.0"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("layer_types", ["full_attention"], "one kind per layer"),
        ("linear_num_value_heads", 3, "must be a multiple of linear_num_key_heads = 2"),
    ],
)
def test_config_fields_not_computed_are_refused_in_one_line(field, value, message):
    with pytest.raises(ValueError, match=message) as refused:
        args_from_config({"model_type": "qwen3_5_moe_text", **TINY, field: value})
    assert "\n" not in str(refused.value)


def test_fields_the_class_reads_past_are_read_past():
    """``Qwen3_5MoeTextConfig`` keeps no ``intermediate_size``, ``norm_topk_prob`` or
    ``mlp_only_layers`` (every layer routes, renormalized): a file's change nothing; ours cannot be
    set otherwise."""
    plain = args_from_config({"model_type": "qwen3_5_moe_text", **TINY})
    odd = dict(intermediate_size=7, norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=2)
    assert args_from_config({"model_type": "qwen3_5_moe_text", **TINY, **odd}) == plain
    assert (plain.ffn_dim, plain.moe_layers) == (24, (0, 1, 2, 3))
    for field, value in (("norm_topk_prob", False), ("mlp_only_layers", [1])):
        with pytest.raises(ValueError, match=f"leave .*{field.split('_')[0]}"):
            FAMILY.args(**{**plain.to_dict(), field: value})


def test_osft_default_targets_are_attention_of_both_kinds_and_the_shared_expert():
    """OSFT's defaults select every attention projection of both layer kinds and the shared expert's
    three matrices in every layer; nothing of the router or the routed experts."""
    from seedckpt.finetune.osft import pattern_matches

    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = FAMILY.model(args)
    matches = pattern_matches(model, FAMILY.osft_targets)
    assert all(matches[target] for target in FAMILY.osft_targets), matches
    assert len(matches["moe.shared_experts.w2"]) == args.n_layers
    assert len(matches["attention.in_proj_qkv"]) == args.n_layers - len(args.full_attention_layers)
    assert not [name for names in matches.values() for name in names if "router" in name or "experts." in name[:-3]]


def _moe_gradients(rank, world_size):
    """The debug model on one process and on tp2 (Qwen3.5's plan; the shared expert split, its gate
    replicated; sequence and loss parallel): per layout, the loss and every gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from seedckpt.train.trainer import token_cross_entropy

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tokens = torch.arange(160).reshape(2, 80) * 7 % 512  # 80 positions: the linear layers past a chunk
    layouts = {}
    for name, plan in (("one", None), ("tp2", FAMILY.tensor_parallel.apply)):
        model = FAMILY.model(FLAVORS["debug"])
        if plan is not None:
            plan(model, mesh, True)
        init_model(model, seed=0)
        with contextlib.nullcontext() if plan is None else loss_parallel():
            loss = token_cross_entropy(model(tokens), torch.roll(tokens, -1, 1))
            loss.backward()
        layouts[name] = full(loss).item(), {n: full(p.grad) for n, p in model.named_parameters()}
    return layouts


def test_tensor_parallel_computes_one_process_loss_and_gradients():
    """tp2 of the debug model: the loss and every gradient -- the mixtures of experts' (router, experts,
    the shared expert split and its gate replicated), the linear layers' ``A_log`` and ``dt_bias`` too
    -- within 1e-5 of its size from one process's. Measured: 9.4e-7 at most (``A_log``); 4.2e-5 when the
    chunked rule's decays were differences of cumulative sums (``segment_sums``)."""
    layouts = run_distributed(_moe_gradients, 2)[0]
    (loss, want), (loss_tp, got) = layouts["one"], layouts["tp2"]
    assert (
        abs(loss_tp - loss) <= 1e-5 * loss and sorted(got) == sorted(want) and sum(".moe." in n for n in want) == 4 * 8
    )
    assert all((got[n] - want[n]).abs().max() <= 1e-5 * want[n].abs().max() for n in want)


M = ["--model.name", "qwen3_5_moe"]
STEPS = ["--training.steps", "3", "--training.seq_len", "80"]


@pytest.mark.slow
def test_the_seed_trains_on_pp2_x_dp_shard2_x_ep2_with_one_process_losses(tmp_path):
    """The debug Qwen3.5-MoE from its seed, on 80-token rows (its linear layers past their chunk):
    pp2 x dp_shard2 x ep2 (4 experts a rank) trains with one process's losses within 1e-5."""
    seed = create_seed_checkpoint(tiny_config(*M), tmp_path / "seed", seed=0, progress=False, workers=1)
    torchrun(tmp_path / "one", seed, 1, *M, "--parallelism.pipeline_parallel_degree", "1", *STEPS)
    layout = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4", *STEPS]
    with warnings.catch_warnings():
        torchrun(tmp_path / "pp2_dp2_ep2", seed, 4, *M, *layout)
    _close(losses(tmp_path / "pp2_dp2_ep2"), losses(tmp_path / "one"), "pp2 x dp_shard2 x ep2")
