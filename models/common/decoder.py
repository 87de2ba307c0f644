"""The decoder every family here shares: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Llama 3 is the plain case; the other families switch on what they add (``DecoderOptions``): bias
on q/k/v (Qwen2), an RMSNorm over each q and k head before RoPE (Qwen3), Granite's multipliers on
the embedding, the residual branches, the attention scores and the logits, and HF's plain normal
init; for gpt-oss a bias on the output projection too and a learned sink logit per head; for Gemma
norms scaled by ``1 + weight`` (``models.common.norms``) also on each branch's output (sandwich norms:
``layers.{i}.{post_attention_norm,post_ffn_norm}``), GeGLU, a softcap on the logits (and one on
the attention scores where configured: Gemma 2's) and the sliding-window layers' own RoPE table
(``window_freqs_cis``). Each family's args provide the shapes and ``decoder_options``; its folder
says which. Any layer may attend through a sliding window
(``DecoderOptions.layer_windows``: Mistral v0.1's, Qwen2's upper layers, gpt-oss's every other
layer), in whole rows and in packed documents alike. RoPE and its stretches (linear, Llama 3.1's,
YaRN) are ``models.common.rope``.

Names are Meta's and torchtitan's (``tok_embeddings``, ``layers.{i}.attention.wq``, ...), for every
family: a family's Hugging Face names are mapped by ``models.common.hf_names``. RoPE rotates
interleaved pairs (Meta's convention), so HF conversion permutes the rows of ``wq``/``wk`` (and
their biases and norms) within each head.

The model is *pipeline friendly* (torchtitan's recipe): ``layers`` is an ``nn.ModuleDict`` keyed
``"0".."n-1"`` so FQNs survive deleting the layers a stage does not own, ``tok_embeddings``,
``norm`` and ``output`` may be set to ``None`` and are then skipped, and the top-level forward is
a plain loop. Anything that depends on the sequence length is sliced inside the layer; attention
reshapes with ``-1`` heads, so a rank holding a slice of the heads runs as it is.

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
    init.zeros_(tensor)

``normal_`` and ``trunc_normal_`` also take ``key=FQN``: draw the values of the tensor named FQN
(the copy of a tied matrix on another pipeline stage). The seed writer and the stage builder pass
one that derives every tensor's values from (seed, FQN, recipe).

Two recipes (``DecoderOptions.init``). ``torchtitan`` is torchtitan's Llama 3 / Qwen3
distribution (depth-scaled output projections). torchtitan calls ``nn.init.trunc_normal_(w,
std=...)`` for the hidden projections with that function's default *absolute* bounds +-2
(``TRUNC_BOUND``): +-100 std for std 0.02, so in effect an untruncated normal, reproduced here
exactly as a normal truncated at +-2. Only the output is cut relative to its std (+-3 std).

=============================================  ==========================================
``tok_embeddings.weight``                      normal, std 1.0
``attention.{wq,wk,wv}``, ``feed_forward.w1``  normal, std 0.02, truncated at +-2 (absolute)
``attention.wo``, ``feed_forward.{w2,w3}``     normal, std 0.02 / sqrt(2 (layer_id + 1)), truncated at +-2
``*norm.weight``                               ones (zeros where the scale is ``1 + weight``)
``output.weight``                              truncated normal, std dim^-0.5, +-3 std
tied ``tok_embeddings.weight`` (= output)      the output's recipe (see ``Transformer.init_weights``)
``attention.{wq,wk,wv,wo}.bias``               zeros
``attention.sinks``                            normal, std 0.02, truncated at +-2 (absolute)
=============================================  ==========================================

``normal`` is Hugging Face's ``_init_weights`` for these families: every linear and embedding
weight (and the sinks) normal with std ``init_std`` (the config's ``initializer_range``), biases
zero, norms at their identity (one; zero where the scale is ``1 + weight``).

Non-persistent buffers (``freqs_cis``, ``window_freqs_cis``) are a pure function of the args. They
are *not* stored in checkpoints: a complex RoPE table is not a weight, HF checkpoints do not carry
it, and persisting it would make a seed depend on ``max_seq_len``. Instead ``init_buffers()``
recomputes them deterministically on whatever device the module lives on, so a stage rebuilt from a
seed has exactly the buffers of the full model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.common.feed_forward import TRUNC_BOUND, FeedForward
from models.common.moe import MoE, MoEOptions
from models.common.norms import init_norm, rms_norm
from models.common.packed_attention import Documents, causal_attention, packed_attention
from models.common.rope import apply_rotary_emb, precompute_freqs_cis


@dataclass(frozen=True)
class DecoderOptions:
    """How a family's decoder differs from Llama 3's; every default is Llama 3's."""

    qkv_bias: bool = False  # a bias on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head, before RoPE (Qwen3)
    embedding_multiplier: float = 1.0  # scales the embedding's output (Granite)
    residual_multiplier: float = 1.0  # scales each block's branches before the residual add (Granite)
    attention_multiplier: float | None = None  # the attention scores' scale (Granite; None: head_dim^-0.5)
    logits_scaling: float = 1.0  # the logits are divided by it (Granite)
    logit_softcap: float | None = None  # the logits become softcap * tanh(logits / softcap) (Gemma)
    # the embedding multiplier is first rounded to the embedding's dtype (Gemma's normalizer, sqrt(dim))
    embedding_multiplier_rounded: bool = False
    norm_offset: bool = False  # every RMSNorm scales by 1 + weight, in float32, its weight starting at 0 (Gemma)
    sandwich_norms: bool = False  # each block's attention and feed-forward outputs normed before the residual add
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the feed-forward's gate: SwiGLU, or GeGLU (Gemma)
    # the sliding-window layers' own RoPE base, unstretched (Gemma 3's local layers); None: the model's table
    window_rope_theta: float | None = None
    init: Literal["torchtitan", "normal"] = "torchtitan"
    init_std: float = 0.02  # ``normal``: the std of every weight (HF's initializer_range)
    moe: MoEOptions | None = None  # the mixture of experts of the layers ``moe_layers`` (Qwen3-MoE, Mixtral)
    moe_layers: tuple[int, ...] = ()
    # Per layer, the positions each token attends back to, itself included (a sliding window: Mistral
    # v0.1, Qwen2's ``max_window_layers``, gpt-oss's ``layer_types``); None, or a layer past the end of
    # the tuple: every earlier position.
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # a learned logit per head joins each softmax, without a value (gpt-oss)
    # the attention scores become cap * tanh(scores / cap), after their scale, before mask and softmax (Gemma 2)
    attn_softcap: float | None = None
    o_bias: bool = False  # a bias on the output projection ``wo`` (gpt-oss, with ``qkv_bias``)
    # The blocks' attention module, built as ``attention(args, init_std)`` and called as ``Attention``
    # is; None: ``Attention`` (DeepSeek-V3's multi-head latent attention is its family's own)
    attention: Callable[..., nn.Module] | None = None
    # Per layer, the blocks' attention module, built as ``layer_attention(args, layer_id, init_std)`` and
    # called as ``Attention`` is, where layers differ in kind (Qwen3.5's linear and full attention)
    layer_attention: Callable[..., nn.Module] | None = None

    def window(self, layer_id: int) -> int | None:
        """Layer ``layer_id``'s sliding window (``layer_windows``)."""
        return self.layer_windows[layer_id] if layer_id < len(self.layer_windows) else None


