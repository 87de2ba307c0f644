"""Stored tensors that the model a ``config.json`` describes lacks are refused, in every family.

Left out, the weights would load as another model than the files hold (DeepSeek-V3's shared experts
under ``n_shared_experts = 0`` computed a model without them, and ``transformers`` refuses that
directory). Each refusal is one line naming the first such tensor, how many there are and the field
to fix; ``convert`` writes nothing, ``load_model`` builds nothing. What is left out on purpose
(DeepSeek-V3's multi-token-prediction layer, the empty shared experts ``transformers`` writes for
none) still reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from seedckpt import load_model
from seedckpt.cli.main import main as cli
from seedckpt.utils.errors import SeedckptError
from tests.test_convert import _assert_nothing_written, _hf_llama
from tests.test_deepseek_v3 import hf_model
from tests.test_moe_interop import _hf_moe

transformers = pytest.importorskip("transformers")


def _set(path: Path, **fields) -> Path:
    """``path``'s ``config.json`` with ``fields`` changed."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | fields))
    return path


def _refused(path: Path, tmp_path: Path, capsys) -> str:
    """The one line ``convert`` prints when it refuses ``path``, once it has written nothing and
    ``load_model`` has refused it too."""
    capsys.readouterr()  # what building the directory printed
    assert cli(["convert", str(path), str(tmp_path / "out"), "--to", "dcp", "--quiet"]) != 0
    _assert_nothing_written(tmp_path, "out")
    [line] = capsys.readouterr().err.strip().splitlines()
    with pytest.raises(SeedckptError) as raised:
        load_model(path)
    assert str(raised.value) in line
    return line


def test_deepseek_v3_shared_experts_under_none_are_refused(tmp_path, capsys):
    path = _set(hf_model(tmp_path / "hf"), n_shared_experts=0)
    assert _refused(path, tmp_path, capsys) == (
        f"seedckpt convert: error: {path}: config.json says n_shared_experts = 0 but the files hold "
        "model.layers.1.mlp.shared_experts.down_proj.weight (and 5 more), which that model lacks: fix n_shared_experts"
    )


def test_deepseek_v3_shared_experts_under_null_are_not_dropped(tmp_path, capsys):
    """Whatever null reads as (none, or the class default of one), two shared experts' weights are
    refused, never left out."""
    path = _set(hf_model(tmp_path / "hf", n_shared_experts=2), n_shared_experts=None)
    assert "shared_experts" in _refused(path, tmp_path, capsys)


def test_deepseek_v3_empty_shared_experts_and_the_prediction_layer_still_read(tmp_path):
    """``transformers`` writes zero shared experts as empty tensors: nothing is lost leaving them out."""
    path = hf_model(tmp_path / "hf", n_shared_experts=0)
    assert any(t.numel() == 0 for t in load_file(path / "model.safetensors").values())
    assert load_model(path).args.n_shared_experts == 0


def test_a_deepseek_v3_layer_past_num_hidden_layers_is_refused_unless_it_predicts_tokens(tmp_path, capsys):
    """A layer past the config's without an ``eh_proj`` is a decoder layer, not the multi-token-prediction
    module: refused, where before it was skipped as that module."""
    path = _set(hf_model(tmp_path / "hf"), num_hidden_layers=2)
    assert _refused(path, tmp_path, capsys).endswith(
        "config.json says num_hidden_layers = 2 but the files hold model.layers.2.input_layernorm.weight "
        "(and 37 more), which that model lacks: fix num_hidden_layers"
    )


@pytest.mark.parametrize(
    "extra, said",
    [
        (
            {},
            "config.json says num_hidden_layers = 2 but the files hold model.layers.2.input_layernorm.weight "
            "(and 8 more), which that model lacks: fix num_hidden_layers",
        ),
        (
            {"model.layers.0.mlp.extra.weight": torch.ones(4, 64)},
            "its files hold model.layers.0.mlp.extra.weight, which the model config.json describes does not "
            "have: correct config.json to the model the weights are, or remove those tensors",
        ),
    ],
    ids=["layer", "unknown"],
)
def test_a_llama_tensor_its_config_lacks_is_refused(tmp_path, capsys, extra, said):
    path = tmp_path / "hf"
    _hf_llama().save_pretrained(path)
    if extra:
        save_file(load_file(path / "model.safetensors") | extra, path / "model.safetensors")
    else:
        _set(path, num_hidden_layers=2)
    assert _refused(path, tmp_path, capsys) == f"seedckpt convert: error: {path}: {said}"


def test_qwen3_moe_experts_past_num_experts_are_refused(tmp_path, capsys):
    path = _set(_hf_moe("qwen3_moe", tmp_path / "hf"), num_experts=2)
    assert _refused(path, tmp_path, capsys).endswith(
        "config.json says num_experts = 2 but the files hold model.layers.0.mlp.experts.2.down_proj.weight "
        "(and 11 more), which that model lacks: fix num_experts"
    )
