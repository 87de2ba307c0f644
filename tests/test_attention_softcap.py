"""Attention-score softcaps (``cap * tanh(scores / cap)`` after the scale, before mask and softmax):
the shared attention against its definition with windows, GQA and sinks; packed rows on every kernel
the dispatcher picks (the CPU's batched calls, flex attention's ``score_mod``); and Gemma 2, whose
every release caps them, against ``transformers``' ``Gemma2ForCausalLM`` both ways. Gemma 3's reader
refuses the field, because ``transformers``' Gemma 3 reads it and never applies it (checked here)."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings

import pytest
import torch

import tests.test_packed_attention as packed
from models.common import packed_attention as pa
from models.common.packed_attention import Documents, causal_attention, packed_attention
from models.registry import get_family
from seedckpt import load_model
from seedckpt.cli.convert import convert
from seedckpt.utils.errors import SeedckptError
from tests.test_convert import our_logits
from tests.test_gemma3 import TINY as GEMMA3_TINY

transformers = pytest.importorskip("transformers")

CAP = 1.0  # small beside these scores (std ~1.2): the cap bites


def _definition(q, k, v, scale, window, sinks, softcap):
    """Scores written out on every q head's own copy of its kv head, capped, a causal (and windowed:
    ``i - window < j <= i``) mask, the sink joining as an uncapped column whose probability is dropped."""
    repeat = q.shape[1] // k.shape[1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(repeat, 1)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    offset = torch.arange(q.shape[2])[:, None] - torch.arange(q.shape[2])[None]  # i - j
    seen = (offset >= 0) & (offset < (window or q.shape[2]))
    scores = scores.where(seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    weights = scores.softmax(-1).narrow(-1, 0, q.shape[2])
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.repeat_interleave(repeat, 1))


# (sequence length, window): whole rows causal, a banded mask, and blocks of queries (seq > 2 (block + window))
LENGTHS_WINDOWS = [(20, None), (20, 5), (300, 7)]


@pytest.mark.parametrize("seqlen,window", LENGTHS_WINDOWS, ids=[f"{n}-w{w}" for n, w in LENGTHS_WINDOWS])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_capped_scores_equal_the_definition_with_gradients(seqlen, window, with_sinks):
    """Outputs and the gradients of q, k, v (and the sinks) within float64's rounding of the
    definition, GQA 8/2; and the cap changes the result (it is applied at all)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seqlen, 16, generator=gen, dtype=torch.float64) for h in (8, 2, 2))
    sinks = torch.randn(8, generator=gen, dtype=torch.float64) if with_sinks else None
    inputs = [t.requires_grad_() for t in (q, k, v, *([sinks] if with_sinks else []))]
    results = []
    for attend in (causal_attention, _definition):
        out = attend(q, k, v, 0.3, window, sinks, CAP)
        results.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    assert (got - causal_attention(q, k, v, 0.3, window, sinks)).abs().max() > 0.01


@pytest.fixture
def capped_reference(monkeypatch):
    """``tests.test_packed_attention``'s per-document reference, each document's attention capped."""
    monkeypatch.setattr(packed, "causal_attention", functools.partial(causal_attention, softcap=CAP))


@pytest.mark.parametrize("window", packed.WINDOWS)
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_packed_rows_with_capped_scores_equal_each_document_alone_with_gradients(window, sinks, capped_reference):
    """The CPU's batched calls (documents of every length class, padding, GQA 4/2, a narrower value
    head): outputs and the gradients of q, k, v and the sinks within 1e-5 of each document alone."""
    ids = packed.document_ids()
    documents = Documents.of(ids)
    inputs = packed._inputs(v_dim=8, sinks=sinks)
    packed._assert_same(
        lambda q, k, v, s: packed_attention(q, k, v, documents, 0.3, window, s, CAP), inputs, ids, 0.3, window
    )


