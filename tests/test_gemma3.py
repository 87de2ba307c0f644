"""Gemma 3 against ``transformers``' ``Gemma3ForCausalLM`` and ``Gemma3ForConditionalGeneration``:
released parameter counts, HF directories both ways (``config.json`` in both of transformers' forms),
packed rows, the init recipe, the FLOPs of windowed layers, refusals, and tp2 x dp_shard2 training."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.common.decoder import Transformer
from models.common.norms import rms_norm
from models.gemma3 import FLAVORS, GEMMA3, LINEAR_8X
from models.gemma3.args import sliding_layers
from seedckpt import load_model
from seedckpt.cli.convert import convert
from seedckpt.materialize.init_recipe import init_model
from seedckpt.materialize.model_checkpoint import parameter_count
from seedckpt.utils.errors import SeedckptError
from tests.test_convert import our_logits
from tests.test_sft import chat_inputs  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")

# The released text decoders' shapes (their config.json / text_config), as Gemma3TextConfig takes them
RELEASED = {
    "1B": dict(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=512,
        max_position_embeddings=32768,
    ),
    "4B": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8),
    "12B": dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8
    ),
    "27B": dict(
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
    ),
}
# google/gemma-3-4b-it's text_config as published (transformers 4.50's fields), the rest left to defaults
HUB_4B_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
# A tiny Gemma 3: windowed and global layers (window 5, pattern 2), GQA, each RoPE base its own, the
# global one stretched, the scores' scale its own, a logit softcap
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    sliding_window_pattern=2,
    query_pre_attn_scalar=24,
    rope_scaling={"rope_type": "linear", "factor": 4.0},
    rope_theta=1e4,
    rope_local_base_freq=100.0,
    final_logit_softcapping=3.0,
    max_position_embeddings=64,
)
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))


def randomized(model):
    """Every tensor random, norms' weights around zero (their scale is 1 + weight)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5) if p.dim() == 1 else p.normal_(0, 0.1)
    return model.eval()


def tiny_text(**changes):
    return randomized(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY | changes)))


def tiny_multimodal():
    """A tiny ``Gemma3ForConditionalGeneration``: the tiny decoder under a small vision tower."""
    text = {name: value for name, value in TINY.items() if name != "final_logit_softcapping"}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision | dict(patch_size=14))
    return randomized(transformers.Gemma3ForConditionalGeneration(config))


@pytest.mark.parametrize("flavor", sorted(RELEASED))
def test_flavors_have_transformers_parameter_counts(flavor):
    from_4b = dict(vocab_size=262208, sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})
    fields = RELEASED[flavor] if flavor == "1B" else from_4b | RELEASED[flavor]
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    args = GEMMA3.hf.args_from_config(transformers.Gemma3TextConfig(**fields).to_dict())
    assert GEMMA3.flavor_of(args) == flavor
    assert args == FLAVORS[flavor]  # the flavor is the released config.json, not only its shapes
    assert parameter_count(GEMMA3, FLAVORS[flavor]) == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize("changes", [{}, dict(tie_word_embeddings=False, attention_bias=True)], ids=["tied", "untied"])
