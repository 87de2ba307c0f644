"""gpt-oss against ``transformers``' ``GptOssForCausalLM``: ``config.json`` both ways (the hub's
own fields), the fused, interleaved, transposed experts read and written, and refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from models.gpt_oss import FLAVORS, GPT_OSS, args_from_config, config
from seedckpt import load_model
from seedckpt.checkpoint import DcpCheckpoint
from seedckpt.cli.convert import convert, diff
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from tests.conftest import tiny_config
from tests.dist import run_distributed
from tests.quantizers import quantize_directory
from tests.test_convert import our_logits
from tests.test_deepseek_v3 import hf_tensors
from tests.test_sft import PP2_DP2, chat_inputs, sft  # noqa: F401 (chat_inputs: a fixture)
from tests.test_train import losses, model_state, torchrun

transformers = pytest.importorskip("transformers")

# openai/gpt-oss-20b's config.json as published (transformers 4.55's field names), less the
# quantization table and the 24 layer kinds, which alternate as HF's default does.
HUB_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}

DIM, FFN, EXPERTS, LAYERS = 32, 24, 4, 2


def hf_config(**changes) -> transformers.GptOssConfig:
    """A tiny gpt-oss: 2 layers (one windowed, one full), GQA, 4 experts, YaRN."""
    fields = dict(
        vocab_size=96,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        sliding_window=6,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
    )
    return transformers.GptOssConfig(**(fields | changes))


def hf_model(path: Path, **changes) -> Path:
    """A random ``GptOssForCausalLM`` saved at ``path``: every tensor random -- sinks, router and
    expert biases, attention biases, norms -- so that nothing misplaced can hide."""
    torch.manual_seed(3)
    model = transformers.GptOssForCausalLM(hf_config(**changes))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3) if p.dim() == 1 else p.normal_(0, 0.08)
    model.eval().save_pretrained(path)
    return path


def test_config_both_ways_and_the_hub_config():
    """Each flavor's config.json reads back as the same args and builds transformers' config with
    the same fields; the hub's own 20B config.json reads as the 20B flavor."""
    for name, args in FLAVORS.items():
        written = config(args, torch.bfloat16)
        assert args_from_config(written) == args, name
        theirs = transformers.GptOssConfig(**written)
        kinds = ["full_attention" if w is None else "sliding_attention" for w in args.layer_windows]
        assert theirs.layer_types == kinds and theirs.num_local_experts == args.n_experts
        assert theirs.rope_parameters == args.rope_scaling.to_config(args.rope_theta)
    hub = args_from_config(json.loads(json.dumps(HUB_20B)))
    assert hub == dataclasses.replace(FLAVORS["20B"], aux_loss_coef=0.9)


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("attention_bias", "yes", "attention_bias"),
        ("attention_dropout", 0.1, "attention_dropout"),
        ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types"),
        ("sliding_window", 0, "sliding_window"),
        ("swiglu_limit", "7", "swiglu_limit"),
    ],
)
def test_config_fields_not_computed_are_refused_in_one_line(field, value, named):
    cfg = config(FLAVORS["debug"], torch.float32) | {field: value}
    with pytest.raises(ValueError, match=named) as caught:
        args_from_config(cfg)
    assert "\n" not in str(caught.value)


VARIANTS = {
    "no_attention_bias_mha_tied": dict(attention_bias=False, num_key_value_heads=4, tie_word_embeddings=True),
    "plain_rope_sliding_everywhere": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=["sliding_attention"] * LAYERS,
        sliding_window=4,
    ),
    "full_then_sliding_clamped": dict(layer_types=["full_attention", "sliding_attention"], swiglu_limit=0.5),
}


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_config_variants_compute_transformers_logits_both_ways(tmp_path, changes):
    """Other gpt-oss configs than the releases': without attention biases (MHA, tied), plain RoPE
    with every layer windowed, full attention first and a clamp that bites. HF -> ours and back:
    transformers' logits within 1e-5."""
    path = hf_model(tmp_path / "hf", **changes)
    with torch.no_grad():
        want = transformers.GptOssForCausalLM.from_pretrained(path).eval()(TOKENS).logits
        assert (load_model(path).eval()(TOKENS) - want).abs().max().item() <= 1e-5
        convert(path, tmp_path / "back", "hf", progress=False)
        back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


