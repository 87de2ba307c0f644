"""DeepSeek-V3's configuration (and DeepSeek-V2's, a routing of it): the shared decoder's fields,
multi-head latent attention's ranks and head widths, and the mixture of experts' shared experts and
routing.

Field names follow the rest of the project (``dim``, ``n_layers``, ``n_experts`` ...) where one
exists and DeepSeek's ``config.json`` otherwise (``kv_lora_rank``, ``first_k_dense_replace``,
``n_group`` ...). ``q_lora_rank = 0`` means no low-rank query (torchtitan's convention; HF's
``null``), which TOML can write.

Routing (``score_func``): DeepSeek-V3 scores experts by a sigmoid, DeepSeek-V2 (and torchtitan's
DeepSeek-V3 recipes but 671B) by a softmax over all experts. Either may limit a token's experts to
the ``topk_group`` best of ``n_group`` groups, a group ranked by the sum of its ``group_top`` best
scores (2: DeepSeek-V3's and torchtitan's; 1, its best: DeepSeek-V2's ``group_limited_greedy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.common.args import DictArgs, check_bool, check_float, check_int, check_rope_scaling
from models.common.decoder import DecoderOptions
from models.common.moe import MoEOptions
from models.common.rope import RopeScaling, softmax_scale_multiplier
from models.deepseek_v3.attention import MultiHeadLatentAttention

SCORE_FUNCS = ("sigmoid", "softmax")


@dataclass
class DeepseekV3Args(DictArgs):
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    ffn_dim: int = 18432  # the dense layers' feed-forward width (HF's intermediate_size)
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    latent_norm_eps: float = 1e-6  # MLA's q_norm and kv_norm (``attention``): HF's fixed 1e-6, torchtitan's 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 163840
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # recorded for config.json; the init recipe is torchtitan's
    # DeepSeek-V3's YaRN: 40 x its 4k pretraining context (``models.common.rope``); None: plain RoPE
    rope_scaling: RopeScaling | None = RopeScaling(
        "yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    # multi-head latent attention
    q_lora_rank: int = 1536  # 0: one query projection (wq), no low-rank bottleneck
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False  # biases on wq_a, wkv_a and wo (HF's attention_bias; DeepSeek's own have none)
    # How HF files lay out each head's RoPE rows: interleaved pairs (DeepSeek's, and ours), or
    # halves (then permuted at conversion). It changes no tensor of ours.
    rope_interleave: bool = True
    # mixture of experts: layers first_k_dense_replace.. hold one
    first_k_dense_replace: int = 3
    n_experts: int = 256  # routed experts
    n_shared_experts: int = 1  # their width together: n_shared_experts x moe_ffn_dim, one SwiGLU
    top_k: int = 8
    moe_ffn_dim: int = 2048
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"  # how the router scores experts (the module doc)
    n_group: int = 8  # the routed experts' groups; a token's experts come from topk_group of them
    topk_group: int = 4
    group_top: int = 2  # a group is ranked by the sum of its group_top best scores
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5  # multiplies the routed experts' weights
    load_balance: Literal["aux_loss", "bias", "none"] = "bias"  # aux-loss-free balancing, DeepSeek-V3's
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 0.001

    def __post_init__(self):
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len", "kv_lora_rank"):
            check_int(name, getattr(self, name))
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_experts", "top_k", "moe_ffn_dim"):
            check_int(name, getattr(self, name))
        for name in ("q_lora_rank", "first_k_dense_replace", "n_shared_experts"):
            check_int(name, getattr(self, name), least=0)
        for name in ("n_group", "topk_group", "group_top"):
            check_int(name, getattr(self, name))
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func = {self.score_func!r}; choose one of {', '.join(SCORE_FUNCS)}")
        for name in ("norm_eps", "latent_norm_eps", "rope_theta", "routed_scaling_factor"):
            setattr(self, name, check_float(name, getattr(self, name)))
        for name in ("initializer_range", "aux_loss_coef", "bias_update_rate"):
            setattr(self, name, check_float(name, getattr(self, name), positive=False))
        for name in ("tie_word_embeddings", "rope_interleave", "norm_topk_prob", "attention_bias"):
            check_bool(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim = {self.qk_rope_head_dim} must be even for RoPE")
        if self.load_balance not in ("aux_loss", "bias", "none"):
            raise ValueError(f"load_balance = {self.load_balance!r}; choose bias, aux_loss or none")
        self.moe_options()  # the mixture of experts' own checks (groups, top_k within them), naming the field

    @property
    def head_dim(self) -> int:
        """The width RoPE rotates (each head's RoPE part): the decoder's RoPE table is this wide."""
        return self.qk_rope_head_dim

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # every head has its own key and value (expanded from one latent)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.ffn_dim

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope + qk_rope)^-0.5``, times YaRN's ``mscale_all_dim`` correction squared."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * softmax_scale_multiplier(self.rope_scaling)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.n_layers))

    def moe_options(self) -> MoEOptions:
        return MoEOptions(
            n_experts=self.n_experts,
            top_k=self.top_k,
            ffn_dim=self.moe_ffn_dim,
            score_func=self.score_func,
            norm_topk_prob=self.norm_topk_prob,
            route_scale=self.routed_scaling_factor,
            n_group=self.n_group,
            topk_group=self.topk_group,
            group_top=self.group_top,
            n_shared_experts=self.n_shared_experts,
            load_balance=self.load_balance,
            aux_loss_coef=self.aux_loss_coef,
            bias_update_rate=self.bias_update_rate,
            router_depth_init=True,  # torchtitan's DeepSeek-V3: the gate at the layer's depth-scaled std
        )

    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(moe=self.moe_options(), moe_layers=self.moe_layers, attention=MultiHeadLatentAttention)


# The fields that decide which tensors exist and their shapes (``load_balance``: the expert bias), and
# how tokens are routed (``ROUTING``): a checkpoint is never read into a model that routes it another
# way than the config it was made with, and a flavor's name labels one routing only.
ROUTING = ("score_func", "n_group", "topk_group", "group_top", "norm_topk_prob", "routed_scaling_factor")
SHAPE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "ffn_dim",
    "vocab_size",
    "tie_word_embeddings",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "attention_bias",
    "first_k_dense_replace",
    "n_experts",
    "n_shared_experts",
    "moe_ffn_dim",
    "load_balance",
    *ROUTING,
)