def tied_weights(args) -> dict[str, str]:
    """FQNs whose tensor is another's: ``{tied: source}`` (a tied output is the embedding)."""
    return {"output.weight": "tok_embeddings.weight"} if args.tie_word_embeddings else {}


def owned_positions(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The positions a document owns: ``document_ids >= 0`` (a negative id marks padding, which no
    document owns); None where every position is owned."""
    if document_ids is None:
        return None
    owned = document_ids >= 0
    return None if bool(owned.all()) else owned


class Attention(nn.Module):
    """Grouped-query attention; ``window``: this layer's sliding window (``causal_attention``)."""

    def __init__(self, args, init_std: float, window: int | None = None):
        super().__init__()
        options = args.decoder_options
        self.head_dim = args.head_dim
        self.options = options
        self.init_std = init_std
        self.window = window
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=options.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=options.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=options.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=options.o_bias)
        if options.qk_norm:
            self.q_norm = rms_norm(self.head_dim, args.norm_eps, options.norm_offset)
            self.k_norm = rms_norm(self.head_dim, args.norm_eps, options.norm_offset)
        # One sink logit per q head (split with the heads under tensor parallelism).
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if options.attention_sinks else None

    def init_weights(self, init) -> None:
        qkv = (self.wq, self.wk, self.wv)
        if self.options.init == "normal":
            for linear in (*qkv, self.wo):
                init.normal_(linear.weight, std=self.options.init_std)
            if self.sinks is not None:
                init.normal_(self.sinks, std=self.options.init_std)
        else:
            for linear in qkv:
                init.trunc_normal_(linear.weight, std=0.02, cutoff=TRUNC_BOUND / 0.02)
            init.trunc_normal_(self.wo.weight, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)
            if self.sinks is not None:
                init.trunc_normal_(self.sinks, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        for linear in (*qkv, self.wo):
            if linear.bias is not None:
                init.zeros_(linear.bias)
        if self.options.qk_norm:
            init_norm(init, self.q_norm)
            init_norm(init, self.k_norm)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``documents``: a packed batch's (``Documents.of``); None: each row is one."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.options.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if freqs_cis.dim() == 2:
            freqs_cis = freqs_cis[:seqlen]  # sliced here, with the runtime sequence length
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scale = self.options.attention_multiplier
        cap = self.options.attn_softcap
        if documents is None:
            out = causal_attention(q, k, v, scale, self.window, self.sinks, cap)
        else:
            out = packed_attention(q, k, v, documents, scale, self.window, self.sinks, cap)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args):
        super().__init__()
        init_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # torchtitan: depth-scaled output projections
        self.residual_multiplier = args.decoder_options.residual_multiplier
        options = args.decoder_options
        window = options.window(layer_id)
        if options.layer_attention is not None:
            self.attention = options.layer_attention(args, layer_id, init_std)
        elif options.attention is not None:
            self.attention = options.attention(args, init_std)
        else:
            self.attention = Attention(args, init_std, window)
        moe = options.moe if layer_id in options.moe_layers else None
        self.feed_forward = (
            FeedForward(args.dim, args.ffn_hidden_dim, options, init_std, options.activation) if moe is None else None
        )
        self.moe = MoE(args.dim, moe, init_std) if moe is not None else None
        self.attention_norm = rms_norm(args.dim, args.norm_eps, options.norm_offset)
        self.ffn_norm = rms_norm(args.dim, args.norm_eps, options.norm_offset)
        sandwich = options.sandwich_norms  # a norm on each branch's output too (Gemma's post-norms)
        self.post_attention_norm = rms_norm(args.dim, args.norm_eps, options.norm_offset) if sandwich else None
        self.post_ffn_norm = rms_norm(args.dim, args.norm_eps, options.norm_offset) if sandwich else None

    def init_weights(self, init) -> None:
        for norm in (self.attention_norm, self.ffn_norm, self.post_attention_norm, self.post_ffn_norm):
            if norm is not None:
                init_norm(init, norm)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents=None, owned=None) -> torch.Tensor:
        """``documents``: a packed batch's (``Documents.of``); ``owned``: the positions a
        document owns (``owned_positions``), routed by a mixture of experts (None: all)."""
        attended = self.attention(self.attention_norm(x), freqs_cis, documents)
        if self.post_attention_norm is not None:
            attended = self.post_attention_norm(attended)
        if self.residual_multiplier != 1.0:
            attended = attended * self.residual_multiplier
        h = x + attended
        if self.moe is None:
            transformed = self.feed_forward(self.ffn_norm(h))
        else:  # ``owned`` as a keyword: a tensor-parallel plan prepares the positional input only
            transformed = self.moe(self.ffn_norm(h), owned=owned)
        if self.post_ffn_norm is not None:
            transformed = self.post_ffn_norm(transformed)
        if self.residual_multiplier != 1.0:
            transformed = transformed * self.residual_multiplier
        return h + transformed


