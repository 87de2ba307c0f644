"""torchtitan 0.3.0's Qwen3.5 names both ways (``models.qwen3_5.torchtitan``; the MoE's,
``models.qwen3_5_moe.torchtitan``): its debugmodel's names and shapes (written down below, as built
from the installed package) are what the adapters give ours; a transformers Qwen3.5 laid out as
torchtitan's checkpointer saves it (its state-dict adapter's rules: renamed, ``in_proj_qkv`` and
``conv1d`` cut into q, k and v) loads with transformers' logits, its vision encoder skipped in one
line; ``convert --to torchtitan`` writes it back bitwise; a rank holding some rows of ``in_proj_qkv``
reads only the stored rows they come from. torchtitan is not needed here."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import seedckpt.checkpoint.load as slabs
from models.common.decoder import Transformer
from models.qwen3_5.args import Qwen35Args
from models.qwen3_5.torchtitan import Qwen35TorchtitanNames
from models.qwen3_5_moe.args import Qwen35MoeArgs
from models.qwen3_5_moe.torchtitan import Qwen35MoeTorchtitanNames
from seedckpt import load_model
from seedckpt.checkpoint import RowWindow
from seedckpt.checkpoint.owned_reads import OwnedFileSystemReader
from seedckpt.cli import convert as convert_module
from seedckpt.cli.convert import convert, diff
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.stored_parts import StoredSplit
from tests.conftest import tiny_config
from tests.test_deepseek_v3 import hf_tensors
from tests.test_moe_interop import _stored
from tests.test_qwen3_5 import TOKENS, hf_model

transformers = pytest.importorskip("transformers")

# torchtitan 0.3.0's qwen3_5 ``debugmodel`` (``model_registry("debugmodel")``, vocab cut to 512),
# its model state's names and shapes: a linear layer (0), a full-attention layer (3), the rest; 73
# ``vision_encoder.*`` tensors besides.
TITAN_DEBUG = {
    "tok_embeddings.weight": (512, 256),
    "layers.0.attn.A_log": (4,),
    "layers.0.attn.dt_bias": (4,),
    "layers.0.attn.in_proj_q.weight": (128, 256),
    "layers.0.attn.in_proj_k.weight": (128, 256),
    "layers.0.attn.in_proj_v.weight": (256, 256),
    "layers.0.attn.in_proj_z.weight": (256, 256),
    "layers.0.attn.in_proj_a.weight": (4, 256),
    "layers.0.attn.in_proj_b.weight": (4, 256),
    "layers.0.attn.conv_q.weight": (128, 1, 4),
    "layers.0.attn.conv_k.weight": (128, 1, 4),
    "layers.0.attn.conv_v.weight": (256, 1, 4),
    "layers.0.attn.norm.weight": (64,),
    "layers.0.attn.out_proj.weight": (256, 256),
    "layers.0.feed_forward.w1.weight": (512, 256),
    "layers.0.feed_forward.w2.weight": (256, 512),
    "layers.0.feed_forward.w3.weight": (512, 256),
    "layers.0.attention_norm.weight": (256,),
    "layers.0.ffn_norm.weight": (256,),
    "layers.3.attn.wq.weight": (512, 256),
    "layers.3.attn.wk.weight": (128, 256),
    "layers.3.attn.wv.weight": (128, 256),
    "layers.3.attn.wo.weight": (256, 256),
    "layers.3.attn.q_norm.weight": (64,),
    "layers.3.attn.k_norm.weight": (64,),
    "layers.3.feed_forward.w1.weight": (512, 256),
    "layers.3.feed_forward.w2.weight": (256, 512),
    "layers.3.feed_forward.w3.weight": (512, 256),
    "layers.3.attention_norm.weight": (256,),
    "layers.3.ffn_norm.weight": (256,),
    "norm.weight": (256,),
    "lm_head.weight": (512, 256),
}
# The same model in our args: 8 layers, every fourth full attention, heads of 64 turning 16 channels.
DEBUG_ARGS = Qwen35Args(
    dim=256,
    n_layers=8,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=512,
    vocab_size=512,
    rope_theta=1e7,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _titan_names(args: Qwen35Args, adapter=Qwen35TorchtitanNames) -> dict[str, tuple[int, ...]]:
    """Our model's tensors under the adapter's names, each part of a ``StoredSplit`` with its shape."""
    names = adapter(args)
    with torch.device("meta"):
        ours = Transformer(args).state_dict()
    stored = {}
    for fqn, tensor in ours.items():
        key = names.to_stored(fqn)
        split = names.from_stored(key)
        if isinstance(split, StoredSplit):
            stored |= {k: tuple(t.shape) for k, t in zip(split.keys, split.split(tensor))}
        else:
            assert split == fqn, (fqn, key, split)
            stored[key] = tuple(tensor.shape)
    return stored


def test_the_adapter_gives_torchtitans_debugmodel_names_and_shapes():
    """Every name and shape of torchtitan's debugmodel (a linear layer, a full one, the rest) is one
    the adapter gives our model of its shapes, and no other name is given for those layers."""
    stored = _titan_names(DEBUG_ARGS)
    shown = {k: s for k, s in stored.items() if not k.startswith("layers.") or k.startswith(("layers.0.", "layers.3."))}
    assert shown == TITAN_DEBUG


# Hugging Face's fused linear-layer tensors -> torchtitan's parts (its ``state_dict_adapter``)
SPLIT = {"in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v"), "conv1d": ("conv_q", "conv_k", "conv_v")}
VISION_LINE = (
    "2 tensors of torchtitan's Qwen3.5 vision encoder (vision_encoder.*) are skipped: this model is its text decoder"
)


def _titan_state(hf: dict[str, torch.Tensor], args: Qwen35Args) -> dict[str, torch.Tensor]:
    """A transformers Qwen3.5's tensors as torchtitan 0.3.0's model state holds them, by its
    state-dict adapter's rules: ``model.`` and ``self_attn``/``linear_attn`` dropped for ``attn``,
    ``in_proj_qkv`` and ``conv1d`` cut into q, k, v rows (key, key, value channels), ``lm_head``;
    and two tensors of its vision encoder."""
    keys = args.linear_num_key_heads * args.linear_key_head_dim
    cut = [keys, keys, args.linear_num_value_heads * args.linear_value_head_dim]
    state = {"lm_head.weight": hf["lm_head.weight"], "norm.weight": hf["model.norm.weight"]}
    state["tok_embeddings.weight"] = hf["model.embed_tokens.weight"]
    renamed = {"mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}
    renamed |= {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf.items():
        if not name.startswith("model.layers."):
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        rest = rest.replace("self_attn.", "attn.").replace("linear_attn.", "attn.")
        rest = rest.replace("q_proj", "wq").replace("k_proj", "wk").replace("v_proj", "wv").replace("o_proj", "wo")
        for theirs, ours in renamed.items():
            rest = rest.replace(theirs, ours)
        for fused, parts in SPLIT.items():
            if rest == f"attn.{fused}.weight":
                state |= {f"layers.{layer}.attn.{p}.weight": t for p, t in zip(parts, tensor.split(cut))}
                break
        else:
            state[f"layers.{layer}.{rest}"] = tensor
    state["vision_encoder.pos_embed"] = torch.randn(16, 8)
    state["vision_encoder.merger.norm.weight"] = torch.randn(8)
    return state


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """A transformers Qwen3.5 (linear layers past their chunk), and its weights saved as torchtitan
    0.3.0's checkpointer saves them (plain ``dcp.save``, its names)."""
    root = tmp_path_factory.mktemp("titan")
    path = hf_model(root / "hf")
    args = open_model_checkpoint(path).args
    dcp.save(_titan_state(hf_tensors(path), args), checkpoint_id=str(root / "titan"), no_dist=True)
    return path, root / "titan", args


