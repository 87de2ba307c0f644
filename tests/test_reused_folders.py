"""A ``checkpoint.folder`` holding another job's steps (issue 46 item 11): a pretraining run started from
another seed of the same architecture, or a run of another model shape, is refused in one line naming
the difference and advising a folder of its own -- never to continue the other job (raise
training.steps, use its config). The folder's ``step-N`` here is the debug seed copied in, with the
job record a training run writes (``find_start`` opens it as it opens a real one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from seedckpt.checkpoint import MANIFEST_NAME
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.materialize.start import START_KEY, find_start, start_identity
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
from tests.test_resume import train


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory) -> Path:
    """The debug model drawn with seed 1: the same architecture, other weights."""
    path = tmp_path_factory.mktemp("seeds") / "seed1"
    create_seed_checkpoint(tiny_config(), path, seed=1, progress=False, workers=2)
    return path


def _config(folder: Path, seed: Path, *more: str):
    return tiny_config("--checkpoint.folder", str(folder), "--checkpoint.seed_checkpoint", str(seed), *more)


def _folder_of(tmp_path: Path, seed: Path, step: int = 8) -> Path:
    """A folder holding ``step-<step>`` of a pretraining run started from ``seed``."""
    folder = tmp_path / "ckpt"
    step_dir = shutil.copytree(seed, folder / f"step-{step}")
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    job = {"finetune": {"mode": "none", "pretrained": ""}, START_KEY: start_identity(_config(folder, seed))}
    (step_dir / MANIFEST_NAME).write_text(json.dumps({**manifest, "kind": "train", "step": step, **job}))
    return folder


def _refusal(cfg) -> str:
    with pytest.raises(SeedckptError) as refused:
        find_start(cfg, cfg.model_args())
    message = str(refused.value)
    assert "\n" not in message and message.endswith(
        "give this run a checkpoint.folder of its own (or move those steps away to start this job there)"
    ), message
    return message


def test_a_pretraining_folder_of_another_seed_is_refused_before_any_advice_to_continue(
    tmp_path, debug_seed, other_seed
):
    """step-8 of a run from seed 0; this run starts from seed 1 with 4 steps: named as another job
    (not "raise training.steps to continue this run")."""
    folder = _folder_of(tmp_path, debug_seed)
    message = _refusal(_config(folder, other_seed, "--training.steps", "4"))
    assert message.startswith(
        f"checkpoint.folder = {folder} holds step-8 of another job (started from {debug_seed}, this run from "
        f"{other_seed}, whose weights differ)"
    ), message


def test_the_same_seed_moved_or_drawn_directly_resumes(tmp_path, debug_seed):
    folder = _folder_of(tmp_path, debug_seed)
    moved = shutil.copytree(debug_seed, tmp_path / "moved")
    assert find_start(_config(folder, moved, "--training.steps", "9"), tiny_config().model_args()).step == 8
    direct = tiny_config(
        "--checkpoint.folder", str(folder), "--training.steps", "9", "--checkpoint.init_from", "direct"
    )
    assert find_start(direct, tiny_config().model_args()).step == 8
    # this job's own step beyond its steps: the advice to raise them is right
    with pytest.raises(SeedckptError, match=r"step-8 is beyond training.steps = 4; raise training.steps"):
        find_start(_config(folder, debug_seed, "--training.steps", "4"), tiny_config().model_args())


def test_a_folder_of_another_model_shape_is_another_job(tmp_path, debug_seed):
    folder = _folder_of(tmp_path, debug_seed)
    cfg = _config(folder, debug_seed, "--training.steps", "9", "--model.n_layers", "4")
    message = _refusal(cfg)
    assert "holds step-8 of another job (another model: n_layers 6, this run's 4)" in message, message
    assert "use the config it was made with" not in message


def test_a_real_run_records_its_seed_and_another_seed_is_refused_writing_nothing(tmp_path, debug_seed, other_seed):
    """train.py from seed 0 saves step-1 with the seed's identity; train.py from seed 1 into the same
    folder stops in one line, the folder as it was."""
    run = tmp_path / "run"
    first = train(
        run, debug_seed, "--training.steps", "2", "--checkpoint.interval", "1", "--training.stop_after_step", "1"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((run / "ckpt" / "step-1" / MANIFEST_NAME).read_text())
    assert manifest[START_KEY]["from"] == str(debug_seed)
    before = sorted(p.name for p in (run / "ckpt").iterdir())
    proc = train(run, other_seed, "--training.steps", "2", "--checkpoint.interval", "1")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"holds step-1 of another job (started from {debug_seed}, this run from {other_seed}" in err, err
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == before
