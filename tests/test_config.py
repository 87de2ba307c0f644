"""Config loading: TOML < command line, typed values, model overrides, clear errors."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from seedckpt.config.job_config import JobConfig, check_output_folders, config_reference, load_config, parse_overrides
from seedckpt.config.resolve import resolve
from seedckpt.utils.errors import SeedckptError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,world_size", [("debug", 4), ("llama3_1b", 8), ("llama3_8b", 16), ("llama3_70b", 64)])
def test_shipped_configs_are_valid_training_layouts(name, world_size):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert f"--world-size {world_size}" in (REPO / "configs" / f"{name}.toml").read_text() or name == "debug"
    dims = resolve(cfg, world_size).dims  # what train.py checks before rendezvous
    assert dims.pp * dims.dp == world_size


def test_command_line_overrides_toml_with_types(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[training]\nsteps = 5\nlr = 1\n[model]\nflavor = "8B"\nn_layers = 4\n'
        '[parallelism]\npipeline_parallel_split_points = ["layers.2"]\n'
    )
    cfg = load_config(
        path, ["--training.steps", "7", "--parallelism.pipeline_parallel_degree=2", "--model.rope_theta", "10000"]
    )
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
        ("parallelism", "pipeline_parallel_split_points", "layers.2,layers.4")
    ]
    cfg = load_config(None, ["--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"])
    assert cfg.parallelism.pipeline_parallel_split_points == ["layers.2", "layers.4"]


@pytest.mark.parametrize(
    "text,message",
    [
        ("[trainig]\nsteps = 1\n", "unknown section [trainig] (did you mean 'training'?)"),
        ("[training]\nsteps = '1'\n", "training.steps expects int, got '1'"),
        ("[training]\nsteps = true\n", "training.steps expects int, got True"),
        ("[model]\nn_layer = 2\n", "unknown key model.n_layer (did you mean 'n_layers'?)"),
        ("[model]\nn_heads = 3\n", "invalid [model] settings"),
        ("steps = 3\n", "top-level key 'steps' must be a [section]"),
        ("[training\n", "is not valid TOML"),
    ],
)
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


def _refused(tmp_path, toml: str = "", overrides=()) -> str:
    """The message load_config gives for a TOML text plus command-line overrides it must refuse."""
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(SeedckptError) as err:
        load_config(path, list(overrides))
    return str(err.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--training.lr", "-1"], "training.lr = -1.0; it must be a finite number > 0"),
        (["--training.lr", "0"], "training.lr = 0.0; it must be a finite number > 0"),
        (["--training.lr", "nan"], "training.lr = nan; it must be a finite number > 0"),
        (["--training.lr", "inf"], "training.lr = inf; it must be a finite number > 0"),
        (["--training.warmup_steps", "-1"], "training.warmup_steps = -1; it must be >= 0"),
        (["--training.max_norm", "-0.5"], "training.max_norm = -0.5; it must be a finite number >= 0"),
        (["--training.max_norm", "nan"], "training.max_norm = nan; it must be a finite number >= 0"),
        (["--training.stop_after_step", "-3"], "training.stop_after_step = -3; it must be >= 0"),
        (["--training.steps", "0"], "training.steps = 0; it must be >= 1"),
        (["--training.local_batch_size", "0"], "training.local_batch_size = 0; it must be >= 1"),
        (["--training.seq_len", "-8"], "training.seq_len = -8; it must be >= 1"),
        (["--training.global_batch_size", "0"], "training.global_batch_size = 0; it must be >= 1, or -1"),
        (["--checkpoint.interval", "-1"], "checkpoint.interval = -1; it must be >= 0"),
        (["--checkpoint.keep_latest_k", "-2"], "checkpoint.keep_latest_k = -2; it must be >= 0"),
        (["--metrics.log_freq", "0"], "metrics.log_freq = 0; it must be >= 1"),
        (
            ["--activation_checkpoint.selective_every", "0"],
            "activation_checkpoint.selective_every = 0; it must be >= 1",
        ),
        (["--parallelism.pipeline_parallel_degree", "0"], "parallelism.pipeline_parallel_degree = 0; it must be >= 1"),
        (
            ["--parallelism.data_parallel_shard_degree", "-2"],
            "parallelism.data_parallel_shard_degree = -2; it must be >= 1, or -1",
        ),
        (
            ["--parallelism.pipeline_parallel_stages_per_rank", "0"],
            "parallelism.pipeline_parallel_stages_per_rank = 0; it must be >= 1",
        ),
        (
            ["--parallelism.pipeline_parallel_microbatches", "0"],
            "parallelism.pipeline_parallel_microbatches = 0; it must be >= 1, or -1",
        ),
        (["--finetune.osft_unfreeze_rank_ratio", "0"], "finetune.osft_unfreeze_rank_ratio = 0.0; it must be in (0, 1]"),
        (
            ["--finetune.osft_unfreeze_rank_ratio", "nan"],
            "finetune.osft_unfreeze_rank_ratio = nan; it must be in (0, 1]",
        ),
        (["--profiling.steps", "3,x"], "profiling.steps = ['3', 'x']; it must be a list of step numbers >= 1"),
    ],
)
def test_out_of_range_values_are_refused_with_the_key(tmp_path, overrides, message):
    assert message in _refused(tmp_path, overrides=overrides)


def test_range_checks_see_toml_values_and_the_overrides_that_replace_them(tmp_path):
    assert "training.lr = nan" in _refused(tmp_path, "[training]\nlr = nan\n")
    assert "training.lr = inf" in _refused(tmp_path, "[training]\nlr = inf\n")
    assert "training.warmup_steps = -1" in _refused(tmp_path, "[training]\nwarmup_steps = -1\n")
    path = tmp_path / "job.toml"
    path.write_text("[training]\nlr = -1.0\n")
    assert load_config(path, ["--training.lr", "0.01"]).training.lr == 0.01  # validated after the override


def test_zero_means_off_where_the_trainer_says_so():
    cfg = load_config(
        None,
        [
            "--training.max_norm",
            "0",
            "--training.warmup_steps",
            "0",
            "--checkpoint.interval",
            "0",
            "--checkpoint.keep_latest_k",
            "0",
            "--training.global_batch_size",
            "-1",
        ],
    )
    assert (cfg.training.max_norm, cfg.checkpoint.interval, cfg.checkpoint.keep_latest_k) == (0.0, 0, 0)


@pytest.mark.parametrize("schedule", ["PipelineScheduleSingle", "PipelineScheduleMulti", "Sideways", "1f1b"])
def test_only_runnable_pipeline_schedules_are_accepted(tmp_path, schedule):
    message = _refused(tmp_path, overrides=["--parallelism.pipeline_parallel_schedule", schedule])
    assert (
        f"parallelism.pipeline_parallel_schedule = {schedule!r}; this version supports GPipe, 1F1B, "
        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"
    ) in message
    assert "PipelineScheduleSingle, " not in message


def test_every_runnable_schedule_is_one_torch_knows():
    """The Literal names what train.py hands to torch's get_schedule_class, exactly as spelled."""
    import typing

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from seedckpt.config.job_config import PipelineSchedule

    for name in typing.get_args(PipelineSchedule):
        schedule = get_schedule_class(name)
        assert schedule.__name__.endswith(name) and schedule is not PipelineScheduleSingle