def test_a_torchtitan_checkpoint_loads_with_transformers_logits(titan):
    """Every stored decoder tensor lands on ours (q/k/v joined), the vision encoder is skipped in one
    line, and the logits are transformers' within 1e-5 on 94 positions."""
    hf_dir, path, args = titan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(path, model="qwen3_5", args=args)
    lines = [str(w.message) for w in caught if "vision_encoder" in str(w.message)]
    assert lines == [VISION_LINE]
    with torch.no_grad():
        want = transformers.Qwen3_5ForCausalLM.from_pretrained(hf_dir).eval()(TOKENS).logits
        assert (model(TOKENS) - want).abs().max().item() <= 1e-5


def test_ours_to_torchtitan_and_back_is_bitwise(titan, tmp_path):
    """torchtitan -> ours -> torchtitan gives back every decoder tensor bitwise under its name (q, k
    and v apart again), and ours -> torchtitan -> ours is bitwise."""
    _, path, args = titan
    ours = convert(path, tmp_path / "ours", "dcp", progress=False, args=args, model="qwen3_5")
    assert "layers.0.attention.in_proj_qkv.weight" in _stored(ours)
    back = convert(ours, tmp_path / "titan", "torchtitan", progress=False)
    original = {k: t for k, t in _stored(path).items() if not k.startswith("vision_encoder.")}
    written = _stored(back)
    assert written.keys() == original.keys() and all(torch.equal(t, original[k]) for k, t in written.items())
    equal, lines = diff(ours, convert(back, tmp_path / "again", "dcp", progress=False))
    assert equal, lines


