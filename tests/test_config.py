"""Config loading: TOML < command line, typed values, model overrides, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from seedckpt.config import load_config, parse_overrides
from seedckpt.errors import SeedckptError
from seedckpt.parallel import ParallelDims

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,world_size", [("debug", 4), ("llama3_1b", 8), ("llama3_8b", 16), ("llama3_70b", 64)])
def test_shipped_configs_are_valid_training_layouts(name, world_size):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert f"--world-size {world_size}" in (REPO / "configs" / f"{name}.toml").read_text() or name == "debug"
    dims = ParallelDims.from_config(cfg, world_size)  # what train.py checks before rendezvous
    assert dims.pp * dims.dp == world_size


def test_command_line_overrides_toml_with_types(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[training]\nsteps = 5\nlr = 1\n[model]\nflavor = "8B"\nn_layers = 4\n'
                    '[parallelism]\npipeline_parallel_split_points = ["layers.2"]\n')
    cfg = load_config(path, ["--training.steps", "7", "--parallelism.pipeline_parallel_degree=2",
                             "--model.rope_theta", "10000"])
    assert cfg.training.steps == 7 and cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.parallelism.pipeline_parallel_degree == 2
    assert cfg.parallelism.pipeline_parallel_split_points == ["layers.2"]
    args = cfg.model_args()
    assert (args.dim, args.n_layers, args.rope_theta) == (4096, 4, 10000.0)
    assert args.rope_scaling is not None and args.rope_scaling.factor == 8.0


def test_rope_scaling_table_in_toml(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nflavor = "debug"\n[model.rope_scaling]\nfactor = 4.0\n')
    assert load_config(path).model_args().rope_scaling.factor == 4.0


def test_list_values_from_command_line():
    assert parse_overrides(["--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"]) == [
        ("parallelism", "pipeline_parallel_split_points", "layers.2,layers.4")]
    cfg = load_config(None, ["--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"])
    assert cfg.parallelism.pipeline_parallel_split_points == ["layers.2", "layers.4"]


@pytest.mark.parametrize("text,message", [
    ("[trainig]\nsteps = 1\n", "unknown section [trainig] (did you mean 'training'?)"),
    ("[training]\nsteps = '1'\n", "training.steps expects int, got '1'"),
    ("[training]\nsteps = true\n", "training.steps expects int, got True"),
    ("[model]\nn_layer = 2\n", "unknown key model.n_layer (did you mean 'n_layers'?)"),
    ("[model]\nn_heads = 3\n", "invalid [model] settings"),
    ("steps = 3\n", "top-level key 'steps' must be a [section]"),
    ("[training\n", "is not valid TOML"),
])
def test_bad_config_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SeedckptError, match=None) as err:
        load_config(path)
    assert message in str(err.value)


def test_override_without_value():
    with pytest.raises(SeedckptError, match="needs a value"):
        load_config(None, ["--training.steps"])
    with pytest.raises(SeedckptError, match="overrides look like --section.key value"):
        load_config(None, ["steps=3"])
