"""Gated DeltaNet: linear attention whose state is a fast-weight matrix written by the delta rule and
decayed by a learned gate (Qwen3.5's ``linear_attention`` layers; Yang, Kautz and Hatamizadeh 2024).

Per value head, with ``q``, ``k`` L2-normalized (``q`` also times ``k_head_dim^-0.5``), a decay
``g_t <= 0`` and a write strength ``beta_t`` in (0, 1), the state ``S`` (``k_head_dim x
v_head_dim``) runs

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t.

``gated_delta_rule`` computes it a chunk of ``CHUNK`` positions at a time (the WY/UT form): inside
a chunk starting from ``S_0``, with ``G_t`` the chunk's cumulative decay, every state is ``S_t =
e^{G_t} S_0 + sum_{i<=t} e^{G_t - G_i} k_i w_i^T``, and the ``w`` solve one unit lower-triangular
system ``(I + A) W = beta V - beta e^{G} K S_0`` with ``A_ti = beta_t e^{G_t - G_i} k_t.k_i``
(``i < t``). So a chunk is a few matmuls and one triangular solve, and only the chunks run in
sequence. ``recurrent_gated_delta_rule`` is the recurrence token by token: the reference the tests
hold the chunked form to. Measured on one CPU thread, forward and backward of 2048 positions, 4 heads
of 64, median of 3 interleaved rounds: 0.19 s chunked, 3.45 s token by token (18x), transformers'
own chunked torch rule 0.17 s. On CUDA, where ``flash-linear-attention`` is installed (the ``fla`` extra),
its fused chunked kernel computes the same (``fla_gated_delta_rule``).

The layer (``GatedDeltaNet``), as ``transformers``' ``Qwen3_5GatedDeltaNet`` computes it: one
projection for q, k and v together (``in_proj_qkv``), one for the output gate ``z`` (``in_proj_z``),
one each for ``beta``'s and the decay's logits (``in_proj_b``, ``in_proj_a``); a depthwise causal
convolution of ``conv_kernel`` taps over q, k and v (``conv1d``) followed by SiLU; ``g =
-exp(A_log) softplus(a + dt_bias)``; ``v_heads / k_heads`` value heads per q/k head; the output
RMS-normed per head and gated by ``silu(z)`` (``norm``), then projected back (``out_proj``).
``in_proj_qkv``'s rows (and ``conv1d``'s channels) are grouped by key head -- its q rows, its k
rows, then its value heads' rows (``qkv_from_hf`` reorders transformers' all-q, all-k, all-v) -- so
a tensor-parallel rank's contiguous slice is whole heads with everything they read.

Packed rows: each document starts from a zero state and an empty convolution window, as it would
alone -- the recurrence's counterpart of attention's document mask. The documents are gathered into
rows of their own (``document_groups``: those of a length class side by side, padded at the end,
which a causal recurrence never reads back) and the convolution and the rule run on those rows; the
projections, the norm and ``out_proj`` are per position and run on the packed rows as they are.
It costs nothing over whole rows: one layer (dim 256, 4 value heads of 64), forward and backward on
4 rows of 2048 tokens, one CPU thread, median of 3 interleaved rounds: 1.30 s as whole rows, 1.17 s
as ~50-token chats (20-80 tokens), 0.83 s as 300-900-token documents.
(Resetting by a decay of -inf at each start instead would leave the convolution to mask apart, and
the chunk's cumulative decays then mix -inf, or, with a large finite stand-in such as -1e4, lose
float32's precision past it: 2^-10 of the small decays that follow.)
Compiled blocks (``training.compile``) take the per-document calls, whose number and sizes follow
each batch's documents, as one operator run eagerly (``_mix_documents``), as packed attention does:
a batch of other documents compiles nothing more (the debug Qwen3.5: 2 graphs, one per kind of
layer, for every layout of a row shape; before, one more per batch; ``_mix_each_documents``' figures).

Init (torchtitan 0.3.0's ``qwen3_5``): projections normal with std 0.02 truncated at +-2 absolute,
``out_proj`` depth-scaled; ``conv1d`` uniform in +-1/sqrt(conv_kernel) (``nn.Conv1d``'s default);
``A_log`` the log of U(0.01, 16); ``dt_bias`` ones; the gated norm's weight ones.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from models.common.eager_op import eager_op
from models.common.feed_forward import TRUNC_BOUND
from models.common.norms import upcast
from models.common.packed_attention import Documents, document_groups

CHUNK = 64  # positions per chunk of the chunked rule (FLA's and transformers' size)
A_LOG_RANGE = (0.01, 16.0)  # A = exp(A_log) is drawn uniformly here (torchtitan, transformers)
L2_EPS = 1e-6  # q and k are divided by sqrt(|x|^2 + eps), as FLA's kernel does


def fla_available() -> bool:
    """Whether ``flash-linear-attention``'s kernels are installed (the optional ``fla`` extra)."""
    return importlib.util.find_spec("fla") is not None


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def recurrent_gated_delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """The rule token by token, in float32 (float64 kept). ``q``, ``k``: (bsz, seq, heads, dk),
    normalized and scaled; ``v``: (bsz, seq, heads, dv); ``g``, ``beta``: (bsz, seq, heads). Returns
    (bsz, seq, heads, dv)."""
    q, k, v, g, beta = (upcast(x) for x in (q, k, v, g, beta))
    bsz, seq, heads, dk = k.shape
    state = q.new_zeros(bsz, heads, dk, v.shape[-1])
    out = []
    for t in range(seq):
        kt, decay, bt = k[:, t], g[:, t].exp()[..., None, None], beta[:, t][..., None]
        state = decay * state
        written = bt * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, state))  # the delta: what S misses of v
        state = state + kt[..., None] * written[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, dim=1)


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """(..., chunk) -> (..., chunk, chunk): ``G_t - G_i = sum_{i<j<=t} g_j`` at [t, i] for i <= t,
    -inf above the diagonal (so its exp is 0 there, never overflowing). Summed pair by pair, not as
    the difference of two cumulative sums, whose gradient to g_j adds and takes away every pair inside
    [j, chunk), which cancel: over 150 positions (4 heads of 32, A up to 16) the rule's float32
    gradient to ``A_log`` was 2.4e-4 of its size from float64's that way, 5.4e-7 this way (the
    token-by-token recurrence's 3.5e-7), and tp2's ``A_log`` gradients went from up to 1.5e-4 of one
    process's to 2.4e-6. Cost: one layer (dim 256, 4 value heads of 64), forward and backward of 4
    rows of 2048 tokens, one CPU thread, median of 3 interleaved rounds: 0.598 s, 0.592 s before."""
    chunk = g.shape[-1]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    spans = g[..., :, None].expand(*g.shape, chunk).masked_fill(~causal.tril(-1), 0).cumsum(-2)
    return spans.masked_fill(~causal, float("-inf"))


