"""Attention inside the documents of packed rows (``models.common.packed_attention``): every kernel
it dispatches to -- SDPA calls over batched documents (the CPU's), flash attention's variable-length
kernel and flex attention with sinks (CUDA's) -- equals ``causal_attention`` run on each document
alone, outputs and gradients, with windows, sinks, GQA, a narrower value head, padding and several
rows. The CUDA kernels' plumbing is checked here too, against stand-ins that compute what the
kernels' documentation says they compute."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from models.common import packed_attention as pa
from models.common.packed_attention import ALONE, Documents, causal_attention, packed_attention
from tests.compiled import compile_with_aot_eager, eager_and_compiled, graph_count, random_layouts
from tests.conftest import tiny_config

# Three rows of 400 positions: documents of every length class, one at least ALONE long, padding at
# the end of a row (the last 17 positions of the second: id -1), and a row that is one document.
LENGTHS = [[9, 3, 300, 12, 60, 16], [17, 40, 23, 5, 61, 33, 70, 2, 8, 27, 31, 33, 33, 17], [400]]


def document_ids() -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in LENGTHS]
    rows[1][-LENGTHS[1][-1] :] = -1
    return torch.stack(rows)


def spans_of(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of equal ids."""
    spans = []
    for row in ids.tolist():
        cuts = [i for i in range(1, len(row)) if row[i] != row[i - 1]]
        spans.append(list(zip([0, *cuts], [*cuts, len(row)])))
    return spans


def per_document(q, k, v, spans, scale, window=None, sinks=None) -> torch.Tensor:
    """The reference (and the path before ``packed_attention``): ``causal_attention`` on each
    document of each row alone, one call each."""
    rows = []
    for b, row in enumerate(spans):
        parts = [
            causal_attention(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], scale, window, sinks)
            for s, e in row
        ]
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows)


def _inputs(device="cpu", dtype=torch.float32, dim=16, v_dim=None, heads=(4, 2), sinks=False):
    gen = torch.Generator(device).manual_seed(0)
    bsz, seq = len(LENGTHS), 400

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).requires_grad_()

    q, k = rand(bsz, heads[0], seq, dim), rand(bsz, heads[1], seq, dim)
    v = rand(bsz, heads[1], seq, v_dim or dim)
    return [q, k, v, rand(heads[0]) if sinks else None]


def _outputs_and_grads(attend, inputs):
    out = attend(*inputs)
    leaves = [t for t in inputs if t is not None]
    return out, torch.autograd.grad(out.float().square().sum(), leaves)


def _assert_same(attend, inputs, ids, scale, window, rtol=1e-5, atol=1e-5):
    got, got_grads = _outputs_and_grads(attend, inputs)
    want, want_grads = _outputs_and_grads(
        lambda q, k, v, s: per_document(q.float(), k.float(), v.float(), spans_of(ids), scale, window, s), inputs
    )
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol)


WINDOWS = [None, 4, 64]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_batched_documents_equal_each_document_alone_with_gradients(window, sinks):
    """The CPU's kernel: outputs and the gradients of q, k, v and the sinks within 1e-5 of one
    ``causal_attention`` call per document (GQA 4/2, a value head narrower than q's)."""
    ids = document_ids()
    documents = Documents.of(ids)
    assert not documents.flash and not documents.block_masks
    inputs = _inputs(v_dim=8, sinks=sinks)
    _assert_same(lambda q, k, v, s: packed_attention(q, k, v, documents, 0.3, window, s), inputs, ids, 0.3, window)


def test_short_documents_share_calls_by_length_and_long_ones_run_alone(monkeypatch):
    """One SDPA call per power-of-two length class of the documents shorter than ``ALONE`` (each
    padded to its class's longest) and one per longer document, at its own length: the 21
    documents of three rows in 9 calls here, none with a mask."""
    sdpa, calls = F.scaled_dot_product_attention, []

    def recorded(q, *args, **kwargs):
        calls.append((q.shape[0], q.shape[2], kwargs.get("attn_mask")))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    q, k, v, _ = _inputs()
    packed_attention(q, k, v, Documents.of(document_ids()), None)
    lengths = [n for row in LENGTHS for n in row]
    long = sorted(n for n in lengths if n >= ALONE)
    short = {(n - 1).bit_length() for n in lengths if n < ALONE}
    assert len(calls) == len(short) + len(long) == 9
    assert sorted(width for batch, width, _ in calls if batch == 1 and width >= ALONE) == long
    assert sum(batch for batch, _, _ in calls) == len(lengths) and all(mask is None for *_, mask in calls)


