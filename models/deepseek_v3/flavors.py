"""DeepSeek's flavors: the released shapes by name (``models.deepseek_v3``'s docstring says which
is what), torchtitan 0.3.0's recipes among them."""

from __future__ import annotations

from models.common.rope import RopeScaling
from models.deepseek_v3.args import DeepseekV3Args


def _torchtitan_recipe(mscale: float = 0.70, **shape) -> DeepseekV3Args:
    """One of torchtitan 0.3.0's softmax-routed DeepSeek recipes (``torchtitan.models.deepseek_v3``):
    MLA without a low-rank query unless ``shape`` gives one, 512-wide latents, heads of 128 + 64 and
    128; one dense layer, then two shared experts beside the routed ones; softmax routing, no
    renormalization, weights times 1 unless ``shape`` says; YaRN 40x over 4096 positions, its
    ``mscale`` folded into the softmax scale only; norms at torchtitan's default epsilon, 1e-5."""
    return DeepseekV3Args(
        **{
            "norm_eps": 1e-5,
            "latent_norm_eps": 1e-5,
            "max_seq_len": 16384,  # torchtitan's RoPE table: 4 x 4096 positions
            "rope_scaling": RopeScaling(
                "yarn", factor=40.0, original_max_position_embeddings=4096, mscale=mscale, mscale_all_dim=mscale
            ),
            "q_lora_rank": 0,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "first_k_dense_replace": 1,
            "n_shared_experts": 2,
            "score_func": "softmax",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            **shape,
        }
    )


FLAVORS = {
    "debug": DeepseekV3Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        rope_scaling=RopeScaling(
            "yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0
        ),
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        n_experts=8,
        n_shared_experts=1,
        top_k=2,
        moe_ffn_dim=64,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    "debugmodel": _torchtitan_recipe(
        dim=256, n_layers=6, n_heads=16, ffn_dim=1024, vocab_size=2048, n_experts=8, top_k=3, moe_ffn_dim=256
    ),
    "16B": _torchtitan_recipe(
        dim=2048, n_layers=27, n_heads=16, ffn_dim=10944, vocab_size=102400, n_experts=64, top_k=6, moe_ffn_dim=1408
    ),
    "236B": _torchtitan_recipe(
        dim=5120,
        n_layers=60,
        n_heads=128,
        ffn_dim=12288,
        vocab_size=102400,
        q_lora_rank=1536,
        n_experts=160,
        top_k=6,
        moe_ffn_dim=1536,
        n_group=8,
        topk_group=3,
        routed_scaling_factor=16.0,
        mscale=1.0,
    ),
    "671B": DeepseekV3Args(),  # the defaults are DeepSeek-V3's config.json
}