# Each case runs flex uncompiled (~2 s here): whole rows plain, and both windows with sinks
FLEX_CASES = [(None, False), (4, True), (64, True)]


@pytest.mark.parametrize(
    "window,with_sinks", FLEX_CASES, ids=[f"w{w}-{'sinks' if s else 'plain'}" for w, s in FLEX_CASES]
)
def test_flex_attention_caps_scores_in_its_score_mod(window, with_sinks, monkeypatch, capped_reference):
    """CUDA's kernel for capped layers, run here uncompiled and forward only (torch 2.13's flex has
    no backward on a CPU): flex attention under the documents' block mask, the cap its ``score_mod``,
    within 1e-5 of each document alone."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(pa, "_compiled_flex", lambda: flex_attention)
    monkeypatch.setattr(pa, "_batched", None)  # not the CPU's kernel
    ids = packed.document_ids()
    mask = pa.document_block_mask(pa.document_starts(ids), window)
    documents = dataclasses.replace(Documents.of(ids), block_masks={window: mask}, flash=True)
    q, k, v, sinks = (None if t is None else t.detach() for t in packed._inputs(sinks=with_sinks))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex's warning that it runs uncompiled
        got = packed_attention(q, k, v, documents, 0.3, window, sinks, CAP)
    want = packed.per_document(q, k, v, packed.spans_of(ids), 0.3, window, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 64])
def test_flex_attention_with_capped_scores_equals_each_document_alone_on_cuda(window, capped_reference):
    """Compiled flex attention, bf16: outputs and the gradients of q, k and v (GQA 8/2) against each
    document alone in float32."""
    ids = packed.document_ids().cuda()
    documents = Documents.of(ids, mask_windows={window})
    inputs = packed._inputs("cuda", torch.bfloat16, dim=64, heads=(8, 2))
    packed._assert_same(
        lambda q, k, v, s: packed_attention(q, k, v, documents, 0.3, window, s, CAP),
        inputs,
        ids,
        0.3,
        window,
        **packed.BF16,
    )


# -- Gemma 2 against transformers --------------------------------------------------------------------
# A tiny Gemma 2: test_gemma3's tiny layers (a windowed layer then a global one, twice: window 5 in
# rows of 20; GQA; the scores' scale its own; a logit softcap) with one RoPE table
GEMMA3_ONLY = ("sliding_window_pattern", "rope_scaling", "rope_local_base_freq")
TINY = {name: value for name, value in GEMMA3_TINY.items() if name not in GEMMA3_ONLY}
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))


def tiny_gemma2(**changes):
    """A random ``Gemma2ForCausalLM`` (its eager attention, which caps the scores)."""
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**TINY | changes))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5) if p.dim() == 1 else p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize(
    "changes",
    [
        dict(attn_logit_softcapping=50.0),
        dict(attn_logit_softcapping=5.0, tie_word_embeddings=False, attention_bias=True),
    ],
    ids=["released-cap", "biting-cap"],
)
def test_gemma2_directories_read_and_write_with_transformers_logits(tmp_path, changes):
    """HF -> DCP -> our model, HF -> two pipeline stages directly, ``load_model``, and back to an HF
    directory that ``transformers`` loads as ``Gemma2ForCausalLM``: logits within 1e-5 each way."""
    hf = tiny_gemma2(**changes)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Gemma2ForCausalLM"
    assert back.config.attn_logit_softcapping == changes["attn_logit_softcapping"]
    with torch.no_grad():
        want = hf(TOKENS).logits
        ways = {
            "DCP": our_logits(tmp_path / "dcp", TOKENS, 1),
            "HF into two stages": our_logits(tmp_path / "hf", TOKENS, 2),
            "load_model": load_model(tmp_path / "hf")(TOKENS),
            "exported, in transformers": back(TOKENS).logits,
        }
    for way, logits in ways.items():
        assert (logits - want).abs().max().item() <= 1e-5, way


def test_a_biting_cap_changes_gemma2s_logits():
    """The same weights without the scores' cap compute other logits: the cap above is applied."""
    capped = tiny_gemma2(attn_logit_softcapping=5.0)
    free = tiny_gemma2(attn_logit_softcapping=None)
    with torch.no_grad():
        assert (capped(TOKENS).logits - free(TOKENS).logits).abs().max().item() > 1e-2


