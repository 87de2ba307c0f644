"""Hugging Face directories that lied or leaked (issue 46 item 11): an index that is not a JSON object,
weights only as ``pytorch_model.bin``, a DeepSeek-V3 ``first_k_dense_replace`` that leaves no layer a
mixture of experts (read as ``transformers`` builds it, with a line), and gpt-oss fields set to null
that ``transformers`` refuses (a null ``head_dim`` was read as ``hidden_size // heads``)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from models.deepseek_v3.hf import args_from_config as deepseek_args
from models.gpt_oss import NOT_NULL
from models.gpt_oss import args_from_config as gpt_oss_args
from seedckpt.cli.main import main as cli

transformers = pytest.importorskip("transformers")

from tests.test_deepseek_v3 import TINY_FIELDS  # noqa: E402 (needs transformers)
from tests.test_gpt_oss import hf_config as gpt_oss_config  # noqa: E402
from tests.test_gpt_oss import hf_model as gpt_oss_model  # noqa: E402


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_an_index_that_is_not_an_object_and_pickled_weights_are_refused_in_one_line(tmp_path, capsys):
    model = gpt_oss_model(tmp_path / "model")
    capsys.readouterr()  # transformers' progress bar
    listed = shutil.copytree(model, tmp_path / "listed")
    (listed / "model.safetensors.index.json").write_text(json.dumps(["model.safetensors"]))
    assert cli(["inspect", str(listed)]) == 2
    err = _error(capsys)
    assert "holds a JSON list, not a safetensors index" in err and "TypeError" not in err, err

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(model / "config.json", pickled)
    torch.save(load_file(model / "model.safetensors"), pickled / "pytorch_model.bin")
    assert cli(["convert", str(pickled), str(tmp_path / "out"), "--to", "dcp", "--quiet"]) == 2
    err = _error(capsys)
    assert "holds its weights as pytorch_model.bin" in err and "only safetensors are read" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dense", [3, 5])
def test_first_k_dense_replace_past_the_layers_reads_a_dense_model_with_a_line(dense):
    """transformers builds every layer dense there (``layer_idx >= first_k_dense_replace`` never holds)."""
    hf = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**(TINY_FIELDS | {"first_k_dense_replace": dense}))
    )
    assert not any(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    config = {**TINY_FIELDS, "first_k_dense_replace": dense}
    with pytest.warns(UserWarning, match=rf"first_k_dense_replace = {dense}, not below num_hidden_layers = 3"):
        args = deepseek_args(config)
    assert args.moe_layers == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert deepseek_args(TINY_FIELDS).moe_layers == (1, 2)  # a model with experts: no line


@pytest.mark.parametrize("field", NOT_NULL)
def test_a_gpt_oss_field_transformers_refuses_as_null_is_refused(field):
    config = {**gpt_oss_config().to_dict(), field: None}
    with pytest.raises(Exception):  # noqa: B017 -- huggingface_hub's validation error is no ValueError
        transformers.GptOssConfig(**config)
    with pytest.raises(ValueError, match=rf"config.json has {field} = null, which transformers' GptOssConfig refuses"):
        gpt_oss_args(config)
