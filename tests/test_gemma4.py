"""Gemma 4 against ``transformers``' ``Gemma4ForCausalLM`` and ``Gemma4ForConditionalGeneration``:
HF directories both ways (per-layer inputs, kv-shared layers, values as keys, the experts beside the
MLP), the multimodal layout, packed rows, the pipeline split the shared keys allow, released
parameter counts, the init recipe, refusals, training layouts against one process, and compiled blocks
against eager."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.gemma4 import FLAVORS, GEMMA4
from models.gemma4.model import Gemma4Transformer, RMSNorm, unscaled_norm
from seedckpt import load_model
from seedckpt.cli.convert import convert
from seedckpt.materialize.init_recipe import init_model
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import pipeline_split, plan_rank_stages
from seedckpt.utils.errors import SeedckptError
from tests.test_convert import our_logits
from tests.test_gemma3 import packed_rows_gap
from tests.test_sft import chat_inputs  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")

# A tiny Gemma 4: windowed layers of heads of 16 (window 5) and global ones of 32 with one key/value
# head whose values are its keys, "proportional" RoPE turning a quarter of a global head, per-layer
# inputs, the last two layers reusing layers 2's and 3's keys and values with double-wide MLPs
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=5,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=96,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    final_logit_softcapping=3.0,
    max_position_embeddings=64,
    rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
)
# 26B-A4B's block: eight experts beside each MLP, two a token
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16)
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
# The released decoders' text_config, as Gemma4TextConfig takes them (the rest: the class's defaults)
SMALL = dict(max_position_embeddings=131072, sliding_window=512, hidden_size_per_layer_input=256)
LARGE = dict(max_position_embeddings=262144, sliding_window=1024, hidden_size_per_layer_input=0, attention_k_eq_v=True)
LARGE |= dict(use_bidirectional_attention="vision")  # image tokens both ways: text stays causal
RELEASED = {
    "E2B": SMALL
    | dict(
        hidden_size=1536,
        num_hidden_layers=35,
        intermediate_size=6144,
        num_key_value_heads=1,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
        num_kv_shared_layers=20,
        use_double_wide_mlp=True,
    ),
    "E4B": SMALL
    | dict(
        hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_key_value_heads=2, num_kv_shared_layers=18
    ),
    "26B-A4B": LARGE
    | dict(
        hidden_size=2816,
        num_hidden_layers=30,
        intermediate_size=2112,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
    ),
    "31B": LARGE
    | dict(
        hidden_size=5376,
        num_hidden_layers=60,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
    ),
}


def randomized(model):
    """Every weight random, norms and scales around one (the q/k norms' smaller, so that the unscaled
    scores stay moderate: transformers' own float32 logits are then 4e-6 off its float64), the
    layers' scalars 0.7."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.75, 1.25) if p.dim() == 1 else p.normal_(0, 0.07)
            if "q_norm" in name or "k_norm" in name:
                p.uniform_(0.2, 0.4)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.7)
    return model.eval()


def tiny_text(**changes):
    return randomized(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**TINY | changes)))


