"""The attention and RoPE variants real checkpoints use, against ``transformers`` 5.24 and against
their own definitions: sliding windows per layer (Qwen2/Qwen3/Qwen3-MoE past the window), YaRN and
linear RoPE (past the original context), sinks and the output bias (gpt-oss's), in whole rows,
packed rows and split over tensor-parallel ranks."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from models.common import hf_config
from models.common.args import DecoderArgs
from models.common.decoder import DecoderOptions, Transformer, causal_attention
from models.common.rope import RopeScaling, rope_frequencies
from seedckpt import load_model
from seedckpt.cli.convert import convert
from seedckpt.materialize.init_recipe import init_model
from tests.dist import run_distributed

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _random_hf(config):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


HF_CONFIGS = {
    # Qwen2's rule: use_sliding_window, the layers from max_window_layers on.
    "qwen2-max_window_layers": lambda: transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    # layer_types given: exactly those layers, whatever max_window_layers says.
    "qwen3-layer_types": lambda: transformers.Qwen3Config(
        **COMMON,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Qwen3-MoE slides every layer.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    # Qwen3's long-context YaRN, with an original context of 16 so that 40 positions are beyond it.
    "qwen3-yarn": lambda: transformers.Qwen3Config(
        **COMMON,
        head_dim=16,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4},
    ),
    "llama3-yarn": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5e5},
    ),
    "qwen2-linear": lambda: transformers.Qwen2Config(
        **COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    ),
    # YaRN and a window together, with the mscales a config may carry.
    "mistral-yarn-window": lambda: transformers.MistralConfig(
        **COMMON,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16.0,
            "truncate": False,
            "rope_theta": 1e4,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(HF_CONFIGS))
def test_windows_and_rope_stretches_match_transformers_and_round_trip(tmp_path, case):
    """40 positions, past every window and original context: ``load_model`` of the HF directory and
    the export of its DCP copy back to HF (which ``transformers`` loads) both give the original's
    logits within 1e-5; what the case turns on matters (off, the logits move)."""
    hf = _random_hf(HF_CONFIGS[case]())
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
        assert (load_model(tmp_path / "hf")(TOKENS) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert (back(TOKENS).logits - want).abs().max().item() <= 1e-5
        plain = json.loads((tmp_path / "hf" / "config.json").read_text())
        plain |= {"use_sliding_window": False, "sliding_window": None, "rope_parameters": {"rope_type": "default"}}
        plain.pop("layer_types", None)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(plain))
        assert (load_model(tmp_path / "hf")(TOKENS) - want).abs().max().item() > 1e-3


YARN = [
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's long context
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.5, "beta_fast": 8, "beta_slow": 2},
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("parameters", YARN, ids=range(len(YARN)))
def test_yarn_frequencies_and_attention_factor_equal_transformers(parameters, head_dim):
    """The config read by ``hf_config.rope_scaling`` and computed by ``rope_frequencies`` equals
    ``transformers``' ``_compute_yarn_parameters`` for the same config.json."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **parameters}
    config = transformers.Qwen3Config(head_dim=head_dim, max_position_embeddings=131072, rope_parameters=rope)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = hf_config.rope_scaling(config.to_dict())
    got, factor = rope_frequencies(head_dim, 150000.0, scaling)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert hf_config.rope_scaling({"rope_parameters": scaling.to_config(150000.0)}) == scaling  # written back


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su"])
def test_rope_kinds_not_computed_are_refused_in_one_line(kind):
    with pytest.raises(ValueError, match=f"config.json asks for '{kind}' RoPE scaling") as refused:
        hf_config.rope_scaling({"rope_scaling": {"rope_type": kind, "factor": 2.0}})
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="yarn RoPE scaling has low_freq_factor, which yarn RoPE does not take"):
        hf_config.rope_scaling({"rope_scaling": {"type": "yarn", "factor": 2.0, "low_freq_factor": 1.0}})


