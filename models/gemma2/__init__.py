"""Gemma 2: Gemma 3's decoder (``models.gemma3``) without the q/k head norms, one RoPE table, layers
alternating between a sliding window (the first) and global attention, and the attention scores
capped: ``cap * tanh(scores / cap)`` before mask and softmax (``attn_logit_softcapping``, 50 in every
release), beside the logits' (``final_logit_softcapping``, 30).

What it shares with Gemma 3 is imported: the ``(1 + weight)`` norms and sandwich norms, GeGLU, the
embedding scaled by ``sqrt(dim)``, ``query_pre_attn_scalar``, tied embeddings, HF's init, the tensor
names (``models.gemma3.hf.Gemma3Names``). Its FLOPs are the shared decoder's (windowed layers counted
over their window). The scores' softcap is the shared attention's (``models.common.packed_attention``):
written out on a CPU (SDPA takes no function of the scores), flex attention's ``score_mod`` on CUDA.
"""

from __future__ import annotations

from models.common import decoder_family
from models.common.args import SHAPE_FIELDS
from models.gemma2 import hf
from models.gemma2.args import Gemma2Args
from models.gemma3.args import sliding_layers
from models.gemma3.hf import Gemma3Names


def _gemma2(n_layers: int, **shape) -> Gemma2Args:
    """Every other layer windowed (the first); ``shape`` over the releases' vocabulary (256,000),
    positions (8192) and windows (4096)."""
    released = dict(vocab_size=256000, max_seq_len=8192, sliding_window=4096)
    return Gemma2Args(n_layers=n_layers, window_layers=sliding_layers(n_layers, 2), **(released | shape))


FLAVORS = {
    "debug": _gemma2(
        4,
        dim=128,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=256,
        vocab_size=512,
        max_seq_len=512,
        sliding_window=16,
        query_pre_attn_scalar=32,
    ),
    "2B": _gemma2(26, dim=2304, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=9216),
    "9B": _gemma2(42, dim=3584, n_heads=16, n_kv_heads=8, head_dim=256, ffn_dim=14336),
    # scores scaled by (dim / n_heads)^-1/2, as in Gemma 3's 27B
    "27B": _gemma2(46, dim=4608, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=36864, query_pre_attn_scalar=144),
}

GEMMA2 = decoder_family(
    "gemma2",
    Gemma2Args,
    FLAVORS,
    (hf.MODEL_TYPE,),
    hf.config,
    hf.args_from_config,
    shape_fields=(*SHAPE_FIELDS, "attention_bias"),
    names=Gemma3Names,
)
