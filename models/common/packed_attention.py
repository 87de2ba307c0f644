"""Causal attention over whole rows (``causal_attention``) and inside the documents of packed rows
(``packed_attention``), on the fastest kernel the device has.

Packing lays a row's documents (and its padding, a document of its own) end to end; each must compute
exactly what it computes alone, and no score across documents should be computed. ``Documents.of``
reads a batch's document ids once per forward (one copy to the host) and prepares what every layer's
``packed_attention`` needs. Each pipeline stage builds its own from the ids of each micro-batch it is
given, so every kernel below runs under pipeline parallelism as it does without. The kernel, per call:

* CUDA, float16 / bfloat16, no sinks: ``torch.nn.attention.varlen.varlen_attn`` (flash attention's
  variable-length kernel), the rows laid end to end as one sequence cut at ``cu_seqlens``, a window
  as ``window_size = (window - 1, 0)``, GQA's kv heads served by the kernel (no copies per q head); a
  value head narrower than q's (MLA's) padded with zeros, as the kernel takes one head size.
* CUDA with sinks (gpt-oss) or capped scores (Gemma 2): flex attention under a block mask of the
  documents (causal, windowed where the layer is), built once per forward and window, compiled
  (once per shape bucket: ``_compiled_block_mask``); flex is compiled (once per shape), caps the
  scores in its ``score_mod`` and returns each query's log-sum-exp, so the sink's share of the
  softmax is applied afterwards.
* Everywhere else (the CPU, float32, a head size flash does not take): documents batched into few
  SDPA calls of ``causal_attention``, those shorter than ``ALONE`` tokens by power-of-two length
  class, each padded to its class's longest, and each longer document alone (the one-call-per-document
  loop, where it wins). Flex attention has no backward on a CPU in torch 2.13.

Measured on a busy 2-core CPU (``benchmarks/packed_attention.py --batch 4 --rounds 3 --repeats 3``: 4
rows of 2048 tokens, GQA 8/2 heads of 64, float32, forward and backward, the median of 3 paired
rounds), against one SDPA call per document (the path before) and one call with a dense document
mask: for ~50-token chats (20-80 tokens, 170 documents) 0.26 s against 1.19 s (4.6x) and 3.0 s,
with sinks 0.42 s against 1.63 s (4.5x); for a few long documents (300-900 tokens, 15) the same as
one call per document within the noise (0.96x; 1.16x with sinks), the dense mask 3.4 s. The loop
loses most where rows are many: each document's slice takes a full-size gradient in backward (one
row of short documents: 1.0-1.2x).

Compiled blocks (``training.compile``) take every kernel into their graph, and a batch of other
documents compiles nothing more: ``varlen_attn`` is a custom op whose ``cu_seqlens`` size is a symbol
from the first batch and whose ``max_len`` takes few values; flex attention is traced with the block,
its block mask an input of the graph; the batched SDPA calls, whose number and sizes follow each
batch's length classes, are one custom op run eagerly (``_packed_sdpa``). Before that op the debug
Llama (6 layers) compiled a graph for nearly every batch of 2 x 256 tokens of other documents (6 in
6; 20-30 s each on 2 cores), until dynamo's recompile limit (8) failed the fullgraph block; now 1.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.common.eager_op import eager_op

# Documents this long or longer take an SDPA call of their own: a call's fixed cost is small beside
# their work, and padding one to its class's longest would add up to 3x the scores. On 2 rows of
# ~50-token chats 128 and 256 measured alike within the noise, 64 slower (it splits their classes).
ALONE = 128
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def causal_attention(
    q, k, v, scale: float | None, window: int | None = None, sinks=None, softcap: float | None = None
) -> torch.Tensor:
    """Causal attention over ``(bsz, heads, seq, head_dim)`` (k and v may have fewer heads: GQA).

    ``window``: each query sees itself and the ``window - 1`` positions before it (transformers'
    ``sliding_window``: key j is seen by query i when ``i - window < j <= i``). ``sinks``: one logit
    per q head that joins every query's softmax and takes its share of the probability mass without
    contributing a value (gpt-oss). ``softcap``: the scaled scores become ``softcap * tanh(scores /
    softcap)`` before the mask and the softmax (Gemma 2's ``attn_logit_softcapping``); a sink is a
    logit of its own, not a score, and joins uncapped.

    One SDPA call, or without SDPA where the scores are capped (``_softcapped``). Without a window it
    is SDPA's ``is_causal`` (sinks too: ``_with_sink_key``). A window is a boolean mask: a banded
    ``(seq, seq)`` one, or, when the sequence is much longer than the window, one over blocks of
    queries that each see only the keys their window reaches (``_window_blocks``), so that work and
    memory grow with ``seq * window``, not ``seq^2`` (measured on a busy 2-core CPU, window 128, 4096
    tokens, forward and backward: 14x and 22x faster than full causal SDPA in two runs;
    ``benchmarks/attention_sinks.py``). A sink is one more key whose value is zero.
    """
    bsz, heads, seqlen, dim = q.shape
    v_dim = v.shape[-1]  # the output's head size (MLA's is narrower than q's)
    scale = dim**-0.5 if scale is None else scale
    windowed = window is not None and window < seqlen
    if sinks is None and not windowed and softcap is None:
        # GQA: each kv head serves n_heads / n_kv_heads q heads, without copying K and V per q head.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    blocked = windowed and seqlen > 2 * (_block_size(window) + window)
    mask = None  # causal
    if blocked:
        q, k, v, mask = _window_blocks(q, k, v, window)
    elif windowed:
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril().triu(1 - window)
    if softcap is None:
        out = _sdpa(q, k, v, mask, scale, sinks)
    else:
        out = _softcapped(q, k, v, mask, scale, sinks, softcap)
    if not blocked:
        return out
    # (bsz * blocks, heads, block, v_dim) -> (bsz, heads, seq, v_dim)
    out = out.view(bsz, -1, heads, out.shape[2], v_dim).transpose(1, 2)
    return out.reshape(bsz, heads, -1, v_dim)[:, :, :seqlen]


def _sdpa(q, k, v, mask, scale: float, sinks) -> torch.Tensor:
    """One SDPA call under ``mask`` (None: causal), a sink key added where there are sinks."""
    v_dim = v.shape[-1]
    if sinks is not None:
        q, k, v, mask = _with_sink_key(q, k, v, mask, sinks, scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    if sinks is None:
        return out
    # drop the sink's channels, and the query placed before the sequence
    return out[..., :v_dim] if mask is not None else out[:, :, 1:, :v_dim]


def _softcapped(q, k, v, mask, scale: float, sinks, softcap: float) -> torch.Tensor:
    """Attention with its scores capped, written out: SDPA takes no function of the scores.

    The scores of each kv head's q heads are one matmul (q's heads of a group laid end to end; K and
    V are not copied per q head), capped, masked (``mask``, broadcast over heads; None: causal), a
    sink column joined uncapped, then softmax in float32 (at least) cast back, as transformers' eager
    attention computes it. Every score of the call is kept for backward: ``seq^2`` per head over
    whole rows, ``seq * (block + window)`` in a window's blocks (``_window_blocks``). Measured on a
    busy 2-core CPU (``benchmarks/attention_sinks.py --softcap 50``: 4096 tokens, GQA 8/1 of 64,
    float32, forward and backward, two runs): 12.6-13.7 s and 2.3 GB peak against SDPA's 2.0-2.1 s
    and 0.11-0.14 GB uncapped (transformers' eager form, with sinks: 11.3-14.0 s, 1.8 GB); in a
    window of 128, 0.20-0.33 s against 0.36-0.39 s uncapped.
    Flex attention with a ``score_mod`` computes the same on a CPU 4-7x faster forward (compiled;
    7 s to compile a shape), but has no backward there in torch 2.13, so training takes this path.
    """
    bsz, heads, seqlen, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(bsz, kv_heads, group * seqlen, dim), k.transpose(-1, -2)) * scale
    scores = (torch.tanh(scores / softcap) * softcap).view(bsz, kv_heads, group, seqlen, keys)
    if mask is None:
        mask = torch.ones(seqlen, keys, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))  # (.., seq, keys) -> (.., 1, seq, keys)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(kv_heads, group, 1, 1).expand(bsz, -1, -1, seqlen, 1)
        scores = torch.cat([scores, sink], dim=-1)
    accurate = torch.promote_types(scores.dtype, torch.float32)  # float32 for 16-bit scores
    weights = scores.softmax(dim=-1, dtype=accurate).to(q.dtype)[..., :keys]
    out = torch.matmul(weights.view(bsz, kv_heads, group * seqlen, keys), v)
    return out.view(bsz, heads, seqlen, v.shape[-1])


def _block_size(window: int) -> int:
    return max(window, 128)  # queries per block: at least 128, so a small window is not many tiny calls


def _window_blocks(q, k, v, window: int):
    """Sliding-window attention as attention within blocks: the queries in blocks of
    ``_block_size(window)`` (the last padded), each block with the ``block + window - 1`` keys and
    values from ``window - 1`` before it to its end (zeros before the sequence and after it), as a
    batch of ``bsz * blocks`` rows for one SDPA call, and the mask that keeps each query's window and
    drops the zeros before the sequence. The keys are copied once more (the blocks overlap by
    ``window - 1``); no score outside a block's reach is computed."""
    bsz, heads, seqlen, dim = q.shape
    size = _block_size(window)
    blocks = -(-seqlen // size)
    pad, span = blocks * size - seqlen, size + window - 1
    q = F.pad(q, (0, 0, 0, pad)).view(bsz, heads, blocks, size, dim).transpose(1, 2).flatten(0, 1)

    def reach(x):  # (bsz, kv_heads, seq, d) -> (bsz * blocks, kv_heads, span, d)
        x = F.pad(x, (0, 0, window - 1, pad)).unfold(2, span, size)  # (bsz, kv_heads, blocks, d, span)
        return x.permute(0, 2, 1, 4, 3).flatten(0, 1)

    a = torch.arange(size, device=q.device)[:, None]  # a query's place in its block
    c = torch.arange(span, device=q.device)[None]  # a key's place in its block's reach
    first = torch.arange(blocks, device=q.device)[:, None, None] * size - (window - 1)  # position of c = 0
    mask = (c >= a) & (c <= a + window - 1) & (first + c >= 0)  # i - window < j <= i, j in the sequence
    return q, reach(k), reach(v), mask[:, None].repeat(bsz, 1, 1, 1)


def _with_sink_key(q, k, v, mask, sinks, scale: float):
    """The inputs of one SDPA call that computes attention with a sink logit per q head.

    A key placed before the sequence, seen by every query, with a zero value, whose logit is the
    head's sink: q gains a channel holding ``sink / scale``, every real key a zero there (their
    logits are unchanged), the sink key a one there and zeros elsewhere. The sink rides on q, not k,
    so GQA's shared kv heads still serve q heads with different sinks. The added channels are 8
    (the alignment fused GPU kernels ask of a head size), and v gets them too (zeros: one head size
    for q, k and v, as flash attention asks). Causal (``mask`` None), a zero query is placed before
    the sequence as well, so that SDPA's causal corner lines query i up with key i + 1, its own, and
    no mask is needed; with a mask, the mask gains the sink's column.
    """
    extra = q.new_zeros(*q.shape[:-1], 8)
    extra[..., 0] = (sinks.to(q.dtype) / scale)[None, :, None]
    q = torch.cat([q, extra], dim=-1)
    k = torch.cat([k, k.new_zeros(*k.shape[:-1], 8)], dim=-1)
    sink_key = k.new_zeros(*k.shape[:2], 1, k.shape[-1])
    sink_key[..., -8] = 1
    k = torch.cat([sink_key, k], dim=2)
    v = torch.cat([v, v.new_zeros(*v.shape[:-1], 8)], dim=-1)
    v = torch.cat([v.new_zeros(*v.shape[:2], 1, v.shape[-1]), v], dim=2)
    if mask is None:
        return torch.cat([q.new_zeros(*q.shape[:2], 1, q.shape[-1]), q], dim=2), k, v, None
    return q, k, v, torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)


@dataclass(frozen=True)
class Documents:
    """A packed batch's documents as every kernel of ``packed_attention`` takes them; ``of`` builds
    it once per forward, and every layer reads it. Positions count along the rows laid end to end."""

    cu_seqlens: torch.Tensor  # (documents + 1,) int32: where each document starts, then the end
    max_len: int  # the longest document's length rounded up to a power of two (>= 128, <= seq)
    take: torch.Tensor  # (bsz * seq,): each position's row in the SDPA calls' outputs laid end to end
    index: torch.Tensor  # every SDPA call's documents' positions, padded, end to end: one size-varying graph input
    layout: torch.Tensor  # (2 * calls,) int64 on the host: each call's documents and width, in turn
    flash: bool  # varlen_attn's kernel runs on this device (CUDA, compute capability 8.0 or later)
    block_masks: dict  # window -> flex attention's block mask of the documents (CUDA, layers taking flex)

    @classmethod
    def of(cls, document_ids: torch.Tensor, mask_windows=()) -> Documents:
        """The documents of ``document_ids`` (bsz, seq): each run of equal ids is one. Flex attention's
        block masks are built (on CUDA) for each of ``mask_windows``: the windows of the layers with
        sinks or capped scores."""
        bsz, seq = document_ids.shape
        device = document_ids.device
        change = document_starts(document_ids)
        starts = change.flatten().cpu().nonzero().flatten()  # the one copy to the host
        lengths = torch.diff(starts, append=torch.tensor([bsz * seq]))
        indices, take = _gather_indices(starts, lengths, _calls(lengths.tolist()))
        bounds = F.pad(lengths.cumsum(0), (1, 0))
        layout = torch.tensor([n for index in indices for n in index.shape])
        sizes = [take.numel(), bounds.numel(), int(layout.view(-1, 2).prod(1).sum())]
        take, bounds, index = torch.cat([take, bounds, *(i.flatten() for i in indices)]).to(device).split(sizes)
        cu_seqlens = bounds.to(torch.int32)
        _mark_dynamic(cu_seqlens, index, layout)
        flash = device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()
        flash = flash and torch.cuda.get_device_capability(device) >= (8, 0)
        return cls(
            cu_seqlens=cu_seqlens,
            max_len=min(seq, max(128, 1 << (int(lengths.max()) - 1).bit_length())),
            take=take,
            index=index,
            layout=layout,
            flash=flash,
            block_masks={w: document_block_mask(change, w) for w in set(mask_windows)} if device.type == "cuda" else {},
        )


def document_groups(index: torch.Tensor, layout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each call's (documents, width) positions of ``Documents.index``, as views of it: the shapes
    ``Documents.layout`` holds."""
    shapes = _shapes(layout)
    return tuple(g.view(shape) for g, shape in zip(index.split([n * w for n, w in shapes]), shapes))


def _shapes(layout: torch.Tensor) -> list[list[int]]:
    """Each call's (documents, width), from ``Documents.layout``."""
    return layout.view(-1, 2).tolist()


def _mark_dynamic(*tensors: torch.Tensor) -> None:
    """Compile the sizes of ``tensors`` (each batch's own) as symbols from the first batch, not as
    constants that a second batch recompiles. Only where ``torch.compile`` has imported dynamo: an
    eager run does without that import (1.6 s)."""
    dynamo = sys.modules.get("torch._dynamo")
    for t in tensors if dynamo is not None else ():
        dynamo.maybe_mark_dynamic(t, 0)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """(bsz, seq) True where a document starts: a row's first position, and where the id changes."""
    change = torch.ones_like(document_ids, dtype=torch.bool)
    change[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return change


def _calls(lengths: list[int]) -> list[list[int]]:
    """The documents of each SDPA call: those shorter than ``ALONE`` by power-of-two length class,
    each longer one alone."""
    calls: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        calls.setdefault((n - 1).bit_length() if n < ALONE else -1 - i, []).append(i)
    return list(calls.values())


def _gather_indices(starts: torch.Tensor, lengths: torch.Tensor, calls: list[list[int]]):
    """Per call, the positions of its documents' tokens, (documents, width), a shorter document
    padded with its first position (computed on, never read back); and ``take``: each position's
    row in the calls' outputs laid end to end."""
    take = torch.empty(int(lengths.sum()), dtype=torch.long)
    indices, offset = [], 0
    for members in calls:
        first, n = starts[members, None], lengths[members, None]
        place = torch.arange(int(n.max()))
        real = place < n
        index = torch.where(real, first + place, first)
        take[index[real]] = offset + torch.arange(index.numel()).view_as(index)[real]
        indices.append(index)
        offset += index.numel()
    return indices, take


def document_block_mask(change: torch.Tensor, window: int | None):
    """Flex attention's block mask of the documents that ``change`` (bsz, seq; ``document_starts``)
    starts: causal within each, and within ``window``. On CUDA it is built compiled
    (``_compiled_block_mask``); elsewhere, and inside a graph being compiled, as written."""
    if change.device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_block_mask()(change, window)
    return _block_mask(change, window)


@functools.cache
def _compiled_block_mask():
    """``_block_mask`` compiled, one graph per shape bucket: a window and the first batch's shape
    (rows, row length) make one, and each batch's documents are only its input's values, so a
    training run's batches share it; another shape makes the sizes symbols (a few graphs between
    them, e.g. 4 graphs for 5 shapes of 256-1024 tokens per window on a CPU). Not ``fullgraph``: past
    dynamo's recompile limit (8) a new bucket is built uncompiled, not refused. Uncompiled, the mask
    is evaluated at every (query, key) pair of every row, one op at a time, and kept whole: ``seq^2``
    booleans per row before its blocks are counted; compiled, the evaluation and the block counts
    are fused, as flex's own documentation advises (``torch.compile(create_block_mask)``). Measured
    on a busy 2-core CPU (4 rows of 2048 tokens, ~50-token documents, the median of 5 paired builds):
    0.29 s as written, 0.008 s compiled (after 11 s of compiling); CUDA's figure is unmeasured."""
    return torch.compile(_block_mask)


def _block_mask(change: torch.Tensor, window: int | None):
    """``document_block_mask``, as written."""
    from torch.nn.attention.flex_attention import create_block_mask

    runs = change.cumsum(1)  # each position's document, counted within its row

    def within(b, h, q, kv):
        keep = (runs[b, q] == runs[b, kv]) & (kv <= q)
        return keep if window is None else keep & (q - kv < window)

    bsz, seq = change.shape
    return create_block_mask(within, bsz, None, seq, seq, device=change.device)


def packed_attention(
    q,
    k,
    v,
    documents: Documents,
    scale: float | None,
    window: int | None = None,
    sinks=None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``causal_attention`` inside each document of ``documents``, ``(bsz, heads, seq, head_dim)`` in
    and out (k and v may have fewer heads; v another head size), on the kernel the module docstring
    names for this device, dtype and layer."""
    flex = sinks is not None or softcap is not None  # what flash attention's kernel does not compute
    if flex and window in documents.block_masks:
        return _flex_attention(q, k, v, documents.block_masks[window], scale, sinks, softcap)
    if not flex and documents.flash and _flash_takes(q, k, v):
        return _varlen(q, k, v, documents, scale, window)
    if torch.compiler.is_compiling():  # the calls follow each batch's documents: one op in the graph
        return _packed_sdpa(q, k, v, documents.index, documents.layout, documents.take, scale, window, sinks, softcap)
    shapes = _shapes(documents.layout)
    return _batched(q, k, v, documents.index, shapes, documents.take, scale, window, sinks, softcap)


def _flash_takes(q, k, v) -> bool:
    """Whether flash attention's kernel takes these heads: 16-bit, q's and k's head size one multiple
    of 8 up to 256, v's no larger."""
    dim = q.shape[-1]
    return q.dtype in FLASH_DTYPES and k.shape[-1] == dim and dim % 8 == 0 and dim <= 256 and v.shape[-1] <= dim


def _varlen(q, k, v, documents: Documents, scale: float | None, window: int | None) -> torch.Tensor:
    """Flash attention's variable-length kernel over every row's documents at once."""
    from torch.nn.attention.varlen import varlen_attn

    bsz, heads, seq, dim = q.shape
    v_dim = v.shape[-1]
    v = F.pad(v, (0, dim - v_dim)) if v_dim < dim else v  # zeros: the kernel takes one head size

    def tokens(x):  # (bsz, heads, seq, dim) -> (bsz * seq, heads, dim): a view of the projection's output
        return x.transpose(1, 2).flatten(0, 1)

    gqa = {"enable_gqa": True}
    if not _varlen_takes_gqa():  # torch 2.11's varlen_attn: the key/value heads repeated to q's count
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
        gqa = {}
    cu, longest = documents.cu_seqlens, documents.max_len
    out = varlen_attn(
        *map(tokens, (q, k, v)),
        cu,
        cu,
        longest,
        longest,
        scale=scale,
        window_size=(-1, 0) if window is None else (window - 1, 0),  # (-1, 0): causal; (w, 0): w keys back
        **gqa,
    )
    return out[..., :v_dim].unflatten(0, (bsz, seq)).transpose(1, 2)


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether this torch's ``varlen_attn`` takes ``enable_gqa`` (2.13 does; 2.11 has no such argument)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _flex_attention(q, k, v, block_mask, scale: float | None, sinks, softcap: float | None) -> torch.Tensor:
    """Flex attention under the documents' block mask, the scores capped (``softcap``), then with
    sinks each query's output scaled by the share of its softmax mass the real keys keep beside the
    sink: ``exp(lse) / (exp(lse) + exp(sink))``."""
    from torch.nn.attention.flex_attention import AuxRequest

    score_mod = None if softcap is None else _softcap_mod(softcap)
    attend = functools.partial(_flex, q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)
    if sinks is None:
        return attend()
    out, aux = attend(return_aux=AuxRequest(lse=True))
    kept = torch.sigmoid(aux.lse - sinks.float()[:, None])  # (bsz, heads, seq)
    return (out * kept.unsqueeze(-1)).to(out.dtype)


def _softcap_mod(softcap: float):
    """Flex attention's ``score_mod`` capping the scaled scores. A new function each call: the
    compiled flex guards on the closure's cap, not on the function, so it is traced once per cap
    (4 calls, caps 1, 1, 1 and 2: 2 graphs)."""

    def capped(score, batch, head, query, key):
        return torch.tanh(score / softcap) * softcap

    return capped


def _flex(*args, **kwargs):
    """Flex attention, compiled: in a compiled block by the block's compile, else on its own."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention(*args, **kwargs)
    return _compiled_flex()(*args, **kwargs)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # uncompiled, flex computes and keeps every score


def _batched(q, k, v, index, shapes, take, scale: float | None, window: int | None, sinks, softcap) -> torch.Tensor:
    """``causal_attention`` once per call of ``Documents.index`` -- ``shapes``: each call's documents
    and width; ``index``: their positions end to end -- each of its documents a row of the call's
    batch; the outputs put back in place by one gather (``take``).

    Every call's rows come from one ``index_select`` of each input, whose backward is one
    ``index_add_`` into one zeroed gradient (faster on a CPU than indexing's ``index_put_``), not
    one per call. Against one per call, forward and backward on 4 rows of 2048 tokens (GQA 8/2 of
    64, a busy 2-core CPU, the median of 5-11 paired rounds): 1.12x on documents of 1-80 tokens (16
    calls), 1.18x on 5-60 (5 calls), 1.02-1.06x on 20-80 and 300-900; the same results bitwise."""
    bsz, _, seq, _ = q.shape
    # (bsz, heads, seq, dim) -> (positions, heads, dim), every call's documents end to end
    q, k, v = (x.transpose(1, 2).flatten(0, 1).index_select(0, index) for x in (q, k, v))
    parts = [x.split([n * width for n, width in shapes]) for x in (q, k, v)]

    def rows(part, shape):  # (documents * width, heads, dim) -> (documents, heads, width, dim)
        return part.unflatten(0, shape).transpose(1, 2)

    outs = [
        causal_attention(*(rows(p[i], shape) for p in parts), scale, window, sinks, softcap)
        .transpose(1, 2)
        .flatten(0, 1)
        for i, shape in enumerate(shapes)
    ]
    out = torch.cat(outs).index_select(0, take)
    return out.unflatten(0, (bsz, seq)).transpose(1, 2)


def _batched_documents(q, k, v, index, layout, take, scale, window, sinks, softcap) -> torch.Tensor:
    """``_batched`` as one operator of a compiled graph, run eagerly (``_packed_sdpa``, an
    ``eager_op``): traced, its SDPA calls would follow each batch's length classes (their number and
    sizes), and a compiled block would recompile for nearly every batch of other documents (the
    module docstring's figures). Its inputs' sizes are symbols (``_mark_dynamic``) and its output's
    shape is q's, so one graph serves every layout of a row shape. Its backward runs the attention's
    forward once more: on batches already compiled for, the debug Llama's compiled step (2 x 256
    tokens) is 0.92-0.99x the eager step, where the traced calls made it 1.11-1.19x
    (``benchmarks/packed_attention.py --compiled-model``, busy 2-core CPU, two paired runs) -- but a
    batch of other documents compiles nothing."""
    return _batched(q, k, v, index, _shapes(layout), take, scale, window, sinks, softcap)


def _packed_sdpa_shape(q, k, v, *args):
    bsz, heads, seq, _ = q.shape
    return q.new_empty(bsz, seq, heads, v.shape[-1]).transpose(1, 2)  # ``_batched``'s layout


_packed_sdpa = eager_op(
    "packed_sdpa",
    "Tensor q, Tensor k, Tensor v, Tensor index, Tensor layout, Tensor take, "
    "float? scale, int? window, Tensor? sinks, float? softcap",
    _batched_documents,
    _packed_sdpa_shape,
    differentiable=(0, 1, 2, 8),  # q, k, v and the sinks, where given
)
