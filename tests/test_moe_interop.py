"""Mixtures of experts moving between tools: torchtitan 0.3.0's Qwen3-MoE checkpoints read and
written (its names, its q/k row order, its expert bias), HF export's refusal of a bias
transformers cannot hold, SFT from HF ``qwen3_moe`` and ``mixtral`` directories on pp=2 x
dp_shard=2 exported back, and OSFT on a mixture of experts (experts frozen).

torchtitan is not needed here: its names are written down below as read from the installed
package, and its checkpoints are made with plain ``dcp.save``, as its checkpointer writes them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from seedckpt import load_model
from seedckpt.checkpoint import DcpCheckpoint
from seedckpt.cli.convert import convert, diff
from seedckpt.cli.main import main
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.stages import build_stages
from seedckpt.parallel.pipeline import plan_rank_stages
from seedckpt.utils.errors import SeedckptError
from tests.test_sft import PP2_DP2, SINGLE, chat_inputs, losses, sft  # noqa: F401 (chat_inputs: a fixture)

transformers = pytest.importorskip("transformers")

# torchtitan 0.3.0's Qwen3-MoE (``torchtitan.models.qwen3``, a model with MoE layers), read from the
# installed package (pip install torchtitan==0.3.0): the model's state dict, and the keys of a step
# checkpoint its CheckpointManager saved after AdamW steps on the CPU. Per layer, then top level;
# experts [E, F, D] (w1_EFD, w3_EFD) and [E, D, F] (w2_EDF); expert_bias_E fp32 [E], always present.
TITAN_LAYER = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TITAN_EXPERTS = {
    "moe.routed_experts.inner_experts.w1_EFD": "gate_proj",
    "moe.routed_experts.inner_experts.w2_EDF": "down_proj",
    "moe.routed_experts.inner_experts.w3_EFD": "up_proj",
}
TITAN_BIAS = "moe.expert_bias_E"
TITAN_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
TITAN_TOP |= {"lm_head.weight": "lm_head.weight"}
# Its optimizer state names the in-memory fused attention projection, rows interleaved per KV head.
TITAN_OPTIMIZER = "optimizer.state.layers.{i}.attention.qkv_linear.wqkv.weight.{moment}"

LAYERS, EXPERTS, HEADS, KV_HEADS, HEAD_DIM, DIM = 2, 4, 4, 2, 16, 64
# A trained-looking bias (torchtitan's moves by 1e-3 a step): large enough to change choices.
BIAS = torch.tensor([[0.08, -0.05, 0.02, -0.05], [-0.06, 0.07, -0.04, 0.03]])
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def _random(model):
    """Every tensor random (norms too), so that a misplaced row cannot hide."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


def _hf_moe(name: str, path: Path, vocab: int = 128, dense: tuple = ()) -> Path:
    """A random ``transformers`` model of the family (Qwen3-MoE with ``dense`` layers) saved at ``path``."""
    torch.manual_seed(2)
    shape = dict(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=LAYERS, max_position_embeddings=128)
    shape |= dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_experts_per_tok=2)
    if name == "qwen3_moe":
        moe = dict(num_experts=EXPERTS, moe_intermediate_size=32, mlp_only_layers=list(dense))
        config = transformers.Qwen3MoeConfig(**shape, **moe, intermediate_size=96, head_dim=HEAD_DIM, rope_theta=1e6)
    else:
        config = transformers.MixtralConfig(**shape, num_local_experts=EXPERTS, intermediate_size=64)
    _random(transformers.AutoModelForCausalLM.from_config(config)).save_pretrained(path)
    return path


