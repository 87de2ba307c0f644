"""Qwen3.5's gated full attention, and which kind of attention each layer has.

The shared decoder's grouped-query attention with q/k norms (scaled by ``1 + weight``) and partial
RoPE, plus an output gate: ``wq`` projects each head to its query and, beside it, as many gate
channels (per head: ``head_dim`` query rows, then ``head_dim`` gate rows, as ``transformers``' q_proj
lays them out, so a tensor-parallel rank's slice of ``wq`` holds whole heads with their gates); the
attention's output is multiplied by ``sigmoid(gate)`` before ``wo``.
"""

from __future__ import annotations

from torch import nn

from models.common.decoder import Attention
from models.common.packed_attention import causal_attention, packed_attention
from models.common.rope import apply_rotary_emb


class GatedAttention(Attention):
    def __init__(self, args, init_std: float):
        super().__init__(args, init_std)
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * self.head_dim, bias=args.attention_bias)

    def forward(self, x, freqs_cis, documents=None):
        bsz, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bsz, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        if freqs_cis.dim() == 2:
            freqs_cis = freqs_cis[:seqlen]
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if documents is None:
            out = causal_attention(q, k, v, None)
        else:
            out = packed_attention(q, k, v, documents, None)
        out = out.transpose(1, 2) * gate.sigmoid()
        return self.wo(out.reshape(bsz, seqlen, -1))


def layer_attention(args, layer_id: int, init_std: float) -> nn.Module:
    """Layer ``layer_id``'s attention: gated full attention in ``full_attention_layers``, Gated
    DeltaNet elsewhere (``DecoderOptions.layer_attention``)."""
    if layer_id in args.full_attention_layers:
        return GatedAttention(args, init_std)
    return args.linear_attention(layer_id, init_std)
