"""Awkward configs of the families with windows, YaRN, MLA and sinks against ``transformers``' own
classes: a random tiny model built from each config (every bias, sink and correction bias
non-zero), saved, read by ``load_model``, converted to DCP and back to HF, and loaded by
``transformers`` again, logits within 1e-5 each way on inputs past every window and original
context. Each case is a path the families' own tests do not take; the config.json edits are what
hub files written before transformers 5 look like. Two tests below pin what this check found
wrong at first: inputs past max_position_embeddings, and files without the RoPE fields whose
class defaults differ from Llama's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seedckpt import load_model
from seedckpt.cli.convert import convert
from tests.test_deepseek_v3 import TINY_FIELDS

transformers = pytest.importorskip("transformers")


def yarn(factor: float, original: int, theta: float = 1e4, **more) -> dict:
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor}
    return rope | {"original_max_position_embeddings": original, **more}


DEEPSEEK = TINY_FIELDS
GPT_OSS = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
    max_position_embeddings=64,
    rope_parameters=yarn(4.0, 16, 150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
)
DENSE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def legacy_rope(cfg: dict) -> dict:
    """transformers 4's fields: ``rope_theta`` at the top, ``rope_scaling`` with ``type``."""
    parameters = cfg.pop("rope_parameters")
    cfg["rope_theta"] = parameters.pop("rope_theta")
    parameters["type"] = parameters.pop("rope_type")
    cfg["rope_scaling"] = parameters
    return cfg


def legacy_rope_without_original(cfg: dict) -> dict:
    """The original context left out: transformers takes ``max_position_embeddings``."""
    cfg = legacy_rope(cfg)
    del cfg["rope_scaling"]["original_max_position_embeddings"]
    return cfg


def without_layer_types(cfg: dict) -> dict:
    """Windowed layers from ``max_window_layers`` alone, as before ``layer_types`` existed."""
    del cfg["layer_types"]
    return cfg


def window_switched_off(cfg: dict) -> dict:
    """Qwen2.5's hub files: a ``sliding_window`` value with ``use_sliding_window`` false."""
    del cfg["layer_types"]
    return cfg | {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 1}


def without_rope_theta(cfg: dict) -> dict:
    del cfg["rope_parameters"]["rope_theta"]
    return cfg


# name: (transformers class prefix, config fields, config.json edit, tokens per row)
CASES = {
    # plain q, HF's halves-rotated RoPE, 4 groups of 2 (3 kept, 5 chosen), no renormalization,
    # two shared experts, no dense layer, tied embeddings, YaRN with unequal mscales
    "deepseek_plain_q_groups_tied_yarn": (
        "DeepseekV3",
        DEEPSEEK
        | dict(
            q_lora_rank=None,
            rope_interleave=False,
            n_group=4,
            topk_group=3,
            num_experts_per_tok=5,
            norm_topk_prob=False,
            n_shared_experts=2,
            first_k_dense_replace=0,
            tie_word_embeddings=True,
            rope_parameters=yarn(4.0, 16, mscale=0.707, mscale_all_dim=1.0),
        ),
        None,
        40,
    ),
    # 3 heads of odd, unequal widths; 16 experts in 8 groups of 2; YaRN with mscale_all_dim alone
    "deepseek_odd_heads_eight_groups": (
        "DeepseekV3",
        DEEPSEEK
        | dict(
            num_attention_heads=3,
            num_key_value_heads=3,
            qk_nope_head_dim=10,
            qk_rope_head_dim=6,
            v_head_dim=20,
            n_routed_experts=16,
            n_group=8,
            topk_group=3,
            num_experts_per_tok=4,
            rope_parameters=yarn(4.0, 16, mscale_all_dim=0.8),
        ),
        None,
        40,
    ),
    # attention biases (q_a_proj, kv_a_proj_with_mqa -- its RoPE rows halves-rotated -- and o_proj)
    "deepseek_attention_bias_halves": (
        "DeepseekV3",
        DEEPSEEK | dict(attention_bias=True, rope_interleave=False),
        None,
        40,
    ),
    # every layer dense (first_k_dense_replace = num_hidden_layers), a wide v head, linear RoPE
    "deepseek_all_dense_linear_rope": (
        "DeepseekV3",
        DEEPSEEK
        | dict(
            first_k_dense_replace=3,
            v_head_dim=40,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        ),
        None,
        40,
    ),
    # the hub's rope_scaling {"type": "yarn", ...} with the top-level rope_theta
    "deepseek_legacy_rope_scaling": (
        "DeepseekV3",
        DEEPSEEK | dict(rope_parameters=yarn(8.0, 8, beta_fast=8.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=1.0)),
        legacy_rope,
        40,
    ),
    # sliding, sliding, full with a window of 1 (each query sees only itself), MQA, every expert chosen
    "gpt_oss_window_one_mqa_all_experts": (
        "GptOss",
        GPT_OSS
        | dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=1,
            num_key_value_heads=1,
            num_experts_per_tok=4,
        ),
        None,
        40,
    ),
    # head_dim 24 != hidden / heads, YaRN truncated, a clamp that bites, 300 tokens (a window of 7
    # over blocks of queries)
    "gpt_oss_wide_heads_truncated_yarn_long": (
        "GptOss",
        GPT_OSS
        | dict(
            head_dim=24,
            num_attention_heads=6,
            num_key_value_heads=3,
            sliding_window=7,
            swiglu_limit=0.3,
            max_position_embeddings=512,
            rope_parameters=yarn(4.0, 16, 150000.0, beta_fast=32.0, beta_slow=1.0, truncate=True),
        ),
        None,
        300,
    ),
    # the hub's rope_scaling without original_max_position_embeddings, no layer_types (alternating)
    "gpt_oss_legacy_rope_no_original_no_layer_types": (
        "GptOss",
        GPT_OSS | dict(num_hidden_layers=3),
        lambda cfg: without_layer_types(legacy_rope_without_original(cfg)),
        40,
    ),
    "mistral_window_one_tied": ("Mistral", DENSE | dict(sliding_window=1, tie_word_embeddings=True), None, 40),
    "mistral_window_yarn_head_dim": (
        "Mistral",
        DENSE | dict(sliding_window=7, head_dim=12, rope_parameters=yarn(4.0, 8)),
        None,
        40,
    ),
    "qwen2_max_window_layers_without_layer_types": (
        "Qwen2",
        DENSE | dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
        without_layer_types,
        40,
    ),
    "qwen2_window_switched_off": ("Qwen2", DENSE, window_switched_off, 40),
    "qwen3_layer_types_sliding_full_sliding": (
        "Qwen3",
        DENSE
        | dict(
            head_dim=12,
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        None,
        40,
    ),
    # Qwen3's long-context YaRN (factor 4) with an original context of 2, and a window from layer 1
    "qwen3_yarn_tiny_original_window_tied": (
        "Qwen3",
        DENSE
        | dict(
            head_dim=16,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            tie_word_embeddings=True,
            rope_parameters=yarn(4.0, 2, 1e6),
        ),
        None,
        40,
    ),
    # Qwen3-MoE slides every layer, whatever max_window_layers says
    "qwen3_moe_window_ignores_max_window_layers": (
        "Qwen3Moe",
        DENSE
        | dict(
            head_dim=16,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=False,
        ),
        None,
        40,
    ),
    "mixtral_window": ("Mixtral", DENSE | dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2), None, 40),
}


