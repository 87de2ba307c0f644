"""GLM-4.5's configuration: the shared decoder's fields (``head_dim`` its own), partial RoPE, q/k
norms and biases, and DeepSeek-V3's mixture of experts after ``first_k_dense_replace`` dense layers
(``models.glm4_moe``'s docstring says what each computes). Field names follow the project's and
HF's ``config.json`` (``first_k_dense_replace``, ``n_group`` ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.common.args import MOE_SHAPE_FIELDS, MoEDecoderArgs, check_bool, check_float, check_int
from models.common.decoder import DecoderOptions


@dataclass
class Glm4MoeArgs(MoEDecoderArgs):
    n_kv_heads: int | None = 8
    head_dim: int | None = 128
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    partial_rotary_factor: float = 0.5  # the share of each head RoPE turns (its first channels)
    qk_norm: bool = False  # HF's use_qk_norm
    attention_bias: bool = True  # biases on q, k and v
    first_k_dense_replace: int = 1  # the dense layers before the mixtures of experts
    n_shared_experts: int = 1  # their width together: n_shared_experts x moe_ffn_dim, one SwiGLU
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    load_balance: Literal["aux_loss", "bias", "none"] = "bias"

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError(
                "GLM-4.5's dense layers are its first first_k_dense_replace ones: leave mlp_only_layers empty and "
                "decoder_sparse_step 1"
            )
        self.partial_rotary_factor = check_float("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor = {self.partial_rotary_factor} turns {self.rotary_dim} of head_dim = "
                f"{self.head_dim} channels; it must be at most 1 and turn an even number, at least 2"
            )
        for name in ("first_k_dense_replace", "n_shared_experts"):
            check_int(name, getattr(self, name), least=0)
        for name in ("qk_norm", "attention_bias"):
            check_bool(name, getattr(self, name))
        self.routed_scaling_factor = check_float("routed_scaling_factor", self.routed_scaling_factor)
        self.decoder_options  # noqa: B018 -- MoEOptions refuses what the block cannot run, here at the door

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE turns (``transformers``: ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.n_layers))

    @property
    def decoder_options(self) -> DecoderOptions:
        moe = self.moe_options(
            "normal",
            self.initializer_range,
            score_func="sigmoid",
            route_scale=self.routed_scaling_factor,
            n_group=self.n_group,
            topk_group=self.topk_group,
            n_shared_experts=self.n_shared_experts,
        )
        return DecoderOptions(
            qkv_bias=self.attention_bias,
            qk_norm=self.qk_norm,
            init="normal",
            init_std=self.initializer_range,
            moe=moe,
            moe_layers=self.moe_layers,
            layer_windows=self.layer_windows,
        )


# Which tensors exist and their shapes (``load_balance``: the expert bias).
SHAPE_FIELDS = (*MOE_SHAPE_FIELDS, "first_k_dense_replace", "n_shared_experts", "qk_norm", "attention_bias")
