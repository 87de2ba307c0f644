"""Kimi K2 (Moonshot AI, 1T parameters, 32B active a token): DeepSeek-V3's architecture at other
sizes (``Kimi-K2-Base``, ``-Instruct``, ``-Thinking``; ``config.json`` model_type ``kimi_k2``).

Every module is DeepSeek-V3's (``models.deepseek_v3``: multi-head latent attention, dense layers
then mixtures of routed and shared experts, the same tensor names, TP plan, FLOPs, OSFT targets and
init recipe); this folder holds what is Kimi K2's own: its args' defaults (``args``: the released
shapes and routing), its flavors, and its ``config.json`` (``hf``). A family of its own rather than
one more model_type of DeepSeek-V3's, so that a Kimi K2 checkpoint keeps its name through seed,
plan, training and export, and its facts live here, not among DeepSeek's.

Routing: sigmoid scores, the expert bias (HF's ``e_score_correction_bias``) added to choose the 8
experts, no groups (``n_group = topk_group = 1``), the weights renormalized and times 2.827.

Flavors: ``1T`` is Kimi-K2-Instruct's released ``config.json`` (1,026,408,209,408 parameters, as
``DeepseekV3ForCausalLM`` counts them); Kimi-K2-Instruct-0905 and Kimi-K2-Thinking have its shapes
and routing with RoPE stretched 64x (262,144 positions), read from their own ``config.json``.
``debug`` (8 experts, one shared, no groups) trains on a CPU in seconds.
"""

from __future__ import annotations

import dataclasses

from models.deepseek_v3 import DEEPSEEK_V3
from models.deepseek_v3.flavors import FLAVORS as DEEPSEEK_FLAVORS
from models.family import HFAdapter
from models.kimi_k2 import hf
from models.kimi_k2.args import KimiK2Args

# Kimi K2's routing and RoPE base (the args' defaults), which its debug flavor keeps
_K2_FIELDS = ("n_group", "topk_group", "routed_scaling_factor", "rope_theta")


def _debug() -> KimiK2Args:
    """DeepSeek-V3's debug shapes (8 experts, one shared, a dense layer first) routed as Kimi K2 routes,
    its YaRN ramp's betas at 1 as K2's."""
    shapes = DEEPSEEK_FLAVORS["debug"]
    k2 = {name: getattr(KimiK2Args, name) for name in _K2_FIELDS}
    rope = dataclasses.replace(shapes.rope_scaling, beta_fast=1.0, beta_slow=1.0)
    return KimiK2Args(**{**shapes.to_dict(), **k2, "rope_scaling": rope})


FLAVORS = {
    "debug": _debug(),
    "1T": KimiK2Args(),  # the defaults are Kimi-K2-Instruct's config.json
}

# DeepSeek-V3's family (model, tensor names, FLOPs, TP plan, OSFT targets, init recipe) with Kimi K2's
# args, flavors and config.json. No torchtitan names: its Kimi (kimi_k2_7) is the multimodal K2.5.
KIMI_K2 = dataclasses.replace(
    DEEPSEEK_V3,
    name="kimi_k2",
    args=KimiK2Args,
    flavors=FLAVORS,
    hf=HFAdapter((hf.MODEL_TYPE,), hf.KimiK2HFNames, hf.config, hf.args_from_config),
    renamings={},
)
