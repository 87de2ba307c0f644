"""Qwen3.5 (dense) against ``transformers``' ``Qwen3_5ForCausalLM``: the chunked gated delta rule
against the token-by-token recurrence and transformers' rule, logits both ways on tiny configs whose
linear layers cross the rule's chunk, the multimodal directory's decoder, packed rows, the released
flavors' parameter counts, the init recipe, the FLOPs, refusals, and pp2 x dp_shard2 training."""

from __future__ import annotations

import contextlib
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models.common.gated_deltanet import (
    CHUNK,
    GatedDeltaNet,
    fla_available,
    gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from models.qwen3_5 import FLAVORS
from models.qwen3_5.hf import args_from_config, config
from models.registry import get_family
from seedckpt import load_model
from seedckpt.materialize.init_recipe import init_model
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.compiled import compile_with_aot_eager, eager_and_compiled, graph_count, random_layouts
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.test_deepseek_v3 import _close, assert_both_ways
from tests.test_train import losses, torchrun

transformers = pytest.importorskip("transformers")

FAMILY = get_family("qwen3_5")
LENGTH = CHUNK + 30  # past one chunk of the rule
TOKENS = torch.randint(0, 96, (2, LENGTH), generator=torch.Generator().manual_seed(0))
# A tiny Qwen3.5: three linear layers and a full one; two value heads per key head
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=128,
)
CASES = {
    "released_pattern": {},
    # full attention first, whole heads turned, q/k/v/o biases, a tied output, one value head per key head
    "full_first_tied_biases": dict(
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
        attention_bias=True,
        tie_word_embeddings=True,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=3,
    ),
}


