"""Gemma 3 (text): the shared decoder with Gemma's norms, GeGLU, a scaled embedding and two RoPE tables.

What sets it apart, each a switch of the shared decoder (``DecoderOptions``):

* every RMSNorm scales by ``1 + weight`` and computes in float32 (``models.common.norms``), the q/k
  head norms included, and each block norms its attention's and its feed-forward's outputs too
  before the residual add (sandwich norms);
* the feed-forward is GeGLU, GELU in its tanh approximation (``gelu_pytorch_tanh``);
* the embedding is scaled by ``sqrt(dim)``, that factor first rounded to the embedding's dtype as
  transformers rounds it; the output is tied to the embedding;
* attention scores are scaled by ``query_pre_attn_scalar^-1/2`` (256 in most releases: head_dim;
  168 in 27B: dim / n_heads, where head_dim is 128);
* five of every six layers attend through a sliding window (``window_layers``; 512 positions in 1B,
  1024 in the others) and turn their RoPE at base ``rope_local_theta`` (10^4, never stretched); the
  global layers use ``rope_theta`` (10^6) with ``rope_scaling`` (linear, 8x, from 4B up);
* ``final_logit_softcap``: the logits become ``cap * tanh(logits / cap)`` (Gemma 3's releases set none).

Tensor names are the shared decoder's (``models.common.decoder``), plus per layer the sandwich
norms ``layers.{i}.post_attention_norm.weight`` and ``layers.{i}.post_ffn_norm.weight``;
``ffn_norm`` is HF's ``pre_feedforward_layernorm`` (``models.gemma3.hf``). The init recipe is HF's:
every weight normal with std ``initializer_range``, every norm's weight zero (its identity). HF
also zeroes the embedding's padding row (``pad_token_id`` 0) and never trains it (a padding index);
here that row is drawn and trained like the others (packed padding carries no loss, so it moves
only where a document uses the token).

FLOPs are the shared decoder's, which count a sliding-window layer's attention over its window, not
the whole sequence (``models.family.attended_keys``): 1B at 8192 tokens costs 6.54 GFLOPs a token, where counting
every layer over all 8192 positions gives 8.62 -- an MFU overstated by 32 %.
"""

from __future__ import annotations

from models.common import decoder_family
from models.common.args import SHAPE_FIELDS
from models.common.rope import RopeScaling
from models.gemma3 import hf
from models.gemma3.args import Gemma3Args, sliding_layers

# The global layers' stretch from 4B up
LINEAR_8X = RopeScaling("linear", 8.0)


def _gemma3(dim, n_layers, n_heads, n_kv_heads, ffn_dim, head_dim=256, query_pre_attn_scalar=256) -> Gemma3Args:
    """A released shape from 4B up: vocabulary 262,208, 128k positions, 1024-position windows."""
    return Gemma3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        vocab_size=262208,
        max_seq_len=131072,
        rope_scaling=LINEAR_8X,
        sliding_window=1024,
        window_layers=sliding_layers(n_layers),
        query_pre_attn_scalar=query_pre_attn_scalar,
    )


FLAVORS = {
    "debug": Gemma3Args(
        dim=128,
        n_layers=6,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        rope_scaling=LINEAR_8X,
        sliding_window=16,
        window_layers=sliding_layers(6),
        query_pre_attn_scalar=32,
    ),
    "1B": Gemma3Args(
        dim=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        ffn_dim=6912,
        vocab_size=262144,
        max_seq_len=32768,
        sliding_window=512,
        window_layers=sliding_layers(26),
    ),
    "4B": _gemma3(2560, 34, 8, 4, 10240),
    "12B": _gemma3(3840, 48, 16, 8, 15360),
    "27B": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, query_pre_attn_scalar=168),
}


GEMMA3 = decoder_family(
    "gemma3",
    Gemma3Args,
    FLAVORS,
    (hf.MODEL_TYPE, hf.WRAPPER_TYPE),
    hf.config,
    hf.args_from_config,
    shape_fields=(*SHAPE_FIELDS, "attention_bias"),
    names=hf.Gemma3Names,
)
