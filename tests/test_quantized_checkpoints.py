"""Quantized Hugging Face directories read dequantized (``seedckpt.checkpoint.formats.quantized``).

FP8 blocks: a random ``transformers`` Qwen3-MoE (dim 256, experts 160 wide, so the expert weights
end in partial 128-blocks: [160, 256] and [256, 160] on 2 x 2 grids) is saved, and its attention and
expert weights are rewritten as DeepSeek-V3 releases its own (``tests.quantizers``: float8 e4m3, one float32
``weight_scale_inv`` per 128 x 128 block, scale = the block's largest magnitude / 448).

The error bound. A block's values are divided by its scale s, so they lie within e4m3's +-448, and
rounded to e4m3: 3 mantissa bits, so a normal value (>= 2^-6) moves by at most half a step, 2^-4 of
itself; below 2^-6 the steps are 2^-9 apart, so a value moves by at most 2^-10. Times s back:
|dequantized - w| <= 2^-4 |w| + 2^-10 s, plus float32's roundings of the division and the product
(2^-24 each, relative), covered by a 1e-6 relative slack.

MXFP4: codes and exponents packed here byte by byte are read back exactly and equal what
``transformers``' own dequantizer makes of the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from seedckpt import load_model
from seedckpt.checkpoint.formats import quantized
from seedckpt.checkpoint.formats.quantized import (
    FP8_BLOCK,
    DequantizedLoad,
    Stored,
    quantized_tensors,
)
from seedckpt.checkpoint.manifest import TensorInfo
from seedckpt.cli.main import main as cli
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.dist import run_distributed
from tests.quantizers import E2M1_TABLE, FP8_CONFIG, pack_mxfp4, quantize_directory, quantize_fp8, reference_fp8

transformers = pytest.importorskip("transformers")

DIM, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, MOE_FFN, LAYERS, VOCAB = 256, 4, 2, 64, 4, 160, 2, 160
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))


def _quantized_name(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The random Qwen3-MoE in float32 (``plain``) and with its attention and expert weights in FP8
    blocks (``fp8``); ``dequantized``: the float32 model with those weights as the definition reads
    them back; ``model``: the original in memory."""
    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(5)
    shape = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, max_position_embeddings=64)
    shape |= dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=1e6)
    moe = dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=MOE_FFN, intermediate_size=96)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**shape, **moe))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    plain = root / "plain"
    model.save_pretrained(plain)
    fp8, dequantized = root / "fp8", root / "dequantized"
    quantize_directory(plain, fp8, "fp8", lambda name, _: _quantized_name(name), dequantized)
    return {"plain": plain, "fp8": fp8, "dequantized": dequantized, "model": model}


def test_fp8_partial_blocks_read_as_deepseek_defines_and_each_row_range_alone(tmp_path, monkeypatch):
    """576 x 300 (DeepSeek-V3's kv_a_proj_with_mqa rows; columns ending in a 44-wide block) on a 5 x 3
    grid: the whole tensor, and rows 100..460 read through their own stored rows (scale rows 0..3),
    equal the definition exactly, every one of the 256 e4m3 codes (subnormals, signed zeros, NaN) among
    the values. transformers 5.24 derives its blocks as rows // scale rows: it refuses 576 rows on 5
    (no multiple), and would read the 300 columns on 3 as 100-column blocks. Dequantized 7 rows at a
    time, so steps straddle blocks."""
    monkeypatch.setattr(quantized, "CHUNK_VALUES", 7 * 300)
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 256, (576, 300), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.rand(5, 3, generator=g) * 4  # unrelated scales: a block taken for another shows
    save_file({"w.weight": values, "w.weight_scale_inv": scale}, tmp_path / "w.safetensors")
    stored = {
        n: Stored(tmp_path / "w.safetensors", n, TensorInfo(tuple(t.shape), t.dtype))
        for n, t in (("w.weight", values), ("w.weight_scale_inv", scale))
    }
    [(name, q)] = quantized_tensors(stored, {"quantization_config": FP8_CONFIG}, tmp_path).items()
    expected = reference_fp8(values, scale)
    assert name == "w.weight" and q.info == TensorInfo((576, 300), torch.float32)
    torch.testing.assert_close(q.read(), expected, rtol=0, atol=0, equal_nan=True)
    windows = q.windows(100, 460)
    assert {n: (w.start, tuple(w.dest.shape)) for n, w in windows.items()} == {
        "w.weight": (100, (360, 300)),
        "w.weight_scale_inv": (0, (4, 3)),
    }
    dest = torch.empty(360, 300)
    q.dequantize_into({"w.weight": values[100:460], "w.weight_scale_inv": scale[0:4]}, dest, 100)
    torch.testing.assert_close(dest, expected[100:460], rtol=0, atol=0, equal_nan=True)


