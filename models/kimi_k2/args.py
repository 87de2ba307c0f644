"""Kimi K2's configuration: DeepSeek-V3's fields (``models.deepseek_v3.args``) with Kimi K2's
released values as the defaults, as DeepSeek-V3's are DeepSeek-V3's.

A class of its own rather than DeepSeek-V3's args with other values: a checkpoint's manifest and
the registry tell families apart by their args' class, so a Kimi K2 seed is read back, planned and
exported as Kimi K2 (``model_type: kimi_k2``), not as DeepSeek-V3.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.rope import RopeScaling
from models.deepseek_v3.args import DeepseekV3Args


@dataclass
class KimiK2Args(DeepseekV3Args):
    """Kimi-K2-Instruct's ``config.json`` (July 2025; Kimi-K2-Base has the same): DeepSeek-V3's
    architecture with 64 heads instead of 128, 384 routed experts instead of 256 (8 a token, one
    shared), one dense layer instead of three, a 163,840-token vocabulary, sigmoid routing without
    groups and weights times 2.827; RoPE at base 50,000 stretched 32x by YaRN with both of its
    ramp's betas at 1 over 4,096 original positions."""

    n_heads: int = 64
    vocab_size: int = 163840
    rope_theta: float = 50000.0
    max_seq_len: int = 131072
    rope_scaling: RopeScaling | None = RopeScaling(
        "yarn",
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    first_k_dense_replace: int = 1
    n_experts: int = 384
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