def rule_inputs(heads: int = 3, length: int = 2 * CHUNK + 22, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q = l2_normalize(torch.randn(2, length, heads, 16, generator=g, dtype=dtype)) * 16**-0.5
    k = l2_normalize(torch.randn(2, length, heads, 16, generator=g, dtype=dtype))
    v = torch.randn(2, length, heads, 8, generator=g, dtype=dtype)
    decay = -torch.rand(2, length, heads, generator=g, dtype=dtype)
    beta = torch.rand(2, length, heads, generator=g, dtype=dtype)
    return q, k, v, decay, beta


@pytest.mark.parametrize("chunk", [CHUNK, 16, 7])
def test_the_chunked_rule_is_the_recurrence(chunk):
    """Over 150 positions (chunks of 64, 16 and 7, the last cut short), the chunked rule's outputs
    are within 1e-5 of the recurrence's, token by token in float64."""
    inputs = rule_inputs()
    want = recurrent_gated_delta_rule(*inputs).double()
    got = gated_delta_rule(*(x.float() for x in inputs), chunk=chunk)
    assert (got.double() - want).abs().max().item() <= 1e-5


def test_the_chunked_rules_decay_rate_gradient_keeps_float32s_precision():
    """The float32 gradient of a per-head decay rate (``A_log``'s: g = -e^rate softplus(.)), a sum
    over 150 positions of dL/dg_t g_t, within 1e-5 of its size from float64's, with A = e^rate up to
    16 as the init draws it. Measured: 5.8e-7; 5.7e-5 when the chunk's decays were differences of
    cumulative sums (``segment_sums``), which set tp2's ``A_log`` gradients up to 1.5e-4 apart."""
    q, k, v, _, beta = rule_inputs()
    draws = torch.Generator().manual_seed(2)
    a, up = (torch.randn(x.shape, generator=draws, dtype=torch.float64) for x in (beta, v))
    rate = torch.linspace(0, math.log(16), 3, dtype=torch.float64)

    def gradient(dtype):
        r = rate.to(dtype).detach().requires_grad_()
        decay = -r.exp() * F.softplus(a.to(dtype) + 1)  # the layer's, dt_bias at its init
        out = gated_delta_rule(*(x.to(dtype) for x in (q, k, v)), decay, beta.to(dtype))
        (out * up.to(dtype)).sum().backward()
        return r.grad.double()

    want = gradient(torch.float64)
    assert (gradient(torch.float32) - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_chunked_rule_is_transformers_rule():
    """Our rule on normalized, scaled q and k is transformers' ``torch_chunk_gated_delta_rule`` (which
    normalizes and scales them itself) within 1e-5, gradients too."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, decay, beta = (x.float().requires_grad_() for x in rule_inputs())
    want, _ = torch_chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)
    got = gated_delta_rule(l2_normalize(q) * 16**-0.5, l2_normalize(k), v, decay, beta)
    assert (got - want).abs().max().item() <= 1e-5
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v, decay, beta)) for out in (want, got)]
    assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(*grads))


@pytest.mark.cuda
@pytest.mark.skipif(not fla_available(), reason="flash-linear-attention is not installed (the fla extra)")
def test_fla_kernel_is_the_torch_rule_on_the_gpu():
    """On CUDA, FLA's chunked kernel computes our torch rule's outputs (bfloat16 inputs, 2e-2)."""
    from models.common.gated_deltanet import fla_gated_delta_rule

    q, k, v, decay, beta = (x.float().cuda() for x in rule_inputs(length=1000))
    want = gated_delta_rule(q, k, v, decay, beta)
    got = fla_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), decay, beta.bfloat16())
    assert (got.float() - want).abs().max().item() <= 2e-2


def hf_model(path, case: str = "released_pattern", wrapper: bool = False, **changes):
    """A random ``Qwen3_5ForCausalLM`` (``wrapper``: its config as a multimodal ``qwen3_5``'s
    ``text_config``) saved at ``path``: every tensor random, norms away from their identity."""
    torch.manual_seed(6)
    fields = TINY | CASES[case] | changes
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0, 0.3 if p.dim() == 1 else 0.08)
    model.eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(tmp_path, case):
    """HF -> DCP -> our model, HF -> our pp=2 stages, ``load_model``, and DCP -> HF that
    transformers loads: logits within 1e-5 of ``Qwen3_5ForCausalLM``'s each way on 94 positions
    (the linear layers past their 64-position chunk), the tensors written back bitwise."""
    path = hf_model(tmp_path / "hf", case)
    assert_both_ways(path, transformers.Qwen3_5ForCausalLM, TOKENS, tmp_path)


def test_the_multimodal_directory_reads_its_decoder_and_skips_the_vision_tower(tmp_path):
    """A ``qwen3_5`` directory (``text_config``; the decoder under ``model.language_model.``, a vision
    tower and an MTP module beside it): the text logits within 1e-5, what is skipped named in one line."""
    assert_the_multimodal_directory_reads_its_decoder(hf_model(tmp_path / "hf"), "qwen3_5", tmp_path)


def assert_the_multimodal_directory_reads_its_decoder(path, wrapper_type: str, tmp_path):
    """The ``transformers`` directory at ``path`` as the multimodal ``wrapper_type``'s, with a vision
    tower and an MTP module: our text logits within 1e-5 of the causal LM's, one line for the skip."""
    want = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    stored = load_file(path / "model.safetensors")
    wrapped = {name.replace("model.", "model.language_model.", 1): t for name, t in stored.items()}
    wrapped |= {"model.visual.blocks.0.attn.qkv.weight": torch.ones(6, 2), "mtp.fc.weight": torch.ones(4, 8)}
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    save_file(wrapped, multimodal / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    (multimodal / "config.json").write_text(json.dumps({"model_type": wrapper_type, "text_config": text}))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = load_model(multimodal)(TOKENS)
        assert (got - want(TOKENS).logits).abs().max().item() <= 1e-5
    [line] = [str(w.message) for w in caught if "vision tower" in str(w.message)]
    assert line.startswith("2 tensors of Qwen3.5's vision tower and multi-token-prediction module")


def test_packed_rows_compute_each_document_alone(tmp_path):
    """Documents packed in a row (the first longer than the rule's chunk, positions restarting;
    padding, document -1, at the end): each document's logits within 1e-5 of transformers' on it
    alone -- the recurrent state and the convolution start empty at each document."""
    path = hf_model(tmp_path / "hf")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path).eval()
    lengths = (70, 3, 1, 16, 4)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    documents = documents.masked_fill(documents == len(lengths) - 1, -1).expand(2, -1)
    with torch.no_grad():
        packed = load_model(path)(TOKENS, positions=positions, document_ids=documents)
        alone = torch.cat([hf(part).logits for part in TOKENS.split(lengths, dim=1)], dim=1)
        whole = load_model(path)(TOKENS)
    assert (packed - alone).abs().max().item() <= 1e-5
    assert (whole[:, 70:] - alone[:, 70:]).abs().max().item() > 1e-3  # the reset changes the logits


def test_compiled_model_compiles_no_more_for_batches_of_other_documents(monkeypatch):
    """The debug Qwen3.5 (3 linear layers, 1 of attention) with ``training.compile``'s blocks: 5
    batches of 2 x 160 tokens packing other documents (some past the rule's chunk) compile 2 graphs
    in the first batch and none after (before: one more per batch, as the linear layers' calls
    followed each batch's documents), with eager's losses and gradients bitwise -- ``A_log``'s and
    ``dt_bias``'s in float32, the convolution's window emptied at each document -- since the
    documents' op runs eager's code. Two: one per kind of layer, whatever the batches."""
    compile_with_aot_eager(monkeypatch)
    args = tiny_config(*M).model_args()
    eager, compiled = eager_and_compiled(args)
    tokens = torch.randint(0, args.vocab_size, (2, 160), generator=torch.Generator().manual_seed(0))
    for ids in random_layouts(5, 2, 160, 80):
        pair = [model(tokens, document_ids=ids, labels=tokens.roll(-1, 1)) for model in (compiled, eager)]
        for loss in pair:
            loss.backward()
        assert torch.equal(pair[0], pair[1])
        assert graph_count() == 2
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("flavor", sorted(set(FLAVORS) - {"debug"}))
def test_flavors_have_transformers_parameter_counts(flavor):
    """Each released flavor's config.json, loaded by ``Qwen3_5TextConfig``, builds a model with our
    parameter count, and reads back as the flavor."""
    cfg = config(FLAVORS[flavor], torch.bfloat16)
    with torch.device("meta"):
        theirs = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg))
        ours = FAMILY.model(FLAVORS[flavor])
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert args_from_config(transformers.Qwen3_5TextConfig(**cfg).to_dict()) == FLAVORS[flavor]


