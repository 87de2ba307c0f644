"""Model specs: everything a caller needs to build, initialize or name a model, by ``model.name``.

Every caller that builds a model or names its tensors goes through a spec -- the config (flavors),
the seed and the stage builder (the class and its ``init_weights`` recipe), checkpoint I/O (name
adapters for other tools' layouts) -- so a second model family is one more entry here, not edits
in a dozen modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from models import llama, llama_hf, llama_torchtitan


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # ``model(args)`` builds it (on ``meta`` under a device context); the ``init_weights`` of its
    # modules is the init recipe (run by ``seedckpt.init``), ``init_buffers`` recomputes derived state.
    model: Callable[[Any], nn.Module]
    args: type  # its configuration dataclass, with ``to_dict`` / ``from_dict``
    flavors: dict[str, Any]  # released shapes by name
    shape_fields: tuple[str, ...]  # the ``args`` fields that decide which tensors exist and their shapes
    flavor_of: Callable[[Any], str | None]  # the flavor whose shapes ``args`` has
    tied_weights: Callable[[Any], dict[str, str]]  # {FQN: FQN whose tensor it is}
    hf_names: Callable[[Any], Any]  # args -> name adapter to Hugging Face's names and row order
    hf_config: Callable[[Any, Any], dict]  # (args, dtype) -> HF config.json
    args_from_hf_config: Callable[[dict], Any]
    renamings: dict = field(default_factory=dict)  # {tool: name adapter}: other tools' names for its tensors


LLAMA3 = ModelSpec(
    name="llama3", model=llama.Transformer, args=llama.ModelArgs, flavors=llama.LLAMA3_FLAVORS,
    shape_fields=llama.SHAPE_FIELDS, flavor_of=llama.flavor_of, tied_weights=llama.tied_weights,
    hf_names=llama_hf.HFNames, hf_config=llama_hf.hf_config, args_from_hf_config=llama_hf.args_from_hf_config,
    renamings={"torchtitan": llama_torchtitan.TorchtitanNames()},
)

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA3,)}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model.name {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name]
