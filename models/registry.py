"""The model families, by ``model.name``: one line per family.

Every caller that builds a model or names its tensors asks the family it finds here
(``models.family.ModelFamily``), so a new family is a folder under ``models/`` and one line below.
"""

from __future__ import annotations

from models.deepseek_v3 import DEEPSEEK_V3
from models.family import ModelFamily
from models.gemma2 import GEMMA2
from models.gemma3 import GEMMA3
from models.gemma4 import GEMMA4
from models.glm4_moe import GLM4_MOE
from models.gpt_oss import GPT_OSS
from models.granite import GRANITE
from models.kimi_k2 import KIMI_K2
from models.llama3 import LLAMA3
from models.mistral import MISTRAL
from models.mixtral import MIXTRAL
from models.qwen2 import QWEN2
from models.qwen3 import QWEN3
from models.qwen3_5 import QWEN3_5
from models.qwen3_5_moe import QWEN3_5_MOE
from models.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        LLAMA3,
        QWEN3,
        QWEN2,
        MISTRAL,
        GRANITE,
        QWEN3_MOE,
        MIXTRAL,
        GPT_OSS,
        DEEPSEEK_V3,
        GEMMA3,
        GEMMA4,
        GEMMA2,
        GLM4_MOE,
        QWEN3_5,
        QWEN3_5_MOE,
        KIMI_K2,
    )
}
DEFAULT_FAMILY = "llama3"  # the family of a config or a command that names none


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model.name {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_model_type(model_type: str | None) -> ModelFamily | None:
    """The family that reads Hugging Face's ``model_type``, if any."""
    return next((family for family in FAMILIES.values() if model_type in family.hf.model_types), None)


def family_of(args) -> ModelFamily:
    """The family whose configuration ``args`` is (each family has its own args class)."""
    for family in FAMILIES.values():
        if type(args) is family.args:
            return family
    raise TypeError(f"{type(args).__name__} is not the args of any model family")