def _flash_stand_in(seen):
    """What ``varlen_attn`` computes, per its documentation: attention within each sequence that
    ``cu_seq_q`` cuts from the (tokens, heads, dim) inputs; ``window_size = (left, 0)``: key j seen
    by query i when ``i - left <= j <= i`` (``left = -1``: no limit)."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and q.shape[-1] == k.shape[-1] == v.shape[-1]
        bounds = cu_q.tolist()
        assert bounds[-1] == q.shape[0] and max_q == max_k >= max(b - a for a, b in zip(bounds, bounds[1:]))
        seen.append(window_size)
        left, right = window_size
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None]
            keep = (j <= i + right) & ((i - j <= left) | (left < 0))
            x = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*x, attn_mask=keep, scale=scale, enable_gqa=enable_gqa))
        return torch.cat(outs, 1).transpose(0, 1)

    return varlen_attn


@pytest.mark.parametrize("window", WINDOWS)
def test_varlen_path_hands_the_kernel_every_row_as_one_packed_sequence(window, monkeypatch):
    """On CUDA, 16-bit and without sinks, ``varlen_attn`` gets the rows laid end to end, the
    documents' boundaries, the window as ``(window - 1, 0)`` and one head size for q, k and v (a
    narrower v padded); with a stand-in computing what the kernel documents, the result equals one
    call per document, outputs and gradients (float32 here, so that the stand-in runs on the CPU)."""
    import torch.nn.attention.varlen as varlen

    seen = []
    monkeypatch.setattr(varlen, "varlen_attn", _flash_stand_in(seen))
    monkeypatch.setattr(pa, "FLASH_DTYPES", (torch.float32,))
    ids = document_ids()
    documents = dataclasses.replace(Documents.of(ids), flash=True)
    inputs = _inputs(v_dim=8)
    _assert_same(lambda q, k, v, s: packed_attention(q, k, v, documents, 0.3, window, s), inputs, ids, 0.3, window)
    assert seen == [(-1, 0) if window is None else (window - 1, 0)]


def test_varlen_path_repeats_key_heads_for_a_kernel_without_gqa(monkeypatch):
    """torch 2.11's ``varlen_attn`` has no ``enable_gqa``: the key and value heads are repeated to the
    query's count and the result is the same as one call per document, outputs and gradients."""
    import torch.nn.attention.varlen as varlen

    seen, full = [], _flash_stand_in([])

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):  # torch 2.11's signature
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return full(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=False)

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
    monkeypatch.setattr(pa, "FLASH_DTYPES", (torch.float32,))
    pa._varlen_takes_gqa.cache_clear()
    try:
        ids = document_ids()
        documents = dataclasses.replace(Documents.of(ids), flash=True)
        inputs = _inputs(v_dim=8)
        _assert_same(lambda q, k, v, s: packed_attention(q, k, v, documents, 0.3, 16, s), inputs, ids, 0.3, 16)
    finally:
        pa._varlen_takes_gqa.cache_clear()
    heads, kv_heads = inputs[0].shape[1], inputs[1].shape[1]
    assert kv_heads < heads and seen == [(heads, heads, heads)]


