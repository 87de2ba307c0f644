"""What a run loads and leaves: ``checkpoint.load_step``, ``exclude_from_loading``,
``initial_load_path`` and ``export_at_end``. Each test fails if its key is ignored. One process
(``python train.py``), real DCP checkpoints: the module's 4-step run (steps 2 and 4 saved) is the
reference."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from seedckpt.checkpoint import MANIFEST_NAME, DcpCheckpoint
from seedckpt.config.job_config import load_config
from seedckpt.config.resolve import resolve
from seedckpt.data.sources import keyed_generator
from seedckpt.materialize.start import CONFIG_CRC_KEY, config_crc
from tests.test_resume import BASE, REPO, finished, rows, train, train_in_process  # noqa: F401 (fixture)

WQ = "layers.0.attention.wq.weight"


def copied(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def saved(step, *keys: str) -> dict:
    """Training-state items (non-tensor or tensor) of ``step``, as a resume reads them."""
    have = DcpCheckpoint(step).tensors()
    state = {k: torch.empty(have[k].shape, dtype=have[k].dtype) if k in have else None for k in keys}
    DcpCheckpoint(step).load(state)
    return state


def test_load_step_resumes_that_step_and_replaces_the_newer_one_bitwise(finished, tmp_path, debug_seed):
    run = copied(finished, tmp_path)
    before = rows(run)
    proc = train(run, debug_seed, "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {run / 'ckpt' / 'step-2'}" in proc.stdout, proc.stdout
    assert "also holds the newer step-4; this run replaces each" in proc.stdout, proc.stdout
    assert rows(run)[2]["loss"] == before[2]["loss"] and rows(run)[3]["loss"] == before[3]["loss"]
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-4"]  # pruned up to the step saved


def test_a_load_step_that_is_not_there_is_one_line(finished, tmp_path, debug_seed):
    run = copied(finished, tmp_path)
    proc = train(run, debug_seed, "--checkpoint.load_step", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"train.py: error: checkpoint.load_step = 3: {run / 'ckpt'} holds no step-3 (it holds step-2, step-4); "
        "choose one of those, or -1 for the newest"
    )


@pytest.mark.parametrize("excluded", [("optimizer", "data"), ("lr_scheduler", "rng")])
def test_exclude_from_loading_starts_those_parts_afresh_and_loads_the_rest(finished, tmp_path, debug_seed, excluded):
    """Resumed at step 2, each part either starts afresh or continues where the reference is."""
    run = copied(finished, tmp_path)
    before = rows(run)
    proc = train(
        run, debug_seed, "--checkpoint.load_step", "2", "--checkpoint.exclude_from_loading", ",".join(excluded)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not loaded from" in proc.stdout and all(f"{part} (" in proc.stdout for part in excluded), proc.stdout
    reference = saved(finished / "ckpt" / "step-4", f"optimizer.state.{WQ}.step", "train_state.data_start", "rng.rank0")
    got = saved(run / "ckpt" / "step-4", f"optimizer.state.{WQ}.step", "train_state.data_start", "rng.rank0")
    after = rows(run)

    adam_steps = got[f"optimizer.state.{WQ}.step"].item()
    assert adam_steps == (2 if "optimizer" in excluded else 4)  # a fresh AdamW counts from 0, not 1

    warmup_start = 3e-3 / 4  # configs/debug.toml: warmup_steps 3, so the schedule's first step is lr / 4
    assert (after[2]["lr"] == warmup_start) == ("lr_scheduler" in excluded)
    if "lr_scheduler" not in excluded:
        assert [r["lr"] for r in after] == [r["lr"] for r in before]

    assert got["train_state.data_start"] == (2 if "data" in excluded else 0)
    if "optimizer" not in excluded and "data" not in excluded:
        assert [r["loss"] for r in after] != [r["loss"] for r in before]  # the schedule alone differs

    derived = keyed_generator("seedckpt-rng", 0, "rng.rank0", 2).get_state()
    assert torch.equal(got["rng.rank0"], derived if "rng" in excluded else reference["rng.rank0"])
    assert not torch.equal(derived, reference["rng.rank0"])


def test_initial_load_path_takes_another_runs_weights_at_step_zero(finished, tmp_path, debug_seed):
    run = tmp_path / "new"
    step4 = finished / "ckpt" / "step-4"
    proc = train(
        run,
        debug_seed,
        "--checkpoint.initial_load_path",
        str(step4),
        "--training.lr",
        "1e-12",  # a step that barely moves: the weights saved at step 1 are the start's
        "--training.steps",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"starting from the weights of {step4} (step 0)" in proc.stdout, proc.stdout
    start, seed = DcpCheckpoint(step4).read_tensor(WQ), DcpCheckpoint(debug_seed).read_tensor(WQ)
    trained = DcpCheckpoint(run / "ckpt" / "step-1").read_tensor(WQ)
    torch.testing.assert_close(trained, start, rtol=0, atol=1e-6)
    assert (trained - seed).abs().max() > 1e-3


def test_initial_load_path_with_its_train_state_continues_another_runs_steps_bitwise(finished, tmp_path, debug_seed):
    run = tmp_path / "new"
    proc = train(
        run,
        debug_seed,
        "--checkpoint.initial_load_path",
        str(finished / "ckpt" / "step-2"),
        "--checkpoint.initial_load_model_only",
        "false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing the train state of" in proc.stdout, proc.stdout
    assert [r["step"] for r in rows(run)] == [3, 4]
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in rows(finished)[2:]]
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-4"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--checkpoint.load_step", "0"], "checkpoint.load_step = 0; it must be >= 1, or -1"),
        (["--checkpoint.exclude_from_loading", "weights"], "this version supports optimizer, lr_scheduler"),
        (
            ["--checkpoint.initial_load_path", "x", "--finetune.mode", "sft", "--finetune.pretrained", "x"],
            "both name the weights a run starts from",
        ),
        (
            ["--validation.enabled", "true", "--parallelism.pipeline_parallel_degree", "2"]
            + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "torch 2.13 cannot run that schedule forward only",
        ),
        (["--validation.enabled", "true", "--data.kind", "text"], "validation.enabled needs validation.path"),
        (["--training.loss_chunk_tokens", "-2"], "training.loss_chunk_tokens = -2; it must be >= 0, or -1"),
    ],
)
def test_load_settings_are_refused_before_any_rendezvous(tmp_path, debug_seed, capsys, monkeypatch, overrides, message):
    monkeypatch.chdir(REPO)
    assert train_in_process(tmp_path / "run", debug_seed, *overrides) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_seed_as_initial_load_path_that_is_not_a_step_cannot_continue_a_train_state(
    tmp_path, debug_seed, capsys, monkeypatch
):
    monkeypatch.chdir(REPO)
    overrides = ["--checkpoint.initial_load_path", str(debug_seed), "--checkpoint.initial_load_model_only", "false"]
    assert train_in_process(tmp_path / "run", debug_seed, *overrides) == 2
    err = capsys.readouterr().err
    assert "is not a step-N written by train.py" in err and "initial_load_model_only = true" in err, err


def test_export_at_end_writes_the_last_step_as_hugging_face_beside_it(finished, tmp_path, debug_seed):
    from safetensors import safe_open

    from seedckpt.cli.convert import diff

    run = copied(finished, tmp_path)
    proc = train(run, debug_seed, "--training.steps", "5", "--checkpoint.export_at_end", "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = run / "ckpt" / "step-5-hf"
    assert f"exported {exported}" in proc.stdout, proc.stdout
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-2", "step-4", "step-5", "step-5-hf"]
    assert (exported / "config.json").is_file()
    with safe_open(str(exported / "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16  # checkpoint.export_dtype's default
    equal, report = diff(run / "ckpt" / "step-5", exported, atol=1e-2)  # bf16 rounding only
    assert equal, report


def wandb_history(run_dir: Path) -> tuple[str, list[dict]]:
    """The run id and logged rows of an offline W&B run, read from its ``run-<id>.wandb`` file:
    a 7-byte header, then LevelDB-log records (checksum, length, type) in 32 KiB blocks, each a
    protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data, pos, block, chunk, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return path.stem.removeprefix("run-"), rows