def _titan_checkpoint(hf_dir: Path, path: Path, bias: torch.Tensor) -> Path:
    """``hf_dir``'s weights as torchtitan 0.3.0 saves a Qwen3-MoE step: its names, experts stacked,
    q/k rows in HF's order (its RoPE rotates halves, as HF's does), ``bias`` as ``expert_bias_E``,
    and optimizer moments under the fused attention name."""
    hf = {}
    for file in hf_dir.glob("*.safetensors"):
        hf.update(load_file(file))
    state = {ours: hf[theirs] for ours, theirs in TITAN_TOP.items()}
    for i in range(LAYERS):
        state.update((f"layers.{i}.{ours}", hf[f"model.layers.{i}.{theirs}"]) for ours, theirs in TITAN_LAYER.items())
        for ours, theirs in TITAN_EXPERTS.items():
            experts = [hf[f"model.layers.{i}.mlp.experts.{e}.{theirs}.weight"] for e in range(EXPERTS)]
            state[f"layers.{i}.{ours}"] = torch.stack(experts)
        state[f"layers.{i}.{TITAN_BIAS}"] = bias[i].clone()
        fused = torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, DIM)
        state.update((TITAN_OPTIMIZER.format(i=i, moment=m), fused) for m in ("exp_avg", "exp_avg_sq"))
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _args(hf_dir: Path, load_balance: str):
    return dataclasses.replace(open_model_checkpoint(hf_dir).args, load_balance=load_balance)