@pytest.mark.parametrize(
    "toml,overrides,message",
    [
        (
            '[activation_checkpoint]\nmode = "some"\n',
            [],
            "job.toml: activation_checkpoint.mode = 'some'; this version supports none, full, selective",
        ),
        ("[activation_checkpoint]\nmode = 1\n", [], "activation_checkpoint.mode = 1; this version supports none, full"),
        (
            "",
            ["--activation_checkpoint.mode", "Full"],
            "command line: activation_checkpoint.mode = 'Full'; this version supports none, full, selective",
        ),
        (
            '[training]\nmixed_precision_param = "fp8"\n',
            [],
            "training.mixed_precision_param = 'fp8'; this version supports float32, bfloat16, float16",
        ),
        (
            "",
            ["--parallelism.fsdp_impl", "fsdp3"],
            "parallelism.fsdp_impl = 'fsdp3'; this version supports fsdp2, manual",
        ),
        ("", ["--parallelism.fsdp_reshard_after_forward", "sometimes"], "this version supports default, always, never"),
        ("", ["--data.kind", "json"], "data.kind = 'json'; this version supports synthetic, text, tokens, chat"),
        ("", ["--data.overflow", "wrap"], "data.overflow = 'wrap'; this version supports truncate, drop"),
        (
            "",
            ["--checkpoint.init_from", "random"],
            "checkpoint.init_from = 'random'; this version supports seed_checkpoint, direct",
        ),
        ("", ["--finetune.mode", "lora"], "finetune.mode = 'lora'; this version supports none, sft, osft"),
    ],
)
def test_choices_are_checked_from_toml_and_command_line(tmp_path, toml, overrides, message):
    assert message in _refused(tmp_path, toml, overrides)


