"""A checkpoint from someone else runs no code: a training-state entry of a real ``step-N``
pointed at a ``torch.save``d ``os.system`` payload is refused, never unpickled with every class
allowed, by the resume path, an SFT start and every command.

Two attackers: one who only re-records ``.metadata``'s checksum (the payload's item has no
checksum: refused when the checkpoint is opened), and one who forges the item's checksums too
(refused when the entry is read, by the weights-only unpickler)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from seedckpt.checkpoint import MANIFEST_NAME, DcpCheckpoint
from seedckpt.checkpoint.integrity import crc
from seedckpt.cli.main import main as cli
from seedckpt.utils.errors import SeedckptError
from tests.dist import run_main
from tests.test_resume import REPO, train

# One entry of each non-tensor kind a step-N holds, and the RNG state (a tensor read the stock way
# once its raw position is gone).
ITEMS = [
    "train_state.step",
    "train_state.samples_seen",
    "train_state.lr_scheduler.base_lrs",
    "optimizer.param_groups.norm.weight.betas",
    "rng.rank0",
]
PAYLOAD = "payload.distcp"


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EXPLOIT_MARKER']}",))


@pytest.fixture(scope="module")
def step(tmp_path_factory, debug_seed) -> Path:
    """A real 2-step run's ``step-2``."""
    run = tmp_path_factory.mktemp("untrusted") / "run"
    proc = train(run, debug_seed, "--training.steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "ckpt" / "step-2"


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    """The file the payload creates when it runs (also in subprocesses, through the environment)."""
    path = tmp_path / "pwned"
    monkeypatch.setenv("EXPLOIT_MARKER", str(path))
    return path


def craft(step: Path, to: Path, key: str, forge_checksums: bool) -> Path:
    """A copy of ``step`` whose ``key`` reads a new data file holding the payload, with ``.metadata``'s
    recorded checksum updated (and, with ``forge_checksums``, the payload's item and file recorded)."""
    shutil.copytree(step, to)
    buffer = io.BytesIO()
    torch.save(_Exploit(), buffer)
    payload = buffer.getvalue()
    (to / PAYLOAD).write_bytes(payload)
    metadata = DcpCheckpoint(to).metadata
    [index] = [i for i in metadata.storage_data if i.fqn == key]
    metadata.storage_data[index] = _StorageInfo(PAYLOAD, 0, len(payload))
    data = pickle.dumps(metadata)
    (to / ".metadata").write_bytes(data)
    manifest = json.loads((to / MANIFEST_NAME).read_text())
    checksums = manifest["checksums"]
    checksums["metadata"] = crc(data)
    if forge_checksums:
        checksums["items"][PAYLOAD] = [[0, len(payload), 0, len(payload), [crc(payload)]]]  # one piece
        checksums["files"][PAYLOAD] = len(payload)
    manifest.pop("raw_items")  # every item is read the stock way, the RNG tensor included
    (to / MANIFEST_NAME).write_text(json.dumps(manifest))
    return to


def test_the_payload_runs_under_a_plain_unpickler(step, tmp_path, marker):
    """The crafted file is a real exploit: stock ``torch.load`` with every class allowed runs it."""
    craft(step, tmp_path / "evil", "train_state.step", forge_checksums=True)
    torch.load(tmp_path / "evil" / PAYLOAD, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("key", ITEMS)
def test_an_item_without_a_recorded_checksum_is_refused_when_opened(step, tmp_path, marker, key):
    evil = craft(step, tmp_path / "evil", key, forge_checksums=False)
    with pytest.raises(SeedckptError, match=rf"no checksum recorded.*{key.replace('.', '[.]')} in {PAYLOAD}"):
        DcpCheckpoint(evil)
    with pytest.raises(SeedckptError, match="no checksum recorded"):
        DcpCheckpoint(evil, verify=False)  # checking reads off does not let it through
    assert not marker.exists()


@pytest.mark.parametrize("key", ITEMS)
def test_a_forged_item_is_refused_by_the_resume_read_path_without_running(step, tmp_path, marker, key):
    """The read the resume makes (``OpenedCheckpoint.load`` of the training state), item by item."""
    evil = DcpCheckpoint(craft(step, tmp_path / "evil", key, forge_checksums=True))
    wanted = torch.get_rng_state() if key.startswith("rng.") else None
    with pytest.raises(SeedckptError, match="is not plain data") as refused:
        evil.load({key: wanted})
    message = str(refused.value)
    assert "posix.system" in message and "weights_only" not in message, message
    assert not marker.exists()


@pytest.mark.parametrize("forge", [False, True])
def test_resume_from_a_crafted_step_stops_in_one_line_without_running(step, tmp_path, marker, debug_seed, forge):
    run = tmp_path / "run"
    craft(step, run / "ckpt" / "step-2", "train_state.step", forge_checksums=forge)
    proc = train(run, debug_seed, "--training.steps", "4")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert ("is not plain data" if forge else "no checksum recorded") in err, err
    assert "weights_only" not in err
    assert not marker.exists()


def test_sft_from_a_crafted_step_stops_in_one_line_without_running(step, tmp_path, marker):
    evil = craft(step, tmp_path / "evil", "optimizer.param_groups.norm.weight.betas", forge_checksums=False)
    argv = [
        "--config",
        "configs/sft_debug.toml",
        "--finetune.pretrained",
        str(evil),
        "--checkpoint.folder",
        str(tmp_path / "sft"),
        "--job.dump_folder",
        str(tmp_path / "sft"),
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--training.steps",
        "2",
    ]
    proc = run_main(argv, 1, {**os.environ, "OMP_NUM_THREADS": "1"}, REPO)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "no checksum recorded" in err and "Traceback" not in err, err
    assert not marker.exists()


@pytest.mark.parametrize("forge", [False, True])
@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "diff"])
def test_commands_on_a_crafted_step_never_run_it(step, tmp_path, marker, capsys, command, forge):
    """Unforged: every command refuses the checkpoint in one line. Forged: the payload's checksum
    matches, and the commands that read only model tensors never parse it."""
    evil = str(craft(step, tmp_path / "evil", "train_state.samples_seen", forge_checksums=forge))
    argv = {
        "inspect": [evil],
        "verify": [evil, "--quiet"],
        "convert": [evil, str(tmp_path / "hf"), "--to", "hf"],
        "diff": [evil, str(step)],
    }[command]
    status = cli([command, *argv])
    err = capsys.readouterr().err.strip()
    if forge:
        assert status == 0, err
    else:
        assert status == 2 and "no checksum recorded" in err and len(err.splitlines()) == 1, err
    assert not marker.exists()


def test_a_torch_file_with_code_is_refused_without_torchs_advice(tmp_path, marker, capsys):
    path = tmp_path / "model.pt"
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2), "extra": _Exploit()}, path)
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "posix.system" in err and "weights_only" not in err and len(err.splitlines()) == 1, err
    assert not marker.exists()
