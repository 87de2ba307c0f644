"""Values no model should hold (issue 46 item 6): ``convert`` refuses a tensor holding NaN or Inf in one
line naming it, leaving nothing behind, unless ``--allow-non-finite``; ``verify`` reads the values of
checkpoints without checksums (Hugging Face, quantized) and names such tensors; quantized scales no
quantizer writes (an FP8 block's scale_inv <= 0, NaN or Inf; MXFP4's e8m0 byte 255) are refused when
read, naming the scale. Tiny random gpt-oss and DeepSeek-V3 directories (sinks, correction bias)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from seedckpt import load_model
from seedckpt.cli.main import main as cli
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.quantizers import quantize_directory

transformers = pytest.importorskip("transformers")

from tests.test_deepseek_v3 import hf_model as deepseek_model  # noqa: E402 (needs transformers)
from tests.test_gpt_oss import hf_model as gpt_oss_model  # noqa: E402

SINKS = "model.layers.1.self_attn.sinks"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
Q_A = "model.layers.0.self_attn.q_a_proj.weight"
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    gpt_oss = gpt_oss_model(root / "gpt_oss", intermediate_size=32)  # experts in whole MXFP4 groups
    deepseek = deepseek_model(root / "deepseek")
    quantize_directory(deepseek, root / "fp8", "fp8", lambda name, _: name == Q_A)
    quantize_directory(gpt_oss, root / "mxfp4", "mxfp4", lambda name, _: name == GATE_UP)
    return {"gpt_oss": gpt_oss, "deepseek": deepseek, "fp8": root / "fp8", "mxfp4": root / "mxfp4"}


def edited(source: Path, to: Path, name: str, change) -> Path:
    """A copy of the one-file HF directory ``source`` with ``change(tensor)`` applied to ``name`` in place."""
    shutil.copytree(source, to)
    [file] = to.glob("*.safetensors")
    tensors = load_file(file)
    change(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})
    return to


def one_error_line(capsys) -> str:
    """The command's error: one line (a warning line about what a file target leaves behind aside)."""
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith("seedckpt "), err
    return err[0]


def nothing_left(dst: Path) -> bool:
    """Neither the output nor a partial of it, nor its lock, exists beside it."""
    return not dst.exists() and not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]


@pytest.mark.parametrize(
    "family,name,fqn,value",
    [
        ("gpt_oss", SINKS, "layers.1.attention.sinks", float("nan")),
        ("gpt_oss", "model.layers.0.self_attn.q_proj.weight", "layers.0.attention.wq.weight", float("inf")),
        ("deepseek", BIAS, "layers.1.moe.expert_bias", float("-inf")),
    ],
)
@pytest.mark.parametrize("to,dst", [("dcp", "out"), ("hf", "out"), ("safetensors", "out.safetensors")])
def test_convert_refuses_a_non_finite_tensor_in_one_line_and_writes_nothing(
    models, tmp_path, capsys, family, name, fqn, value, to, dst
):
    def poison(tensor):
        tensor.view(-1)[3] = value

    src = edited(models[family], tmp_path / "src", name, poison)
    out = tmp_path / "converted" / dst
    out.parent.mkdir()
    assert cli(["convert", str(src), str(out), "--to", to, "--quiet"]) == 2
    err = one_error_line(capsys)
    assert f"{fqn} holds 1 NaN or Inf values of" in err and "--allow-non-finite" in err, err
    assert nothing_left(out), sorted(p.name for p in out.parent.iterdir())

    assert cli(["convert", str(src), str(out), "--to", to, "--quiet", "--allow-non-finite"]) == 0
    kept = open_model_checkpoint(out).read_tensor(fqn)
    assert kept.reshape(-1)[3].item() == value or (value != value and kept.reshape(-1)[3].isnan())


def test_verify_reads_an_hf_directorys_values_and_names_those_not_finite(models, tmp_path, capsys):
    assert cli(["verify", str(models["deepseek"]), "--quiet"]) == 0
    assert "every value finite" in capsys.readouterr().out

    def poison(tensor):
        tensor[::2] = float("nan")

    src = edited(models["deepseek"], tmp_path / "nan", BIAS, poison)
    assert cli(["verify", str(src), "--quiet"]) == 0  # the files are whole: a warning, as for checksums
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"warning: {BIAS} in model.safetensors holds 4 NaN or Inf values of 8", out
    assert "1 of them hold NaN or Inf" in out[1], out


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_an_impossible_fp8_scale_is_named_by_convert_verify_and_a_load(models, tmp_path, capsys, scale):
    """The 24 x 64 ``q_a_proj`` is one block; its scale ``[0, 0]`` replaced."""

    def change(scales):
        scales[0, 0] = scale

    src = edited(models["fp8"], tmp_path / "fp8", f"{Q_A}_scale_inv", change)
    named = f"{Q_A}_scale_inv[0, 0] = {scale}, an impossible scale"
    for command in (["convert", str(src), str(tmp_path / "out"), "--to", "dcp"], ["verify", str(src)]):
        assert cli([*command, "--quiet"]) == 2
        err = one_error_line(capsys)
        assert named in err, err
    assert nothing_left(tmp_path / "out")
    with pytest.raises(SeedckptError, match=r"an impossible scale"):
        load_model(src)


def test_mxfp4s_nan_scale_is_named_and_an_overflowing_one_refused_as_values(models, tmp_path, capsys):
    """Byte 255 is e8m0's NaN: named where it is. Byte 254 is 2^127, a scale; times e2m1's 6 it
    overflows float32, which convert names as the expert weight's Inf values, dequantized."""

    def nan_scale(scales):
        scales[1, 2, 0] = 255

    src = edited(models["mxfp4"], tmp_path / "nan", f"{GATE_UP}_scales", nan_scale)
    assert cli(["convert", str(src), str(tmp_path / "out"), "--to", "dcp", "--quiet"]) == 2
    assert f"{GATE_UP}_scales[1, 2, 0] = 255, e8m0's NaN" in one_error_line(capsys)

    def huge_scale(scales):
        scales[1, 2, 0] = 254

    src = edited(models["mxfp4"], tmp_path / "huge", f"{GATE_UP}_scales", huge_scale)
    blocks = load_file(src / "model.safetensors")[f"{GATE_UP}_blocks"][1, 2, 0]
    assert ((blocks & 7) >= 6).any() or ((blocks >> 4 & 7) >= 6).any()  # a 4 or a 6 in the group: it overflows
    assert cli(["convert", str(src), str(tmp_path / "out"), "--to", "dcp", "--quiet"]) == 2
    err = one_error_line(capsys)
    assert "layers.0.moe.experts.w" in err and "(dequantized: a NaN code, or a scale that overflows" in err, err
    assert nothing_left(tmp_path / "out")
    assert cli(["verify", str(src), "--quiet"]) == 0
    assert f"warning: {GATE_UP} in model.safetensors holds" in capsys.readouterr().out