def test_fp8_directory_loads_within_fp8s_error_and_computes_what_transformers_does_on_its_values(dirs, tmp_path):
    """load_model of the FP8 directory: every quantized weight within the derived bound of the float32
    original and bitwise the definition's dequantization (q/k rows in our order); logits within 1e-5
    of transformers' model holding the same dequantized values. convert keeps them exactly: float32
    unless --dtype asks otherwise."""
    ours = load_model(dirs["fp8"])
    plain = load_model(dirs["plain"])
    checkpoint = open_model_checkpoint(dirs["fp8"])
    assert checkpoint.infos["layers.1.moe.experts.w2"] == TensorInfo((EXPERTS, DIM, MOE_FFN), torch.float32)
    assert len(checkpoint.dequantized) == LAYERS * 7  # 4 attention projections and 3 expert weights a layer
    state, original = ours.state_dict(), plain.state_dict()
    worst = 0.0
    for fqn in checkpoint.dequantized:
        w, got = original[fqn], state[fqn]
        bound = 2**-4 * w.abs() + 2**-10 * _block_scales_like(w)
        assert ((got - w).abs() <= bound * (1 + 1e-6)).all(), fqn
        worst = max(worst, ((got - w).abs() / bound).max().item())
    assert worst > 0.5  # the bound is approached: the values really went through e4m3
    untouched = [f for f in original if f not in checkpoint.dequantized]
    assert untouched and all(torch.equal(state[f], original[f]) for f in untouched)
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(dirs["dequantized"]).eval()(TOKENS).logits
        got, original_logits = ours(TOKENS), dirs["model"].eval()(TOKENS).logits
    assert (got - expected).abs().max() <= 1e-5, (got - expected).abs().max()
    assert (got - original_logits).abs().max() > 1e-3  # FP8 did change the model

    from seedckpt.cli.convert import convert

    kept = convert(dirs["fp8"], tmp_path / "dcp", "dcp", progress=False)
    converted = open_model_checkpoint(kept)
    assert converted.manifest["dtype"] == "float32"
    assert all(torch.equal(converted.read_tensor(f), state[f]) for f in converted.infos)
    cast = open_model_checkpoint(convert(dirs["fp8"], tmp_path / "bf16", "dcp", dtype="bfloat16", progress=False))
    assert {i.dtype for i in cast.infos.values()} == {torch.bfloat16}