def test_the_seed_recipe_is_torchtitans():
    """torchtitan 0.3.0's qwen3_5 recipe: ``A_log`` the log of U(0.01, 16), ``dt_bias`` and the
    gated norms ones, the convolution U(+-1/2) (4 taps), the offset norms zero, the projections
    std 0.02, the output projections depth-scaled; drawn values inside those ranges."""
    args = FLAVORS["debug"]
    torch.manual_seed(0)
    model = FAMILY.model(args)
    recipe = init_model(model, seed=0)
    kinds = {fqn.split(".", 2)[-1]: (spec.kind, spec.low, spec.high) for fqn, spec in recipe.items()}
    assert kinds["attention.A_log"] == ("log_uniform", 0.01, 16.0)
    assert kinds["attention.conv1d.weight"] == ("uniform", -0.5, 0.5)
    assert kinds["attention.dt_bias"][0] == kinds["attention.norm.weight"][0] == "ones"
    assert {spec.kind for fqn, spec in recipe.items() if fqn.endswith(("attention_norm.weight", "q_norm.weight"))} == {
        "zeros"
    }
    assert recipe["layers.2.attention.out_proj.weight"].std == pytest.approx(0.02 / 6**0.5)
    assert recipe["layers.3.attention.wo.weight"].std == pytest.approx(0.02 / 8**0.5)
    a = model.layers["0"].attention.A_log.exp()
    assert a.min() >= 0.01 and a.max() <= 16.0 and a.std() > 1.0


def test_linear_layers_count_their_rule_not_the_sequence():
    """A linear layer's FLOPs do not grow with the sequence; the full-attention layer's do, by the
    decoder's 12·H·Q per position."""
    args = FLAVORS["9B"]
    short, long = FAMILY.layer_flops(args, 4096), FAMILY.layer_flops(args, 8192)
    assert long.blocks[0] == short.blocks[0]
    assert long.blocks[3] - short.blocks[3] == 12 * args.n_heads * args.head_dim * 4096
    assert FAMILY.flops_per_token(args, 4096) == sum(short.blocks) + short.last + 6 * args.dim * args.vocab_size


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("layer_types", ["linear_attention", "sliding_attention", "full_attention", "full_attention"], "sliding"),
        ("layer_types", ["full_attention"], "one kind per layer"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("linear_num_value_heads", 3, "must be a multiple of linear_num_key_heads = 2"),
        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "'dynamic' RoPE scaling"),
        ("linear_conv_kernel_dim", 0, "linear_conv_kernel_dim = 0"),
        ("linear_num_value_heads", None, "linear_num_value_heads = null"),
        ("head_dim", None, "head_dim = null"),
        ("attention_dropout", 0.1, "attention_dropout = 0.1"),
        ("full_attention_interval", "4", "full_attention_interval = '4'"),
    ],
)
def test_config_fields_not_computed_are_refused_in_one_line(field, value, message):
    with pytest.raises(ValueError, match=message) as refused:
        args_from_config({"model_type": "qwen3_5_text", **TINY, field: value})
    assert "\n" not in str(refused.value)


M = ["--model.name", "qwen3_5"]
STEPS = ["--training.steps", "3", "--training.seq_len", "80"]


