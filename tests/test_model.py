"""The Llama-3 model: shapes of the released flavors, RoPE scaling, GQA, pipeline-friendliness."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models.common.decoder import Transformer
from models.common.rope import rope_frequencies
from models.llama3.args import LLAMA3_FLAVORS, ModelArgs, RopeScaling
from seedckpt.materialize.init_recipe import init_model
from tests.conftest import tiny_config


def _model(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    init_model(model, seed)
    return model


# Published parameter counts (HF configs of the released models; 1B/3B tie their embeddings).
@pytest.mark.parametrize(
    "flavor,params",
    [
        ("1B", 1_235_814_400),
        ("3B", 3_212_749_824),
        ("8B", 8_030_261_248),
        ("70B", 70_553_706_496),
        ("405B", 405_853_388_800),
    ],
)
def test_flavor_shapes_match_released_models(flavor, params):
    args = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert args.tie_word_embeddings == (flavor in ("1B", "3B"))
    assert (model.output.weight is model.tok_embeddings.weight) == args.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == params


def test_packed_documents_compute_what_they_compute_alone():
    """Document ids + per-document positions make a packed row equal its documents run one by one."""
    args = tiny_config().model_args()
    model = _model(args)
    a, b = torch.randint(0, args.vocab_size, (1, 7)), torch.randint(0, args.vocab_size, (1, 9))
    packed = model(
        torch.cat([a, b], 1),
        positions=torch.cat([torch.arange(7), torch.arange(9)])[None],
        document_ids=torch.tensor([[0] * 7 + [1] * 9]),
    )
    alone = torch.cat([model(a), model(b)], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(torch.cat([a, b], 1))[:, 7:], alone[:, 7:], atol=1e-3)  # unmasked differs


def test_rope_scaling_matches_llama31_rule():
    args = ModelArgs(
        dim=256,
        n_heads=2,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    )
    got, _ = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    head_dim = args.head_dim
    for i in range(head_dim // 2):
        freq = 1.0 / (500000.0 ** (2 * i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            want = freq
        elif wavelen > 8192 / 1.0:
            want = freq / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * freq / 8.0 + smooth * freq
        assert got[i].item() == pytest.approx(want, rel=1e-6), i
    # At least one frequency in each regime for this head_dim.
    plain, _ = rope_frequencies(head_dim, 500000.0)
    ratio = plain / got
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_forward_is_causal_with_gqa():
    args = tiny_config().model_args()
    assert args.n_kv_heads < args.n_heads
    model = _model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, args.vocab_size)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % args.vocab_size
    out = model(changed)
    assert torch.equal(out[:, :8], logits[:, :8])
    assert not torch.allclose(out[:, 8:], logits[:, 8:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    args = tiny_config().model_args()
    gqa = _model(args)
    mha_args = ModelArgs(**{**args.to_dict(), "n_kv_heads": args.n_heads})
    mha = Transformer(mha_args)
    state = gqa.state_dict()
    repeats, hd = args.n_heads // args.n_kv_heads, args.head_dim
    for fqn, t in list(state.items()):
        if fqn.endswith(("wk.weight", "wv.weight")):
            state[fqn] = t.view(args.n_kv_heads, hd, args.dim).repeat_interleave(repeats, 0).reshape(-1, args.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 10))
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-5)


def test_missing_top_level_modules_are_skipped():
    args = tiny_config().model_args()
    model = _model(args)
    tokens = torch.randint(0, args.vocab_size, (1, 6))
    hidden = model.tok_embeddings(tokens)
    ref = model(tokens)
    model.tok_embeddings = None
    assert torch.equal(model(hidden), ref)
    model.norm, model.output = None, None
    assert model(hidden).shape == (1, 6, args.dim)


def test_freqs_cis_is_recomputed_and_not_checkpointed():
    args = tiny_config().model_args()
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.freqs_cis.fill_(float("nan"))
    model.init_buffers()
    assert torch.equal(model.freqs_cis, Transformer(args).freqs_cis)
    assert "freqs_cis" not in model.state_dict()


def test_invalid_model_args_are_rejected():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)


# granite: the logits scaled in each chunk; tied: the output is the embedding's matrix; softcap:
# a final logit softcap (Gemma's)
@pytest.mark.parametrize(
    "family,tied,softcap",
    [("llama3", False, None), ("llama3", True, None), ("granite", False, None), ("llama3", True, 3.0)],
)
def test_chunked_loss_equals_the_whole_logits_loss_and_computes_each_chunk_once(family, tied, softcap):
    from models.registry import get_family

    args = dataclasses.replace(get_family(family).flavors["debug"], vocab_size=512, tie_word_embeddings=tied)
    model = _model(args)
    if softcap is not None:
        model.options = dataclasses.replace(model.options, logit_softcap=softcap)
    tokens = torch.randint(0, args.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, 1)
    labels[0, :5] = -100  # no loss there
    whole = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(), reduction="sum")
    whole.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    model.loss_chunk_tokens = 16
    rows = []
    model.output.register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    chunked = model(tokens, labels=labels)
    assert rows == [16, 16, 16, 16, 10]  # 2 x 37 tokens; never all 74 at once
    chunked.backward()
    assert rows == [16, 16, 16, 16, 10]  # backward recomputed no chunk's logits
    assert abs(chunked.item() - whole.item()) <= 1e-6 * abs(whole.item())
    for name, p in model.named_parameters():  # each gradient within 1e-6 of its norm
        assert torch.linalg.norm(p.grad - expected[name]) <= 1e-6 * torch.linalg.norm(expected[name]), name


@pytest.mark.parametrize("family", ["llama3", "granite"])  # granite: its own attention scale
def test_packed_rows_attend_within_documents_as_a_dense_mask_would_without_one(family, monkeypatch):
    """Each document of a packed row attends causally within itself (padding is a document too): the
    outputs and gradients of a dense (seq, seq) document mask, to 1e-5, while each row of every SDPA
    call is one document (each its own length class here) and no call has a mask."""
    import torch.nn.functional as F

    from models.registry import get_family

    args = dataclasses.replace(get_family(family).flavors["debug"], vocab_size=256)
    model = _model(args)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    documents = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 40])
    positions = torch.cat([torch.arange(13), torch.arange(20), torch.arange(7)])[None].repeat(2, 1)
    positions[1] = torch.arange(40)
    sdpa, calls = F.scaled_dot_product_attention, []

    def recorded_sdpa(q, *args, **kwargs):
        calls.append((q.shape[2], kwargs.get("attn_mask")))
        return sdpa(q, *args, **kwargs)

    def dense_mask_sdpa(q, k, v, is_causal=False, **kwargs):  # the reference: the mask the model once built
        same = documents[:, None, :, None] == documents[:, None, None, :]
        return sdpa(q, k, v, attn_mask=same & torch.ones(40, 40, dtype=torch.bool).tril(), **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded_sdpa)
    ours = model(tokens, positions=positions, document_ids=documents)
    ours.square().mean().backward()
    assert {length for length, _ in calls} == {13, 20, 7, 40} and all(mask is None for _, mask in calls)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(F, "scaled_dot_product_attention", dense_mask_sdpa)
    reference = model(tokens, positions=positions)  # whole rows: the patched SDPA applies the mask
    reference.square().mean().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