def hf_model(path: Path, kind: str, fields: dict, edit=None):
    """A random ``<kind>ForCausalLM`` saved at ``path`` (its config.json edited by ``edit``), and
    the model ``transformers`` loads from there. Norms near one, every other vector (biases,
    sinks) and the correction bias clearly non-zero."""
    torch.manual_seed(4)
    model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3) if p.dim() == 1 else p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    if edit is not None:
        (path / "config.json").write_text(json.dumps(edit(json.loads((path / "config.json").read_text()))))
    return getattr(transformers, f"{kind}ForCausalLM").from_pretrained(path).eval()


def tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 96, (2 if n <= 64 else 1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", CASES)
def test_awkward_configs_match_transformers_both_ways(tmp_path, case):
    kind, fields, edit, n = CASES[case]
    hf = hf_model(tmp_path / "hf", kind, fields, edit)
    x = tokens(n)
    with torch.no_grad():
        want = hf(x).logits
        assert (load_model(tmp_path / "hf")(x) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        back = getattr(transformers, f"{kind}ForCausalLM").from_pretrained(tmp_path / "back").eval()
        assert (back(x).logits - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "kind,fields", [("Qwen3", DENSE | dict(head_dim=16)), ("DeepseekV3", DEEPSEEK)], ids=["qwen3", "deepseek_v3"]
)
def test_inputs_past_max_position_embeddings_compute_transformers_logits(tmp_path, kind, fields):
    hf = hf_model(tmp_path / "hf", kind, fields | dict(max_position_embeddings=32))
    x = tokens(40)
    with torch.no_grad():
        assert (load_model(tmp_path / "hf")(x) - hf(x).logits).abs().max().item() <= 1e-5


def without_rope_fields(cfg: dict) -> dict:
    """No RoPE table at all (a pre-5 file of a family whose class stretches by default), no epsilon."""
    del cfg["rope_parameters"], cfg["rms_norm_eps"]
    return cfg


@pytest.mark.parametrize(
    "kind,fields,edit",
    [
        ("GptOss", GPT_OSS, without_rope_theta),
        ("GptOss", GPT_OSS, without_rope_fields),
        ("Mixtral", DENSE | dict(num_local_experts=4, num_experts_per_tok=2), without_rope_theta),
        ("Mixtral", DENSE | dict(num_local_experts=4, num_experts_per_tok=2), without_rope_fields),
    ],
    ids=["gpt_oss_no_theta", "gpt_oss_no_rope_no_eps", "mixtral_no_theta", "mixtral_no_rope_no_eps"],
)
def test_a_config_without_rope_fields_takes_the_classes_defaults(tmp_path, kind, fields, edit):
    """transformers fills a field a file leaves out from the family's config class (gpt-oss: base
    150000 and YaRN x32, epsilon 1e-5; Mixtral: base 1e6, epsilon 1e-5), and so do we."""
    hf = hf_model(tmp_path / "hf", kind, fields, edit)
    x = tokens(40)
    with torch.no_grad():
        assert (load_model(tmp_path / "hf")(x) - hf(x).logits).abs().max().item() <= 1e-5
