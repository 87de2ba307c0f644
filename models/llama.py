"""Llama-3 / 3.1 decoder (RMSNorm, RoPE with optional 3.1 scaling, GQA, SwiGLU).

Names follow Meta's and torchtitan <= 0.2's layout (``tok_embeddings``, ``layers.{i}.attention.wq``
...); torchtitan 0.3's renamed ones are mapped by ``models.llama_torchtitan``, never changed here. RoPE
uses Meta's interleaved-pair convention (HF conversion therefore permutes ``wq``/``wk``).

The model is *pipeline friendly* (torchtitan's recipe): ``layers`` is an ``nn.ModuleDict`` keyed
``"0".."n-1"`` so FQNs survive deleting the layers a stage does not own, ``tok_embeddings``,
``norm`` and ``output`` may be set to ``None`` and are then skipped, and the top-level forward is
a plain loop. Anything that depends on the sequence length is sliced inside the layer.

Initialization protocol
-----------------------
Constructors allocate but never initialize weights. Each module that owns parameters defines
``init_weights(init)`` and initializes *only its own* parameters (directly, or those of leaf
children such as ``nn.Linear`` that have no ``init_weights``); it never calls ``init_weights`` of
a child. A driver calls ``init_weights`` once on every module that defines it. This is the lesson
of fms-fsdp: a recursive init used per module re-initializes children and silently overwrites the
recipe. ``init`` is any object with::

    init.normal_(tensor, std)               # N(0, std^2)
    init.trunc_normal_(tensor, std, cutoff) # N(0, std^2) truncated to +-cutoff*std
    init.ones_(tensor)

``trunc_normal_`` also takes ``key=FQN``: draw the values of the tensor named FQN (the copy of a
tied matrix on another pipeline stage).

(``seedckpt.init`` provides one that derives every tensor's values from (seed, FQN, recipe)).

The recipe is torchtitan's Llama-3 distribution (depth-scaled output projections). torchtitan
calls ``nn.init.trunc_normal_(w, std=...)`` for the hidden projections with that function's
default *absolute* bounds +-2 (``TRUNC_BOUND``): +-100 std for std 0.02, so in effect an untruncated
normal, reproduced here exactly as a normal truncated at +-2. Only the output is cut relative to
its std (+-3 std).

=============================================  ==========================================
``tok_embeddings.weight``                      normal, std 1.0
``attention.{wq,wk,wv}``, ``feed_forward.w1``  normal, std 0.02, truncated at +-2 (absolute)
``attention.wo``, ``feed_forward.{w2,w3}``     normal, std 0.02 / sqrt(2 (layer_id + 1)), truncated at +-2
``*norm.weight``                               ones
``output.weight``                              truncated normal, std dim^-0.5, +-3 std
tied ``tok_embeddings.weight`` (= output)      the output's recipe (see ``Transformer.init_weights``)
=============================================  ==========================================

Non-persistent buffers (``freqs_cis``) are a pure function of ``ModelArgs``. They are *not*
stored in checkpoints: a complex RoPE table is not a weight, HF checkpoints do not carry it, and
persisting it would make a seed depend on ``max_seq_len``. Instead ``init_buffers()`` recomputes
them deterministically on whatever device the module lives on, so a stage rebuilt from a seed has
exactly the buffers of the full model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# Absolute bound of ``nn.init.trunc_normal_``'s defaults (a=-2, b=2), which torchtitan keeps.
TRUNC_BOUND = 2.0


@dataclass
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (``rope_type="llama3"`` in HF)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    # One matrix for the input embedding and the output projection (Llama-3.2 1B/3B). When a
    # pipeline puts them on different stages each holds a copy, kept equal by the trainer.
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        sizes = dict(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                     vocab_size=self.vocab_size, multiple_of=self.multiple_of, max_seq_len=self.max_seq_len)
        if any(v < 1 for v in sizes.values()):
            raise ValueError(f"sizes must be >= 1: {sizes}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown ModelArgs fields {sorted(unknown)}; valid: {sorted(names)}")
        return cls(**d)


# ModelArgs fields that decide which tensors exist and their shapes: a config must agree with a
# checkpoint on these (loading an untied checkpoint into a tied model would keep one of two matrices).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_word_embeddings")

_LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)

# Shapes of the released Llama 3.x models (torchtitan's flavors, plus 1B/3B from Llama 3.2 and a
# tiny CPU-friendly ``debug``). 1B and 3B tie the output to the embedding, as released.
LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=128, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=32,
                       rope_theta=10000.0, max_seq_len=512),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                    multiple_of=256, rope_scaling=RopeScaling(**_LLAMA32_ROPE), max_seq_len=131072,
                    tie_word_embeddings=True),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                    multiple_of=256, rope_scaling=RopeScaling(**_LLAMA32_ROPE), max_seq_len=131072,
                    tie_word_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, rope_scaling=RopeScaling(**_LLAMA31_ROPE), max_seq_len=131072),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, rope_scaling=RopeScaling(**_LLAMA31_ROPE), max_seq_len=131072),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, rope_scaling=RopeScaling(**_LLAMA31_ROPE), max_seq_len=131072),
}


def tied_weights(args: ModelArgs) -> dict[str, str]:
    """FQNs whose tensor is another's: ``{tied: source}`` (a tied output is the embedding)."""
    return {"output.weight": "tok_embeddings.weight"} if args.tie_word_embeddings else {}