def test_hf_directories_read_and_write_with_transformers_logits(tmp_path, changes):
    """HF -> DCP -> our model, HF -> two pipeline stages directly, ``load_model``, and back to an HF
    directory that ``transformers`` loads as ``Gemma3ForCausalLM``: logits within 1e-5 each way."""
    hf = tiny_text(**changes)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
        convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
        for source, pp in ((tmp_path / "dcp", 1), (tmp_path / "hf", 2)):
            assert (our_logits(source, TOKENS, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        assert (load_model(tmp_path / "hf")(TOKENS) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(back).__name__ == "Gemma3ForCausalLM"
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


def test_the_multimodal_directory_reads_its_decoder_and_skips_the_vision_tower(tmp_path):
    """A ``gemma3`` directory (``text_config``; the decoder under ``language_model.model.`` as
    ``save_pretrained`` writes it, or ``model.language_model.`` as the module names it): its text
    logits within 1e-5, the vision tower skipped with one line, exported as ``Gemma3ForCausalLM``."""
    hf = tiny_multimodal()
    hf.save_pretrained(tmp_path / "hf")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", renamed)
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in stored)
    unwrapped = {name.replace("language_model.model.", "model.language_model."): t for name, t in stored.items()}
    save_file(unwrapped, renamed / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits
        for source in (tmp_path / "hf", renamed):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = load_model(source)(TOKENS)
            assert (got - want).abs().max().item() <= 1e-5, source
            [line] = [str(w.message) for w in caught if "vision tower" in str(w.message)]
            assert "\n" not in line
        with pytest.warns(UserWarning, match="vision tower"):
            convert(tmp_path / "hf", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(back).__name__ == "Gemma3ForCausalLM"
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


def test_packed_rows_compute_each_document_alone(tmp_path):
    """Documents packed in a row (positions restarting, longer than the window, the global layers'
    and the windowed layers' tables each indexed by them) within 1e-5 of ``transformers`` on each
    document alone."""
    assert packed_rows_gap(tiny_text(), tmp_path, TOKENS) <= 1e-5


def packed_rows_gap(hf, path, tokens: torch.Tensor, lengths=(12, 3, 5)) -> float:
    """The largest gap between our logits of ``tokens``' rows packed as documents of ``lengths``
    (positions restarting) and ``hf``'s logits of each document alone, ``hf`` saved at ``path``."""
    hf.save_pretrained(path)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(len(tokens), -1)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(len(tokens), -1)
    with torch.no_grad():
        packed = load_model(path)(tokens, positions=positions, document_ids=documents)
        alone = torch.cat([hf(part).logits for part in tokens.split(lengths, dim=1)], dim=1)
    return (packed - alone).abs().max().item()


def test_the_embedding_scale_is_rounded_to_the_embedding_dtype_as_transformers_rounds_it():
    """In bfloat16 sqrt(72) rounds to 8.5: the scaled embedding is transformers' bitwise (multiplying
    by the unrounded 8.485... differs in some elements)."""
    hf = tiny_text(hidden_size=72).to(torch.bfloat16)
    ours = Transformer(GEMMA3.hf.args_from_config(hf.config.to_dict()))
    ours.tok_embeddings.to(torch.bfloat16).weight.data.copy_(hf.model.embed_tokens.weight)
    with torch.no_grad():
        want = hf.model.embed_tokens(TOKENS)
        assert torch.equal(ours.embed(TOKENS), want)
        assert not torch.equal(ours.tok_embeddings(TOKENS) * 72**0.5, want)


def test_a_float64_models_norm_computes_in_float64():
    """``1 + weight`` is computed in float32 at least (``upcast``): a float64 model's in float64."""
    norm = rms_norm(64, 1e-6, offset=True).double()
    torch.nn.init.normal_(norm.weight, std=0.1)
    x = torch.randn(3, 64, dtype=torch.float64) * 1e3
    exact = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + norm.weight)
    assert (norm(x) - exact).abs().max() < 1e-12  # in float32: 2e-7


def test_the_seed_recipe_is_transformers_normal_init_with_norms_at_zero():
    """Every weight normal with std ``initializer_range`` (the tied matrix once), every norm's weight
    -- the blocks' four, the q/k head norms, the final one -- zero: the identity of ``1 + weight``."""
    args = FLAVORS["debug"]
    with torch.device("meta"):
        recipe = init_model(Transformer(args), seed=0, materialize=False)
    norms = {fqn: spec for fqn, spec in recipe.items() if fqn.endswith("norm.weight")}
    assert len(norms) == 6 * args.n_layers + 1
    assert {spec.kind for spec in norms.values()} == {"zeros"}
    weights = [spec for fqn, spec in recipe.items() if fqn not in norms]
    assert {(spec.kind, spec.std) for spec in weights} == {("normal", args.initializer_range)}
    assert "output.weight" not in recipe  # tied: the embedding's


def test_a_windowed_layer_counts_its_attention_over_the_window():
    args = FLAVORS["1B"]
    costs = GEMMA3.layer_flops(args, 8192)
    per_position = 12 * args.n_heads * args.head_dim
    assert costs.blocks[5] - costs.blocks[0] == per_position * (8192 - 512)  # layer 5 global, 0 windowed
    assert GEMMA3.flops_per_token(args, 256) == GEMMA3.flops_per_token(args, 256, parameter_count(GEMMA3, args))
    every_layer_full = 6 * parameter_count(GEMMA3, args) + args.n_layers * per_position * 8192
    assert GEMMA3.flops_per_token(args, 8192) == every_layer_full - 22 * per_position * (8192 - 512)


def test_a_transformers_4_config_reads_as_the_released_flavor():
    """The hub's 4B ``gemma3`` config.json (``text_config`` with ``rope_scaling`` and no layer kinds)
    is the 4B flavor: the global layers stretched 8x, every sixth layer global, tied."""
    args = GEMMA3.hf.args_from_config({"model_type": "gemma3", "text_config": HUB_4B_TEXT})
    assert args == FLAVORS["4B"]
    assert args.rope_scaling == LINEAR_8X and args.window_layers == sliding_layers(34)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping = 50.0"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention = True"),
        ("hidden_activation", "gelu", "hidden_activation = 'gelu'"),
        ("attention_dropout", 0.1, "attention_dropout = 0.1"),
        ("head_dim", None, "head_dim = null"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "factor, rope_type at its top"),
        (
            "rope_parameters",
            {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
            "stretches the sliding-window layers' RoPE",
        ),
    ],
)
def test_config_fields_this_version_does_not_compute_are_refused_in_one_line(tmp_path, field, value, message):
    tiny_text().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(SeedckptError, match=message) as refused:
        load_model(tmp_path)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_seed_then_tp2_x_dp_shard2_trains_like_one_process(tmp_path):
    """The debug flavor's seed (windows of 16 in 32-token rows, one global layer) on tp2 x dp_shard2
    (sequence parallel: the sandwich norms split along the sequence) with one process's losses."""
    from seedckpt.materialize.seed import create_seed_checkpoint
    from tests.conftest import tiny_config
    from tests.test_train import losses, torchrun

    family = ["--model.name", "gemma3"]
    seed = create_seed_checkpoint(tiny_config(*family), tmp_path / "seed", seed=0, progress=False, workers=1)
    common = [*family, "--training.steps", "3", "--parallelism.pipeline_parallel_degree", "1"]
    torchrun(tmp_path / "one", seed, 1, *common, "--training.local_batch_size", "8")
    tp = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
    torchrun(tmp_path / "four", seed, 4, *common, *tp)
    reference, got = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert len(got) == len(reference) == 3
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.slow
def test_osft_from_a_multimodal_directory_trains_its_decoder_and_exports_what_transformers_loads(tmp_path, chat_inputs):
    """A fine-tuning start from the multimodal directory (its decoder; the vocabulary grown to the
    tokenizer's), OSFT on the default targets -- every attention and feed-forward matrix --, then
    its dense export, which ``transformers`` loads as ``Gemma3ForCausalLM`` with the step's logits."""
    from tests.test_sft import sft

    tokenizer, chats, _ = chat_inputs
    tiny_multimodal().save_pretrained(tmp_path / "hf")
    overrides = ["--finetune.mode", "osft", "--parallelism.pipeline_parallel_degree", "1"]
    sft(tmp_path / "run", tmp_path / "hf", tokenizer, chats, 1, *overrides, "--training.steps", "3")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["osft_leak"] < 1e-4 for row in rows)
    stored = json.loads((tmp_path / "run" / "ckpt" / "step-3" / "seedckpt.json").read_text())["tensors"]
    factored = {fqn.removesuffix(".U_low") for fqn in stored if fqn.endswith(".U_low")}
    linears = [f"layers.{i}.{target}" for i in range(TINY["num_hidden_layers"]) for target in GEMMA3.osft_targets]
    assert factored == set(linears)
    convert(tmp_path / "run" / "ckpt" / "step-3", tmp_path / "export", "hf", dense=True, progress=False)
    export = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(export).__name__ == "Gemma3ForCausalLM"
    step = load_model(tmp_path / "run" / "ckpt" / "step-3")
    with torch.no_grad():
        assert (step(TOKENS) - export(TOKENS).logits).abs().max().item() <= 1e-5