def test_choices_are_accepted_from_toml_and_command_line(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[activation_checkpoint]\nmode = "full"\n[data]\nkind = "text"\n')
    cfg = load_config(path, ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    assert (cfg.activation_checkpoint.mode, cfg.data.kind) == ("full", "text")
    assert cfg.parallelism.pipeline_parallel_schedule == "ZBVZeroBubble"


def test_chat_data_needs_a_tokenizer():
    with pytest.raises(SeedckptError, match="data.kind = 'chat' needs data.tokenizer"):
        load_config(None, ["--data.kind", "chat"])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_passes_validation(path):
    """A template whose header says to pass --data.tokenizer gets one, as its users do; one that
    pretrains also fits its model and a world of its degrees (the layout, a sliding window)."""
    from seedckpt.config.resolve import default_world_size, resolve

    cfg = load_config(path, ["--data.tokenizer", "tok"] if "--data.tokenizer" in path.read_text() else [])
    if cfg.finetune.mode == "none":
        resolve(cfg, default_world_size(cfg) * 2, local_world_size=0)


def test_output_folders_are_created_and_probed(tmp_path):
    cfg = load_config(
        None, ["--checkpoint.folder", str(tmp_path / "a" / "ckpt"), "--job.dump_folder", str(tmp_path / "b")]
    )
    check_output_folders(cfg)
    assert (tmp_path / "a" / "ckpt").is_dir() and (tmp_path / "b").is_dir()
    assert not any((tmp_path / "a" / "ckpt").iterdir()) and not any((tmp_path / "b").iterdir())  # probe deleted


def test_output_folder_with_a_file_in_the_way(tmp_path):
    (tmp_path / "taken").write_text("")
    cfg = load_config(None, ["--checkpoint.folder", str(tmp_path / "taken"), "--job.dump_folder", str(tmp_path)])
    with pytest.raises(SeedckptError) as err:
        check_output_folders(cfg)
    assert f"checkpoint.folder = {tmp_path / 'taken'}: cannot write there (a file is in the way)" in str(err.value)
    cfg = load_config(None, ["--checkpoint.folder", str(tmp_path), "--job.dump_folder", str(tmp_path / "taken" / "x")])
    with pytest.raises(SeedckptError, match=r"job.dump_folder = .*: cannot write there \(Not a directory\)"):
        check_output_folders(cfg)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_folder_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        cfg = load_config(None, ["--checkpoint.folder", str(tmp_path), "--job.dump_folder", str(locked)])
        with pytest.raises(SeedckptError) as err:
            check_output_folders(cfg)
    finally:
        locked.chmod(0o700)
    assert f"job.dump_folder = {locked}: cannot write there (Permission denied); choose a writable directory" in str(
        err.value
    )


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig) if not f.name.startswith("_")}


@pytest.mark.parametrize("section", _sections())
def test_every_config_key_has_a_doc(section):
    """--help prints these (config_reference): a key added without one fails here."""
    cls = _sections()[section]
    assert cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(")  # its own, not dataclass's signature
    for f in dataclasses.fields(cls):
        assert f.metadata.get("doc", "").strip(), f"{section}.{f.name} has no doc: declare it with option(default, doc)"
        assert "\n" not in f.metadata["doc"]


def test_config_reference_shows_type_choices_default_and_doc():
    reference = config_reference()
    assert re.search(r"^  steps = 10 +\(int\) optimizer steps", reference, re.MULTILINE)
    assert re.search(
        r'^  mixed_precision_param = "float32" +\("float32" \| "bfloat16" \| "float16"\) dtype', reference, re.MULTILINE
    )
    assert re.search(r"^  verify_checksums = true +\(bool\)", reference, re.MULTILINE)
    assert "overrides" not in reference and "given =" not in reference  # filled by the loader, not keys


def test_a_loaded_config_is_frozen(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nn_layers = 4\n[finetune]\nosft_target_patterns = ["attention.wq"]\n')
    cfg = load_config(path, ["--training.steps", "3"])
    for section in _sections():
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, section, getattr(cfg, section))
        for f in dataclasses.fields(getattr(cfg, section)):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(getattr(cfg, section), f.name, getattr(getattr(cfg, section), f.name))
    with pytest.raises(TypeError):
        cfg.model.overrides["n_layers"] = 8  # a read-only mapping
    assert dict(cfg.model.overrides) == {"n_layers": 4} and cfg.model.given == frozenset({"n_layers"})
    assert cfg.model_args().n_layers == 4 and cfg.training.steps == 3


def test_loading_twice_shares_nothing():
    """Defaults are built per config: what one load sets is not in the next one."""
    first = load_config(None, ["--model.n_layers", "2", "--profiling.steps", "3"])
    second = load_config(None)
    assert (dict(second.model.overrides), second.model.given, second.profiling.steps) == ({}, frozenset(), [])
    assert first.profiling.steps is not second.profiling.steps