def flavor_of(args: ModelArgs) -> str | None:
    """The released flavor with these tensor shapes, if any."""
    return next((name for name, flavor in LLAMA3_FLAVORS.items()
                 if all(getattr(flavor, f) == getattr(args, f) for f in SHAPE_FIELDS)), None)


def rope_frequencies(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama-3.1 scaling when configured.

    3.1 scaling leaves high frequencies (wavelength < original_len / high_freq_factor) alone,
    divides low frequencies (wavelength > original_len / low_freq_factor) by ``factor`` and
    interpolates smoothly in between.
    """
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    s = args.rope_scaling
    if s is not None:
        wavelen = 2 * math.pi / freqs
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * freqs / s.factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / s.factor,
                            torch.where(wavelen < high_wavelen, freqs, blended))
    return freqs.float()


def precompute_freqs_cis(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """``(max_seq_len, head_dim // 2)`` complex64 table of e^{i * pos * freq}."""
    freqs = rope_frequencies(args, device)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of ``x`` (bsz, seq, heads, head_dim).

    ``freqs_cis`` is ``(seq, head_dim // 2)`` (the same positions in every row) or
    ``(bsz, seq, head_dim // 2)`` (per-row positions, e.g. restarting at each packed document).
    """
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[None, :, None, :] if freqs_cis.dim() == 2 else freqs_cis[:, :, None, :]
    rotated = torch.view_as_real(x_complex * freqs).flatten(3)
    return rotated.type_as(x)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``(bsz, 1, seq, seq)`` boolean mask: token i attends to token j <= i of the same document.

    Packing several documents (e.g. chat conversations) into one row needs this so no token sees
    another document -- with per-document positions the row then computes exactly what the
    documents would compute one by one.
    """
    seqlen = document_ids.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, init_std: float):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.init_std = init_std
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        init.trunc_normal_(self.wo.weight, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if freqs_cis.dim() == 2:
            freqs_cis = freqs_cis[:seqlen]  # sliced here, with the runtime sequence length
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        repeats = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(repeats, dim=2)  # GQA: each kv head serves `repeats` q heads
        v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init) -> None:
        init.trunc_normal_(self.w1.weight, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal_(linear.weight, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        init_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # depth-scaled output projections
        self.attention = Attention(args, init_std)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, init_std)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def init_weights(self, init) -> None:
        init.ones_(self.attention_norm.weight)
        init.ones_(self.ffn_norm.weight)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # On `meta` this allocates nothing; after `to_empty` call `init_buffers()`.
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, make ``output`` use the embedding's parameter when this
        module holds both. Call again after anything that replaces parameters (``to_empty``)."""
        if (self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None
                and self.output.weight is not self.tok_embeddings.weight):
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers on the device the module now lives on."""
        self.freqs_cis = precompute_freqs_cis(self.args, device=self.freqs_cis.device)

    def init_weights(self, init) -> None:
        if self.norm is not None:
            init.ones_(self.norm.weight)
        output_std = self.args.dim ** -0.5
        if not self.args.tie_word_embeddings:
            if self.tok_embeddings is not None:
                init.normal_(self.tok_embeddings.weight, std=1.0)
            if self.output is not None:
                init.trunc_normal_(self.output.weight, std=output_std, cutoff=3.0)
            return
        # Tied: one matrix is the output projection too, so it takes the output's recipe (std 1.0
        # would give logits of std ~sqrt(dim)); HF's Llama likewise draws a tied matrix at std 0.02.
        # A stage holding only the output copy draws it under the embedding's FQN, so the copies on
        # the first and last pipeline stages are bitwise equal without communication.
        weights = {id(m.weight): m.weight for m in (self.tok_embeddings, self.output) if m is not None}
        for weight in weights.values():
            init.trunc_normal_(weight, std=output_std, cutoff=3.0, key="tok_embeddings.weight")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or, on a later pipeline stage, hidden states) -> logits (or hidden states).

        ``positions`` (bsz, seq): RoPE position of each token (default ``0..seq-1`` in every row).
        ``document_ids`` (bsz, seq): tokens attend only within their document (default: one per row).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs_cis = self.freqs_cis if positions is None else self.freqs_cis[positions]
        mask = None if document_ids is None else document_causal_mask(document_ids)
        for layer in self.layers.values():
            h = layer(h, freqs_cis, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
