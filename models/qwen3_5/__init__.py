"""Qwen3.5 (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``; the releases are the multimodal
``qwen3_5``, whose text decoder this is): three of every four layers are Gated DeltaNet linear
attention, the fourth gated full attention.

The shared decoder (``models.common.decoder``) with every norm scaled by ``1 + weight`` (zero at
init) and, per layer (``full_attention_layers``; by default every fourth):

* a Gated DeltaNet layer (``models.common.gated_deltanet``): a recurrent state per value head,
  written by the gated delta rule, reset at each packed document's start;
* or gated full attention (``models.qwen3_5.attention``): grouped-query attention with q/k norms,
  RoPE on the first ``rotary_dim = head_dim * partial_rotary_factor`` channels of each head (a
  quarter, as released; ``models.common.rope``) and an output gate ``sigmoid(gate)`` that ``wq``
  projects beside each head's query.

Each layer's feed-forward is the decoder's SwiGLU.

Tensor names: the shared decoder's (``attention.{wq,wk,wv,wo}``, ``attention.{q_norm,k_norm}``,
``feed_forward.{w1,w2,w3}``, ``attention_norm``, ``ffn_norm`` ...; ``wq`` twice as tall: each head's
query rows, then its gate's); in a linear layer ``attention.{in_proj_qkv,in_proj_z,in_proj_b,
in_proj_a,out_proj}.weight``, ``attention.conv1d.weight``, ``attention.A_log``, ``attention.dt_bias``,
``attention.norm.weight``. Hugging Face's are mapped by ``hf``.

Flavors: ``0.8B``, ``2B``, ``4B``, ``9B`` and ``27B`` are the released text decoders' shapes (the
first three tie their output to the embedding), with ``transformers``' parameter counts;
``debug`` trains on a CPU in seconds, its linear layers crossing the rule's chunk. The init recipe
is torchtitan 0.3.0's ``qwen3_5``: the decoder's ``torchtitan`` recipe, and for the linear layers
the one ``models.common.gated_deltanet`` names (``A_log`` the log of U(0.01, 16)). Tensor
parallelism splits the linear layers by heads (``models.qwen3_5.tensor_parallel``).
"""

from __future__ import annotations

from models.common import decoder_family, decoder_layer_flops
from models.common.decoder import Transformer
from models.common.gated_deltanet import CHUNK
from models.family import decoder_flops_per_token
from models.qwen3_5 import hf
from models.qwen3_5.args import SHAPE_FIELDS, Qwen35Args
from models.qwen3_5.tensor_parallel import QWEN3_5_TENSOR_PARALLEL
from models.qwen3_5.torchtitan import Qwen35TorchtitanNames

# The block linears OSFT trains by default: every attention and feed-forward matrix, of both kinds.
OSFT_TARGETS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "attention.in_proj_qkv",
    "attention.in_proj_z",
    "attention.out_proj",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def _released(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, v_heads: int, **fields):
    """A released Qwen3.5 text decoder: 248320 tokens, heads of 256 turning a quarter at base 10^7,
    262144 positions; linear layers with 16 key heads of 128 and ``v_heads`` value heads of 128."""
    return Qwen35Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        linear_num_value_heads=v_heads,
        rope_theta=1e7,
        max_seq_len=262144,
        **fields,
    )


FLAVORS = {
    "debug": Qwen35Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        rope_theta=1e7,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "0.8B": _released(1024, 24, 8, 2, 3584, 16, tie_word_embeddings=True),
    "2B": _released(2048, 24, 8, 2, 6144, 16, tie_word_embeddings=True),
    "4B": _released(2560, 32, 16, 4, 9216, 32, tie_word_embeddings=True),
    "9B": _released(4096, 32, 16, 4, 12288, 32),
    "27B": _released(5120, 64, 24, 4, 17408, 48),
}


def attention_flops(args: Qwen35Args, layer: int, seq_len: int) -> int:
    """Training FLOPs per token of one layer's token mixing (forward and backward: 3x the forward).
    Full attention: the decoder's 2·H·Q·T for q·k and as much for weights·v. A linear layer, per value
    head, as the chunked rule computes it: q·k and the solved writes over the token's chunk, 2·C·(dk +
    dv) (C = ``CHUNK``, or the sequence where shorter), and against the chunk's starting state its
    read, its correction and its write, 2·dk·dv each -- independent of T, which is the point of it."""
    if layer in args.full_attention_layers:
        return attention_flops_full(args, seq_len)
    dk, dv, chunk = args.linear_key_head_dim, args.linear_value_head_dim, min(CHUNK, seq_len)
    return 3 * args.linear_num_value_heads * (2 * chunk * (dk + dv) + 6 * dk * dv)


def flops_per_token(args: Qwen35Args, seq_len: int, num_params: int | None = None) -> int:
    """The decoder's count (6 FLOPs per parameter, a tied matrix once), each layer's own mixing
    (``attention_flops``) in place of the full attention it counts in every layer."""
    every_layer_full = decoder_flops_per_token(Transformer, args, seq_len, num_params)
    mixing = sum(attention_flops(args, layer, seq_len) for layer in range(args.n_layers))
    return every_layer_full - args.n_layers * attention_flops_full(args, seq_len) + mixing


def attention_flops_full(args: Qwen35Args, seq_len: int) -> int:
    return 12 * args.n_heads * args.head_dim * seq_len


QWEN3_5 = decoder_family(
    "qwen3_5",
    Qwen35Args,
    FLAVORS,
    (hf.MODEL_TYPE, hf.WRAPPER_TYPE),
    hf.config,
    hf.args_from_config,
    shape_fields=SHAPE_FIELDS,
    names=hf.Qwen35Names,
    osft_targets=OSFT_TARGETS,
    flops_per_token=flops_per_token,
    layer_flops=lambda args, seq_len: decoder_layer_flops(args, seq_len, attention=attention_flops),
    tensor_parallel=QWEN3_5_TENSOR_PARALLEL,
    renamings={"torchtitan": Qwen35TorchtitanNames},
)
