"""Whole-tensor reads of quantized tensors hold a bounded slab, not the tensor dequantized.

``seedckpt verify`` dequantized a stored MXFP4 expert tensor whole: 8.5 GB of float32 for one of
gpt-oss-120B's (128 x 2880 x 5760 values). It now reads and checks ``load.SLAB_BYTES`` of rows
at a time, so a process capped far below the dequantized tensor verifies it; and every slab, FP8,
MXFP4 and INT4 alike, holds the bits the whole-tensor dequantization makes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from seedckpt.checkpoint import load
from seedckpt.checkpoint.formats import quantized
from seedckpt.checkpoint.formats.compressed_tensors import packed_tensors
from seedckpt.checkpoint.formats.quantized import Stored, quantized_tensors
from seedckpt.checkpoint.manifest import TensorInfo
from tests.dist import HANG_S
from tests.quantizers import FP8_CONFIG, INT4_CONFIG, MXFP4_CONFIG, quantize_fp8, quantize_int4
from tests.test_train import REPO

pytest.importorskip("transformers")

EXPERTS, DIM = 8, 2880  # gpt-oss's width: one down_proj expert is 33 MB dequantized, the tensor 265 MB
DOWN = "model.layers.0.mlp.experts.down_proj"
CAP = 192 << 20  # address space allowed above what the opened checkpoint had mapped

CAPPED = """
import resource, sys
from seedckpt.cli.main import main
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
open_model_checkpoint(sys.argv[1], complete=False)  # its lazy imports, before the cap
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]), vm + int(sys.argv[2])))
sys.exit(main(["verify", sys.argv[1], "--quiet"]))
"""


def _gpt_oss_down_proj(path: Path) -> Path:
    """A gpt-oss directory whose one file stores layer 0's MXFP4 ``down_proj`` (8 experts, 2880 wide;
    33 MB of blocks and scales), random codes and scales 2^-7..2^6 (every value finite)."""
    from tests.test_gpt_oss import hf_config

    path.mkdir()
    shape = dict(hidden_size=DIM, intermediate_size=DIM, num_local_experts=EXPERTS, num_hidden_layers=1)
    config = hf_config(**shape).to_dict() | {"quantization_config": MXFP4_CONFIG}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    groups = DIM // (2 * quantized.MX_BYTES)
    blocks = torch.randint(0, 256, (EXPERTS, DIM, groups, quantized.MX_BYTES), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (EXPERTS, DIM, groups), dtype=torch.uint8, generator=g)
    save_file({f"{DOWN}_blocks": blocks, f"{DOWN}_scales": scales}, path / "model.safetensors")
    return path


def test_verify_checks_an_mxfp4_expert_tensor_larger_than_its_memory_cap(tmp_path):
    """The 265 MB (dequantized) tensor is verified by a process allowed 192 MiB of address space above
    what it held once the checkpoint was open: a slab (one expert, 33 MB) at a time, its stored rows
    read alone. Read whole, as before, it is refused by the cap (measured: the address space grew by
    409 MiB reading it whole, by 119 MiB by slabs -- the slab, the dequantizer's temporaries)."""
    path = _gpt_oss_down_proj(tmp_path / "gpt_oss")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED, str(path), str(CAP)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 tensors, 0.25 GiB, every value finite" in proc.stdout, proc.stdout


def _stored(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Stored]:
    save_file(tensors, path)
    return {n: Stored(path, n, TensorInfo(tuple(t.shape), t.dtype)) for n, t in tensors.items()}


def _quantized_kinds(tmp_path: Path) -> list:
    """One tensor each of FP8 (300 rows: the slabs below straddle its 128-row blocks), MXFP4 (5
    experts) and INT4 (70 rows), random."""
    g = torch.Generator().manual_seed(2)
    values, scale = quantize_fp8(torch.randn(300, 200, generator=g))
    fp8 = _stored(tmp_path / "fp8.safetensors", {"w.weight": values, "w.weight_scale_inv": scale})
    blocks = torch.randint(0, 256, (5, 6, 2, quantized.MX_BYTES), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (5, 6, 2), dtype=torch.uint8, generator=g)
    mx = _stored(tmp_path / "mx.safetensors", {"e_blocks": blocks, "e_scales": scales})
    packed = quantize_int4(torch.randn(70, 64, generator=g))
    int4 = _stored(tmp_path / "int4.safetensors", {f"x.{k}": t for k, t in packed.items()})
    return [
        quantized_tensors(fp8, {"quantization_config": FP8_CONFIG}, tmp_path)["w.weight"],
        quantized_tensors(mx, {"quantization_config": MXFP4_CONFIG}, tmp_path)["e"],
        packed_tensors(int4, {"quantization_config": INT4_CONFIG}, tmp_path)["x.weight"],
    ]


def test_slabs_and_reads_hold_the_bits_of_the_whole_tensor_dequantized_at_once(tmp_path, monkeypatch):
    """Slabs of 2 MXFP4 experts, 40 FP8 rows, 24 INT4 rows (``load.SLAB_BYTES``, the one setting the
    memory estimates read too, shrunk to fit): put together, and ``read`` (which fills its output a
    slab at a time), they equal bitwise the tensor dequantized in one call from its whole stored
    tensors, the way it was read before."""
    from safetensors.torch import load_file

    kinds = _quantized_kinds(tmp_path)
    for q, rows in zip(kinds, (40, 2, 24)):
        monkeypatch.setattr(load, "SLAB_BYTES", rows * q.info.nbytes // q.info.shape[0])
        whole = torch.empty(q.info.shape)
        q.dequantize_into({p.name: load_file(p.file)[p.name] for p in q.parts}, whole, 0)
        slabs = [slab.clone() for slab in q.slabs()]
        assert len(slabs) == -(-q.info.shape[0] // rows), q.name
        assert torch.equal(torch.cat(slabs).view(torch.int32), whole.view(torch.int32)), q.name
        assert torch.equal(q.read().view(torch.int32), whole.view(torch.int32)), q.name