def tiny_multimodal():
    """A tiny ``Gemma4ForConditionalGeneration``: the tiny decoder under a small vision tower."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
    config = transformers.Gemma4Config(text_config=TINY, vision_config=vision)
    return randomized(transformers.Gemma4ForConditionalGeneration(config))


def two_stages(source, split: int) -> torch.Tensor:
    """Logits of the checkpoint at ``source`` run as two pipeline stages split at layer ``split``."""
    args = open_model_checkpoint(source).args
    h = TOKENS
    for rank in range(2):
        [stage] = build_stages(args, plan_rank_stages(args, rank, 2, split_points=[split]), "cpu", checkpoint=source)
        h = stage(h)
    return h


@pytest.mark.parametrize("changes", [{}, MOE], ids=["dense", "moe"])
def test_hf_directories_read_and_write_with_transformers_logits(tmp_path, changes):
    """HF -> DCP -> our model, HF -> two pipeline stages (the per-layer inputs carried beside the
    hidden state), ``load_model``, and back to an HF directory -- its tensors the original's bitwise
    -- that ``transformers`` loads as ``Gemma4ForCausalLM``: logits within 1e-5 each way."""
    hf = tiny_text(**changes)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
        convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
        assert (our_logits(tmp_path / "dcp", TOKENS) - want).abs().max().item() <= 1e-5
        assert (two_stages(tmp_path / "hf", 2) - want).abs().max().item() <= 1e-5
        assert (load_model(tmp_path / "hf")(TOKENS) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(back).__name__ == "Gemma4ForCausalLM"
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5
    original = load_file(tmp_path / "hf" / "model.safetensors")
    [exported] = [load_file(path) for path in (tmp_path / "back").glob("*.safetensors")]
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[name], exported[name]) for name in original)


def test_the_multimodal_directory_reads_its_decoder_and_skips_the_towers(tmp_path):
    """A ``gemma4`` directory (``text_config``, the decoder under ``model.language_model.``): its text
    logits within 1e-5, the vision tower skipped with one line, exported as ``Gemma4ForCausalLM``."""
    hf = tiny_multimodal()
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = load_model(tmp_path / "hf")(TOKENS)
        assert (got - want).abs().max().item() <= 1e-5
        [line] = [str(w.message) for w in caught if "vision and audio towers" in str(w.message)]
        assert "\n" not in line
        with pytest.warns(UserWarning, match="vision and audio towers"):
            convert(tmp_path / "hf", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(back).__name__ == "Gemma4ForCausalLM"
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("flavor", sorted(RELEASED))
def test_the_released_text_configs_read_as_the_flavors(flavor):
    """Each released text_config reads as its flavor, every field (``tests/test_families.py`` checks
    the parameter counts: E2B 4.63 B and E4B 7.46 B without their towers, 26B-A4B 25.2 B, 31B 30.7 B)."""
    config = transformers.Gemma4TextConfig(**RELEASED[flavor], final_logit_softcapping=30.0)
    args = GEMMA4.hf.args_from_config(config.to_dict())
    assert args == FLAVORS[flavor] and GEMMA4.flavor_of(args) == flavor


def test_a_kv_shared_layers_stored_keys_and_values_are_skipped_with_one_line(tmp_path):
    """A file holding keys and values for the layers that reuse another's (transformers ignores them):
    skipped with one line, the logits transformers computes."""
    hf = tiny_text()
    hf.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for name in ("k_proj", "v_proj"):
        stored[f"model.layers.5.self_attn.{name}.weight"] = torch.ones(32, 64)
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="2 key/value tensors of the kv-shared layers") as caught:
        model = load_model(tmp_path)
    assert all("\n" not in str(w.message) for w in caught)
    with torch.no_grad():
        assert (model(TOKENS) - hf(TOKENS).logits).abs().max().item() <= 1e-5


def test_a_fused_gate_up_of_an_odd_row_count_is_refused_in_one_line(tmp_path, capsys):
    """``experts.gate_up_proj`` with 33 rows (not a gate's and an up projection's halves): convert
    exits non-zero with one line naming the layout, and writes nothing."""
    from seedckpt.cli.main import main as cli

    tiny_text(**MOE).save_pretrained(tmp_path / "hf")
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    stored["model.layers.1.experts.gate_up_proj"] = torch.ones(8, 33, 64)
    save_file(stored, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--to", "dcp", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "as [8, 33, 64], which is not its layout: a fused gate_up_proj is" in err and err.count("\n") == 1
    assert not (tmp_path / "dcp").exists()


def test_the_per_layer_table_counts_as_a_lookup_and_a_windowed_layer_over_its_window():
    """E2B at 4096 tokens: 6 FLOPs per parameter but the per-layer table's 2.35 B (15.4 GFLOPs a
    token, not 29.5), each layer's attention in its kind's head size, a windowed one over 512."""
    from seedckpt.materialize.model_checkpoint import parameter_count

    args = FLAVORS["E2B"]
    table = args.vocab_size * args.n_layers * args.per_layer_dim
    attention = sum(12 * 8 * (256 * 512 if args.is_sliding(i) else 512 * 4096) for i in range(args.n_layers))
    assert GEMMA4.flops_per_token(args, 4096) == 6 * (parameter_count(GEMMA4, args) - table) + attention


def test_packed_rows_compute_each_document_alone(tmp_path):
    """Documents packed in a row (positions restarting, longer than the window, the shared keys
    reused within each document) within 1e-5 of ``transformers`` on each document alone."""
    assert packed_rows_gap(tiny_text(), tmp_path, TOKENS) <= 1e-5


def test_the_pipeline_keeps_a_layer_and_the_layers_reusing_its_keys_on_one_stage():
    """Layers 4 and 5 reuse layers 3's and 2's keys and values: the balanced split keeps 2..5 on one
    stage, split points after layer 2 are refused in one line, one at layer 2 runs."""
    args = FLAVORS["debug"]
    assert pipeline_split(args, 2) == [(0, 1), (2, 3, 4, 5)]
    assert pipeline_split(args, 2, [2]) == [(0, 1), (2, 3, 4, 5)]
    with pytest.raises(SeedckptError, match=r"layers 2\.\.5 .* at layers\.2 or before") as refused:
        pipeline_split(args, 2, [3])
    assert "\n" not in str(refused.value)
    with pytest.raises(SeedckptError, match="keeping layers 2..5 on one stage"):
        pipeline_split(args, 4)


def test_the_norm_rounds_once_as_transformers_and_computes_a_float64_model_in_float64():
    """In bfloat16 bitwise transformers' ``Gemma4RMSNorm`` (rounding the unscaled norm first, as this
    norm once did, changed 26 % of its outputs); in float64 within 1e-12 of the exact norm."""
    theirs = transformers.models.gemma4.modeling_gemma4.Gemma4RMSNorm(256, 1e-6)
    ours = RMSNorm(256, 1e-6)
    torch.nn.init.normal_(theirs.weight, 1.0, 0.3)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 10
    assert torch.equal(ours.bfloat16()(x.bfloat16()), theirs.bfloat16()(x.bfloat16()))
    x = x.double()
    exact = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert (unscaled_norm(x, 1e-6) - exact).abs().max() < 1e-12  # in float32: 2e-7
    assert (ours.double()(x) - exact * ours.weight).abs().max() < 1e-12


def test_the_seed_recipe_is_transformers_normal_init_with_norms_and_scales_at_one():
    args = FLAVORS["debug"]
    with torch.device("meta"):
        recipe = init_model(Gemma4Transformer(args), seed=0, materialize=False)
    ones = {fqn for fqn, spec in recipe.items() if spec.kind == "ones"}
    assert {fqn for fqn in recipe if fqn.endswith(("norm.weight", "layer_scalar"))} == ones
    assert {(spec.kind, spec.std) for fqn, spec in recipe.items() if fqn not in ones} == {
        ("normal", args.initializer_range)
    }
    assert "output.weight" not in recipe and "layers.5.attention.wk.weight" not in recipe


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("use_bidirectional_attention", "all", "use_bidirectional_attention = 'all'"),
        ("hidden_activation", "gelu", "hidden_activation = 'gelu'"),
        ("attention_bias", True, "attention_bias = True"),
        ("global_head_dim", None, "global_head_dim = null"),
        ("rope_parameters", {"full_attention": {"rope_type": "yarn"}}, "lacks sliding_attention"),
        ("per_layer_config", {"2": {"intermediate_size": 8}}, "gives layer 2 intermediate_size"),
        ("num_kv_shared_layers", 5, "and there is none"),
        ("enable_moe_block", True, "lacks num_experts"),
    ],
)
def test_config_fields_this_version_does_not_compute_are_refused_in_one_line(tmp_path, field, value, message):
    tiny_text().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("per_layer_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(SeedckptError, match=message) as refused:
        load_model(tmp_path)
    assert "\n" not in str(refused.value)


# The debug flavor with two global key/value heads (tp2 splits them), and its experts
TP_READY = ["--model.name", "gemma4", "--model.global_kv_heads", "2"]
EXPERTS = ["--model.n_experts", "4", "--model.top_k", "2", "--model.moe_ffn_dim", "32"]


def test_tp2_computes_the_loss_and_every_gradient_of_one_process(tmp_path):
    """tp2 with sequence parallelism (the per-layer inputs and their gates whole on each rank, the
    kv-shared layers' reused keys each rank's own heads, the MLP split beside the experts): a packed
    batch's loss within 1e-5 of one process, dense and with experts, and every gradient within 1e-4
    of its tensor's largest. (Measured: 3e-5 at most, the embedding's, whose gradients reach 1e2 in
    this tiny model -- the embedding scaled by sqrt(dim), scores unscaled -- where 1e-5 absolute is
    float32's rounding; an error in the plan shows as a gap of the gradient's own size.)"""
    from seedckpt.materialize.seed import create_seed_checkpoint
    from tests.conftest import tiny_config
    from tests.dist import run_distributed
    from tests.test_deepseek_v3 import _tp_worker

    variants = {"dense": TP_READY, "experts": [*TP_READY, *EXPERTS]}
    seeds = {
        name: str(create_seed_checkpoint(tiny_config(*flags), tmp_path / name, seed=1, progress=False, workers=1))
        for name, flags in variants.items()
    }
    for name, (loss_one, loss_tp, gaps, same_names, scales) in run_distributed(_tp_worker, 2, seeds)[0].items():
        assert same_names, name
        assert abs(loss_tp - loss_one) <= 1e-5 * loss_one, (name, loss_tp, loss_one)
        assert all(gaps[fqn] <= 1e-4 * scales[fqn] for fqn in gaps), (name, max(gaps[f] / scales[f] for f in gaps))


def _layouts_steps(rank, world_size, dtype: torch.dtype, steps: int):
    """The debug flavor with experts in ``dtype``, on one process and on tp2 (sequence and loss
    parallel): ``steps`` AdamW steps on packed rows, the auxiliary loss weighted. Per layout: each
    step's loss and each layer's chosen experts, and the first step's full gradients."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from models.common.moe import moe_modules
    from tests.conftest import tiny_config

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    args = tiny_config(*TP_READY, *EXPERTS).model_args()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    positions = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, 32)
    documents = (torch.arange(32) >= 20).long().expand(2, 32)
    layouts = []
    for tp in (False, True):
        model = Gemma4Transformer(args)
        if tp:
            GEMMA4.tensor_parallel.apply(model, mesh, True)
        init_model(model, 0)
        model.to(dtype).init_buffers()  # ``to`` keeps the RoPE tables' real parts only
        chosen = []
        for moe in moe_modules(model):
            moe.aux_loss_scale = 1e-2
            moe.router.register_forward_hook(lambda _, __, routed: chosen.append(routed[1]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        draws, losses, gradients = torch.Generator().manual_seed(0), [], None
        for _ in range(steps):
            tokens = torch.randint(0, args.vocab_size, (2, 33), generator=draws)
            with loss_parallel() if tp else contextlib.nullcontext():  # the cross-entropy in ``dtype``
                logits = model(tokens[:, :-1], positions=positions, document_ids=documents)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
            losses.append(full(loss).item())
            if gradients is None:
                gradients = {n: full(p.grad) for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        layouts.append((losses, torch.stack(chosen), gradients))
    return layouts


def test_tp2_with_experts_trains_as_one_process_in_float64():
    """Three AdamW steps of the debug flavor with experts in float64, packed rows, the auxiliary loss
    weighted: tp2 routes every token to the same experts at every step, its losses are within 1e-9
    of one process's and its first gradients within 1e-10 of each tensor's largest. Measured: 1e-16,
    1e-16, 3e-12 and 2e-14. In float32 the same steps part by 8e-8, 1e-4, 8e-4, their routing by
    step 2 (rounding that AdamW and the unscaled scores grow, ``models.gemma4``), so only float64's
    losses tell the plan's errors: the MoE's post-norms left unsummed over the sequence's halves move their
    gradients by 0.99 of their size; a per-expert scale's gradient summed twice, by 1.0 of its size,
    moves the losses by 6e-10 and 8e-8 only (AdamW does not see a gradient's scale)."""
    from tests.dist import run_distributed

    (losses, chosen, want), (losses_tp, chosen_tp, got) = run_distributed(_layouts_steps, 2, torch.float64, 3)[0]
    assert torch.equal(chosen_tp, chosen)
    assert all(abs(a - b) <= 1e-9 * b for a, b in zip(losses_tp, losses)), (losses_tp, losses)
    gaps = {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}
    assert sorted(got) == sorted(want) and max(gaps.values()) <= 1e-10, max(gaps.items(), key=lambda kv: kv[1])


def test_compiled_blocks_train_as_eager_with_the_shared_keys_and_experts(monkeypatch):
    """The debug flavor with experts, its blocks compiled (``training.compile``'s ``apply_compile``)
    through ``aot_eager``: three AdamW steps route as eager and reach eager's losses within 1e-6 (the
    kv-shared layers' keys and values handed between graphs, the per-layer inputs, the routing).
    Measured: equal. Not inductor: its fused norms round one ulp off eager's, which Gemma 4's
    unscaled scores amplify to 9e-5 here by step 2 (``models.gemma4``'s docstring)."""
    from models.common.moe import moe_modules
    from tests.compiled import compile_with_aot_eager, eager_and_compiled
    from tests.conftest import tiny_config

    compile_with_aot_eager(monkeypatch)
    args = tiny_config("--model.name", "gemma4", *EXPERTS).model_args()
    eager, compiled = models = eager_and_compiled(args, model=Gemma4Transformer)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        tokens = torch.randint(0, args.vocab_size, (4, 33), generator=generator)
        losses = []
        for model, optimizer in zip(models, optimizers):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 1e-6 * losses[0], (step, losses)
        for a, b in zip(moe_modules(eager), moe_modules(compiled)):
            assert torch.equal(a.routed[-1][0], b.routed[-1][0]), step


@pytest.mark.slow
def test_the_experts_train_on_pp2_x_dp_shard2_x_ep2_like_one_process(tmp_path):
    """The debug seed with experts beside each MLP on two pipeline stages (the per-layer inputs sent
    beside the hidden state, the kv-shared layers with the layers they reuse), each stage's experts
    over two ranks: one process's losses within 1e-5."""
    from seedckpt.materialize.seed import create_seed_checkpoint
    from tests.conftest import tiny_config
    from tests.test_train import losses, torchrun

    family = ["--model.name", "gemma4", *EXPERTS]
    seed = create_seed_checkpoint(tiny_config(*family), tmp_path / "seed", seed=0, progress=False, workers=1)
    common = [*family, "--training.steps", "3"]
    torchrun(tmp_path / "one", seed, 1, *common, "--parallelism.pipeline_parallel_degree", "1")
    layout = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
    torchrun(tmp_path / "four", seed, 4, *common, "--parallelism.pipeline_parallel_degree", "2", *layout)
    reference, got = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert len(got) == len(reference) == 3
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.slow
def test_osft_from_the_multimodal_directory_grows_both_tables_and_exports_what_transformers_loads(
    tmp_path, chat_inputs
):
    """A fine-tuning start from the multimodal directory (its decoder; the vocabulary grown to the
    tokenizer's, the per-layer inputs' table with it), OSFT on the default targets, then its dense
    export, which ``transformers`` loads as ``Gemma4ForCausalLM`` with the step's logits."""
    from tests.test_sft import sft

    tokenizer, chats, _ = chat_inputs
    tiny_multimodal().save_pretrained(tmp_path / "hf")
    overrides = ["--finetune.mode", "osft", "--parallelism.pipeline_parallel_degree", "1"]
    sft(tmp_path / "run", tmp_path / "hf", tokenizer, chats, 1, *overrides, "--training.steps", "3")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["osft_leak"] < 1e-4 for row in rows)
    convert(tmp_path / "run" / "ckpt" / "step-3", tmp_path / "export", "hf", dense=True, progress=False)
    export = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(export).__name__ == "Gemma4ForCausalLM"
    step = load_model(tmp_path / "run" / "ckpt" / "step-3")
    assert step.per_layer_inputs.embeddings.weight.shape[0] == step.args.vocab_size > TINY["vocab_size"]
    tokens = TOKENS + step.args.vocab_size - TINY["vocab_size"]  # the grown rows too
    with torch.no_grad():
        assert (step(tokens) - export(tokens).logits).abs().max().item() <= 1e-5
