"""Every model family against ``transformers``: released parameter counts, HF directories read and
written with logits within 1e-5 of the family's own class (tied and untied, GQA, biases, q/k norms,
multipliers), and the config fields that change the math read or refused in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from models.registry import FAMILIES, get_family
from seedckpt import load_model
from seedckpt.cli.convert import convert, diff
from seedckpt.materialize.model_checkpoint import parameter_count
from seedckpt.utils.errors import SeedckptError
from tests.test_convert import our_logits
from tests.test_sft import chat_inputs  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")

# The released models' parameter counts (their config.json shapes; a tied matrix counted once).
RELEASED = {
    ("llama3", "1B"): 1_235_814_400,
    ("llama3", "3B"): 3_212_749_824,
    ("llama3", "8B"): 8_030_261_248,
    ("llama3", "70B"): 70_553_706_496,
    ("llama3", "405B"): 405_853_388_800,
    ("qwen3", "0.6B"): 596_049_920,
    ("qwen3", "1.7B"): 1_720_574_976,
    ("qwen3", "4B"): 4_022_468_096,
    ("qwen3", "8B"): 8_190_735_360,
    ("qwen3", "32B"): 32_762_123_264,
    ("qwen2", "0.5B"): 494_032_768,
    ("qwen2", "1.5B"): 1_543_714_304,
    ("qwen2", "7B"): 7_615_616_512,
    ("qwen2", "72B"): 72_706_203_648,
    ("mistral", "7B"): 7_241_732_096,
    ("mistral", "7B-v0.3"): 7_248_023_552,
    ("granite", "2B"): 2_533_531_648,
    ("granite", "8B"): 8_170_848_256,
    ("qwen3_moe", "30B-A3B"): 30_532_122_624,
    ("qwen3_moe", "235B-A22B"): 235_093_634_560,
    ("mixtral", "8x7B"): 46_702_792_704,
    ("mixtral", "8x22B"): 140_630_071_296,
    ("gpt_oss", "20B"): 20_914_757_184,
    ("gpt_oss", "120B"): 116_829_156_672,
    ("deepseek_v3", "16B"): 15_706_484_224,
    ("deepseek_v3", "671B"): 671_026_404_352,  # without the multi-token-prediction layer
    ("gemma3", "1B"): 999_885_952,
    ("gemma3", "4B"): 3_880_263_168,  # the text decoders of the multimodal releases
    ("gemma3", "12B"): 11_766_034_176,
    ("gemma3", "27B"): 27_009_346_304,
    ("gemma2", "2B"): 2_614_341_888,
    ("gemma2", "9B"): 9_241_705_984,
    ("gemma2", "27B"): 27_227_128_320,
    ("gemma4", "E2B"): 4_628_569_344,  # the text decoders of the multimodal releases (E2B, E4B: per-layer inputs)
    ("gemma4", "E4B"): 7_463_013_376,
    ("gemma4", "26B-A4B"): 25_233_141_760,
    ("gemma4", "31B"): 30_697_345_280,
    ("glm4_moe", "355B-A32B"): 352_797_814_784,  # GLM-4.5, without its multi-token-prediction layer
    ("glm4_moe", "106B-A12B"): 106_852_245_504,  # GLM-4.5-Air, the same
    ("qwen3_5", "0.8B"): 752_393_024,  # the text decoders of the multimodal releases
    ("qwen3_5", "2B"): 1_881_825_088,
    ("qwen3_5", "4B"): 4_205_751_296,
    ("qwen3_5", "9B"): 8_953_803_264,
    ("qwen3_5", "27B"): 26_895_998_464,
    ("qwen3_5_moe", "35B-A3B"): 34_660_610_688,  # the text decoders of the multimodal releases
    ("qwen3_5_moe", "122B-A10B"): 122_111_526_912,
    ("qwen3_5_moe", "397B-A17B"): 396_346_350_336,
    ("kimi_k2", "1T"): 1_026_408_209_408,  # Kimi-K2-Instruct, as DeepseekV3ForCausalLM counts it
}
CLASSES = {
    "llama3": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}
# A model_type transformers has no class for, and the one it reads such a config as
READ_AS = {"kimi_k2": "deepseek_v3"}
# A released flavor whose config.json is another class's: torchtitan's 16B routes by softmax, DeepSeek-V2's
RELEASED_CLASSES = {("deepseek_v3", "16B"): "DeepseekV2ForCausalLM"}
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
# Every config.json model_type a family reads, in the registry's order (as a refusal lists them)
MODEL_TYPES_READ = ", ".join(repr(t) for family in FAMILIES.values() for t in family.hf.model_types)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied matrix once


@pytest.mark.parametrize("name,flavor", sorted(RELEASED))
def test_flavors_have_the_released_parameter_counts_and_transformers_agrees(name, flavor):
    family = get_family(name)
    args = family.flavors[flavor]
    written = family.hf.config(args, torch.bfloat16)
    config = transformers.AutoConfig.for_model(**written | {"model_type": READ_AS.get(name, written["model_type"])})
    with torch.device("meta"):
        ours, theirs = family.model(args), transformers.AutoModelForCausalLM.from_config(config)
    assert type(theirs).__name__ == RELEASED_CLASSES.get((name, flavor), CLASSES[name])
    assert _count(ours) == _count(theirs) == RELEASED[name, flavor]
    # the count the FLOPs per token (MFU) take, read off the layout rather than a model built again
    assert parameter_count(family, args) == RELEASED[name, flavor]


def test_every_family_has_a_debug_flavor_and_a_released_one():
    for name, family in FAMILIES.items():
        assert "debug" in family.flavors
        assert any(key[0] == name for key in RELEASED), name


def _hf_model(name: str, tie: bool):
    """A small random model of the family's own ``transformers`` class (GQA), from its own config
    class, every tensor random (norms and biases too) so that nothing can hide."""
    torch.manual_seed(1)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    config = {
        "llama3": lambda: transformers.LlamaConfig(**common, rope_theta=500000.0),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16, rope_theta=1e6),
        "qwen2": lambda: transformers.Qwen2Config(**common, rope_theta=1e6),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=64, rope_theta=1e6),
        "granite": lambda: transformers.GraniteConfig(
            **common,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.03,
            logits_scaling=4.0,
        ),
        # experts whose top-k choices are spread (8 experts, 3 layers, one dense): routing matters
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            rope_theta=1e6,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    }[name]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", ["qwen3", "qwen2", "mistral", "granite", "qwen3_moe", "mixtral"])
def test_hf_directories_read_and_write_with_transformers_logits(tmp_path, name, tie):
    """HF -> DCP -> our model, HF -> our pipeline stages directly, and back to an HF directory that
    ``transformers`` loads as the family's class: logits within 1e-5 of the original each way."""
    hf = _hf_model(name, tie)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
        convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
        manifest = json.loads((tmp_path / "dcp" / "seedckpt.json").read_text())
        assert manifest["model"]["name"] == name  # found from config.json's model_type
        for source, pp in ((tmp_path / "dcp", 1), (tmp_path / "hf", 2)):
            assert (our_logits(source, TOKENS, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(back).__name__ == CLASSES[name]
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "name,field,value,message",
    [
        ("qwen3", "hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("qwen3", "attention_bias", True, "attention_bias = True"),
        ("mistral", "rope_parameters", {"rope_type": "dynamic", "factor": 4.0}, "'dynamic' RoPE scaling"),
        ("granite", "mlp_bias", True, "mlp_bias = True"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(tmp_path, name, field, value, message):
    _hf_model(name, tie=False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config[field] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SeedckptError, match=message.replace("(", r"\(").replace("[", r"\[")):
        convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    assert not (tmp_path / "dcp").exists()


# A config.json value of the wrong type or out of range, by family: (family, field, value, the refusal).
# field None: the whole config.json is that value.
NONSENSE = [
    ("qwen3", "rms_norm_eps", "1e-6", "rms_norm_eps = '1e-6'; it must be a finite number > 0"),
    ("llama3", "rms_norm_eps", -1e-5, "rms_norm_eps = -1e-05; it must be a finite number > 0"),
    ("qwen3", "rope_theta", float("nan"), "rope_theta = nan; it must be a finite number > 0"),
    ("llama3", "rope_theta", float("inf"), "rope_theta = inf; it must be a finite number > 0"),
    ("granite", "attention_multiplier", 0, "attention_multiplier = 0; it must be a finite number > 0"),
    ("granite", "logits_scaling", 0.0, "logits_scaling = 0.0; it must be a finite number > 0"),
    ("qwen3", "layer_types", ["full_attention", "chunked_attention", "full_attention"], "'chunked_attention'"),
    ("qwen2", "num_key_value_heads", 2.0, "num_key_value_heads = 2.0; it must be an integer >= 1"),
    ("mistral", "tie_word_embeddings", "false", "tie_word_embeddings = 'false'; it must be true or false"),
    ("mistral", "sliding_window", 0, "sliding_window = 0; it must be an integer >= 1"),
    ("qwen3_moe", "num_experts", "8", "num_experts = '8'; it must be an integer >= 1"),
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok = 9; it must be at most num_local_experts = 8"),
    ("qwen3_moe", "moe_intermediate_size", 0, "moe_intermediate_size = 0; it must be an integer >= 1"),
    ("qwen3_moe", "norm_topk_prob", 1, "norm_topk_prob = 1; it must be true or false"),
    ("qwen3_moe", "mlp_only_layers", [1, 5], "mlp_only_layers = [1, 5] names layers [5]"),
    ("qwen3_moe", "decoder_sparse_step", 0, "decoder_sparse_step = 0; it must be an integer >= 1"),
    ("mixtral", "router_aux_loss_coef", -0.01, "router_aux_loss_coef = -0.01; it must be a finite number >= 0"),
    ("mixtral", "num_local_experts", None, "config.json lacks num_local_experts (or num_experts)"),
    ("qwen2", None, [], "config.json holds a JSON list, not an object"),
]


@pytest.mark.parametrize("name,field,value,message", NONSENSE, ids=[f"{c[0]}-{c[1]}" for c in NONSENSE])
def test_config_values_of_the_wrong_type_or_range_are_refused_naming_the_field(
    tmp_path, capsys, name, field, value, message
):
    """Each is refused when the directory is opened, by ``convert`` and ``diff`` (exit 2, one line, nothing
    written), ``load_model`` and a fine-tuning start (the family found in the directory), never later
    inside the model (a TypeError, a NaN logit, "buffers not recomputed")."""
    from seedckpt.cli.main import main as cli
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve

    hf = tmp_path / "hf"
    _hf_model(name, tie=False).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(value if field is None else {**config, field: value}))
    capsys.readouterr()  # transformers' progress bar
    for command in (["convert", str(hf), str(tmp_path / "out"), "--to", "dcp", "--quiet"], ["diff", str(hf), str(hf)]):
        assert cli(command) == 2, command
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    sft = load_config(None, ["--finetune.mode", "sft", "--finetune.pretrained", str(hf)])
    for start in (lambda: load_model(hf), lambda: resolve(sft, 1, local_world_size=0)):
        with pytest.raises(SeedckptError, match=re.escape(message)) as refused:
            start()
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "model_type,model,message",
    [
        ("qwen3", "llama3", "model_type 'qwen3', not a llama3 model: set model.name = 'qwen3'"),
        (
            "phi3",
            None,
            f"config.json has model_type 'phi3', which no model family here reads (they read {MODEL_TYPES_READ}); "
            "a family is added as 'Adding a family' in docs/model_families.md describes",
        ),
    ],
)
def test_a_directory_of_another_family_names_the_model_name_to_set(tmp_path, model_type, model, message):
    """Another family's directory read as llama3 names the model.name to set; a model_type no family reads
    names the ones read and where adding a family is described -- not a family the user never named."""
    _hf_model("qwen3", tie=False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(SeedckptError, match=re.escape(message)) as refused:
        load_model(tmp_path / "hf", model=model)
    assert (model is not None) == ("llama3" in str(refused.value))


@pytest.mark.parametrize(
    "model_keys,refusal",
    [
        ([], None),
        (["--model.name", "qwen3"], None),
        (
            ["--model.name", "llama3"],
            "config.json has model_type 'qwen3', not a llama3 model: set model.name = 'qwen3'",
        ),
        (
            ["--model.n_layers", "2"],
            "[model] would change the tensors of finetune.pretrained {hf}, which fixes them: model.n_layers = 2 "
            "(the checkpoint: 3)",
        ),
    ],
    ids=["no [model]", "the same family", "another family", "another shape"],
)
def test_a_fine_tuning_start_takes_family_and_shape_from_the_hf_directory(tmp_path, model_keys, refusal):
    """As ``convert`` and ``load_model`` do: ``[model]`` is not needed, and what it says that the
    directory contradicts is refused, naming both."""
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve

    hf = tmp_path / "hf"
    _hf_model("qwen3", tie=False).save_pretrained(hf)
    cfg = load_config(None, ["--finetune.mode", "sft", "--finetune.pretrained", str(hf), *model_keys])
    if refusal is not None:
        with pytest.raises(SeedckptError, match=re.escape(refusal.format(hf=hf))) as refused:
            resolve(cfg, 1, local_world_size=0)
        assert str(hf) in str(refused.value) and "\n" not in str(refused.value)
        return
    run = resolve(cfg, 1, local_world_size=0)
    assert run.cfg.model.name == run.family.name == "qwen3"
    assert run.args == get_family("qwen3").hf.args_from_config(json.loads((hf / "config.json").read_text()))


WINDOW = 8


@pytest.mark.parametrize("name", ["mistral", "mixtral"])
def test_an_attention_window_matches_transformers_past_it(tmp_path, name):
    """A directory with a sliding window of 8, 40 positions in: ``load_model``'s module and pp=2's
    stages compute ``transformers``' logits (where the window drops positions), and the export back
    to HF keeps the window."""
    hf = _hf_model(name, tie=False)
    hf.config.sliding_window = WINDOW
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    assert diff(tmp_path / "hf", tmp_path / "dcp")[0]
    with torch.no_grad():
        want = hf(TOKENS).logits
        hf.config.sliding_window = None
        assert (hf(TOKENS).logits - want).abs().max().item() > 1e-3  # the window matters
        assert (load_model(tmp_path / "hf")(TOKENS) - want).abs().max().item() <= 1e-5
        assert (our_logits(tmp_path / "dcp", TOKENS, pp=2) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert back.config.sliding_window == WINDOW
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5


FAMILIES_BEYOND_LLAMA = ["qwen3", "qwen2", "mistral", "granite"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "qwen2", "granite"])
def test_seed_then_pp2_x_dp_shard2_matches_one_process(tmp_path, name):
    """A seed of the family's debug flavor trains on pp=2 x dp_shard=2 with the losses of one
    process (the same global batch) within 1e-5. (Mistral's math is Llama 3's, which
    ``test_train`` runs in every layout.)"""
    from seedckpt.materialize.seed import create_seed_checkpoint
    from tests.conftest import tiny_config
    from tests.test_train import losses, torchrun

    family = ["--model.name", name]
    seed = create_seed_checkpoint(tiny_config(*family), tmp_path / "seed", seed=0, progress=False, workers=1)
    steps = ["--training.steps", "4", *family]
    torchrun(
        tmp_path / "one",
        seed,
        1,
        *steps,
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--training.local_batch_size",
        "8",
    )
    torchrun(
        tmp_path / "four",
        seed,
        4,
        *steps,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_microbatches",
        "2",
    )
    reference, got = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert len(got) == len(reference) == 4
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES_BEYOND_LLAMA)
def test_osft_from_the_familys_hf_directory_exports_what_transformers_loads(tmp_path, name, chat_inputs):
    """OSFT (the biases of Qwen2 stay dense and train) from the family's HF directory, then its
    dense export, which ``transformers`` loads as the family's class."""
    from tests.test_sft import sft

    tokenizer, chats, _ = chat_inputs
    _hf_model(name, tie=name in ("qwen3", "qwen2")).save_pretrained(tmp_path / "hf")
    sft(
        tmp_path / "run",
        tmp_path / "hf",
        tokenizer,
        chats,
        1,  # no --model.name: the family is the directory's
        "--finetune.mode",
        "osft",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--training.steps",
        "4",
        "--checkpoint.interval",
        "4",
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["osft_leak"] < 1e-4 for row in rows)
    convert(tmp_path / "run" / "ckpt" / "step-4", tmp_path / "export", "hf", dense=True, progress=False)
    export = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(export).__name__ == CLASSES[name]
    step = load_model(tmp_path / "run" / "ckpt" / "step-4")  # its factors rebuilt dense
    tokens = TOKENS % step.args.vocab_size
    with torch.no_grad():
        assert (step(tokens) - export(tokens).logits).abs().max().item() <= 1e-5
    if name == "qwen2":  # the biases stayed dense parameters, trained, and were exported
        bias = "model.layers.0.self_attn.v_proj.bias"
        before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()[bias]
        assert torch.equal(export.state_dict()[bias], step.layers["0"].attention.wv.bias)
        assert not torch.equal(export.state_dict()[bias], before)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen2", "mistral", "granite"])
def test_load_model_reads_every_format_as_transformers_computes(tmp_path, name):
    """``load_model`` on an HF directory, the DCP checkpoint, one safetensors file and one torch
    file converted from it: the family's module in eval mode, logits within 1e-5 of ``transformers``."""
    hf = _hf_model(name, tie=name == "qwen3")
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    convert(tmp_path / "dcp", tmp_path / "model.safetensors", "safetensors", progress=False)
    convert(tmp_path / "dcp", tmp_path / "model.pt", "torch", progress=False)
    with torch.no_grad():
        want = hf(TOKENS).logits
        for source in ("hf", "dcp", "model.safetensors", "model.pt"):
            model = load_model(tmp_path / source)
            assert get_family(name).args is type(model.args) and not model.training, source
            assert (model(TOKENS) - want).abs().max().item() <= 1e-5, source
        bf16 = load_model(tmp_path / "dcp", dtype=torch.bfloat16)
        assert bf16.output.weight.dtype == torch.bfloat16 and bf16.freqs_cis.is_complex()
        assert (bf16(TOKENS).float() - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_every_command_takes_a_family(tmp_path, capsys):
    """``seed``, ``inspect``, ``verify``, ``plan``, ``convert`` and ``diff`` on a Qwen3 model, which
    each finds in the checkpoint (the manifest, then ``config.json``)."""
    from seedckpt.cli.main import main as cli

    seed, hf = str(tmp_path / "seed"), str(tmp_path / "hf")
    family = ["--config", "configs/debug.toml", "--model.name", "qwen3"]
    assert cli(["seed", *family, "--output", seed, "--quiet"]) == 0
    assert cli(["inspect", seed]) == 0
    assert "model qwen3 debug" in capsys.readouterr().out
    assert cli(["verify", seed, "--quiet"]) == 0
    assert cli(["plan", *family, "--world-size", "4"]) == 0
    assert cli(["convert", seed, hf, "--to", "hf", "--quiet"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3"
    capsys.readouterr()
    assert cli(["diff", seed, hf]) == 0  # the q/k rows and their norms went out permuted and came back
    assert capsys.readouterr().out.splitlines()[-1].startswith("equal: 69 tensors compared")