def test_the_memory_estimate_counts_a_tensor_torchtitan_stores_split_whole(titan, tmp_path, monkeypatch):
    """Going to torchtitan, our fused ``in_proj_qkv`` (20 KiB) is read whole and copied into its
    q, k and v: in slabs of 1 KiB with 32 KiB available, the estimate counts 60 KiB (read, parts,
    cast) and refuses it, nothing written; counted as one slab (2 KiB) it was let through."""
    _, path, args = titan
    ours = convert(path, tmp_path / "ours", "dcp", progress=False, args=args, model="qwen3_5")
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1 << 10)
    monkeypatch.setattr(convert_module, "available_memory", lambda: 32 << 10)
    with pytest.raises(SeedckptError, match=r"in_proj_qkv.weight is held whole and copied into the parts"):
        convert(ours, tmp_path / "titan", "torchtitan", progress=False)
    assert not list(tmp_path.glob("*titan*"))


def test_a_rank_holding_some_rows_reads_only_the_stored_rows_they_come_from(titan, monkeypatch):
    """Our rows [10, 50) of layer 0's ``in_proj_qkv`` (key head 0's last k rows and its values, key
    head 1's q and first k rows; 8-channel key heads, 24 value channels each): torchtitan's q rows
    [8, 16), k rows [2, 10) and v rows [0, 24) are asked for, and the window holds the joined rows."""
    _, path, args = titan
    opened = open_model_checkpoint(path, args, model="qwen3_5")
    fqn = "layers.0.attention.in_proj_qkv.weight"
    window = RowWindow(torch.empty(40, *opened.infos[fqn].shape[1:]), 10)
    asked, read_data = [], OwnedFileSystemReader.read_data
    monkeypatch.setattr(
        OwnedFileSystemReader,
        "read_data",
        lambda self, plan, planner: asked.extend(plan.items) or read_data(self, plan, planner),
    )
    opened.load({fqn: window})
    rows = {
        i.storage_index.fqn.rsplit(".", 2)[1]: (i.storage_offsets[0], i.storage_offsets[0] + i.lengths[0])
        for i in asked
    }
    assert rows == {"in_proj_q": (8, 16), "in_proj_k": (2, 10), "in_proj_v": (0, 24)}
    assert torch.equal(window.dest, opened.read_tensor(fqn)[10:50])


def test_a_missing_part_and_attention_biases_are_refused_in_one_line(titan, tmp_path):
    """A checkpoint lacking one of the q/k/v parts is refused naming it, and one whose parts a model of
    other key heads cannot hold naming their rows; a model with attention biases (torchtitan's has
    none) is refused ``--to torchtitan``, nothing written."""
    _, path, args = titan
    state = _stored(path)
    del state["layers.1.attn.in_proj_k.weight"]
    dcp.save(state, checkpoint_id=str(tmp_path / "cut"), no_dist=True)
    with pytest.raises(SeedckptError, match=r"layers\.1\.attn\.in_proj_k\.weight missing"):
        open_model_checkpoint(tmp_path / "cut", args, model="qwen3_5")
    wider = dataclasses.replace(args, linear_key_head_dim=16)  # 32 q and k rows where 16 are stored
    with pytest.raises(SeedckptError, match=r"have \[16, 16, 48\] rows, which this model's linear layers cannot hold"):
        open_model_checkpoint(path, wider, model="qwen3_5")
    ours = convert(hf_model(tmp_path / "hf", attention_bias=True), tmp_path / "ours", "dcp", progress=False)
    assert open_model_checkpoint(ours).args.attention_bias
    with pytest.raises(SeedckptError, match="torchtitan's Qwen3.5 has no attention biases"):
        convert(ours, tmp_path / "titan_b", "torchtitan", progress=False)
    assert not (tmp_path / "titan_b").exists()