class Transformer(nn.Module):
    block = TransformerBlock  # built as ``block(layer_id, args)``; a family with blocks of its own sets it (Gemma 4)

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.options = args.decoder_options
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block(i, args) for i in range(args.n_layers)})
        self.norm = rms_norm(args.dim, args.norm_eps, self.options.norm_offset)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # On `meta` this allocates nothing; after `to_empty` call `init_buffers()`.
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        theta = self.options.window_rope_theta  # the sliding-window layers' table, if theirs is their own
        window_table = None if theta is None else precompute_freqs_cis(args, theta=theta)
        self.register_buffer("window_freqs_cis", window_table, persistent=False)
        self.loss_chunk_tokens = 0  # tokens per chunk of forward(labels=...)'s loss; a training setting

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, make ``output`` use the embedding's parameter when this
        module holds both. Call again after anything that replaces parameters (``to_empty``)."""
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers on the device the module now lives on."""
        device = self.freqs_cis.device
        self.freqs_cis = precompute_freqs_cis(self.args, device=device)
        if self.window_freqs_cis is not None:
            self.window_freqs_cis = precompute_freqs_cis(self.args, device, theta=self.options.window_rope_theta)

    def init_weights(self, init) -> None:
        if self.norm is not None:
            init_norm(init, self.norm)
        # A stage holding only the output copy of a tied matrix draws it under the embedding's FQN,
        # so the copies on the first and last pipeline stages are bitwise equal without communication.
        tied = self.args.tie_word_embeddings
        key = "tok_embeddings.weight" if tied else None
        if self.options.init == "normal":
            weights = {id(m.weight): m.weight for m in (self.tok_embeddings, self.output) if m is not None}
            for weight in weights.values():
                init.normal_(weight, std=self.options.init_std, key=key)
            return
        output_std = self.args.dim**-0.5
        if not tied:
            if self.tok_embeddings is not None:
                init.normal_(self.tok_embeddings.weight, std=1.0)
            if self.output is not None:
                init.trunc_normal_(self.output.weight, std=output_std, cutoff=3.0)
            return
        # Tied: one matrix is the output projection too, so it takes the output's recipe (std 1.0
        # would give logits of std ~sqrt(dim)); HF's Llama likewise draws a tied matrix at std 0.02.
        weights = {id(m.weight): m.weight for m in (self.tok_embeddings, self.output) if m is not None}
        for weight in weights.values():
            init.trunc_normal_(weight, std=output_std, cutoff=3.0, key=key)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (or, on a later pipeline stage, hidden states) -> logits (or hidden states).

        ``positions`` (bsz, seq): RoPE position of each token (default ``0..seq-1`` in every row).
        ``document_ids`` (bsz, seq): tokens attend only within their document (default: one per row);
        a negative id marks padding: its own document, and never routed to an expert.
        ``labels`` (bsz, seq): on the stage holding ``output``, return the summed cross-entropy of the
        label tokens (-100: none) instead of the logits, ``loss_chunk_tokens`` tokens at a time
        (``chunked_cross_entropy``); other stages ignore them.
        """
        h = tokens if self.tok_embeddings is None else self.embed(tokens)
        freqs_cis, window_freqs_cis = self.rope_tables(tokens.shape[1], positions)
        documents = self.documents(document_ids, h)
        owned = owned_positions(document_ids)
        for i, layer in self.layers.items():
            h = layer(h, freqs_cis if self.options.window(int(i)) is None else window_freqs_cis, documents, owned)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if labels is not None:
            weights = list(self.output.parameters())  # the tensors ``project`` reads
            return chunked_cross_entropy(h, labels, self.project, self.loss_chunk_tokens, weights)
        return self.project(h)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> the scaled embedding (``embedding_multiplier``, ``embedding_multiplier_rounded``)."""
        h = self.tok_embeddings(tokens)
        scale = self.options.embedding_multiplier
        if scale == 1.0:
            return h
        if self.options.embedding_multiplier_rounded:  # as transformers' Gemma: float32, then h's dtype
            scale = torch.tensor(scale, dtype=torch.float32).to(h.dtype).item()
        return h * scale

    def rope_tables(self, seqlen: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE rows for ``positions`` (None: ``0..seqlen-1``) of the full-attention layers and of
        the sliding-window layers (the same table unless ``window_rope_theta``). Longer than
        max_seq_len (a table's rows), a table is computed for this length here -- it is a pure
        function of the args -- as transformers computes any position."""
        rows = []
        for table, theta in ((self.freqs_cis, None), (self.window_freqs_cis, self.options.window_rope_theta)):
            if table is not None and seqlen > table.shape[0]:
                table = precompute_freqs_cis(self.args, table.device, length=seqlen, theta=theta)
            if table is not None:
                rows.append(table if positions is None else table[positions])
        return rows[0], rows[-1]

    def documents(self, document_ids: torch.Tensor | None, h: torch.Tensor) -> Documents | None:
        """The documents of a packed batch (``Documents.of``), None for whole rows -- but on CUDA with
        capped attention scores, whole rows are one document each: flex attention computes the cap
        there, under a block mask built once per forward (``packed_attention``)."""
        if document_ids is None and self.options.attn_softcap is not None and h.device.type == "cuda":
            document_ids = torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
        return None if document_ids is None else Documents.of(document_ids, self.flex_windows())

    def flex_windows(self) -> set[int | None]:
        """The windows of this module's layers that have sinks or capped scores, whose packed
        attention takes flex attention's block masks on CUDA (``packed_attention``)."""
        if not self.options.attention_sinks and self.options.attn_softcap is None:
            return set()
        return {self.options.window(int(i)) for i in self.layers}

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits."""
        logits = self.output(h)
        if self.options.logits_scaling != 1.0:
            logits = logits / self.options.logits_scaling
        cap = self.options.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def chunked_cross_entropy(
    h: torch.Tensor,
    labels: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    chunk_tokens: int,
    weights: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The summed float32 cross-entropy of ``project(h)`` against ``labels`` (-100: no loss), computed
    ``chunk_tokens`` tokens at a time (0: all at once), so at most one chunk's logits exist at any
    time -- at a 128k vocabulary the whole micro-batch's would be 0.5 MB per token in float32.

    Each chunk's gradients (of its hidden states and of ``weights``, the tensors ``project`` reads)
    are computed in forward, right after its loss, and the chunk's logits freed: backward only
    scales them, so no logits are computed twice. (Checkpointing each chunk instead recomputed its
    logits in backward: 2.1x the whole-logits loss time on a GPU, where the matmuls dominate.)
    ``project`` is any function (a vocabulary-sharded output under loss parallel, a scale, a
    softcap); ``weights`` must hold every tensor it reads that needs a gradient. Without gradients
    (validation, ``no_grad``), the chunks are scored only."""
    h, labels = h.flatten(0, 1), labels.flatten()
    size = chunk_tokens if chunk_tokens > 0 else h.shape[0]
    weights = [w for w in weights if w.requires_grad]
    if torch.is_grad_enabled() and (h.requires_grad or weights):
        return _LossWithGradients.apply(project, labels, size, h, *weights)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], size):
        total = total + _summed_cross_entropy(project, h[start : start + size], labels[start : start + size])
    return total


