"""Each field of each family's ``config.json`` left out, one at a time, against ``transformers``: a
file without a field means the default of the family's config class there, so from the same weights
ours must compute the logits ``transformers`` computes (within 1e-5) or refuse where it cannot load
them, and must read the file as it reads the full file ``transformers`` writes once its class has
filled the field in (which checks the fields that change no logit: ``initializer_range``,
``max_position_embeddings``, ``router_aux_loss_coef``; and the shapes, whose defaults no tiny weights
match). The defaults come from the classes themselves, never copied here. Each field set to null
too: read as ``transformers`` reads it (refused, in one line naming it, where the class refuses it).

Fields whose default changes the weights' shapes (``hidden_size``, ``vocab_size``,
``num_hidden_layers``, ``intermediate_size``, ``num_attention_heads``, the experts' counts and
widths ...) leave ``transformers`` unable to load the tiny weights, so there both sides must refuse;
where it is cheap the tiny model takes the class's own value (Qwen3's ``head_dim``, Qwen3-MoE's key
and value heads, gpt-oss's ``head_dim``) so that leaving the field out computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from models.registry import get_family
from seedckpt import load_model
from seedckpt.utils.errors import SeedckptError
from tests.test_awkward_configs import DEEPSEEK, DENSE, GPT_OSS, hf_model, tokens
from tests.test_deepseek_v2 import TINY as DEEPSEEK_V2
from tests.test_gemma4 import MOE as GEMMA4_MOE
from tests.test_gemma4 import TINY as GEMMA4
from tests.test_glm4_moe import TINY as GLM4_MOE
from tests.test_qwen3_5 import TINY as QWEN3_5
from tests.test_qwen3_5_moe import TINY as QWEN3_5_MOE

transformers = pytest.importorskip("transformers")

TWO_LAYERS = DENSE | dict(num_hidden_layers=2)
V2_GROUPS = dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0)
GLM_ROUTING = dict(use_qk_norm=True, n_routed_experts=16, n_group=4, topk_group=2, routed_scaling_factor=2.0)
GLM_ROUTING |= dict(num_experts_per_tok=2)  # the class's 8 fit in the 2 groups kept
GLM_ROUTING |= dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
# family: (transformers class prefix, the tiny config's fields). Experts per token below the class's
# default, with at least that many experts, so that the default computes and routes differently.
FAMILIES = {
    "llama3": ("Llama", TWO_LAYERS | dict(rope_theta=5e5, rms_norm_eps=1e-5)),
    "qwen3": ("Qwen3", TWO_LAYERS | dict(num_attention_heads=4, head_dim=128, rope_theta=1e6)),
    "qwen2": (
        "Qwen2",
        TWO_LAYERS | dict(rope_theta=1e6, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "mistral": ("Mistral", TWO_LAYERS | dict(sliding_window=6, rope_theta=1e6)),
    "granite": (
        "Granite",
        TWO_LAYERS
        | dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03, logits_scaling=4.0),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        TWO_LAYERS
        | dict(
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            use_sliding_window=True,
            sliding_window=4,
        ),
    ),
    "mixtral": ("Mixtral", TWO_LAYERS | dict(num_local_experts=4, num_experts_per_tok=1, sliding_window=6)),
    "gpt_oss": ("GptOss", GPT_OSS | dict(head_dim=64)),
    "deepseek_v3": ("DeepseekV3", DEEPSEEK | dict(num_hidden_layers=2)),
    # DeepSeek-V2, read by the deepseek_v3 family: softmax groups ranked by their best score
    "deepseek_v2": ("DeepseekV2", DEEPSEEK_V2 | dict(num_hidden_layers=2, **V2_GROUPS)),
    # a quarter of each head turned (the class's default: a half), q/k norms, groups, fewer experts a token
    "glm4_moe": ("Glm4Moe", GLM4_MOE | dict(num_hidden_layers=2, **GLM_ROUTING)),
    # a windowed and a global layer, each RoPE base its own, the global one stretched; untied, so that
    # the class's tie is seen (transformers keeps the stored head, and says so). Small heads: with the
    # class's 256 (norms scaling by ~2 here) transformers' own float32 logits are 1.4e-5 off its float64
    "gemma3": (
        "Gemma3",
        TWO_LAYERS
        | dict(
            num_key_value_heads=4,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
            final_logit_softcapping=5.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    # a linear and a full layer; small heads of both kinds (the class's 256 and 128 would not fit), a
    # half of each head turned (the class's default: a quarter), two value heads per key head
    "qwen3_5": (
        "Qwen3_5",
        QWEN3_5
        | dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        ),
    ),
    # the same two layers, each with 8 experts (3 a token: the class's 8 route to all) and a shared
    # expert; an aux-loss weight of its own, which changes no logit
    "qwen3_5_moe": (
        "Qwen3_5Moe",
        QWEN3_5_MOE
        | dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            router_aux_loss_coef=0.01,
        ),
    ),
}
# Kimi K2: DeepSeek-V3's file under model_type kimi_k2 (EDITS), K2's routing and YaRN betas; transformers reads it
# as deepseek_v3 (READ_AS: it has no kimi_k2 class, and under that model_type leaves the experts unloaded)
K2_YARN = dict(rope_type="yarn", rope_theta=5e4, factor=4.0, original_max_position_embeddings=16, beta_fast=1.0)
K2 = dict(num_hidden_layers=2, routed_scaling_factor=2.827, rope_parameters=K2_YARN | dict(beta_slow=1.0))
FAMILIES["kimi_k2"] = ("DeepseekV3", DEEPSEEK | K2)
EDITS = {"kimi_k2": lambda cfg: {**cfg, "model_type": "kimi_k2"}}
READ_AS = {"kimi_k2": "deepseek_v3"}
# Gemma 2: Gemma 3's tiny layers with one RoPE table, the scores' softcap small enough to bite (the class's: 50)
GEMMA2 = dict(attn_logit_softcapping=2.0, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
FAMILIES["gemma2"] = ("Gemma2", FAMILIES["gemma3"][1] | GEMMA2)
# The config class where it is not ``<prefix>Config`` (``Gemma3Config``, ``Qwen3_5Config``: the multimodal models')
CONFIG_CLASSES = {"gemma3": "Gemma3TextConfig", "qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig"}
# The family that reads a model_type the sweep names by itself
READER = {"deepseek_v2": "deepseek_v3"}
# Gemma 4: test_gemma4's tiny decoder (per-layer inputs, values as keys) with its experts, in four layers, the last
# two reusing the first two's keys, heads of 8 and 16: under this file's random weights ours and transformers'
# float32 logits were 3e-5 apart in six layers of heads of 16 and 32, 1.1e-5 in four
GEMMA4_LAYERS = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
FAMILIES["gemma4"] = ("Gemma4", GEMMA4 | GEMMA4_MOE | GEMMA4_LAYERS | dict(head_dim=8, global_head_dim=16))
CONFIG_CLASSES["gemma4"] = "Gemma4TextConfig"
# What transformers writes about itself or generation, not the model: left in every file.
NOT_THE_MODEL = {"model_type", "transformers_version", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id"}


def config_class(family: str):
    return getattr(transformers, CONFIG_CLASSES.get(family, f"{FAMILIES[family][0]}Config"))


def fields_written(family: str) -> list[str]:
    """The fields ``save_pretrained`` writes for the family's tiny config, but those about no model."""
    return sorted(set(config_class(family)(**FAMILIES[family][1]).to_diff_dict()) - NOT_THE_MODEL)