@pytest.mark.slow
def test_the_seed_trains_on_pp2_x_dp_shard2_with_one_process_losses(tmp_path):
    """The debug Qwen3.5 from its seed, on 80-token rows (its linear layers past their chunk):
    pp2 x dp_shard2 trains with one process's losses within 1e-5."""
    seed = create_seed_checkpoint(tiny_config(*M), tmp_path / "seed", seed=0, progress=False, workers=1)
    torchrun(tmp_path / "one", seed, 1, *M, "--parallelism.pipeline_parallel_degree", "1", *STEPS)
    with warnings.catch_warnings():
        torchrun(tmp_path / "pp2_dp2", seed, 4, *M, "--training.local_batch_size", "4", *STEPS)
    _close(losses(tmp_path / "pp2_dp2"), losses(tmp_path / "one"), "pp2 x dp_shard2")


@pytest.mark.slow
def test_the_seed_trains_on_tp2_x_dp_shard2_with_one_process_losses(tmp_path):
    """The debug Qwen3.5 from its seed on tp2 x dp_shard2 (the linear layers split by heads,
    sequence parallel between them) with one process's losses within 1e-5."""
    seed = create_seed_checkpoint(tiny_config(*M), tmp_path / "seed", seed=0, progress=False, workers=1)
    common = [*M, *STEPS, "--parallelism.pipeline_parallel_degree", "1"]
    torchrun(tmp_path / "one", seed, 1, *common, "--training.local_batch_size", "8")
    tp = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
    torchrun(tmp_path / "four", seed, 4, *common, *tp)
    _close(losses(tmp_path / "four"), losses(tmp_path / "one"), "tp2 x dp_shard2")


def _linear_layer_gradients(rank, world_size, dtype):
    """The debug model in ``dtype`` on one process and on tp2 (Qwen3.5's plan, sequence and loss
    parallel), two rows of two documents (the first past a chunk): per layout, the loss and the
    linear layers' gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tokens = torch.arange(192).reshape(2, 96) * 7 % 512
    first = CHUNK + 6
    positions = torch.cat([torch.arange(first), torch.arange(96 - first)]).expand(2, 96)
    documents = (torch.arange(96) >= first).long().expand(2, 96)
    layouts = []
    for plan in (None, FAMILY.tensor_parallel.apply):
        model = FAMILY.model(FLAVORS["debug"])
        if plan is not None:
            plan(model, mesh, True)
        init_model(model, seed=0)
        model.to(dtype)
        with contextlib.nullcontext() if plan is None else loss_parallel():
            logits = model(tokens, positions=positions, document_ids=documents)
            loss = F.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten(), reduction="sum")
            loss.backward()
        linear = tuple(
            f"layers.{i}.attention." for i, b in model.layers.items() if isinstance(b.attention, GatedDeltaNet)
        )
        layouts.append(
            (full(loss).item(), {n: full(p.grad) for n, p in model.named_parameters() if n.startswith(linear)})
        )
    return layouts


def test_tensor_parallel_linear_layers_are_one_process_in_float64():
    """tp2 of the debug model in float64 on packed documents: the loss within 1e-9 of one process's
    and every gradient of the linear layers (projections, convolution, ``A_log``, ``dt_bias``, the
    gated norm) within 1e-6 of its size. Measured: 0 and 2e-15 (up to 7e-9 with RoPE's table left
    complex64: RoPE's input computes in float32 in both layouts). A head out
    of place (``b``'s reversed, q/k repeated instead of interleaved) moves gradients by 1.5-1.7x their
    size, and the float32 loss by 4.9e-6 only, inside the 1e-5 the training test allows. In float32
    the layouts' gradients here are 2.4e-6 apart (``A_log``'s; 1.5e-4 before ``segment_sums``), each
    2.8e-6 from float64's (4.7e-4 before): tests/test_qwen3_5_moe.py holds float32 to 1e-5."""
    (loss, want), (loss_tp, got) = run_distributed(_linear_layer_gradients, 2, torch.float64)[0]
    assert abs(loss_tp - loss) <= 1e-9 * loss and sorted(got) == sorted(want) and len(want) == 3 * 9
    gaps = {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}
    assert max(gaps.values()) <= 1e-6, gaps


def test_osft_default_targets_are_every_projection_of_both_layer_kinds():
    """OSFT's default targets select q/k/v/o (and the gate in ``wq``) of the full layer, the fused
    q/k/v, the z gate and ``out_proj`` of each linear layer, and every feed-forward matrix."""
    from seedckpt.finetune.osft import pattern_matches

    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = FAMILY.model(args)
    matches = pattern_matches(model, FAMILY.osft_targets)
    assert all(matches[target] for target in FAMILY.osft_targets), matches
    linear_layers = args.n_layers - len(args.full_attention_layers)
    assert len(matches["attention.in_proj_qkv"]) == linear_layers
    assert len(matches["attention.wq"]) == len(args.full_attention_layers)