class _LossWithGradients(torch.autograd.Function):
    """``chunked_cross_entropy`` with gradients: forward scores each chunk and takes its gradients
    at once (``torch.autograd.grad`` over the chunk's own small graph), summing the weights'
    gradients in float32; backward returns them times the incoming gradient (the loss's scale)."""

    @staticmethod
    def forward(ctx, project, labels, size: int, h, *weights):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        h_grads, weight_grads = [], [None] * len(weights)
        with torch.enable_grad():
            for start in range(0, h.shape[0], size):
                part = h[start : start + size].detach().requires_grad_(h.requires_grad)
                loss = _summed_cross_entropy(project, part, labels[start : start + size])
                inputs = [part, *weights] if h.requires_grad else list(weights)
                grads = torch.autograd.grad(loss, inputs, allow_unused=True)
                if h.requires_grad:
                    h_grads.append(grads[0])
                    grads = grads[1:]
                for i, grad in enumerate(grads):
                    if grad is None:
                        continue
                    if weight_grads[i] is None:
                        weight_grads[i] = grad.float()
                    else:
                        weight_grads[i].add_(grad)  # in place: no new weight-sized tensor per chunk
                total = total + loss.detach()
        ctx.has_h_grad = h.requires_grad
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.save_for_backward(*([torch.cat(h_grads)] if h.requires_grad else []), *weight_grads)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        saved = list(ctx.saved_tensors)
        h_grad = saved.pop(0) * grad_total if ctx.has_h_grad else None
        weight_grads = [None if g is None else (g * grad_total).to(dtype) for g, dtype in zip(saved, ctx.weight_dtypes)]
        return None, None, None, h_grad, *weight_grads


def _summed_cross_entropy(project, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(project(h).float(), labels, reduction="sum")  # ignore_index: -100, the default