def _block_scales_like(w: torch.Tensor) -> torch.Tensor:
    """Each element's block scale, as ``quantize_fp8`` chose it (per expert for a layer's experts; q/k
    rows are permuted within heads of 64 rows, so within their 128-row blocks)."""
    if w.dim() == 3:
        return torch.stack([_block_scales_like(expert) for expert in w])
    _, scale = quantize_fp8(w)
    rows = torch.arange(w.shape[0])[:, None] // FP8_BLOCK
    return scale[rows, torch.arange(w.shape[1])[None, :] // FP8_BLOCK]


def _row_split_worker(rank, world_size, fp8_path):
    """FSDP2 over 2 ranks, then tp2: each rank's shard equals one process's load; per rank (FSDP2),
    the bytes read and the experts whose FP8 values or scales it asked the files for."""
    import re

    from torch.distributed.device_mesh import init_device_mesh

    from models.registry import family_of
    from seedckpt.checkpoint.owned_reads import OwnedHFReader, OwnedReads
    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from seedckpt.utils.tensors import local, local_rows
    from tests.test_distributed import _fsdp

    read, requested = [], []
    run, read_data = OwnedReads.run, OwnedHFReader.read_data

    def counting(self, items, locate, planner):
        run(self, items, locate, planner)
        read.append(self.bytes_read)

    OwnedReads.run = counting
    OwnedHFReader.read_data = lambda self, plan, planner: (
        requested.extend(i.storage_index.fqn for i in plan.items) or read_data(self, plan, planner)
    )
    checkpoint = open_model_checkpoint(fp8_path, complete=False)
    args = checkpoint.args
    [whole] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=checkpoint)
    read.clear()
    requested.clear()
    shard = _fsdp(init_device_mesh("cpu", (world_size,)))
    [mine] = build_stages(args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=checkpoint, shard_fn=shard)
    expected = whole.state_dict()
    failures = []
    for fqn, t in mine.state_dict().items():
        lo, hi = local_rows(t) or (0, t.shape[0])
        if not torch.equal(local(t), expected[fqn][lo:hi]):
            failures.append(fqn)
    experts = {int(m[1]) for m in (re.search(r"experts\.(\d+)\..*_scale_inv", n) for n in requested) if m}
    nbytes = sum(read)
    # tensor parallel: column shards (wo, w2) and the experts' splits are no blocks of whole rows
    tp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    plan = family_of(args).tensor_parallel
    [split] = build_stages(
        args, plan_rank_stages(args, 0, 1), "cpu", checkpoint=checkpoint, shard_fn=lambda m: plan.apply(m, tp, False)
    )
    failures += [f"tp {f}" for f, t in split.state_dict().items() if not torch.equal(t.full_tensor(), expected[f])]
    columns = [f for f, t in split.state_dict().items() if f in checkpoint.dequantized and local_rows(t) is None]
    return failures, nbytes, experts, columns


def test_a_rank_reads_its_rows_and_experts_of_the_fp8_values_and_scales(dirs):
    """Two FSDP2 ranks: experts [0, 2) and [2, 4), and half of every other tensor's rows (a 128-row
    scale block straddling the split is read by both). Each rank reads about half the directory's
    bytes and asks for its own experts' FP8 tensors only. Under tp2, whose column shards read whole
    tensors, every tensor equals one process's load too."""
    stored = sum(file.stat().st_size for file in dirs["fp8"].glob("*.safetensors"))
    results = run_distributed(_row_split_worker, 2, str(dirs["fp8"]))
    for rank, (failures, nbytes, experts, columns) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:4]}"
        assert any(".attention.wo." in f for f in columns), columns  # a column shard of an FP8 weight was read
        assert experts == {2 * rank, 2 * rank + 1}, f"rank {rank} asked for experts {sorted(experts)}"
        assert 0.45 * stored <= nbytes <= 0.55 * stored, f"rank {rank}: {nbytes / stored:.3f} of the bytes"


