"""Quantized Hugging Face directories made here, for tests and ``benchmarks/quantized_read.py``.

seedckpt reads FP8-block and MXFP4 checkpoints but does not write them; these quantizers make them
the way their releases are made, from a directory of float weights:

* FP8 blocks (DeepSeek-V3): each 128 x 128 block divided by its largest magnitude / 448 (e4m3's
  largest value), rounded to e4m3; that divisor is stored as the block's ``weight_scale_inv``.
* MXFP4 (gpt-oss): each group of 32 values along a row shares the power of two 2^e with e the least
  that brings the group within e2m1's +-6, and each value is rounded to the nearest e2m1 code.
* INT4 (Kimi-K2-Thinking's experts, compressed-tensors' ``pack-quantized``): each group of 32 values
  along a row is divided by its largest magnitude / 7 (stored in bfloat16), rounded to an integer in
  [-8, 7] and packed eight to an int32 word, the first value in the lowest four bits, as ``q + 8``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from seedckpt.checkpoint.formats.quantized import E8M0_BIAS, FP8_BLOCK, MX_BYTES

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": []}
E4M3_MAX = 448.0
INT4_GROUP = 32
# Kimi-K2-Thinking's quantization_config: the routed experts' linears only
INT4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": INT4_GROUP,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1's magnitudes; codes 8..15 are their negatives
E2M1_TABLE = torch.tensor([*E2M1, *(-v for v in E2M1)])
E2M1_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(E2M1, E2M1[1:])])


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [R, C] as e4m3 values and the float32 scale of each 128 x 128 block (a partial block at
    an edge has its own)."""
    rows, cols = w.shape
    grid = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(grid[0] * FP8_BLOCK, grid[1] * FP8_BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    values = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return values, scale


def reference_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition, element by element: (r, c) takes the scale at (r // 128, c // 128)."""
    rows = torch.arange(values.shape[0])[:, None] // FP8_BLOCK
    cols = torch.arange(values.shape[1])[None, :] // FP8_BLOCK
    return values.float() * scale[rows, cols]


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit ``codes`` [E, R, G * 32] two to a byte, the even one in the low nibble, as blocks
    [E, R, G, 16]; ``exponents`` [E, R, G] as e8m0 bytes."""
    pairs = codes.view(*codes.shape[:-1], -1, 2).to(torch.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.view(*exponents.shape, MX_BYTES), (exponents + E8M0_BIAS).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [E, C, R] (HF's layout of gpt-oss's experts) as MXFP4 blocks [E, R, C / 32, 16] and
    scales [E, R, C / 32], with the values they stand for ([E, C, R], float32)."""
    rows = w.transpose(1, 2).float().contiguous()
    groups = rows.reshape(*rows.shape[:2], -1, 2 * MX_BYTES)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-120) / E2M1[-1])).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponents)[..., None]
    # the nearest magnitude (by the midpoints between e2m1's), then the sign bit: no [..., 16] temporary
    codes = torch.bucketize(scaled.abs(), E2M1_MIDPOINTS) + 8 * (scaled < 0)
    values = E2M1_TABLE[codes] * torch.pow(2.0, exponents)[..., None]
    blocks, scales = pack_mxfp4(codes.flatten(-2), exponents.long())
    return blocks, scales, values.flatten(-2).transpose(1, 2).contiguous()


def quantize_int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` [R, C] as compressed-tensors stores it: packed words, bfloat16 scales, its shape."""
    groups = w.float().reshape(w.shape[0], -1, INT4_GROUP)
    scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).reshape(w.shape).long()
    return {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": torch.tensor(list(w.shape))}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-8, 7] ``[R, C]`` as int32 words ``[R, C / 8]``, value i of a word at bits 4i."""
    words = sum((q[:, i::8] + 8) << (4 * i) for i in range(8))
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # the top bit is the sign's


def reference_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition, value by value: the word's bits 4i..4i+3, less 8, times the group's scale."""
    words = packed.long() & 0xFFFFFFFF
    q = torch.stack([((words >> (4 * i)) & 0xF) - 8 for i in range(8)], dim=-1).reshape(packed.shape[0], -1)
    return q.float() * scale.float().repeat_interleave(INT4_GROUP, dim=1)


def _quantized(method: str, name: str, tensor: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """``name``'s stored tensors in ``method`` and the float32 values they stand for."""
    if method == "fp8":
        values, scale = quantize_fp8(tensor.float())
        return {name: values, f"{name}_scale_inv": scale}, reference_fp8(values, scale)
    if method == "int4":
        parts = quantize_int4(tensor)
        stored = {f"{name}{k.removeprefix('weight')}": t for k, t in parts.items()}
        return stored, reference_int4(parts["weight_packed"], parts["weight_scale"])
    blocks, scales, values = quantize_mxfp4(tensor)
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}, values


def quantize_directory(
    src: Path, dst: Path, method: str, chosen: Callable[[str, torch.Tensor], bool], values_dst: Path | None = None
) -> None:
    """A copy of the HF directory ``src`` at ``dst`` with the tensors ``chosen(name, tensor)`` picks
    stored quantized (``method``: "fp8", "mxfp4" or "int4") and ``quantization_config`` set; ``values_dst``:
    also a float32 copy holding the values the quantized tensors stand for."""
    shutil.copytree(src, dst)
    if values_dst is not None:
        shutil.copytree(src, values_dst)
    renamed = {}
    for file in sorted(dst.glob("*.safetensors")):
        tensors, values = load_file(file), {}
        for name in [n for n, t in tensors.items() if chosen(n, t)]:
            stored, values[name] = _quantized(method, name, tensors.pop(name))
            tensors.update(stored)
            renamed[name] = list(stored)
        save_file(tensors, file, metadata={"format": "pt"})
        if values_dst is not None:
            save_file(load_file(src / file.name) | values, values_dst / file.name, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    settings = {"fp8": FP8_CONFIG, "mxfp4": MXFP4_CONFIG, "int4": INT4_CONFIG}[method]
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    index = dst / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f for name, f in data["weight_map"].items() for n in renamed.get(name, [name])}
        index.write_text(json.dumps(data))