def gated_delta_rule(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """The rule of ``recurrent_gated_delta_rule``, ``chunk`` positions at a time (the module
    docstring's WY form), in float32 (float64 kept); the sequence padded at its end to whole chunks
    (zero decay and zero writes, which no earlier position reads)."""
    dtype = v.dtype
    bsz, seq, heads, dk = k.shape
    pad = -seq % chunk
    q, k, v = (F.pad(upcast(x).transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(upcast(x).transpose(1, 2), (0, pad)) for x in (g, beta))
    q, k, v = (x.unflatten(2, (-1, chunk)) for x in (q, k, v))  # (bsz, heads, chunks, chunk, d)
    g, beta = (x.unflatten(2, (-1, chunk)) for x in (g, beta))  # (bsz, heads, chunks, chunk)
    cum = g.cumsum(-1)  # G_t within each chunk
    decays = segment_sums(g).exp()  # e^{G_t - G_i} for i <= t, 0 elsewhere
    strict = ((k @ k.transpose(-1, -2)) * decays * beta[..., None]).tril(-1)  # A: i < t only
    system = torch.eye(chunk, dtype=strict.dtype, device=q.device) + strict
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, wk = solved.split([v.shape[-1], dk], dim=-1)  # W = u - wk S_0
    scores = (q @ k.transpose(-1, -2)) * decays
    state = q.new_zeros(bsz, heads, dk, v.shape[-1])
    out = []
    for c in range(q.shape[2]):
        w = u[:, :, c] - wk[:, :, c] @ state
        out.append((q[:, :, c] * cum[:, :, c, :, None].exp()) @ state + scores[:, :, c] @ w)
        tail = decays[:, :, c, -1, :, None]  # e^{G_C - G_i}
        state = cum[:, :, c, -1, None, None].exp() * state + (k[:, :, c] * tail).transpose(-1, -2) @ w
    out = torch.stack(out, dim=2).flatten(2, 3)[:, :, :seq]
    return out.transpose(1, 2).to(dtype)


def fla_gated_delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """FLA's fused chunked kernel (CUDA, ``flash-linear-attention`` installed); q and k as
    ``gated_delta_rule`` takes them (normalized and scaled here, so the kernel does neither)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, beta = (x.to(v.dtype) for x in (q, k, beta))  # the kernel takes one dtype
    out, _ = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, scale=1.0)
    return out


def delta_rule_kernel(device: torch.device):
    """The chunked rule for tensors on ``device``: FLA's on CUDA when installed, else ours."""
    return fla_gated_delta_rule if device.type == "cuda" and fla_available() else gated_delta_rule


def qkv_from_hf(rows: torch.Tensor, k_heads: int, k_head_dim: int) -> torch.Tensor:
    """transformers' ``in_proj_qkv`` rows (every q head, every k head, every value head) -> ours,
    grouped by key head (q, k, then its value heads); any trailing dims ride along (``conv1d``)."""
    key_dim = k_heads * k_head_dim
    q, k, v = rows.split([key_dim, key_dim, rows.shape[0] - 2 * key_dim])
    return torch.cat([x.unflatten(0, (k_heads, -1)) for x in (q, k, v)], dim=1).flatten(0, 1)


def qkv_to_hf(rows: torch.Tensor, k_heads: int, k_head_dim: int) -> torch.Tensor:
    """The inverse of ``qkv_from_hf``."""
    grouped = rows.unflatten(0, (k_heads, -1))
    q, k, v = grouped.split([k_head_dim, k_head_dim, grouped.shape[1] - 2 * k_head_dim], dim=1)
    return torch.cat([x.flatten(0, 1) for x in (q, k, v)])


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's values, in float32 (float64 kept), rounded to the input's dtype
    before the weight: the norm of transformers' ``RMSNormGated``, whose gate ``GatedDeltaNet``
    applies after it (one input, so a tensor-parallel plan norms each rank's heads as it norms q/k
    heads)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps).to(x.dtype)


class CausalConv1d(nn.Module):
    """The weight of a depthwise causal convolution over positions, then SiLU (``causal_conv1d``):
    ``nn.Conv1d``'s (channels, 1, taps), its channels the ones computed (a tensor-parallel rank's
    own). Called, it returns the weight (``GatedDeltaNet.weights``), which ``GatedDeltaNet`` hands to
    one operator with the rule's other weights: the call is what lets a tensor-parallel plan's module
    hooks (``HeadParameter``) hand it a rank's local slice."""

    def __init__(self, channels: int, taps: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps))

    def forward(self) -> torch.Tensor:
        return self.weight


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(bsz, seq, channels) both ways: the convolution of ``CausalConv1d``'s ``weight``, then SiLU."""
    padded = F.pad(x.transpose(1, 2), (weight.shape[-1] - 1, 0))
    return F.silu(F.conv1d(padded, weight, groups=weight.shape[0])).transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (the module docstring). Called as the decoder's attention is:
    ``(x, freqs_cis, documents)``; it has no positions to turn, so ``freqs_cis`` is unused."""

    def __init__(
        self,
        dim: int,
        k_heads: int,
        v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        norm_eps: float,
        init_std: float,
    ):
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(
                f"linear_num_value_heads = {v_heads} must be a multiple of linear_num_key_heads = {k_heads}"
            )
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.values_per_key = v_heads // k_heads  # value heads per q/k head
        self.init_std = init_std
        channels = k_heads * (2 * k_head_dim + self.values_per_key * v_head_dim)
        self.in_proj_qkv = nn.Linear(dim, channels, bias=False)
        self.in_proj_z = nn.Linear(dim, v_heads * v_head_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, v_heads, bias=False)
        self.conv1d = CausalConv1d(channels, conv_kernel)
        self.A_log = nn.Parameter(torch.empty(v_heads))
        self.dt_bias = nn.Parameter(torch.empty(v_heads))
        self.norm = HeadRMSNorm(v_head_dim, norm_eps)
        self.out_proj = nn.Linear(v_heads * v_head_dim, dim, bias=False)

    def init_weights(self, init) -> None:
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            init.trunc_normal_(linear.weight, std=0.02, cutoff=TRUNC_BOUND / 0.02)
        init.trunc_normal_(self.out_proj.weight, std=self.init_std, cutoff=TRUNC_BOUND / self.init_std)
        bound = self.conv1d.weight.shape[-1] ** -0.5  # nn.Conv1d's default: fan-in = the taps of one channel
        init.uniform_(self.conv1d.weight, -bound, bound)
        init.uniform_(self.A_log, *A_LOG_RANGE, log=True)
        init.ones_(self.dt_bias)
        init.ones_(self.norm.weight)

    def forward(self, x: torch.Tensor, freqs_cis=None, documents: Documents | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        mixed = torch.cat([self.in_proj_qkv(x), self.in_proj_b(x), self.in_proj_a(x)], dim=-1)
        out = self.mix(mixed) if documents is None else self.mix_documents(mixed, documents)
        z = self.in_proj_z(x).unflatten(-1, (-1, self.v_head_dim))
        gated = (self.norm(out) * F.silu(upcast(z))).to(out.dtype)  # transformers' RMSNormGated
        return self.out_proj(gated.flatten(2))

    def mix_documents(self, mixed: torch.Tensor, documents: Documents) -> torch.Tensor:
        """``mix`` inside each document of a packed batch (``mix_each``); compiled, as one operator
        of the graph, run eagerly (``_mix_documents``). Not with FLA's kernel: the operator's
        backward runs the forward under ``torch.func.vjp``, which takes no ``autograd.Function``
        without a ``setup_context`` (FLA's has none); FLA's own ``cu_seqlens`` would serve there."""
        dims = self.k_head_dim, self.v_head_dim, self.values_per_key
        ours = delta_rule_kernel(mixed.device) is gated_delta_rule
        if ours and torch.compiler.is_compiling():  # the calls follow each batch's documents: one op in the graph
            return _mix_documents(mixed, *self.weights(), documents.index, documents.layout, documents.take, *dims)
        return mix_each(mixed, *self.weights(), documents.index, documents.layout, documents.take, *dims)

    def mix(self, mixed: torch.Tensor) -> torch.Tensor:
        """``mix_rows`` with this layer's weights."""
        return mix_rows(mixed, *self.weights(), self.k_head_dim, self.v_head_dim, self.values_per_key)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's weight, ``A_log`` and ``dt_bias``, each a tensor-parallel rank's own
        slice: the plan's ``HeadParameter`` hands a module its slice when the module is called, so
        the convolution is called for its weight."""
        return self.conv1d(), self.A_log, self.dt_bias


def mix_rows(mixed, conv_weight, A_log, dt_bias, k_head_dim: int, v_head_dim: int, values_per_key: int) -> torch.Tensor:
    """Rows of the projections' outputs (q, k, v, then b and a) -> the rule's output per value head
    (bsz, seq, v_heads, v_head_dim), each row from a zero state. The heads are those of ``A_log``
    (a tensor-parallel rank's own)."""
    v_heads = A_log.shape[0]
    qkv, b, a = mixed.split([mixed.shape[-1] - 2 * v_heads, v_heads, v_heads], dim=-1)
    width = values_per_key * v_head_dim
    q, k, v = (
        causal_conv1d(qkv, conv_weight)
        .unflatten(-1, (-1, 2 * k_head_dim + width))
        .split([k_head_dim, k_head_dim, width], dim=-1)
    )
    q, k = (l2_normalize(upcast(x)).repeat_interleave(values_per_key, dim=2) for x in (q, k))
    v = v.flatten(2).unflatten(-1, (-1, v_head_dim))
    g = -upcast(A_log).exp() * F.softplus(upcast(a) + dt_bias)
    kernel = delta_rule_kernel(mixed.device)
    return kernel(q * k_head_dim**-0.5, k, v, g, b.sigmoid()).to(mixed.dtype)


def mix_each(mixed, conv_weight, A_log, dt_bias, index, layout, take, *dims: int) -> torch.Tensor:
    """``mix_rows`` inside each document of a packed batch: its documents gathered into rows of their
    own, one call per group (``document_groups``: ``index`` in the shapes ``layout`` holds), the
    outputs put back in place by one gather (``take``)."""
    bsz, seq, _ = mixed.shape
    flat = mixed.flatten(0, 1)
    outs = [
        mix_rows(flat.index_select(0, group.flatten()).unflatten(0, group.shape), conv_weight, A_log, dt_bias, *dims)
        for group in document_groups(index, layout)
    ]
    out = torch.cat([o.flatten(0, 1) for o in outs]).index_select(0, take)
    return out.unflatten(0, (bsz, seq))


def _mix_each_documents(*inputs) -> torch.Tensor:
    """``mix_each`` as one operator of a compiled graph, run eagerly (``_mix_documents``, an
    ``eager_op``, as packed attention's ``_packed_sdpa``): traced, its calls (their number, and each
    one's rows and chunks) follow each batch's documents, so a compiled block recompiled for nearly
    every batch of other documents. The documents' sizes are symbols (``Documents.of`` marks them)
    and the output's shape follows ``mixed``'s, so one graph serves every layout of a row shape. Its
    backward runs the forward once more. The debug Qwen3.5 on 6 batches of 2 x 256 tokens of
    5-60-token documents (busy 2-core CPU, inductor, ``benchmarks/packed_attention.py
    --compiled-model 6 --model qwen3_5``): 2 graphs, 0.78 steps/s over the 6 with the compiling;
    traced, 7 graphs and 0.0087 steps/s (115 s of compiling a step). The price, on batches already
    compiled for: the compiled step is 0.80x the eager one (traced: 1.22x), the rule's forward run
    twice and the layer's pointwise ops left unfused."""
    return mix_each(*inputs)


def _mix_documents_shape(
    mixed, conv_weight, A_log, dt_bias, index, layout, take, k_head_dim, v_head_dim, values_per_key
):
    return mixed.new_empty(*mixed.shape[:2], A_log.shape[0], v_head_dim)


_mix_documents = eager_op(
    "gated_deltanet_documents",
    "Tensor mixed, Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor index, Tensor layout, Tensor take, "
    "int k_head_dim, int v_head_dim, int values_per_key",
    _mix_each_documents,
    _mix_documents_shape,
    differentiable=(0, 1, 2, 3),  # mixed and the weights: float32's A_log and dt_bias kept
)
