"""Gemma 4's decoder: the shared decoder's ``Transformer`` with Gemma 4's blocks, per-layer inputs
and each layer kind's RoPE table (``models.gemma4``'s docstring says what each computes and why the
per-layer inputs and the shared keys travel as they do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.decoder import Transformer, chunked_cross_entropy, owned_positions
from models.common.feed_forward import GATE_ACTIVATIONS, FeedForward
from models.common.moe import MoE, Router
from models.common.norms import init_norm, upcast
from models.common.packed_attention import Documents, causal_attention, packed_attention
from models.common.rope import rope_frequencies, rope_table

GELU_TANH = GATE_ACTIVATIONS["gelu_tanh"]


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``weight`` (ones at init), computed in float32 at least (``upcast``) and rounded
    once at the end, as transformers' ``Gemma4RMSNorm`` (not Gemma 3's ``1 + weight``): bitwise its
    output in bfloat16, where rounding the unscaled norm first changed 26 % of the outputs."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps) * upcast(self.weight)).type_as(x)


def unscaled_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a scale, in float32 at least (the values' and the router's)."""
    return F.rms_norm(upcast(x), (x.shape[-1],), eps=eps).type_as(x)


def rope_tables(args, device: torch.device | None = None, length: int | None = None):
    """(the global layers' table, the windowed layers' table), ``length`` positions (default
    ``max_seq_len``). A global head of D channels has D/2 pairs; the first ``global_rope_fraction``
    of them turn at ``theta^(-2j/D)`` / ``global_rope_factor`` and the rest not at all (transformers'
    "proportional" RoPE: the frequencies keep the whole head's denominator, unlike partial RoPE)."""
    length = length or args.max_seq_len
    widths = (args.global_head_dim, args.head_dim)
    if (device or torch.get_default_device()).type == "meta":  # shapes only, as the shared decoder's
        return tuple(torch.empty(length, w // 2, dtype=torch.complex64, device="meta") for w in widths)
    freqs, _ = rope_frequencies(args.global_head_dim, args.rope_theta, device=device)
    turning = int(args.global_rope_fraction * args.global_head_dim // 2)
    freqs = torch.cat([freqs[:turning] / args.global_rope_factor, freqs.new_zeros(len(freqs) - turning)])
    local, _ = rope_frequencies(args.head_dim, args.rope_local_theta, device=device)
    return rope_table(freqs, 1.0, length, device), rope_table(local, 1.0, length, device)


def rotate_halves(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` (bsz, seq, heads, d) whose pairs are ``(x_j, x_{j + d/2})``, transformers' layout
    (``models.gemma4``: why Gemma 4 keeps it); ``freqs_cis`` (seq, d/2) or (bsz, seq, d/2)."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half].float(), x[..., half:].float())
    turned = pairs * (freqs_cis[None, :, None, :] if freqs_cis.dim() == 2 else freqs_cis[:, :, None, :])
    return torch.cat([turned.real, turned.imag], dim=-1).type_as(x)


def _init_linears(init, std: float, *linears: nn.Linear | None) -> None:
    for linear in linears:
        if linear is not None:
            init.normal_(linear.weight, std=std)


class Attention(nn.Module):
    """One layer's attention: its kind's head size and key/value heads, q/k norms, values normed
    without a scale, scores unscaled (1.0). A kv-shared layer has only ``wq``, ``q_norm`` and ``wo``:
    its keys and values are given (``shared``); with ``attention_k_eq_v`` a global layer's values are
    its keys' projection before the key norm and RoPE (no ``wv``)."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.head_dim = head_dim = args.layer_head_dim(layer_id)
        kv_width = args.layer_kv_heads(layer_id) * head_dim
        self.window = args.layer_windows[layer_id]
        self.options = args.decoder_options  # what a tensor-parallel plan reads (q/k norms)
        self.eps = args.norm_eps
        self.init_std = args.initializer_range
        self.wq = nn.Linear(args.dim, args.n_heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, args.norm_eps)
        self.wo = nn.Linear(args.n_heads * head_dim, args.dim, bias=False)
        own = args.kv_source(layer_id) is None
        self.wk = nn.Linear(args.dim, kv_width, bias=False) if own else None
        self.wv = nn.Linear(args.dim, kv_width, bias=False) if own and not args.values_are_keys(layer_id) else None
        self.k_norm = RMSNorm(head_dim, args.norm_eps) if own else None

    def init_weights(self, init) -> None:
        _init_linears(init, self.init_std, self.wq, self.wk, self.wv, self.wo)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                init_norm(init, norm)

    def forward(self, x, freqs_cis, documents=None, shared=None):
        """-> (the output, this layer's (keys, values) as attention takes them: (bsz, heads, seq, d))."""
        bsz, seqlen, _ = x.shape
        if freqs_cis.dim() == 2:
            freqs_cis = freqs_cis[:seqlen]
        q = rotate_halves(self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim)), freqs_cis)
        k, v = shared if shared is not None else self.keys_values(x, freqs_cis)
        q = q.transpose(1, 2)
        if documents is None:
            out = causal_attention(q, k, v, 1.0, self.window)
        else:
            out = packed_attention(q, k, v, documents, 1.0, self.window)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1)), (k, v)

    def keys_values(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = k if self.wv is None else self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        k = rotate_halves(self.k_norm(k), freqs_cis)
        return k.transpose(1, 2), unscaled_norm(v, self.eps).transpose(1, 2)


class Gemma4Router(Router):
    """The shared softmax router (top-k renormalized) on the tokens normed without a scale, times a
    learned ``scale`` and ``dim^-1/2``; each chosen expert's weight then times its ``per_expert_scale``."""

    def __init__(self, dim: int, options, eps: float):
        super().__init__(dim, options)
        self.eps = eps
        self.scale = nn.Parameter(torch.empty(dim))
        self.per_expert_scale = nn.Parameter(torch.empty(options.n_experts))

    def init_weights(self, init) -> None:
        super().init_weights(init)
        init.ones_(self.scale)
        init.ones_(self.per_expert_scale)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        x = unscaled_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        scores, chosen, weights = super().forward(x, expert_bias)
        return scores, chosen, weights * self.per_expert_scale.float()[chosen]


class Gemma4MoE(MoE):
    """The shared mixture of experts (GeGLU experts) routed by ``Gemma4Router`` on the block's
    residual, its experts taking that residual through a norm of their own (``expert_norm``)."""

    def __init__(self, args):
        super().__init__(args.dim, args.moe_options, args.initializer_range)
        self.router = Gemma4Router(args.dim, args.moe_options, args.norm_eps)
        self.expert_norm = RMSNorm(args.dim, args.norm_eps)

    def init_weights(self, init) -> None:
        super().init_weights(init)
        init_norm(init, self.expert_norm)

    def expert_inputs(self, flat: torch.Tensor) -> torch.Tensor:
        return self.expert_norm(flat)


class PerLayerGate(nn.Module):
    """A block's use of its per-layer input: ``norm(projection(gelu(gate(h)) * input))``, added to h."""

    def __init__(self, args):
        super().__init__()
        self.init_std = args.initializer_range
        self.gate = nn.Linear(args.dim, args.per_layer_dim, bias=False)
        self.projection = nn.Linear(args.per_layer_dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def init_weights(self, init) -> None:
        _init_linears(init, self.init_std, self.gate, self.projection)
        init_norm(init, self.norm)

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        return self.norm(self.projection(GELU_TANH(self.gate(h)) * per_layer_input))


class PerLayerInputs(nn.Module):
    """Every layer's input, from the tokens and the scaled embedding ``h``: a table of
    ``per_layer_dim`` per layer per token (scaled by ``sqrt(per_layer_dim)``, rounded to its dtype),
    and ``h`` projected (times ``dim^-1/2``) and normed per layer; their sum times ``2^-1/2``."""

    def __init__(self, args):
        super().__init__()
        self.shape = (args.n_layers, args.per_layer_dim)
        self.init_std = args.initializer_range
        self.embeddings = nn.Embedding(args.per_layer_vocab, args.n_layers * args.per_layer_dim)
        self.projection = nn.Linear(args.dim, args.n_layers * args.per_layer_dim, bias=False)
        self.norm = RMSNorm(args.per_layer_dim, args.norm_eps)

    def init_weights(self, init) -> None:
        init.normal_(self.embeddings.weight, std=self.init_std)
        _init_linears(init, self.init_std, self.projection)
        init_norm(init, self.norm)

    def forward(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """-> (bsz, seq, n_layers, per_layer_dim)."""
        table = self.embeddings(tokens)
        scale = torch.tensor(self.shape[1] ** 0.5).to(table.dtype)  # rounded as transformers rounds it
        context = self.norm((self.projection(h) * h.shape[-1] ** -0.5).unflatten(-1, self.shape))
        return (context + (table * scale).unflatten(-1, self.shape)) * 2**-0.5


class Gemma4Block(nn.Module):
    """Attention and the MLP, each with sandwich norms; beside the MLP, with ``n_experts``, the
    mixture of experts (each branch normed, their sum normed again); then the per-layer input's
    gate, and the whole times ``layer_scalar`` (a stored buffer, one at init)."""

    def __init__(self, layer_id: int, args):
        super().__init__()
        norms = ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm")
        norms += ("post_mlp_norm", "post_moe_norm") if args.n_experts else ()
        for name in norms:
            setattr(self, name, RMSNorm(args.dim, args.norm_eps))
        self.norms = norms
        self.attention = Attention(args, layer_id)
        options = args.decoder_options
        self.feed_forward = FeedForward(args.dim, args.layer_ffn_dim(layer_id), options, 0.02, "gelu_tanh")
        self.moe = Gemma4MoE(args) if args.n_experts else None
        self.per_layer = PerLayerGate(args) if args.per_layer_dim else None
        self.register_buffer("layer_scalar", torch.empty(1))

    def init_weights(self, init) -> None:
        for name in self.norms:
            init_norm(init, getattr(self, name))
        init.ones_(self.layer_scalar)

    def forward(self, x, freqs_cis, documents=None, owned=None, per_layer_input=None, shared_kv=None):
        """-> (the block's output, its attention's keys and values)."""
        attended, kv = self.attention(self.attention_norm(x), freqs_cis, documents, shared=shared_kv)
        h = x + self.post_attention_norm(attended)
        transformed = self.feed_forward(self.ffn_norm(h))
        if self.moe is not None:  # ``owned`` as a keyword: a tensor-parallel plan prepares positional inputs
            transformed = self.post_mlp_norm(transformed) + self.post_moe_norm(self.moe(h, owned=owned))
        out = h + self.post_ffn_norm(transformed)
        if self.per_layer is not None:
            out = out + self.per_layer(out, per_layer_input)
        return (out * self.layer_scalar).type_as(out), kv


class Gemma4Transformer(Transformer):
    """The shared decoder's top level with Gemma 4's blocks and norms, its per-layer inputs beside
    the embedding (``per_layer_inputs``) and the keys and values of the kv-shared layers handed on."""

    block = Gemma4Block

    def __init__(self, args):
        super().__init__(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.per_layer_inputs = PerLayerInputs(args) if args.per_layer_dim else None
        global_table, window_table = rope_tables(args, self.freqs_cis.device)
        self.register_buffer("freqs_cis", global_table, persistent=False)
        self.register_buffer("window_freqs_cis", window_table, persistent=False)
        self.kv_sources = {i: args.kv_source(i) for i in range(args.n_layers) if args.kv_source(i) is not None}
        self.kv_kept = set(self.kv_sources.values())  # kept through the forward, no others (activation checkpointing)

    def init_buffers(self) -> None:
        self.freqs_cis, self.window_freqs_cis = rope_tables(self.args, self.freqs_cis.device)

    def rope_tables(self, seqlen: int, positions: torch.Tensor | None):
        """As the shared decoder's, from Gemma 4's tables (``rope_tables``)."""
        tables = (self.freqs_cis, self.window_freqs_cis)
        if seqlen > tables[0].shape[0]:
            tables = rope_tables(self.args, tables[0].device, seqlen)
        return tuple(table if positions is None else table[positions] for table in tables)

    def forward(self, tokens, positions=None, document_ids=None, labels=None):
        """As the shared decoder's. Between pipeline stages the hidden state travels with the
        per-layer inputs beside it, one tensor ``(bsz, seq, dim + n_layers * per_layer_dim)``."""
        h, per_layer = self.unpacked(tokens) if self.tok_embeddings is None else self.embedded(tokens)
        global_rope, window_rope = self.rope_tables(h.shape[1], positions)
        documents = None if document_ids is None else Documents.of(document_ids, set())
        owned = owned_positions(document_ids)
        kept = {}  # the keys and values the kv-shared layers reuse, by layer
        for name, layer in self.layers.items():
            i = int(name)
            rope = window_rope if self.args.is_sliding(i) else global_rope
            given = None if per_layer is None else per_layer[:, :, i]
            h, kv = layer(h, rope, documents, owned, per_layer_input=given, shared_kv=self.reused(i, kept))
            if i in self.kv_kept:
                kept[i] = kv
        if self.norm is None:
            return h if per_layer is None else torch.cat([h, per_layer.flatten(2)], dim=-1)
        h = self.norm(h)
        if self.output is None:
            return h
        if labels is not None:
            weights = list(self.output.parameters())
            return chunked_cross_entropy(h, labels, self.project, self.loss_chunk_tokens, weights)
        return self.project(h)

    def embedded(self, tokens):
        h = self.embed(tokens)
        return h, None if self.per_layer_inputs is None else self.per_layer_inputs(tokens, h)

    def unpacked(self, x):
        """An earlier pipeline stage's output -> (hidden state, per-layer inputs or None)."""
        if not self.args.per_layer_dim:
            return x, None
        h, rest = x.split([self.args.dim, x.shape[-1] - self.args.dim], dim=-1)
        return h, rest.unflatten(-1, (self.args.n_layers, self.args.per_layer_dim))

    def reused(self, layer: int, kept: dict):
        source = self.kv_sources.get(layer)
        if source is None:
            return None
        if source not in kept:
            raise ValueError(
                f"layer {layer} reuses the keys and values of layer {source}, which this module does not hold: "
                f"keep layers {source}..{self.args.n_layers - 1} on one pipeline stage"
            )
        return kept[source]
