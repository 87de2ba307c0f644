"""Kimi K2 (``kimi_k2``) against ``transformers``' ``DeepseekV3ForCausalLM`` (``transformers`` 5.24
has no ``kimi_k2`` class; its Kimi K2.5 wrapper reads a ``kimi_k2`` config as DeepSeek-V3's), and its
INT4 experts in compressed-tensors' ``pack-quantized`` format.

The INT4 files are made here (``tests.quantizers``), from a random tiny K2 of the debug flavor's
shapes: each routed expert's weight, in groups of 32 along a row, is divided by the group's largest
magnitude / 7, rounded to an integer in [-8, 7] and packed eight to an int32 word, the first value in
the lowest four bits, stored as ``q + 8`` (compressed-tensors' ``pack_to_int32``); the scale is
stored in bfloat16. The reference dequantization there shifts each value out of its word (the reader
reads bytes), so the two are independent.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.kimi_k2 import FLAVORS
from models.kimi_k2.args import KimiK2Args
from models.kimi_k2.hf import args_from_config, config
from models.registry import get_family
from seedckpt import load_model
from seedckpt.checkpoint.formats.compressed_tensors import packed_tensors
from seedckpt.checkpoint.formats.quantized import Stored
from seedckpt.checkpoint.manifest import TensorInfo
from seedckpt.cli.convert import convert
from seedckpt.cli.main import main as cli
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.dist import run_distributed
from tests.quantizers import INT4_CONFIG, quantize_directory, reference_int4
from tests.test_convert import our_logits
from tests.test_deepseek_v3 import hf_tensors
from tests.test_train import losses, torchrun

transformers = pytest.importorskip("transformers")

FAMILY = get_family("kimi_k2")
DEBUG = FLAVORS["debug"]
TOKENS = torch.randint(0, DEBUG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
# Kimi-K2-Instruct's config.json as released (its auto_map, token ids and generation fields aside)
HUB_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 163840,
}
K2_PARAMETERS = 1_026_408_209_408


def deepseek_config(args: KimiK2Args) -> transformers.DeepseekV3Config:
    """The ``DeepseekV3Config`` our ``config.json`` of ``args`` means."""
    return transformers.DeepseekV3Config(**{k: v for k, v in config(args, torch.float32).items() if k != "model_type"})


def hf_model(path: Path) -> Path:
    """A random ``DeepseekV3ForCausalLM`` of the debug flavor's shapes and K2's routing saved at
    ``path`` as Kimi K2 (model_type ``kimi_k2``): norms near one, the correction bias large enough to
    change which experts tokens pick."""
    torch.manual_seed(3)
    model = transformers.DeepseekV3ForCausalLM(deepseek_config(DEBUG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.eval().save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "model_type": "kimi_k2"}))
    return path


def as_deepseek_v3(path: Path, dst: Path) -> Path:
    """A copy of the ``kimi_k2`` directory ``path`` with ``model_type: deepseek_v3``: what
    ``transformers``' own Kimi K2.5 reader makes of a ``kimi_k2`` config, and what its
    ``DeepseekV3ForCausalLM`` loads (it stacks the per-expert tensors by a rule keyed on the
    model_type: under ``kimi_k2`` it leaves every expert unloaded, ``test_logits_...`` shows)."""
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    return dst


def test_logits_match_transformers_both_ways_and_export_as_kimi_k2(tmp_path):
    """A ``kimi_k2`` directory reads as Kimi K2 (not DeepSeek-V3) and computes ``DeepseekV3ForCausalLM``'s
    logits within 1e-5 each way: HF -> DCP, HF -> pp=2 stages, ``load_model``, and DCP -> HF, which is
    written as the release is (``model_type: kimi_k2``, architecture ``DeepseekV3ForCausalLM``, the
    tensors bitwise the originals). ``transformers`` 5.24 has no ``kimi_k2`` class: naming
    ``DeepseekV3ForCausalLM`` on the file as it is leaves the experts unloaded."""
    path = hf_model(tmp_path / "hf")
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(path, output_loading_info=True)
    assert any(".mlp.experts." in key for key in info["missing_keys"])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(as_deepseek_v3(path, tmp_path / "v3")).eval()
    with torch.no_grad():
        want = hf(TOKENS).logits
        convert(path, tmp_path / "dcp", "dcp", progress=False)
        for source, pp in ((tmp_path / "dcp", 1), (path, 2)):
            assert (our_logits(source, TOKENS, pp) - want).abs().max().item() <= 1e-5, (source, pp)
        ours = load_model(path)
        assert type(ours.args) is KimiK2Args and (ours(TOKENS) - want).abs().max().item() <= 1e-5
        convert(tmp_path / "dcp", tmp_path / "back", "hf", progress=False)
        original = hf_tensors(path)
        assert hf_tensors(tmp_path / "back").keys() == original.keys()
        assert all(torch.equal(t, original[k]) for k, t in hf_tensors(tmp_path / "back").items())
        written = json.loads((tmp_path / "back" / "config.json").read_text())
        assert (written["model_type"], written["architectures"]) == ("kimi_k2", ["DeepseekV3ForCausalLM"])
        back = transformers.DeepseekV3ForCausalLM.from_pretrained(as_deepseek_v3(tmp_path / "back", tmp_path / "b3"))
        assert (back.eval()(TOKENS).logits - want).abs().max().item() <= 1e-5
    assert open_model_checkpoint(tmp_path / "dcp").manifest["model"]["name"] == "kimi_k2"


def test_the_1t_flavor_is_the_released_config():
    """The hub's config.json reads as the ``1T`` flavor, which writes back as itself (its 1,026,408,209,408
    parameters, as ``DeepseekV3ForCausalLM`` counts them on ``meta``: ``tests/test_families.py``); a
    softmax-routed model is refused an export as Kimi K2. OSFT trains DeepSeek-V3's targets, tensor
    parallelism splits as DeepSeek-V3's."""
    deepseek = get_family("deepseek_v3")
    assert (FAMILY.osft_targets, FAMILY.tensor_parallel) == (deepseek.osft_targets, deepseek.tensor_parallel)
    args = args_from_config(HUB_K2)
    assert args == FLAVORS["1T"] and FAMILY.flavor_of(args) == "1T"
    for name, flavor in FLAVORS.items():
        assert args_from_config(config(flavor, torch.bfloat16)) == flavor, name
    with pytest.raises(ValueError, match="Kimi K2's config.json .* routes by sigmoid; export to dcp"):
        config(KimiK2Args(**{**DEBUG.to_dict(), "score_func": "softmax", "norm_topk_prob": False}), torch.float32)