def test_fused_experts_are_read_as_gate_up_and_down(tmp_path, monkeypatch):
    """Our w1 / w3 are the even / odd columns of HF's gate_up_proj, transposed, and b1 / b3 of its
    bias; w2 is down_proj transposed: read from a transformers directory, each equals the slice that
    GptOssExperts computes with. Each stored tensor is read once for the tensors it holds."""
    path = hf_model(tmp_path / "hf")
    theirs = hf_tensors(path)
    opened = open_model_checkpoint(path)
    reads, read_stored = [], opened._read_stored
    monkeypatch.setattr(opened, "_read_stored", lambda file, name: reads.append(name) or read_stored(file, name))
    assert set(opened.infos) == set(opened.layout.shapes)
    for i in range(LAYERS):
        hf = f"model.layers.{i}.mlp.experts."
        gate_up, bias = theirs[hf + "gate_up_proj"], theirs[hf + "gate_up_proj_bias"]
        expected = {
            "w1": gate_up[..., ::2].transpose(1, 2),
            "w3": gate_up[..., 1::2].transpose(1, 2),
            "w2": theirs[hf + "down_proj"].transpose(1, 2),
            "b1": bias[:, ::2],
            "b3": bias[:, 1::2],
            "b2": theirs[hf + "down_proj_bias"],
        }
        for ours, want in expected.items():
            assert torch.equal(opened.read_tensor(f"layers.{i}.moe.experts.{ours}"), want), ours
        sinks = opened.read_tensor(f"layers.{i}.attention.sinks")
        assert torch.equal(sinks, theirs[f"model.layers.{i}.self_attn.sinks"])
        router = opened.read_tensor(f"layers.{i}.moe.router.gate.bias")
        assert torch.equal(router, theirs[f"model.layers.{i}.mlp.router.bias"])
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 6 * LAYERS  # 4 expert tensors, sinks, router