# Qwen's max_window_layers only speaks in a file without layer_types (those written before
# transformers added it), so its default is seen with both left out (Qwen2's tiny model slides).
CASES = [(family, (field,)) for family in FAMILIES for field in fields_written(family)]
CASES.append(("qwen2", ("layer_types", "max_window_layers")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The directory of each family's random tiny model, saved once for all its fields."""
    paths = {}

    def directory(family: str):
        if family not in paths:
            paths[family] = tmp_path_factory.mktemp(family)
            prefix, fields = FAMILIES[family]
            with pytest.MonkeyPatch.context() as patch:  # ``hf_model`` builds ``<prefix>Config``
                patch.setattr(transformers, f"{prefix}Config", config_class(family))
                hf_model(paths[family], prefix, fields, EDITS.get(family))
        return paths[family]

    return directory


def transformers_logits(family: str, path, x: torch.Tensor) -> torch.Tensor | None:
    """``transformers``' logits from the directory, or None where it cannot compute them: it refuses
    the config or the weights, leaves a weight uninitialized or drops one, or fails running."""
    model_class = getattr(transformers, f"{FAMILIES[family][0]}ForCausalLM")
    if family in READ_AS:  # the file as transformers reads it, beside ours
        cfg = json.loads((path / "config.json").read_text())
        path = shutil.copytree(path, path.with_name(f"{path.name}-transformers"))
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": READ_AS[family]}))
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True)
        with torch.no_grad():
            logits = model.eval()(x, use_cache=False).logits  # the math, not the cache's set-up
    except Exception:  # noqa: BLE001 -- any failure to build, load or run is its refusal
        return None
    loaded = not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    return logits if loaded and logits.isfinite().all() else None


def filled_in(family: str, config: dict) -> dict | None:
    """The full ``config.json`` ``transformers`` writes for ``config`` once its class has filled in
    what ``config`` leaves out; None where the class refuses ``config``."""
    try:
        return config_class(family)(**config).to_dict()
    except Exception:  # noqa: BLE001 -- a validator's error is no ValueError (huggingface_hub's own)
        return None


def our_args(family: str, config: dict):
    """Our args for ``config`` (the reader ``load_model`` uses), or the refusal's type."""
    try:
        return get_family(READER.get(family, family)).hf.args_from_config(config)
    except ValueError as refused:
        return type(refused)


@pytest.mark.parametrize("family,fields", CASES, ids=[f"{family}-{'+'.join(fields)}" for family, fields in CASES])
def test_a_field_left_out_reads_as_the_transformers_class_default(tmp_path, saved, family, fields):
    source = saved(family)
    config = json.loads((source / "config.json").read_text())
    for field in fields:
        del config[field]
    computes_as_transformers(tmp_path, source, family, config)
    filled = filled_in(family, config)
    assert our_args(family, config) == (ValueError if filled is None else our_args(family, filled))


def computes_as_transformers(tmp_path, source, family: str, config: dict) -> None:
    """``config`` beside the weights at ``source``: our logits within 1e-5 of ``transformers``', or
    a one-line refusal where ``transformers`` computes none."""
    shutil.copy(source / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    x = tokens(24)
    want = transformers_logits(family, tmp_path, x)
    if want is None:
        with pytest.raises(SeedckptError) as refused:
            load_model(tmp_path)
        assert "\n" not in str(refused.value)
    else:
        with torch.no_grad():
            assert (load_model(tmp_path)(x) - want).abs().max().item() <= 1e-5


# A field Qwen3-MoE's class does not have, though Qwen3's does: a null one is kept and changes nothing
NULL_CASES = [*CASES, ("qwen3_moe", ("max_window_layers",))]


@pytest.mark.parametrize(
    "family,fields", NULL_CASES, ids=[f"{family}-{'+'.join(fields)}" for family, fields in NULL_CASES]
)
def test_a_null_field_reads_as_transformers_reads_it(tmp_path, saved, family, fields):
    """A null means what ``transformers`` makes of it: refused, in one line naming the field, where the
    class refuses it; else the logits ``transformers`` computes (a null ``sliding_window``: no window,
    DeepSeek-V3's null ``rope_interleave``: halves rotated), or a refusal where it cannot run it."""
    source = saved(family)
    config = {**json.loads((source / "config.json").read_text()), **dict.fromkeys(fields)}
    if filled_in(family, config) is None:
        with pytest.raises(ValueError) as refused:
            get_family(READER.get(family, family)).hf.args_from_config(config)
        said = str(refused.value)
        assert "\n" not in said and any(f"{field} = null" in said or f"lacks {field}" in said for field in fields)
        return
    computes_as_transformers(tmp_path, source, family, config)
    if our_args(family, config) is not ValueError:
        assert our_args(family, config) == our_args(family, filled_in(family, config))


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "qwen3_5"])
@pytest.mark.parametrize("where", ["rope_parameters", "top"])
def test_a_null_rope_base_is_refused_as_transformers_fails_on_it(tmp_path, saved, family, where):
    """A null ``rope_theta`` with no other beside it: ``transformers``' class keeps it, its model fails."""
    source = saved(family)
    config = json.loads((source / "config.json").read_text())
    rope = {**config.pop("rope_parameters"), "rope_theta": None}
    config |= {"rope_parameters": rope} if where == "rope_parameters" else {"rope_theta": None}
    shutil.copy(source / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert transformers_logits(family, tmp_path, tokens(24)) is None
    with pytest.raises(SeedckptError, match="rope_theta = null, which transformers' model cannot run"):
        load_model(tmp_path)
