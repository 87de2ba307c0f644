"""Multi-head latent attention (MLA), DeepSeek-V2's and V3's attention.

Queries and keys/values each pass through a low-rank bottleneck before they are expanded to heads:

* q: ``wq_a`` (dim -> ``q_lora_rank``), ``q_norm`` (RMSNorm), ``wq_b`` (-> heads x
  ``qk_nope_head_dim + qk_rope_head_dim``); with ``q_lora_rank = 0`` one projection ``wq`` instead
  (DeepSeek-V2-Lite, the 16B shape);
* k and v: ``wkv_a`` (dim -> ``kv_lora_rank + qk_rope_head_dim``) gives a latent that ``kv_norm``
  normalizes and ``wkv_b`` expands to heads x ``qk_nope_head_dim + v_head_dim`` (each head's k part,
  then its v part), plus one RoPE key of ``qk_rope_head_dim`` shared by every head;
* each head's query and key are ``[nope part, RoPE part]``: RoPE rotates only the last
  ``qk_rope_head_dim`` dimensions, the shared RoPE key being rotated once. Values have
  ``v_head_dim``; ``wo`` maps heads x ``v_head_dim`` back to dim.

The RoPE part rotates interleaved pairs, as the rest of the decoder does (and as DeepSeek's own
weights are laid out: HF's ``rope_interleave``). The softmax scale is ``(qk_nope + qk_rope)^-0.5``,
times the square of YaRN's attention scale when the RoPE is stretched (``args.softmax_scale``).

The module keeps the shared decoder's attention interface -- ``forward(x, freqs_cis, documents)`` --
and reshapes with ``-1`` heads, so a tensor-parallel rank holding some heads of ``wq``/``wq_b`` and
``wkv_b`` (and the matching input columns of ``wo``) runs it unchanged.

With ``attention_bias`` (HF's field; DeepSeek's released models have none) ``wq_a``, ``wkv_a`` and
``wo`` carry a bias, as transformers' ``DeepseekV3Attention`` does (``wq``, ``wq_b`` and ``wkv_b``
never do).

The two latent norms, ``q_norm`` and ``kv_norm``, take their own epsilon, ``latent_norm_eps``:
DeepSeek's code and ``transformers``' V2 and V3 classes build them at their RMSNorm's default,
1e-6, whatever ``rms_norm_eps`` says, and torchtitan builds every norm at its own default, 1e-5.

Init (torchtitan's for DeepSeek-V3): every projection a normal of std 0.02 truncated at +-2
(absolute), ``wo`` at the layer's depth-scaled std; the two norms ones; biases zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.feed_forward import TRUNC_BOUND
from models.common.packed_attention import causal_attention, packed_attention
from models.common.rope import apply_rotary_emb


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        qk_dims = args.n_heads * (self.nope_dim + self.rope_dim)
        bias = args.attention_bias
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=bias)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.latent_norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, qk_dims, bias=False)
        else:
            self.wq = nn.Linear(args.dim, qk_dims, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.latent_norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=bias)

    def projections(self) -> list[nn.Linear]:
        """The projections before ``wo``, in the order q, then k/v."""
        q = [self.wq_a, self.wq_b] if hasattr(self, "wq_a") else [self.wq]
        return [*q, self.wkv_a, self.wkv_b]

    def init_weights(self, init) -> None:
        for linear in self.projections():
            init.trunc_normal_(linear.weight, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        init.trunc_normal_(self.wo.weight, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)
        for linear in (*self.projections(), self.wo):
            if linear.bias is not None:
                init.zeros_(linear.bias)
        for norm in (getattr(self, "q_norm", None), self.kv_norm):
            if norm is not None:
                init.ones_(norm.weight)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents=None) -> torch.Tensor:
        """``documents``: a packed batch's (``Documents.of``); None: each row is one."""
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_rope = q.view(bsz, seqlen, -1, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        if freqs_cis.dim() == 2:
            freqs_cis = freqs_cis[:seqlen]  # sliced here, with the runtime sequence length
        q_rope = apply_rotary_emb(q_rope, freqs_cis)
        k_rope = apply_rotary_emb(k_rope.unsqueeze(2), freqs_cis)  # one key, shared by every head
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if documents is None:
            out = causal_attention(q, k, v, self.softmax_scale)
        else:
            out = packed_attention(q, k, v, documents, self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