# 24 positions: past the window (6) and past YaRN's original context (16).
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def test_logits_match_transformers_both_ways(tmp_path):
    """HF -> DCP -> our model, HF -> our pp=2 stages directly, ``load_model``, and DCP -> HF that
    ``transformers`` loads: logits within 1e-5 of ``GptOssForCausalLM``'s each way, on inputs longer
    than the window and than YaRN's original context, with every sink and bias non-zero. The window,
    the sinks and the experts' biases each move the logits (so each is computed, not skipped)."""
    path = hf_model(tmp_path / "hf")
    hf = transformers.GptOssForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = hf(TOKENS).logits
        convert(path, tmp_path / "dcp", "dcp", progress=False)
        equal, lines = diff(path, tmp_path / "dcp")
        assert equal, lines
        for source, pp in ((tmp_path / "dcp", 1), (path, 2)):
            assert (our_logits(source, TOKENS, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        ours = load_model(path).eval()
        assert (ours(TOKENS) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        assert hf_tensors(tmp_path / "back").keys() == hf_tensors(path).keys()
        assert all(torch.equal(t, hf_tensors(path)[k]) for k, t in hf_tensors(tmp_path / "back").items())
        back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5
        for switch_off in (
            lambda: hf.config.__setattr__("layer_types", ["full_attention"] * LAYERS),
            lambda: hf.model.layers[1].self_attn.sinks.fill_(-1e9),
            lambda: hf.model.layers[1].mlp.experts.down_proj_bias.zero_(),
        ):
            switch_off()
            assert (hf(TOKENS).logits - want).abs().max().item() > 1e-3
            want = hf(TOKENS).logits


G = ["--model.name", "gpt_oss", "--training.steps", "6"]
ONE = ["--parallelism.pipeline_parallel_degree", "1"]


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}, step {step}: {a} vs {b}"


@pytest.mark.slow
def test_layouts_match_one_process_and_resume_bitwise(tmp_path):
    """The debug gpt-oss (windows of 16 in 32-token rows, sinks, biases, YaRN) from its seed:
    pp2 x dp_shard2 x ep2 and tp2 x ep2 (sequence parallel: each TP rank its heads' sinks) train
    with one process's losses within 1e-5; tp2 x ep2 saved at step 3 resumes bitwise."""
    seed = create_seed_checkpoint(tiny_config(*G), tmp_path / "seed", seed=0, progress=False, workers=1)
    torchrun(tmp_path / "one", seed, 1, *G, *ONE)
    want = losses(tmp_path / "one")
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    tp2 = [*ONE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "true"]
    torchrun(tmp_path / "pp2_dp2_ep2", seed, 4, *G, *ep2, "--training.local_batch_size", "4")
    _close(losses(tmp_path / "pp2_dp2_ep2"), want, "pp2 x dp_shard2 x ep2")
    torchrun(tmp_path / "tp2_ep2", seed, 2, *G, *tp2, *ep2, "--checkpoint.interval", "3")
    _close(losses(tmp_path / "tp2_ep2"), want, "tp2 x ep2")
    shutil.copytree(tmp_path / "tp2_ep2" / "ckpt" / "step-3", tmp_path / "resumed" / "ckpt" / "step-3")
    torchrun(tmp_path / "resumed", seed, 2, *G, *tp2, *ep2, "--checkpoint.interval", "3")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "tp2_ep2")[3:]
    a, b = (model_state(tmp_path / run / "ckpt" / "step-6") for run in ("tp2_ep2", "resumed"))
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.slow
def test_sft_from_an_hf_directory_on_pp2_x_dp2_x_ep2_exports_what_transformers_computes(tmp_path, chat_inputs):
    """SFT from a transformers gpt-oss directory on pp=2 x dp_shard=2, the experts expert-parallel
    over the two DP ranks (each reads its experts' rows of the fused tensors), packed chat rows of
    64 tokens past the window of 6: one process's losses within 1e-5, the masked loss falls, the
    aux loss is reported, and the end-of-run HF export loads in transformers with our checkpoint's
    logits."""
    tokenizer, chats, tokenizer_vocab = chat_inputs
    path = hf_model(tmp_path / "hf", vocab_size=-(-tokenizer_vocab // 8) * 8)
    export = ["--checkpoint.export_at_end", "hf", "--checkpoint.export_dtype", "float32"]
    steps = ["--training.steps", "6", "--checkpoint.interval", "6"]
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    sft(tmp_path / "run", path, tokenizer, chats, 4, *PP2_DP2, *ep2, *export, *steps)
    sft(tmp_path / "single", path, tokenizer, chats, 1, *ONE, "--training.local_batch_size", "8", *steps)
    loss = losses(tmp_path / "run")
    _close(loss, losses(tmp_path / "single"), "pp2 x dp_shard2 x ep2 against one process")
    assert len(loss) == 6 and loss[-1] < loss[0] - 0.3, loss
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["moe_aux_loss"] > 0 for row in rows)
    ours = load_model(tmp_path / "run" / "ckpt" / "step-6").eval()
    tokens = TOKENS % ours.args.vocab_size
    exported = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "run" / "ckpt" / "step-6-hf").eval()
    with torch.no_grad():
        assert (exported(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_osft_trains_attention_and_keeps_the_experts_frozen(tmp_path, chat_inputs):
    """OSFT on gpt-oss: the attention matrices are factorized and trained (their biases and the
    sinks dense), the mixtures of experts -- router, experts, their biases -- frozen: bitwise the
    pretrained weights after training, and no optimizer state."""
    tokenizer, chats, tokenizer_vocab = chat_inputs
    path = hf_model(tmp_path / "hf", vocab_size=-(-tokenizer_vocab // 8) * 8)
    steps = ["--training.steps", "3", "--checkpoint.interval", "3", *ONE]
    sft(tmp_path / "run", path, tokenizer, chats, 1, "--finetune.mode", "osft", *steps)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["osft_leak"] <= 1e-5 for row in rows)
    step, pretrained = open_model_checkpoint(tmp_path / "run" / "ckpt" / "step-3"), open_model_checkpoint(path)
    for fqn in ("experts.w1", "experts.w2", "experts.b1", "experts.b2", "router.gate.weight", "router.gate.bias"):
        assert torch.equal(step.read_tensor(f"layers.0.moe.{fqn}"), pretrained.read_tensor(f"layers.0.moe.{fqn}")), fqn
    assert not torch.equal(
        step.read_tensor("layers.0.attention.sinks"), pretrained.read_tensor("layers.0.attention.sinks")
    )
    assert "layers.0.attention.wo.U_low" in step.infos
    keys = DcpCheckpoint(step.path).metadata.state_dict_metadata
    assert not [k for k in keys if k.startswith("optimizer") and ".moe." in k]


def _mxfp4(root: Path) -> tuple[Path, Path, Path]:
    """A random gpt-oss (experts 32 wide: whole MXFP4 groups), its copy with the experts quantized to
    MXFP4 as the hub stores them, and a float copy holding the values those blocks stand for."""
    src = hf_model(root / "hf", intermediate_size=32)
    experts = lambda name, tensor: name.endswith(("experts.gate_up_proj", "experts.down_proj"))  # noqa: E731
    quantize_directory(src, root / "mxfp4", "mxfp4", experts, root / "values")
    return src, root / "mxfp4", root / "values"


def test_an_mxfp4_directory_reads_to_mxfp4s_error(tmp_path):
    """gpt-oss's hub layout (``gate_up_proj_blocks`` / ``_scales`` ...): our model, and its export to
    an HF directory, compute transformers' logits on the values the blocks stand for (within 1e-5),
    each expert weight is the
    original within MXFP4's rounding (at most 2^e, e its group's exponent: less than a third of the
    group's largest magnitude), and the quantization moved the logits."""
    src, quantized, values = _mxfp4(tmp_path)
    with torch.no_grad():
        want = transformers.GptOssForCausalLM.from_pretrained(values).eval()(TOKENS).logits
        assert (load_model(quantized).eval()(TOKENS) - want).abs().max().item() <= 1e-5
        convert(quantized, tmp_path / "dequantized", "hf", progress=False)  # fused and transposed again
        exported = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "dequantized").eval()
        assert (exported(TOKENS).logits - want).abs().max().item() <= 1e-5
        original = transformers.GptOssForCausalLM.from_pretrained(src).eval()(TOKENS).logits
        assert (original - want).abs().max().item() > 1e-3
    read, exact = open_model_checkpoint(quantized), open_model_checkpoint(src)
    for fqn in ("experts.w1", "experts.w3", "experts.w2"):
        got, w = read.read_tensor(f"layers.1.moe.{fqn}"), exact.read_tensor(f"layers.1.moe.{fqn}")
        groups = w.reshape(*w.shape[:2], -1, 32)  # our [E, out, in]: groups of 32 along in, as stored
        bound = groups.abs().amax(-1, keepdim=True) / 3
        assert ((got.reshape(groups.shape) - groups).abs() <= bound).all(), fqn


def _owned_worker(rank, world_size, plain, quantized):
    """Each directory into FSDP2 stages over 2 ranks (4 experts: 2 each): equal to its whole read,
    and the rows of expert tensors this rank asked the files for."""
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.checkpoint.owned_reads import OwnedHFReader
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local, local_rows
    from tests.test_distributed import _fsdp

    requested, read_data = [], OwnedHFReader.read_data
    OwnedHFReader.read_data = lambda self, plan, planner: (
        requested.extend(
            (i.storage_index.fqn, i.storage_offsets[0], i.storage_offsets[0] + i.lengths[0])
            for i in plan.items
            if ".experts." in i.storage_index.fqn
        )
        or read_data(self, plan, planner)
    )
    failures, asked = [], {}
    for path in (plain, quantized):
        opened = open_model_checkpoint(path)
        args = opened.args
        [stage] = build_stages(
            args, plan_rank_stages(args, 0, 1), "cpu", opened, shard_fn=_fsdp(init_device_mesh("cpu", (2,)))
        )
        for fqn, t in stage.state_dict().items():
            lo, hi = local_rows(t) or (0, t.shape[0])
            if not torch.equal(local(t), opened.read_tensor(fqn)[lo:hi].to(t.dtype)):
                failures.append(f"{path}: {fqn}")
        asked[str(path)], requested[:] = sorted(set(requested)), []
    return failures, asked


@pytest.mark.slow
def test_each_rank_reads_only_its_experts_of_the_fused_and_the_mxfp4_tensors(tmp_path):
    """Two FSDP2 ranks, each holding experts [2r, 2r + 2) of 4: loaded from the plain directory
    (fused gate_up_proj, down_proj) and from its MXFP4 copy (their blocks and scales), each rank's
    tensors equal the whole read's rows, and every expert read it asks the files for is of its rows."""
    src, quantized, _ = _mxfp4(tmp_path)
    for rank, (failures, asked) in enumerate(run_distributed(_owned_worker, 2, src, quantized)):
        assert failures == [], failures[:5]
        for path, items in asked.items():
            assert items and all((lo, hi) == (2 * rank, 2 * rank + 2) for _, lo, hi in items), (rank, path, items)
        assert any(name.endswith("gate_up_proj_blocks") for name, _, _ in asked[str(quantized)])


def test_packed_rows_compute_their_documents_as_transformers_does(tmp_path):
    """A row packing documents of 20, 5 and 15 tokens (positions restarting, one id each): every
    document's logits are transformers' for it alone, past the window and YaRN's original context."""
    path = hf_model(tmp_path / "hf")
    hf, ours = transformers.GptOssForCausalLM.from_pretrained(path).eval(), load_model(path).eval()
    lengths = (20, 5, 15)
    docs = [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        packed = ours(
            torch.cat(docs, 1),
            positions=torch.cat([torch.arange(n) for n in lengths])[None],
            document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
        )
        alone = torch.cat([hf(d).logits for d in docs], 1)
    assert (packed - alone).abs().max().item() <= 1e-5


def test_compiled_attention_computes_eager_logits_and_gradients(tmp_path, monkeypatch):
    """``training.compile`` of gpt-oss as training applies it to a model with mixtures of experts: each
    block's attention compiled (sinks, biases, a window in one block, none in the other), the MoE layers
    eager: eager's logits and gradients. Dynamo captures each whole (``fullgraph``) and AOT autograd
    builds its backward; inductor's C++ code generation, the same for every family and 100 s of a
    busy CPU here, is left out (``aot_eager``)."""
    from torch._dynamo.utils import counters

    from seedckpt.parallel.parallelize import apply_compile
    from tests.compiled import compile_with_aot_eager

    compile_with_aot_eager(monkeypatch)
    path = hf_model(tmp_path / "hf")
    eager, compiled = load_model(path), load_model(path)
    apply_compile(compiled, whole_blocks=False)
    out, reference = compiled(TOKENS), eager(TOKENS)
    out.square().mean().backward()
    reference.square().mean().backward()
    assert counters["aot_autograd"]["total"] >= 1
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_init_recipe_is_transformers():
    """Every tensor of the debug model drawn as ``GptOssPreTrainedModel._init_weights`` draws it:
    weights, experts, sinks and the router's bias normal at ``initializer_range``; the other biases
    zero; norms one."""
    from seedckpt.materialize.init_recipe import init_model

    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = GPT_OSS.model(args)
    for fqn, spec in init_model(model, 0, materialize=False).items():
        if fqn.endswith("norm.weight"):
            assert spec.kind == "ones", fqn
        elif fqn.endswith(("attention.sinks", "router.gate.bias")) or not fqn.endswith(("bias", ".b1", ".b2", ".b3")):
            assert (spec.kind, spec.std) == ("normal", args.initializer_range), fqn
        else:
            assert spec.kind == "zeros", fqn