def _logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def _hf_logits(path: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()(tokens).logits


def _stored(path: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model tensors as stock DCP reads them (stored names, stored rows)."""
    entries = DcpCheckpoint(path).metadata.state_dict_metadata
    tensors = {k: m for k, m in entries.items() if hasattr(m, "size") and not k.startswith("optimizer")}
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """An HF Qwen3-MoE directory and the same weights as torchtitan checkpoints, with a trained bias
    and with a zero one (a torchtitan seed)."""
    root = tmp_path_factory.mktemp("titan")
    hf = _hf_moe("qwen3_moe", root / "hf")
    return hf, _titan_checkpoint(hf, root / "trained", BIAS), _titan_checkpoint(hf, root / "seed", 0 * BIAS)


def test_torchtitan_checkpoints_read_with_their_bias_as_transformers_computes(titan):
    """Every torchtitan tensor lands on one of ours (the fused optimizer state is not read); with a
    zero bias the logits are transformers'; a trained bias routes: the logits are those of our model
    given that bias, which ignoring it would move."""
    hf_dir, trained, seed = titan
    args = _args(hf_dir, "bias")
    opened = open_model_checkpoint(trained, args, model="qwen3_moe")
    assert set(opened.infos) == set(opened.layout.shapes)
    want = _hf_logits(hf_dir)
    zero = load_model(seed, model="qwen3_moe", args=args)
    assert (_logits(zero) - want).abs().max().item() <= 1e-5
    model = load_model(trained, model="qwen3_moe", args=args)
    biases = [model.layers[str(i)].moe.expert_bias for i in range(LAYERS)]
    assert all(torch.equal(b, BIAS[i]) for i, b in enumerate(biases))
    for i in range(LAYERS):
        zero.layers[str(i)].moe.expert_bias.copy_(BIAS[i])
    assert torch.equal(_logits(model), _logits(zero))
    moved = (_logits(model) - want).abs().max() / want.abs().max()
    assert moved > 0.01, f"the bias moved the logits by {moved:.3%} only: it chooses nothing here"


def test_torchtitan_round_trips_bitwise_and_a_pipeline_stage_starts_from_it(titan, tmp_path):
    """torchtitan -> ours -> torchtitan gives back its stored tensors bitwise (names, rows, bias),
    ours -> torchtitan -> ours is bitwise, and the stages of a pp=2 start read it as ours."""
    hf_dir, trained, _ = titan
    args = _args(hf_dir, "bias")
    ours = convert(trained, tmp_path / "ours", "dcp", progress=False, args=args, model="qwen3_moe")
    back = convert(ours, tmp_path / "titan", "torchtitan", progress=False)
    original, written = _stored(trained), _stored(back)
    assert set(written) == set(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
    again = convert(back, tmp_path / "again", "dcp", progress=False)
    equal, lines = diff(ours, again)
    assert equal, lines
    whole = load_model(ours).state_dict()
    for rank in range(2):
        [stage] = build_stages(args, plan_rank_stages(args, rank, 2), "cpu", checkpoint=trained)
        assert all(torch.equal(t, whole[k]) for k, t in stage.state_dict().items())


def test_a_model_without_a_bias_reads_torchtitans_only_at_zero_and_writes_zeros(titan, tmp_path):
    """A model balanced by the auxiliary loss has no bias: a torchtitan seed's zero one is left out
    (checked on the values); a trained one is refused naming the setting; written to torchtitan, the
    model gets the zero bias torchtitan's model needs, and reads back as it was."""
    hf_dir, trained, seed = titan
    aux = _args(hf_dir, "aux_loss")
    want = _hf_logits(hf_dir)
    assert (_logits(load_model(seed, model="qwen3_moe", args=aux)) - want).abs().max().item() <= 1e-5
    with pytest.raises(SeedckptError) as refused:
        open_model_checkpoint(trained, aux, model="qwen3_moe")
    assert "layers.0.moe.expert_bias_E is torchtitan's trained expert bias" in str(refused.value)
    assert 'set model.load_balance = "bias"' in str(refused.value) and "\n" not in str(refused.value)
    written = _stored(convert(hf_dir, tmp_path / "titan", "torchtitan", progress=False))
    assert set(written) == set(_stored(seed))
    assert all(not written[f"layers.{i}.{TITAN_BIAS}"].any() for i in range(LAYERS))
    equal, lines = diff(hf_dir, tmp_path / "titan")
    assert equal, lines


def test_hf_export_refuses_a_trained_bias_in_one_line_and_takes_a_zero_one(titan, tmp_path, capsys):
    hf_dir, trained, seed = titan
    args = _args(hf_dir, "bias")
    biased = convert(trained, tmp_path / "biased", "dcp", progress=False, args=args, model="qwen3_moe")
    assert main(["convert", str(biased), str(tmp_path / "out"), "--to", "hf", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layers.0.moe.expert_bias is aux-loss-free balancing's trained" in err
    assert "export to dcp or torchtitan, or train with --model.load_balance aux_loss" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    zero = convert(seed, tmp_path / "zero", "dcp", progress=False, args=args, model="qwen3_moe")
    convert(zero, tmp_path / "hf", "hf", progress=False)  # a zero bias routes as none: left out
    assert (_hf_logits(tmp_path / "hf") - _logits(load_model(zero))).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name,ep", [("qwen3_moe", "2"), ("mixtral", "1")], ids=["qwen3_moe-ep2", "mixtral"])
def test_sft_from_an_hf_mixture_of_experts_on_pp2_x_dp_shard2_exports_what_transformers_computes(
    tmp_path, chat_inputs, name, ep
):
    """SFT from the family's HF directory on pp=2 x dp_shard=2, Qwen3-MoE's experts expert-parallel
    over the two DP ranks (each rank reads only its experts' HF tensors: ``test_expert_checkpoints``):
    the masked loss falls, the aux loss is reported, and the end-of-run HF export loads in
    transformers with our checkpoint's logits. With experts expert-parallel, the losses and the aux
    loss (over the rows' conversations, never their padding) are one process's within 1e-5."""
    tokenizer, chats, tokenizer_vocab = chat_inputs
    hf = _hf_moe(name, tmp_path / "hf", -(-tokenizer_vocab // 8) * 8, dense=(1,))
    export = ["--checkpoint.export_at_end", "hf", "--checkpoint.export_dtype", "float32"]
    steps = ["--training.steps", "6", "--checkpoint.interval", "6"]
    sft(
        tmp_path / "run", hf, tokenizer, chats, 4, *PP2_DP2, "--parallelism.expert_parallel_degree", ep, *export, *steps
    )
    loss = losses(tmp_path / "run")
    assert len(loss) == 6 and loss[-1] < loss[0] - 0.3, loss
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["moe_aux_loss"] > 0 for row in rows)
    if ep != "1":
        sft(tmp_path / "one", hf, tokenizer, chats, 1, *SINGLE, *steps)
        single = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
        for key in ("loss", "moe_aux_loss", "moe_max_load"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in single], rel=1e-5), key
    ours = load_model(tmp_path / "run" / "ckpt" / "step-6")
    exported = _hf_logits(tmp_path / "run" / "ckpt" / "step-6-hf", TOKENS % ours.args.vocab_size)
    assert (exported - _logits(ours, TOKENS % ours.args.vocab_size)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_osft_on_a_mixture_of_experts_trains_attention_and_keeps_the_experts_frozen(tmp_path, chat_inputs):
    """OSFT's targets are the attention (and dense feed-forward) matrices; the mixtures of experts,
    router and experts, are frozen: bitwise the pretrained weights after training, no optimizer state."""
    tokenizer, chats, tokenizer_vocab = chat_inputs
    hf = _hf_moe("qwen3_moe", tmp_path / "hf", -(-tokenizer_vocab // 8) * 8, dense=(1,))
    steps = ["--training.steps", "3", "--checkpoint.interval", "3", "--parallelism.pipeline_parallel_degree", "1"]
    sft(tmp_path / "run", hf, tokenizer, chats, 1, "--finetune.mode", "osft", *steps)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["osft_leak"] <= 1e-5 for row in rows)
    step = open_model_checkpoint(tmp_path / "run" / "ckpt" / "step-3")
    pretrained = open_model_checkpoint(hf)
    for fqn in ("layers.0.moe.experts.w1", "layers.0.moe.experts.w2", "layers.0.moe.router.gate.weight"):
        assert torch.equal(step.read_tensor(fqn), pretrained.read_tensor(fqn)), fqn
    assert "layers.0.attention.wq.U_low" in step.infos and "layers.1.feed_forward.w1.U_low" in step.infos
    keys = DcpCheckpoint(step.path).metadata.state_dict_metadata
    assert not [k for k in keys if k.startswith("optimizer") and ".moe." in k]
    assert [k for k in keys if k.startswith("optimizer") and "attention.wq.U_low" in k]


def test_mixtral_export_writes_no_norm_topk_prob_and_reads_renormalized():
    """``MixtralConfig`` has no ``norm_topk_prob`` (it always renormalizes): the export writes none and
    refuses a model that does not renormalize in one line; a file's stray one is still not read."""
    from models.mixtral import FLAVORS, args_from_config, config

    written = config(FLAVORS["debug"], torch.float32)
    assert "norm_topk_prob" not in written
    for stray in ({}, {"norm_topk_prob": False}):
        assert args_from_config({**written, **stray}).norm_topk_prob is True
    with pytest.raises(ValueError) as refused:
        config(dataclasses.replace(FLAVORS["debug"], norm_topk_prob=False), torch.float32)
    assert "norm_topk_prob = false" in str(refused.value) and "\n" not in str(refused.value)


def test_mixtral_export_refuses_no_renormalization_before_the_first_shard(tmp_path, capsys, monkeypatch):
    """A Mixtral that does not renormalize is refused by ``convert --to hf`` in one line before any
    shard is written (not after all of them, at ``config.json``): no shard, no partial directory."""
    from seedckpt.checkpoint.formats import hf as hf_format
    from seedckpt.materialize.seed import create_seed_checkpoint
    from tests.conftest import tiny_config

    cfg = tiny_config("--model.name", "mixtral", "--model.norm_topk_prob", "false")
    seed = create_seed_checkpoint(cfg, tmp_path / "seed", seed=0, progress=False, workers=1)
    shards = []
    write = hf_format.write_safetensors
    monkeypatch.setattr(hf_format, "write_safetensors", lambda path, *rest: shards.append(path) or write(path, *rest))
    capsys.readouterr()
    assert main(["convert", str(seed), str(tmp_path / "out"), "--to", "hf", "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "norm_topk_prob = false: transformers' Mixtral always renormalizes" in err
    assert shards == [] and not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