def _stored(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Stored]:
    save_file(tensors, path / "model.safetensors")
    return {n: Stored(path / "model.safetensors", n, TensorInfo(tuple(t.shape), t.dtype)) for n, t in tensors.items()}


def test_packed_words_read_as_compressed_tensors_defines_them(tmp_path):
    """A word of 0x76543210 holds 0..7 from its lowest bits up: -8..-1 times the scale. Random words
    (every 4-bit code, negative words included) with scales from 2^-20 to 2^20 read back as the
    reference's values bitwise, whole and rows 1..4 alone, through the stored rows those need."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31, (5, 8), generator=g, dtype=torch.int64).to(torch.int32)
    packed[0, 0] = 0x76543210
    scale = torch.pow(2.0, torch.randint(-20, 21, (5, 2), generator=g).float()).to(torch.bfloat16)
    scale[0, 0] = 0.5
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    parts = {"_packed": packed, "_scale": scale, "_shape": torch.tensor([5, 64])}
    found = packed_tensors(
        _stored(tmp_path, {name + k: t for k, t in parts.items()}), {"quantization_config": INT4_CONFIG}, tmp_path
    )
    q = found[name]
    expected = reference_int4(packed, scale)
    assert q.info == TensorInfo((5, 64), torch.float32)
    assert q.read()[0, :8].tolist() == [v * 0.5 for v in range(-8, 0)]
    assert torch.equal(q.read(), expected)
    windows = q.windows(1, 4)
    dest = torch.empty(3, 64)
    q.dequantize_into(
        {n: parts[n.removeprefix(name)][w.start : w.start + len(w.dest)] for n, w in windows.items()}, dest, 1
    )
    assert torch.equal(dest, expected[1:4])


def _experts(name: str) -> bool:
    return re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", name) is not None


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """The tiny K2 with its routed experts in INT4 (``int4``), and the same in float32 holding the
    values the INT4 files stand for (``dequantized``)."""
    root = tmp_path_factory.mktemp("int4")
    plain = hf_model(root / "plain")
    quantize_directory(plain, root / "int4", "int4", lambda name, _: _experts(name), root / "dequantized")
    return {"int4": root / "int4", "dequantized": root / "dequantized", "plain": plain}


def test_int4_experts_load_dequantized_convert_and_train(int4, tmp_path):
    """``load_model`` of the INT4 directory: every routed expert weight bitwise the reference
    dequantization, every other tensor bitwise the file's, logits within 1e-5 of
    ``DeepseekV3ForCausalLM`` on the dequantized values (and not the float model's: INT4 moved them);
    ``convert`` to DCP keeps the values in float32, and ``train.py`` starts from it and trains."""
    ours, plain = load_model(int4["int4"]), load_model(int4["plain"])
    reference = load_model(int4["dequantized"]).state_dict()
    dequantized = open_model_checkpoint(int4["int4"]).dequantized
    assert sorted(dequantized) == [f"layers.{i}.moe.experts.{w}" for i in (1, 2, 3) for w in ("w1", "w2", "w3")]
    state, original = ours.state_dict(), plain.state_dict()
    assert all(torch.equal(state[f], reference[f]) for f in state)
    assert all(torch.equal(state[f], original[f]) for f in state if f not in dequantized)
    with torch.no_grad():
        reference_dir = as_deepseek_v3(int4["dequantized"], tmp_path / "v3")
        want = transformers.DeepseekV3ForCausalLM.from_pretrained(reference_dir).eval()(TOKENS).logits
        assert (ours(TOKENS) - want).abs().max().item() <= 1e-5
        assert (plain(TOKENS) - want).abs().max().item() > 1e-3
    dcp = convert(int4["int4"], tmp_path / "dcp", "dcp", progress=False)
    converted = open_model_checkpoint(dcp)
    assert converted.manifest["dtype"] == "float32"
    assert all(torch.equal(converted.read_tensor(f), state[f]) for f in converted.infos)
    steps = ["--model.name", "kimi_k2", "--parallelism.pipeline_parallel_degree", "1", "--training.steps", "3"]
    torchrun(tmp_path / "run", dcp, 1, *steps, "--checkpoint.interval", "3")
    loss = losses(tmp_path / "run")
    assert len(loss) == 3 and all(0 < x < 20 for x in loss), loss


def _expert_reads_worker(rank, world_size, path):
    """FSDP2 over 2 ranks from the INT4 directory: whether the shard equals one process's load, and
    the experts whose packed words, scales or shape this rank asked the files for."""
    from torch.distributed.device_mesh import init_device_mesh

    from seedckpt.checkpoint.owned_reads import OwnedHFReader
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local, local_rows
    from tests.test_distributed import _fsdp

    requested, read_data = [], OwnedHFReader.read_data
    OwnedHFReader.read_data = lambda self, plan, planner: (
        requested.extend(i.storage_index.fqn for i in plan.items) or read_data(self, plan, planner)
    )
    checkpoint = open_model_checkpoint(path, complete=False)
    args = checkpoint.args
    shard = _fsdp(init_device_mesh("cpu", (world_size,)))
    [mine] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=checkpoint, shard_fn=shard)
    found = (re.search(r"experts\.(\d+)\..*weight_(packed|scale|shape)", n) for n in requested)
    experts = {int(m[1]) for m in found if m}
    whole = load_model(path).state_dict()
    rows = {f: slice(*(local_rows(t) or (0, t.shape[0]))) for f, t in mine.state_dict().items()}
    return [f for f, t in mine.state_dict().items() if not torch.equal(local(t), whole[f][rows[f]])], experts


def test_each_rank_reads_only_its_experts_int4_words_and_scales(int4):
    """Two FSDP2 ranks split the 8 experts 4 and 4: each asks the files for its own experts' packed
    words, scales and shapes only, and holds what one process loads."""
    results = run_distributed(_expert_reads_worker, 2, str(int4["int4"]))
    for rank, (wrong, experts) in enumerate(results):
        assert wrong == [], f"rank {rank}: {wrong[:4]}"
        assert experts == set(range(4 * rank, 4 * rank + 4)), f"rank {rank} asked for experts {sorted(experts)}"


UP = "model.layers.2.mlp.experts.5.up_proj.weight"
Q = "model.layers.0.self_attn.q_a_proj.weight"


def _settings(**weights):
    group = INT4_CONFIG["config_groups"]["group_0"]
    return {**INT4_CONFIG, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


@pytest.mark.parametrize(
    "case,change,message",
    [
        (
            "num_bits",
            lambda t, c: c.update(quantization_config=_settings(num_bits=8)),
            "weights.num_bits = 8; seedckpt reads 4",
        ),
        (
            "asymmetric",
            lambda t, c: c.update(quantization_config=_settings(symmetric=False)),
            "weights.symmetric = False",
        ),
        (
            "group size",
            lambda t, c: c.update(quantization_config=_settings(group_size=64)),
            "with scales [rows, columns / 64] (group_size 64)",
        ),
        (
            "format",
            lambda t, c: c["quantization_config"].update(format="marlin-24"),
            "in format 'marlin-24'; seedckpt reads compressed-tensors' 'pack-quantized'",
        ),
        (
            "method",
            lambda t, c: c["quantization_config"].update(quant_method="awq"),
            "quant_method = 'awq', but its files store",
        ),
        ("no config", lambda t, c: c.pop("quantization_config"), "has no quantization_config object"),
        (
            "ignored",
            lambda t, c: c["quantization_config"].update(ignore=["re:.*experts.*"]),
            "as unquantized -- the config is not this checkpoint's",
        ),
        (
            "scale shape",
            lambda t, c: t.update({f"{UP}_scale": torch.ones(64, 3, dtype=torch.bfloat16)}),
            f"{UP}_scale bfloat16 [64, 3]",
        ),
        (
            "packed dtype",
            lambda t, c: t.update({f"{UP}_packed": t[f"{UP}_packed"].to(torch.int64)}),
            f"{UP}_packed is int64 [64, 16]",
        ),
        ("no scale", lambda t, c: t.pop(f"{UP}_scale"), f"{UP}_packed has no {UP}_scale beside it"),
        (
            "zero point",
            lambda t, c: t.update({f"{UP}_zero_point": torch.zeros(8, 4, dtype=torch.int32)}),
            f"has {UP}_zero_point beside it",
        ),
        (
            "orphan shape",
            lambda t, c: [t.pop(n) for n in list(t) if n.endswith(("_packed", "_scale"))],
            "_shape has no ",
        ),
    ],
)
def test_crafted_int4_directories_are_refused_on_opening_in_one_line(int4, tmp_path, capsys, case, change, message):
    path = _crafted(int4, tmp_path, change)
    with pytest.raises(SeedckptError) as error:
        open_model_checkpoint(path)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def _scale(value: float):
    def change(t, c):
        t[f"{UP}_scale"][3, 1] = value

    return change


@pytest.mark.parametrize(
    "case,change,message",
    [
        ("nan", _scale(float("nan")), f"{UP}_scale[3, 1] = nan, an impossible scale"),
        ("inf", _scale(float("inf")), f"{UP}_scale[3, 1] = inf, an impossible scale"),
        ("zero", _scale(0.0), f"{UP}_scale[3, 1] = 0.0, an impossible scale"),
        ("negative", _scale(-1.0), f"{UP}_scale[3, 1] = -1.0, an impossible scale"),
        (
            "shape lies",
            lambda t, c: t.update({f"{UP}_shape": torch.tensor([64, 120])}),
            f"{UP}_shape = [64, 120], but {UP}_packed [64, 16] packs [64, 128] values",
        ),
    ],
)
def test_crafted_int4_values_are_refused_when_read_in_one_line_and_nothing_is_written(
    int4, tmp_path, capsys, case, change, message
):
    """Refused where the bytes are read (``convert``, ``verify``), one line, no output left."""
    path = _crafted(int4, tmp_path, change)
    out = tmp_path / "out"
    assert cli(["convert", str(path), str(out), "--to", "dcp", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not out.exists()
    with pytest.raises(SeedckptError, match=re.escape(message)):
        load_model(path)


def _crafted(int4, tmp_path, change) -> Path:
    """A copy of the INT4 directory with ``change(tensors, config)`` applied."""
    path = tmp_path / "crafted"
    shutil.copytree(int4["int4"], path)
    tensors, cfg = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    change(tensors, cfg)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_the_1t_shape_is_planned_and_its_full_seed_refused_for_disk_before_a_byte(tmp_path, capsys):
    """``seedckpt plan`` of the 1T shape on 512 GPUs (pp 8, ep 8: 48 experts an EP rank, 6 a GPU) counts
    every parameter on one stage, compute within 5 % of balanced, 31.8 GiB of training state the
    largest share of a GPU (the figure configs/kimi_k2_1t.toml quotes); its seed (3,824 GiB in
    float32) is refused up front against the test disk's real free space, naming the size, nothing
    written."""
    assert cli(["plan", "--config", "configs/kimi_k2_1t.toml", "--world-size", "512", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_params"] == sum(stage["params"] for stage in plan["stages"]) == K2_PARAMETERS
    assert (plan["experts_per_ep_rank"], plan["expert_rows_per_gpu"]) == (48, 6)
    assert plan["imbalance"]["stage_flops"] <= 1.05
    assert round(max(rank["train_state_bytes_per_gpu"] for rank in plan["ranks"]) / 2**30, 1) == 31.8
    out = tmp_path / "1t"
    assert cli(["seed", "--config", "configs/kimi_k2_1t.toml", "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"the seed needs 3,823.67 GiB at {out}, but {tmp_path} has " in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