def _sharded_load(rank: int, world_size: int, path: str, args: Qwen35Args) -> list[str]:
    """On each rank: layer 0's q/k/v and convolution loaded into DTensors cut by rows (``Shard(0)``,
    3 ranks: cuts inside key-head groups) and by columns (``Shard(1)``: no block of whole rows); the
    FQNs whose local block is not the checkpoint's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    opened = open_model_checkpoint(path, args, model="qwen3_5")
    cuts = {f"layers.0.attention.{name}.weight": Shard(0) for name in ("in_proj_qkv", "conv1d")}
    cuts["layers.1.attention.in_proj_qkv.weight"] = Shard(1)
    wanted = {fqn: distribute_tensor(torch.zeros(opened.infos[fqn].shape), mesh, [cut]) for fqn, cut in cuts.items()}
    opened.load(wanted)
    return [
        fqn
        for fqn, cut in cuts.items()
        if not torch.equal(wanted[fqn].to_local(), distribute_tensor(opened.read_tensor(fqn), mesh, [cut]).to_local())
    ]


def test_sharded_destinations_load_their_block_of_the_joined_rows(titan):
    """FSDP-like row shards on 3 ranks, and a column shard, each get their block of ours."""
    from tests.dist import run_distributed

    _, path, args = titan
    assert run_distributed(_sharded_load, 3, str(path), args) == [[], [], []]


# torchtitan 0.3.0's qwen3_5 ``debugmodel_moe`` (vocab cut to 512): layer 0's mixture of experts
# (its other tensors are named as in the dense model above), and our args of its shapes.
TITAN_DEBUG_MOE = {
    "layers.0.moe.expert_bias_E": (8,),
    "layers.0.moe.routed_experts.inner_experts.w1_EFD": (8, 256, 256),
    "layers.0.moe.routed_experts.inner_experts.w2_EDF": (8, 256, 256),
    "layers.0.moe.routed_experts.inner_experts.w3_EFD": (8, 256, 256),
    "layers.0.moe.router.gate.weight": (8, 256),
    "layers.0.moe.shared_experts.w1.weight": (256, 256),
    "layers.0.moe.shared_experts.w2.weight": (256, 256),
    "layers.0.moe.shared_experts.w3.weight": (256, 256),
    "layers.0.moe.shared_experts.gate.weight": (1, 256),
}
DEBUG_MOE_ARGS = Qwen35MoeArgs(
    **{**DEBUG_ARGS.to_dict(), "n_layers": 4, "full_attention_layers": [3], "ffn_dim": 256},
    n_experts=8,
    top_k=2,
    moe_ffn_dim=256,
    load_balance="bias",
)


def test_the_moe_adapter_gives_torchtitans_debugmodel_moe_names_and_shapes():
    """Layer 0's experts, router, expert bias and shared expert under torchtitan's names and shapes;
    the attention's as the dense model's."""
    stored = _titan_names(DEBUG_MOE_ARGS, Qwen35MoeTorchtitanNames)
    assert {k: s for k, s in stored.items() if k.startswith("layers.0.moe.")} == TITAN_DEBUG_MOE
    dense = {k: s for k, s in TITAN_DEBUG.items() if k.startswith("layers.0.attn") or not k.startswith("layers.")}
    assert dense.items() <= stored.items()


def test_a_qwen3_5_moe_seed_goes_to_torchtitan_and_back_bitwise(tmp_path):
    """The debug Qwen3.5-MoE's seed (balanced by its auxiliary loss) written in torchtitan's names
    gets the zero ``expert_bias_E`` torchtitan's model has, and reads back as the seed, bitwise."""
    m = ("--model.name", "qwen3_5_moe")
    seed = create_seed_checkpoint(tiny_config(*m), tmp_path / "seed", seed=0, progress=False, workers=1)
    titan = convert(seed, tmp_path / "titan", "torchtitan", progress=False)
    stored = _stored(titan)
    assert "layers.0.moe.routed_experts.inner_experts.w1_EFD" in stored
    assert not stored["layers.0.moe.expert_bias_E"].any()
    equal, lines = diff(seed, convert(titan, tmp_path / "back", "dcp", progress=False))
    assert equal, lines


def test_a_tied_model_reads_torchtitans_copy_of_the_embedding_as_the_tie(tmp_path):
    """torchtitan ties no embedding: a tied model's export holds ``lm_head`` as the embedding's copy,
    and reading it back into a tied model takes that copy as the tie, without a word (a distinct one
    is refused: ``tests/test_tied_reads.py``)."""
    ours = convert(hf_model(tmp_path / "hf", tie_word_embeddings=True), tmp_path / "ours", "dcp", progress=False)
    titan = convert(ours, tmp_path / "titan", "torchtitan", progress=False)
    stored = _stored(titan)
    assert torch.equal(stored["lm_head.weight"], stored["tok_embeddings.weight"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        equal, lines = diff(ours, convert(titan, tmp_path / "back", "dcp", progress=False))
    assert equal, lines
    assert not any("lm_head" in str(w.message) for w in caught)