@pytest.mark.parametrize("window", WINDOWS)
def test_flex_path_with_sinks_equals_each_document_alone(window, monkeypatch):
    """Layers with sinks take flex attention under the documents' block mask, the sink's share of
    the softmax applied from the log-sum-exp: within 1e-5 of one call per document. Forward only,
    flex uncompiled: torch 2.13's flex has no backward on a CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(pa, "_compiled_flex", lambda: flex_attention)
    ids = document_ids()
    mask = pa.document_block_mask(pa.document_starts(ids), window)
    documents = dataclasses.replace(Documents.of(ids), block_masks={window: mask})
    q, k, v, sinks = (t.detach() for t in _inputs(sinks=True))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex's warning that it runs uncompiled
        got = packed_attention(q, k, v, documents, 0.3, window, sinks)
    torch.testing.assert_close(got, per_document(q, k, v, spans_of(ids), 0.3, window, sinks), rtol=1e-5, atol=1e-5)


def test_documents_round_the_longest_up_for_few_compiled_shapes():
    """``max_len`` (the kernel's grid) takes few values -- 128 for any batch of short documents -- and
    never more than the row; ``cu_seqlens`` are every document's bounds, the rows end to end."""
    documents = Documents.of(document_ids())
    assert documents.max_len == 400  # the longest (400) rounds to 512, capped at the row
    lengths = torch.tensor([n for row in LENGTHS for n in row])
    assert documents.cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert Documents.of(torch.arange(2048)[None] // 50).max_len == 128


# -- CUDA: the real kernels (bf16 against the per-document reference in float32) --------------------
BF16 = dict(rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("v_dim", [None, 64], ids=["v_same", "v_narrower"])
def test_varlen_attn_equals_each_document_alone_on_cuda(window, v_dim, monkeypatch):
    """bf16 without sinks takes flash attention's variable-length kernel: outputs and the gradients
    of q, k and v (GQA 8/2; MLA's narrower value head too)."""
    import torch.nn.attention.varlen as varlen

    calls, kernel = [], varlen.varlen_attn
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    ids = document_ids().cuda()
    documents = Documents.of(ids)
    assert documents.flash
    inputs = _inputs("cuda", torch.bfloat16, dim=96 if v_dim else 64, v_dim=v_dim, heads=(8, 2))
    _assert_same(
        lambda q, k, v, s: packed_attention(q, k, v, documents, None, window, s), inputs, ids, None, window, **BF16
    )
    assert calls


# Each case compiles flex attention anew: gpt-oss's two kinds of layer, not every pair.
@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 64])
def test_flex_attention_with_sinks_equals_each_document_alone_on_cuda(window):
    """gpt-oss's layers: flex attention, compiled, outputs and the gradients of q, k, v and the sinks."""
    ids = document_ids().cuda()
    documents = Documents.of(ids, mask_windows={window})
    assert window in documents.block_masks
    inputs = _inputs("cuda", torch.bfloat16, dim=64, heads=(8, 2), sinks=True)
    _assert_same(
        lambda q, k, v, s: packed_attention(q, k, v, documents, 0.3, window, s), inputs, ids, 0.3, window, **BF16
    )


@pytest.mark.cuda
def test_varlen_attn_compiles_once_for_batches_of_other_documents():
    """Under ``torch.compile`` (fullgraph, as ``training.compile`` compiles blocks) varlen_attn traces,
    forward and backward, with eager's results; batches with other documents reuse the first one's
    graph (``cu_seqlens``' size a symbol from the first batch)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(packed_attention, fullgraph=True, backend="aot_eager")
    q, k, v, _ = _inputs("cuda", torch.bfloat16, dim=64, heads=(8, 2))
    for length in (40, 50, 60):
        documents = Documents.of(torch.arange(400, device="cuda")[None].expand(3, -1) // length)
        got, got_grads = _outputs_and_grads(lambda q, k, v: compiled(q, k, v, documents, None), [q, k, v])
        want, want_grads = _outputs_and_grads(lambda q, k, v: packed_attention(q, k, v, documents, None), [q, k, v])
        torch.testing.assert_close(got, want, **BF16)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, **BF16)
    assert counters["stats"]["unique_graphs"] == 1


# -- compiled: one graph for every layout of documents -----------------------------------------------
def _assert_compiled_is_eager(compiled, documents: Documents, inputs, window, softcap, **tolerance) -> None:
    """``compiled`` (``packed_attention`` under ``torch.compile``) computes eager's outputs and
    gradients (scale 0.3)."""
    (got, got_grads), (want, want_grads) = (
        _outputs_and_grads(lambda q, k, v, s: attend(q, k, v, documents, 0.3, window, s, softcap), inputs)
        for attend in (compiled, packed_attention)
    )
    torch.testing.assert_close(got, want, **tolerance)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tolerance)


@pytest.mark.parametrize(
    "window, sinks, softcap", [(None, False, None), (4, True, None), (64, True, 2.0)], ids=["causal", "sinks", "capped"]
)
def test_compiled_packed_attention_runs_one_graph_for_every_layout(window, sinks, softcap, monkeypatch):
    """Compiled (fullgraph, as ``training.compile`` compiles blocks), the CPU's kernel is one op of
    the graph: 5 batches of other documents run the first one's graph (before: a graph for nearly
    every batch, as the length classes' number and sizes changed), with eager's outputs and the
    gradients of q, k, v and the sinks within 1e-5 (GQA 4/2, a narrower value head)."""
    compile_with_aot_eager(monkeypatch)
    compiled = torch.compile(packed_attention, fullgraph=True)
    inputs = _inputs(v_dim=8, sinks=sinks)
    for ids in random_layouts(5, len(LENGTHS), 400, 150):
        _assert_compiled_is_eager(compiled, Documents.of(ids), inputs, window, softcap, rtol=1e-5, atol=1e-5)
    assert graph_count() == 1


def test_compiled_model_compiles_no_more_for_batches_of_other_documents(monkeypatch):
    """A Gemma 2 of 2 layers (a window in one, capped scores, GQA) with ``training.compile``'s
    blocks: 5 batches of 2 x 256 tokens packing other documents compile 2 graphs in the first batch
    and none after (before: a graph for nearly every batch), each batch's loss and the gradients
    eager's within 1e-5. Two: one per kind of layer (a window is a constant of its graph), whatever
    the batches; nothing in a graph follows the documents (``_packed_sdpa`` takes them as inputs
    whose sizes are symbols from the first batch)."""
    compile_with_aot_eager(monkeypatch)
    args = tiny_config("--model.name", "gemma2", "--model.n_layers", "2", "--model.window_layers", "0").model_args()
    eager, compiled = eager_and_compiled(args)
    tokens = torch.randint(0, args.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    graphs = []
    for ids in random_layouts(5, 2, 256, 60):
        losses = [model(tokens, document_ids=ids, labels=tokens.roll(-1, 1)) for model in (compiled, eager)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        graphs.append(graph_count())
    assert graphs == [2] * 5
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 64])
def test_compiled_block_mask_equals_the_eager_one_on_cuda(window):
    """On CUDA the documents' block mask is built compiled, one graph for every batch of the same
    shape: the same mask as built eagerly -- the blocks computed (partial and full) and every (query,
    key) pair its ``mask_mod`` keeps."""
    from torch.nn.attention.flex_attention import create_mask

    torch._dynamo.reset()
    counters.clear()
    for ids in random_layouts(3, 2, 1024, 300):
        change = pa.document_starts(ids.cuda())
        got, want = pa.document_block_mask(change, window), pa._block_mask(change, window)
        assert torch.equal(got.to_dense(), want.to_dense())
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
        pairs = [create_mask(mask.mask_mod, 2, None, 1024, 1024, device="cuda") for mask in (got, want)]
        assert torch.equal(*pairs)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.cuda
def test_compiled_flex_attention_takes_other_documents_masks_without_compiling_again_on_cuda():
    """Compiled (fullgraph), gpt-oss's flex path takes each batch's block mask (built compiled) as an
    input: 3 batches of other documents compile 2 graphs -- the mask's builder and the attention --
    with eager's outputs and gradients."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(packed_attention, fullgraph=True)
    inputs = _inputs("cuda", torch.bfloat16, dim=64, heads=(8, 2), sinks=True)
    for ids in random_layouts(3, len(LENGTHS), 400, 150):
        _assert_compiled_is_eager(compiled, Documents.of(ids.cuda(), mask_windows={64}), inputs, 64, None, **BF16)
    assert counters["stats"]["unique_graphs"] == 2
