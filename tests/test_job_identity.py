"""What identifies a fine-tuning job's pretrained source (``checkpoint.fingerprint``): its weights,
read in a bounded number of bytes; and how a ``step-N`` that recorded only the source's config (an
older version) is treated on resume (``start.check_same_job``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from seedckpt.checkpoint import MANIFEST_NAME
from seedckpt.checkpoint.fingerprint import (
    HEAD_BYTES,
    WINDOW_BYTES,
    WINDOWS,
    sampled_bytes,
    weights_fingerprint,
    window_offsets,
)
from seedckpt.config.job_config import load_config
from seedckpt.materialize.seed import create_seed_checkpoint
from seedckpt.materialize.start import CONFIG_CRC_KEY, WEIGHTS_KEY, check_same_job, config_crc
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config


def test_seeds_drawn_with_other_seeds_differ_and_a_copy_matches_whatever_its_manifest_says(debug_seed, tmp_path):
    """Our checkpoints: the manifest's checksums and model, not its other fields (the time it was
    written, the seed it records) nor its path."""
    create_seed_checkpoint(tiny_config(), tmp_path / "seed1", seed=1, progress=False)
    assert weights_fingerprint(tmp_path / "seed1") != weights_fingerprint(debug_seed)
    copy = shutil.copytree(debug_seed, tmp_path / "copy")
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest.update(created="2000-01-01T00:00:00+00:00", kind="converted")
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert weights_fingerprint(copy) == weights_fingerprint(debug_seed)


def test_a_large_shard_is_sampled_in_a_fixed_number_of_bytes_and_each_window_counts(tmp_path):
    """A sparse 4 GiB 'safetensors' file: 128 KiB read. A byte changed inside a window, or the length,
    changes the fingerprint; a byte between windows does not (the documented limit)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    shard = hf / "model.safetensors"
    size = 4 << 30
    with shard.open("wb") as f:
        f.truncate(size)
    assert len(sampled_bytes(shard)) == len(shard.name) + 8 + HEAD_BYTES + WINDOWS * WINDOW_BYTES
    base = weights_fingerprint(hf)

    def poked(offset: int) -> str:
        with shard.open("r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        try:
            return weights_fingerprint(hf)
        finally:
            with shard.open("r+b") as f:
                f.seek(offset)
                f.write(b"\x00")

    windows = window_offsets(size)
    assert len(windows) == WINDOWS and windows[-1] == size - WINDOW_BYTES  # the last window ends the file
    assert poked(windows[8] + 100) != base
    assert poked(windows[8] + WINDOW_BYTES + 100) == base
    with shard.open("r+b") as f:
        f.truncate(size + 1)
    assert weights_fingerprint(hf) != base


def _legacy_resume(tmp_path: Path, source_config: str, recorded: dict):
    """``check_same_job`` of an SFT run from an HF directory whose config.json is ``source_config``,
    against a step-1 whose manifest records ``recorded`` for its source."""
    source = tmp_path / "hf"
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text(source_config)
    cfg = load_config(
        "configs/sft_debug.toml", ["--finetune.pretrained", str(source), "--checkpoint.folder", str(tmp_path / "ckpt")]
    )
    manifest = {"finetune": {"mode": "sft", "pretrained": str(source), **recorded}}
    start = SimpleNamespace(checkpoint=SimpleNamespace(manifest=manifest), path=tmp_path / "ckpt" / "step-1")
    return check_same_job(cfg, start)


def test_a_step_that_records_only_its_sources_config_is_resumed_when_it_matches_and_says_so(tmp_path):
    """Written by an older version: refusing it would strand every run interrupted across the
    upgrade, so a matching config resumes -- with a line saying the weights were not compared."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"hidden_size": 128}')
    crc = config_crc(tmp_path / "hf")
    [note] = _legacy_resume(tmp_path, '{"hidden_size": 128}', {CONFIG_CRC_KEY: crc})
    assert "by its configuration only" in note and "the weights could not be compared" in note, note
    with pytest.raises(SeedckptError, match=r"holds step-1 of another job \(fine-tuned from .*whose weights differ"):
        _legacy_resume(tmp_path, '{"hidden_size": 256}', {CONFIG_CRC_KEY: crc})


def test_a_step_that_records_the_weights_is_checked_by_them_alone(tmp_path):
    """A recorded weights fingerprint decides, whatever the config's CRC says: no note."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"weights")
    crc, weights = config_crc(tmp_path / "hf"), weights_fingerprint(tmp_path / "hf")
    assert _legacy_resume(tmp_path, "{}", {WEIGHTS_KEY: weights, CONFIG_CRC_KEY: crc}) == ()
    with pytest.raises(SeedckptError, match="whose weights differ"):
        _legacy_resume(tmp_path, "{}", {WEIGHTS_KEY: "0" * 32, CONFIG_CRC_KEY: crc})