def test_wandb_logs_every_step_offline_and_a_resume_continues_the_same_run(tmp_path, debug_seed, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    wandb = ["--metrics.wandb", "true", "--metrics.wandb_project", "tests", "--metrics.wandb_run_name", "first"]
    assert train(run, debug_seed, *wandb, "--training.stop_after_step", "2").returncode == 0
    assert train(run, debug_seed, *wandb).returncode == 0
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    (first_id, first), (second_id, second) = (wandb_history(r) for r in runs)
    assert first_id == second_id == (run / "wandb_run_id").read_text().strip()
    assert [r["_step"] for r in first + second] == [1, 2, 3, 4]
    assert [r["loss"] for r in first + second] == [r["loss"] for r in rows(run)]


def test_mlflow_logs_every_step_to_a_local_store_and_a_resume_continues_the_same_run(tmp_path, debug_seed):
    """A real MLflow tracking store (SQLite in the dump folder): every step's loss as a metric of one
    run, the config as its parameters; the resumed run continues that run."""
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    mlflow = ["--metrics.mlflow", "true", "--metrics.mlflow_experiment", "tests"]
    assert train(run, debug_seed, *mlflow, "--training.stop_after_step", "2").returncode == 0
    assert train(run, debug_seed, *mlflow).returncode == 0
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    [logged] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert logged.info.run_id == (run / "mlflow_run_id").read_text().strip() and logged.info.status == "FINISHED"
    assert logged.info.run_name == "run" and logged.data.params["training.steps"] == str(len(rows(run)))
    history = client.get_metric_history(logged.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in rows(run)]


def test_a_folder_holding_another_jobs_steps_is_refused_in_one_line(tmp_path, debug_seed, finished):
    """An SFT job's folder, reused by an SFT of another pretrained model and by an OSFT of the same
    one: each refuses, naming the difference, rather than resuming those weights (or, at its step
    count, reporting nothing to train)."""
    run = tmp_path / "sft"
    sft = ["--finetune.mode", "sft", "--training.steps", "2", "--training.stop_after_step", "1"]
    first = train(run, debug_seed, *sft, "--finetune.pretrained", str(finished / "ckpt" / "step-2"))
    assert first.returncode == 0, first.stderr[-3000:]
    for other, difference in (
        (["--finetune.pretrained", str(debug_seed)], f"this run from {debug_seed}, whose weights differ"),
        (["--finetune.mode", "osft", "--finetune.pretrained", str(finished / "ckpt" / "step-2")], "this run's 'osft'"),
    ):
        proc = train(run, debug_seed, *sft, *other, "--training.steps", "1")  # at its step: "nothing to train"?
        assert proc.returncode == 2, proc.stdout + proc.stderr
        err = proc.stderr.strip()
        assert err.startswith(f"train.py: error: checkpoint.folder = {run / 'ckpt'} holds step-1 of another job")
        assert difference in err and "a checkpoint.folder of its own" in err and len(err.splitlines()) == 1, err
    moved = tmp_path / "moved"  # the same pretrained source, moved: the same job
    shutil.copytree(finished / "ckpt" / "step-2", moved)
    again = train(run, debug_seed, *sft[:-2], "--finetune.pretrained", str(moved))
    assert again.returncode == 0 and "resuming from" in again.stdout, again.stdout + again.stderr


def _hf_debug_llama(path: Path, seed: int) -> Path:
    """A random LlamaForCausalLM of the debug flavor's shape (seed ``seed``), saved by transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def test_a_fine_tune_of_another_model_of_the_same_architecture_does_not_resume_its_steps(tmp_path, debug_seed):
    """Model A, a random HF Llama, fine-tuned into a folder; then model B, drawn with another seed
    (the same config.json, byte for byte): refused in one line naming both, nothing written. A
    again, moved elsewhere: the same job, resumed. (DCP sources: the test above, and
    ``test_job_identity``.)"""
    a, b = (_hf_debug_llama(tmp_path / f"hf{seed}", seed) for seed in (0, 1))
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    run = tmp_path / "sft"
    sft = ["--finetune.mode", "sft", "--training.steps", "2", "--checkpoint.interval", "1"]
    first = train(run, debug_seed, *sft, "--training.stop_after_step", "1", "--finetune.pretrained", str(a))
    assert first.returncode == 0, first.stderr[-3000:]
    before = _listing(run)
    proc = train(run, debug_seed, *sft, "--finetune.pretrained", str(b))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"train.py: error: checkpoint.folder = {run / 'ckpt'} holds step-1 of another job (fine-tuned from {a}, "
        f"this run from {b}, whose weights differ); give this run a checkpoint.folder of its own (or move those "
        "steps away to start this job there)"
    )
    assert _listing(run) == before
    moved = shutil.copytree(a, tmp_path / "moved")
    again = train(run, debug_seed, *sft, "--finetune.pretrained", str(moved))
    assert again.returncode == 0 and f"resuming from {run / 'ckpt' / 'step-1'}" in again.stdout, again.stdout
    # A step-N of an older version records only its source's config CRC, which B shares: B resumes
    # it (refusing would strand runs interrupted across the upgrade), and the log says so.
    step = run / "ckpt" / "step-2"
    manifest = json.loads((step / MANIFEST_NAME).read_text())
    manifest["finetune"] = {"mode": "sft", "pretrained": str(a), CONFIG_CRC_KEY: config_crc(a)}
    (step / MANIFEST_NAME).write_text(json.dumps(manifest))
    argv = ["--checkpoint.folder", str(run / "ckpt"), *BASE, *sft, "--finetune.pretrained", str(b)]
    legacy = resolve(load_config("configs/debug.toml", argv), 1).with_start()
    assert legacy.start.step == 2
    assert any("by its configuration only" in note for note in legacy.notes), legacy.notes


def test_a_resume_on_more_data_parallel_ranks_keeps_the_checkpoints_global_batch(finished, tmp_path, debug_seed):
    """One process's step-2 (global batch 2) resumed on 2 ranks with the same config: the global
    batch stays 2 (local batch 1), not 2 x 2, so steps 3-4 are the uninterrupted run's."""
    from tests.dist import run_main

    run = copied(finished, tmp_path)
    shutil.rmtree(run / "ckpt" / "step-4")
    argv = ["--config", "configs/debug.toml", "--checkpoint.seed_checkpoint", str(debug_seed)]
    argv += ["--checkpoint.folder", str(run / "ckpt"), "--job.dump_folder", str(run), *BASE]
    proc = run_main(argv, 2, {**os.environ, "OMP_NUM_THREADS": "1"}, REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "keeping step-2's global batch of 2 sequences on 2 data-parallel rank(s): local_batch_size 1 x 1 "
        "accumulation step(s)" in proc.stdout
    ), proc.stdout
    for got, want in zip(rows(run)[2:], rows(finished)[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_validation_loss_is_logged_at_its_frequency_and_agrees_across_layouts(tmp_path, debug_seed):
    """Held-out synthetic batches, forward only: every 2 steps and at the last, the same value (to
    1e-5) on one process and on pp 2 x dp_shard 2, where the last stages' sums are reduced."""
    from tests.test_train import torchrun

    validation = ["--validation.enabled", "true", "--validation.interval", "2", "--validation.steps", "2"]
    runs = {
        "one": (1, ["--parallelism.pipeline_parallel_degree", "1"]),
        "pp2_dp2": (4, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
    }
    logged = {}
    for name, (nproc, layout) in runs.items():
        proc = torchrun(tmp_path / name, debug_seed, nproc, *layout, *validation, "--training.steps", "5")
        assert "val_loss" in proc.stdout, proc.stdout
        logged[name] = {r["step"]: r["val_loss"] for r in rows(tmp_path / name) if "val_loss" in r}
    assert sorted(logged["one"]) == [2, 4, 5]
    for step, value in logged["one"].items():
        assert logged["pp2_dp2"][step] == pytest.approx(value, rel=1e-5)
    assert logged["one"][5] < logged["one"][2]  # the model learns the held-out motifs too


def test_checkpoint_enable_false_trains_and_saves_nothing(tmp_path, debug_seed):
    run = tmp_path / "run"
    proc = train(run, debug_seed, "--training.steps", "3", "--checkpoint.enable", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert not (run / "ckpt").exists() or not any((run / "ckpt").iterdir())


def test_checkpoint_enable_false_with_an_export_is_refused(tmp_path, debug_seed, capsys):
    code = train_in_process(
        tmp_path / "run", debug_seed, "--checkpoint.enable", "false", "--checkpoint.export_at_end", "hf"
    )
    assert code == 2
    assert (
        "checkpoint.export_at_end = 'hf'; it must be \"none\" while checkpoint.enable = false"
        in capsys.readouterr().err
    )


def test_keep_best_records_each_validated_steps_loss_and_keeps_the_lowest(tmp_path, debug_seed):
    run = tmp_path / "run"
    keep_best = ["--checkpoint.keep_best", "true", "--checkpoint.keep_latest_k", "1"]
    validation = ["--validation.enabled", "true", "--validation.interval", "2", "--validation.steps", "1"]
    proc = train(run, debug_seed, "--training.steps", "6", *keep_best, *validation)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = {r["step"]: r["val_loss"] for r in rows(run) if "val_loss" in r}
    best = min(logged, key=lambda step: (logged[step], step))
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == sorted({"step-6", f"step-{best}"})
    for step in {6, best}:  # each kept step records the loss logged for it
        manifest = json.loads((run / "ckpt" / f"step-{step}" / "seedckpt.json").read_text())
        assert manifest["val_loss"] == pytest.approx(logged[step])
    assert f"lowest validation loss: step-{best}, kept (checkpoint.keep_best)" in proc.stdout


def _fake_step(folder: Path, step: int, val_loss) -> None:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "seedckpt.json").write_text(
        json.dumps({"format": "seedckpt", **({"val_loss": val_loss} if val_loss else {})})
    )


def test_pruning_spares_the_step_with_the_lowest_recorded_validation_loss(tmp_path):
    from seedckpt.checkpoint import prune_steps

    for step, loss in {2: 3.0, 4: 1.5, 6: "NaN", 8: 2.5, 10: None}.items():
        _fake_step(tmp_path, step, float(loss) if loss else None)
    (tmp_path / "step-12").mkdir()  # unfinished: neither counted nor deleted
    (tmp_path / "step-12" / "seedckpt.json").write_text("{not json")
    assert prune_steps(tmp_path, 2, 10, keep_best=True) == 4  # the lowest recorded, finite loss
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-12", "step-4", "step-8"]
    assert prune_steps(tmp_path, 1, 10) is None  # without keep_best the best goes like any other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-12"]


def test_keep_best_without_a_validation_at_every_save_is_refused(tmp_path, debug_seed, capsys):
    code = train_in_process(tmp_path / "run", debug_seed, "--checkpoint.keep_best", "true")
    assert code == 2
    err = capsys.readouterr().err
    assert "checkpoint.keep_best keeps the saved step with the lowest validation loss" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_chunked_loss_trains_and_validates_like_the_whole_logits_on_pp2_x_dp_shard2_and_tp2(tmp_path, debug_seed):
    """``training.loss_chunk_tokens``: the last pipeline stage returns its loss computed 24 tokens at a
    time (FSDP2-sharded output projection, 1F1B schedule), training and validation, within 1e-5; and
    under tp2 x dp_shard2, where each chunk's logits are split by vocabulary (loss parallel)."""
    from tests.test_train import torchrun

    common = ["--training.steps", "4", "--checkpoint.enable", "false", "--training.local_batch_size", "4"]
    common += ["--validation.enabled", "true", "--validation.interval", "2", "--validation.steps", "1"]
    tp = ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.tensor_parallel_degree", "2"]
    for name, layout in (("pp2_dp2", []), ("tp2_dp2", tp)):
        torchrun(tmp_path / f"{name}_whole", debug_seed, 4, *common, *layout, "--training.loss_chunk_tokens", "0")
        torchrun(tmp_path / f"{name}_chunked", debug_seed, 4, *common, *layout, "--training.loss_chunk_tokens", "24")
        whole, chunked = rows(tmp_path / f"{name}_whole"), rows(tmp_path / f"{name}_chunked")
        assert [r["step"] for r in chunked] == [1, 2, 3, 4]
        for a, b in zip(chunked, whole):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), name
            assert ("val_loss" in a) == ("val_loss" in b) == (a["step"] in (2, 4))
            assert a.get("val_loss", 0.0) == pytest.approx(b.get("val_loss", 0.0), rel=1e-5)


def test_the_default_loss_chunks_only_logits_too_large_to_hold():
    """``training.loss_chunk_tokens = -1`` (the default): a 65 536 vocabulary's chunks are 512 tokens
    (128 MiB of float32 logits); a rank holding half the vocabulary under tp2 takes twice the tokens;
    a micro-batch whose logits fit is not chunked; an explicit value is kept."""
    from seedckpt.train.trainer import LOSS_CHUNK_BYTES, LOSS_CHUNK_BYTES_CUDA, loss_chunk_tokens

    assert loss_chunk_tokens(-1, 65536, 8192) == 512 == LOSS_CHUNK_BYTES // (4 * 65536)
    assert loss_chunk_tokens(-1, 65536 // 2, 8192) == 1024
    assert loss_chunk_tokens(-1, 512, 8 * 64) == 0
    assert loss_chunk_tokens(0, 65536, 8192) == 0 and loss_chunk_tokens(24, 512, 512) == 24
    assert loss_chunk_tokens(-1, 128256, 8192, LOSS_CHUNK_BYTES_CUDA) == 2092  # a GPU's: 1 GiB chunks