def _crafted(dirs, tmp_path, change) -> Path:
    """A copy of the FP8 directory with ``change(tensors, config)`` applied."""
    path = tmp_path / "crafted"
    shutil.copytree(dirs["fp8"], path)
    [file] = path.glob("*.safetensors")
    tensors, config = load_file(file), json.loads((path / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, file, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.experts.3.up_proj.weight"
EXPERTS_NAME = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    "case,change,message",
    [
        (
            "scale grid",
            lambda t, c: t.update({f"{UP}_scale_inv": torch.ones(1, 2)}),
            f"{UP}_scale_inv is float32 [1, 2], but {UP} [160, 256] in 128 x 128 blocks needs float32 scales [2, 2]",
        ),
        (
            "scale dtype",
            lambda t, c: t.update({f"{Q}_scale_inv": torch.ones(2, 2, dtype=torch.int32)}),
            "is int32 [2, 2]",
        ),
        ("weight not fp8", lambda t, c: t.update({Q: torch.ones(256, 256, dtype=torch.bfloat16)}), f"{Q} is bfloat16"),
        ("no scales", lambda t, c: t.pop(f"{UP}_scale_inv"), f"{UP} is stored in float8 without its scales"),
        ("block size", lambda t, c: c["quantization_config"].update(weight_block_size=[64, 64]), "[128, 128] blocks"),
        ("method", lambda t, c: c["quantization_config"].update(quant_method="fbgemm_fp8"), "quant_method = 'fbgemm"),
        ("no config", lambda t, c: c.pop("quantization_config"), "has no quantization_config object"),
        (
            "mxfp4 shapes",
            lambda t, c: t.update(
                {
                    f"{EXPERTS_NAME}_blocks": torch.zeros(2, 4, 3, 16, dtype=torch.uint8),
                    f"{EXPERTS_NAME}_scales": torch.zeros(2, 4, 2, dtype=torch.uint8),
                }
            ),
            "MXFP4 stores uint8 blocks [experts, rows, groups, 16]",
        ),
        (
            "mxfp4 alone",
            lambda t, c: t.update({f"{EXPERTS_NAME}_blocks": torch.zeros(2, 4, 3, 16, dtype=torch.uint8)}),
            f"has no {EXPERTS_NAME}_scales beside it",
        ),
    ],
)
def test_crafted_quantized_directories_are_refused_in_one_line(dirs, tmp_path, capsys, case, change, message):
    path = _crafted(dirs, tmp_path, change)
    with pytest.raises(SeedckptError, match=None) as error:
        open_model_checkpoint(path)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_mxfp4_packed_here_reads_back_exactly_and_as_transformers_dequantizes(tmp_path, monkeypatch):
    """Random codes (all 16) and exponents -127..127 (e8m0's every finite scale, both ends included)
    over 3 experts, 5 rows, 2 groups: the tensor is [3, 64, 5] (groups x 32 by rows), each value the
    e2m1 code's times 2^exponent (subnormal or overflowing to inf in float32 at the ends, as the
    definition's float32 is); transformers' ``convert_moe_packed_tensors`` gives the same bits;
    experts [1, 3) alone, read through DCP, cost exactly their blocks' and scales' bytes. Two rows are
    dequantized at a time."""
    monkeypatch.setattr(quantized, "CHUNK_VALUES", 2 * 64)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from seedckpt.checkpoint.load import RowWindow, load_state
    from seedckpt.checkpoint.owned_reads import OwnedHFReader

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g)
    exponents = torch.randint(-127, 128, (3, 5, 2), generator=g)
    exponents[0, 0], exponents[2, 4] = torch.tensor([-127, 127]), torch.tensor([-126, 126])
    blocks, scales = pack_mxfp4(codes, exponents)
    values = (E2M1_TABLE[codes].double() * torch.pow(2.0, exponents.repeat_interleave(32, dim=-1).double())).float()
    expected = values.transpose(1, 2)
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({f"{name}_blocks": blocks, f"{name}_scales": scales}, tmp_path / "model.safetensors")
    stored = {
        n: Stored(tmp_path / "model.safetensors", n, TensorInfo(tuple(t.shape), t.dtype))
        for n, t in ((f"{name}_blocks", blocks), (f"{name}_scales", scales))
    }
    found = quantized_tensors(stored, {"quantization_config": {"quant_method": "mxfp4"}}, tmp_path)
    q = found[name]
    assert q.info == TensorInfo((3, 64, 5), torch.float32)
    assert torch.equal(q.read(), expected)
    assert torch.equal(q.read(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))

    reader = OwnedHFReader(tmp_path)
    dest = torch.empty(2, 64, 5)
    load = DequantizedLoad(found)
    load_state(load.requests({name: RowWindow(dest, 1)}), reader, tmp_path, no_dist=True)
    load.finish()
    assert torch.equal(dest, expected[1:3])
    assert reader.reads.bytes_read == blocks[1:3].numel() + scales[1:3].numel() == 2 * 5 * 2 * 17