def _packed_batch():
    """Documents of 12, 3 and 5 tokens in each row (the first longer than the window), positions
    restarting; the ids and positions, and the lengths."""
    lengths = (12, 3, 5)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    return positions, documents, lengths


def test_gemma2_packed_rows_compute_each_document_alone_with_its_gradients(tmp_path):
    """A row of packed documents within 1e-5 of ``transformers`` on each document alone, and every
    parameter's gradient of the packed rows' loss within 1e-5 of the sum over the documents alone."""
    hf = tiny_gemma2(attn_logit_softcapping=5.0)
    hf.save_pretrained(tmp_path)
    positions, documents, lengths = _packed_batch()
    with torch.no_grad():
        alone = torch.cat([hf(part).logits for part in TOKENS.split(lengths, dim=1)], dim=1)
    model = load_model(tmp_path)
    packed_logits = model(TOKENS, positions=positions, document_ids=documents)
    assert (packed_logits - alone).abs().max().item() <= 1e-5
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(packed_logits.square().sum(), params)
    parts = sum(model(part).square().sum() for part in TOKENS.split(lengths, dim=1))
    for got, want in zip(grads, torch.autograd.grad(parts, params)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("head_dim", None, "head_dim = null, which transformers' Gemma2Config refuses"),
        ("hidden_activation", "gelu", "hidden_activation = 'gelu'; Gemma 2 supports only 'gelu_pytorch_tanh'"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention = True"),
        ("attn_logit_softcapping", 0.0, "attn_logit_softcapping = 0.0; it must be a finite number > 0"),
    ],
)
def test_gemma2_fields_not_computed_are_refused_in_one_line(tmp_path, field, value, message):
    tiny_gemma2().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(SeedckptError, match=message) as refused:
        load_model(tmp_path)
    assert "\n" not in str(refused.value)


def test_gemma2_null_softcaps_are_none():
    """``Gemma2Config`` types both softcaps as optional: null is no cap, absent is 30 and 50."""
    read = get_family("gemma2").hf.args_from_config
    free = read({"attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert free.decoder_options.attn_softcap is None and free.decoder_options.logit_softcap is None
    assert (read({}).attn_logit_softcap, read({}).final_logit_softcap) == (50.0, 30.0)


def test_gemma3_refuses_the_scores_cap_that_transformers_reads_and_never_applies(tmp_path):
    """transformers' Gemma 3 keeps ``attn_logit_softcapping`` and computes the logits of no cap: a
    file setting it is refused, naming that and the fix."""
    from tests.test_gemma3 import tiny_text

    capped, free = tiny_text(attn_logit_softcapping=1.0), tiny_text()
    with torch.no_grad():
        assert torch.equal(capped(TOKENS).logits, free(TOKENS).logits)
    capped.save_pretrained(tmp_path)
    with pytest.raises(SeedckptError, match="reads but never applies .* set it null"):
        load_model(tmp_path)


@pytest.mark.cuda
def test_gemma2_whole_rows_on_cuda_take_flex_attention_with_transformers_logits(tmp_path):
    """On CUDA whole rows are one document each, so the capped layers take flex attention under a
    block mask built once per forward: float32 logits within 1e-4 of transformers' on the CPU."""
    hf = tiny_gemma2(attn_logit_softcapping=5.0)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cuda")
    with torch.no_grad():
        want = hf(TOKENS).logits
        assert model.documents(None, TOKENS.cuda()).block_masks  # whole rows as documents
        got = model(TOKENS.cuda()).cpu()
    assert (got - want).abs().max().item() <= 1e-4