def _eager(q, k, v, scale, window, sinks):
    """The definition: explicit scores, a causal (and windowed: ``i - window < j <= i``) mask, the
    sink as one more softmax column whose probability is dropped."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None]
    allowed = (j <= i) & ((j > i - window) if window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    return scores.softmax(-1)[..., : q.shape[2]] @ v


# (sequence length, window): a banded mask over the whole sequence, or (seq > 2 (block + window))
# blocks of queries with the keys their windows reach, the last block partial.
LENGTHS_WINDOWS = [(20, None), (20, 1), (20, 5), (20, 64), (300, 1), (300, 7), (700, 130)]


@pytest.mark.parametrize("seqlen,window", LENGTHS_WINDOWS, ids=[f"{n}-w{w}" for n, w in LENGTHS_WINDOWS])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_causal_attention_equals_its_definition_with_gradients(seqlen, window, with_sinks):
    """Windows (as ``transformers`` counts them) and sinks through SDPA equal the eager softmax
    with an extra column: outputs and the gradients of q, k, v and the sinks, GQA, float64."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seqlen, 16, generator=gen, dtype=torch.float64) for h in (8, 2, 2))
    sinks = torch.randn(8, generator=gen, dtype=torch.float64) if with_sinks else None
    inputs = [t.requires_grad_() for t in (q, k, v, *([sinks] if with_sinks else []))]
    outs = []
    for attend in (causal_attention, _eager):
        out = attend(q, k, v, 0.3, window, sinks)
        outs.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    (got, got_grads), (want, want_grads) = outs
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@dataclass
class _SinkArgs(DecoderArgs):
    """gpt-oss's attention on the shared decoder: q/k/v/o biases, sinks, a window in some layers."""

    @property
    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=True,
            o_bias=True,
            attention_sinks=True,
            layer_windows=self.layer_windows,
            init="normal",
            init_std=0.1,
        )


SINK_ARGS = _SinkArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=512, sliding_window=4
)


def _sink_model(window_layers=(0,)) -> Transformer:
    args = _SinkArgs(**{**SINK_ARGS.to_dict(), "window_layers": list(window_layers)})
    model = Transformer(args)
    init_model(model, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)  # nonzero, so that each matters
    return model


def test_packed_rows_with_windows_and_sinks_compute_their_documents_one_by_one():
    """A row packing documents of 9, 3, 300 and 12 tokens (positions restarting, one document id
    each) equals each document run alone, in a model with a window of 4 in one layer (in blocks in
    the 300-token document) and sinks in both."""
    model = _sink_model()
    lengths = (9, 3, 300, 12)
    docs = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        packed = model(
            torch.cat(docs, 1),
            positions=torch.cat([torch.arange(n) for n in lengths])[None],
            document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
        )
        alone = torch.cat([model(d) for d in docs], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def _tensor_parallel_logits(rank, world_size, state):
    from torch.distributed.device_mesh import init_device_mesh

    from models.common.tensor_parallel import parallelize_decoder

    model = _sink_model()
    model.load_state_dict(state)
    parallelize_decoder(model, init_device_mesh("cpu", (world_size,)), sequence_parallel=True)
    local = model.layers["0"].attention.sinks.to_local()
    logits = model(TOKENS[:, :16] % 128)
    logits.full_tensor().square().mean().backward()
    grad = model.layers["0"].attention.sinks.grad.full_tensor()
    return local, logits.full_tensor().detach(), grad


def test_sinks_split_with_the_heads_under_tensor_parallelism():
    """tp=2 with sequence parallelism: each rank holds the sinks of its own heads, and the logits
    and the sinks' gradient equal one process's."""
    model = _sink_model()
    logits = model(TOKENS[:, :16] % 128)
    logits.square().mean().backward()
    sinks = model.layers["0"].attention.sinks
    results = run_distributed(_tensor_parallel_logits, 2, model.state_dict())
    for rank, (local, got, grad) in enumerate(results):
        torch.testing.assert_close(local, sinks.detach()[2 * rank : 2 * rank + 2])
        torch.testing.assert_close(got, logits.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, sinks.grad, rtol=1e-5, atol=1e-6)


def test_rope_scaling_args_round_trip_through_a_manifest_and_refuse_nonsense():
    args = _SinkArgs(
        **{
            **SINK_ARGS.to_dict(),
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        }
    )
    assert isinstance(args.rope_scaling, RopeScaling)
    assert _SinkArgs.from_dict(args.to_dict()) == args
    with pytest.raises(ValueError, match="rope_scaling.factor = 0; it must be a finite number > 0"):
        _SinkArgs(**{**SINK_ARGS.to_dict(), "rope_scaling": {"rope_type": "linear", "factor": 0}})
    with pytest.raises(ValueError, match="original_max_position_embeddings = None; yarn RoPE needs"):
        _SinkArgs(**{**SINK_ARGS.to_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
