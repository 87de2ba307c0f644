"""Integrity: every byte of a checkpoint is checked against the CRC32C written with it.

Byte flips at random offsets of every data file (seed and a two-rank checkpoint with training
state) are each caught by ``seedckpt verify`` and by loading, naming the tensor and the file;
broken files (truncated, missing, crafted headers) give one line and exit 2 from every command.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from seedckpt.checkpoint import DcpCheckpoint
from seedckpt.checkpoint.integrity import (
    MIN_PIECE_BYTES,
    PIECE_BYTES,
    ItemChecks,
    PieceHasher,
    band_checks,
    piece_bytes,
)
from seedckpt.cli.main import main as cli
from seedckpt.materialize.model_checkpoint import open_model_checkpoint
from seedckpt.utils.errors import SeedckptError
from tests.conftest import tiny_config
from tests.dist import run_distributed

FLIPS_PER_FILE = 20


def _two_rank_checkpoint_worker(rank, world_size, path):
    """A checkpoint written by two ranks: each its own model rows plus training state (bytes items)."""
    from seedckpt.checkpoint import make_manifest, write_checkpoint

    g = torch.Generator().manual_seed(rank)
    state = {
        f"layers.{rank}.attention.wq.weight": torch.randn(64, 128, generator=g),
        f"layers.{rank}.attention_norm.weight": torch.randn(128, generator=g),
        f"rng.rank{rank}": torch.get_rng_state(),
        "train_state": {"step": 7, "lr_scheduler": {"base_lrs": [3e-4], "last_epoch": 7}},
    }
    write_checkpoint(path, state, make_manifest("train", "llama3", "debug", tiny_config().model_args().to_dict()))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, debug_seed):
    root = tmp_path_factory.mktemp("integrity")
    run_distributed(_two_rank_checkpoint_worker, 2, str(root / "two_ranks"))
    return {"seed": debug_seed, "two_ranks": root / "two_ranks"}


def _owner(checkpoint: DcpCheckpoint, file: str, offset: int) -> str:
    """The stored key whose item holds byte ``offset`` of ``file``."""
    for index, info in checkpoint.metadata.storage_data.items():
        if info.relative_path == file and info.offset <= offset < info.offset + info.length:
            return index.fqn
    raise AssertionError(f"byte {offset} of {file} belongs to no item")


def _load_everything(path: Path) -> None:
    """Load every entry (tensors and training state) the way a resume does: through DCP."""
    checkpoint = DcpCheckpoint(path)
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype) if hasattr(md, "size") else None
        for key, md in checkpoint.metadata.state_dict_metadata.items()
    }
    checkpoint.load(state)


@pytest.mark.parametrize("which", ["seed", "two_ranks"])
def test_every_byte_flip_is_caught_by_verify_and_by_loading_naming_the_tensor(checkpoints, tmp_path, which):
    path = tmp_path / which
    shutil.copytree(checkpoints[which], path)
    _load_everything(path)  # intact: loads
    g = torch.Generator().manual_seed(0)
    files = sorted(path.glob("*.distcp"))
    assert len(files) == 2  # the seed's two workers' files; the two ranks' files
    for data in files:
        size = data.stat().st_size
        for offset in torch.randint(0, size, (FLIPS_PER_FILE,), generator=g).tolist():
            owner = _owner(DcpCheckpoint(path), data.name, offset)
            with open(data, "r+b") as f:
                f.seek(offset)
                original = f.read(1)
                f.seek(offset)
                f.write(bytes([original[0] ^ 0x24]))
            try:
                problems = DcpCheckpoint(path).verify()
                assert len(problems) == 1, f"flip at {data.name}:{offset}: {problems}"
                assert owner in problems[0] and data.name in problems[0], problems[0]
                assert cli(["verify", str(path), "--quiet"]) == 2
                with pytest.raises(SeedckptError, match="corrupt") as raised:
                    _load_everything(path)
                assert owner in str(raised.value) and data.name in str(raised.value)
            finally:
                with open(data, "r+b") as f:
                    f.seek(offset)
                    f.write(original)
    assert DcpCheckpoint(path).verify() == []


def test_a_tied_checkpoint_checks_the_matrix_once_naming_the_embedding(tmp_path, tied_seed):
    """``output.weight`` points at the embedding's bytes: verify checks every byte once, and a
    flipped byte of the matrix is one problem, under the name that stores it."""
    path = tmp_path / "tied"
    shutil.copytree(tied_seed, path)
    checkpoint = DcpCheckpoint(path)
    assert "output.weight" in checkpoint.metadata.state_dict_metadata
    checked = []
    assert checkpoint.verify(checked.append) == []
    assert sum(checked) == sum(data.stat().st_size for data in path.glob("*.distcp"))
    info = next(info for index, info in checkpoint.metadata.storage_data.items() if index.fqn == "output.weight")
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        original = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([original[0] ^ 0x24]))
    [problem] = DcpCheckpoint(path).verify()
    assert "tok_embeddings.weight" in problem and "output.weight" not in problem, problem
    assert cli(["verify", str(path), "--quiet"]) == 2


def test_verify_reports_intact_and_inspect_names_the_checksums(debug_seed, capsys):
    assert cli(["verify", str(debug_seed), "--quiet"]) == 0
    assert "intact" in capsys.readouterr().out
    assert cli(["inspect", str(debug_seed)]) == 0
    assert "checksums: crc32c" in capsys.readouterr().out


def test_old_and_foreign_checkpoints_load_and_say_no_checksum(tmp_path, debug_seed, capsys):
    """A checkpoint from before checksums (manifest without them) and a stock ``dcp.save`` one load
    as before; inspect and verify say that there is nothing to check."""
    import torch.distributed.checkpoint as dcp

    old = tmp_path / "old"
    shutil.copytree(debug_seed, old)
    manifest = json.loads((old / "seedckpt.json").read_text())
    del manifest["checksums"]
    (old / "seedckpt.json").write_text(json.dumps(manifest))
    state = {f: torch.empty(i.shape, dtype=i.dtype) for f, i in open_model_checkpoint(debug_seed).infos.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "foreign")), no_dist=True)
    for path in (old, tmp_path / "foreign"):
        open_model_checkpoint(path, tiny_config().model_args()).load(dict(state))
        assert cli(["inspect", str(path)]) == 0
        assert "no checksum" in capsys.readouterr().out
        assert cli(["verify", str(path), "--quiet"]) == 0
        assert "contents cannot be verified" in capsys.readouterr().out


def test_a_flipped_metadata_byte_is_caught(tmp_path, debug_seed):
    path = tmp_path / "seed"
    shutil.copytree(debug_seed, path)
    data = bytearray((path / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / ".metadata").write_bytes(bytes(data))
    with pytest.raises(SeedckptError, match=r"\.metadata is corrupt"):
        open_model_checkpoint(path)


def test_skipping_verification_loads_corrupt_bytes(tmp_path, debug_seed):
    """``--no-verify`` / ``checkpoint.verify_checksums = false`` really turns the check off."""
    path = tmp_path / "seed"
    shutil.copytree(debug_seed, path)
    _flip_middle_of(path, "output.weight")
    with pytest.raises(SeedckptError, match="output.weight .*corrupt"):
        open_model_checkpoint(path).read_tensor("output.weight")
    damaged = open_model_checkpoint(path, verify=False).read_tensor("output.weight")
    assert not torch.equal(damaged, open_model_checkpoint(debug_seed).read_tensor("output.weight"))


def _flip_middle_of(path: Path, fqn: str) -> None:
    """Flip a byte in the middle of ``fqn``'s (first) item."""
    info = next(i for idx, i in DcpCheckpoint(path).metadata.storage_data.items() if idx.fqn == fqn)
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte[0] ^ 0x80]))


def test_pieces_align_with_the_raw_data_and_reads_cover_what_they_touch():
    """Cuts at the raw data's start and every piece after it: a power-of-two shard of the rows reads
    nothing extra; the first rows' reader also checks the header, the last rows' reader the tail."""
    head, nbytes, tail = 300, 4 * PIECE_BYTES, 500
    hasher = PieceHasher("f", 1000)
    payload = os.urandom(head + nbytes + tail)
    hasher.update(memoryview(payload)[:head])
    hasher.mark_start(PIECE_BYTES)
    hasher.update(memoryview(payload)[head:])
    item = hasher.finish()
    start = 1000 + head
    # head, four data pieces (the last ends where the data does), the zip tail
    assert item.cuts == [1000, start] + [start + k * PIECE_BYTES for k in range(1, 5)] + [1000 + len(payload)]
    assert ItemChecks("f", 1000, len(payload), start, item.crcs).cuts == item.cuts  # as re-read from a manifest
    quarter = nbytes // 4
    assert item.covering(start + quarter, start + 2 * quarter, start + nbytes) == (2, 3)  # its piece only
    assert item.covering(start, start + quarter, start + nbytes) == (0, 2)  # + the header
    assert item.covering(start + 3 * quarter, start + nbytes, start + nbytes) == (4, 6)  # its piece + the tail
    assert item.covering(start + 10, start + 20, start + nbytes) == (1, 2)  # unaligned: the piece around it


def test_pieces_and_tiles_are_sized_to_the_tensor_not_the_item():
    """At least 64 pieces and 64 tiles to a tensor, however small (down to 4 KiB pieces), 1 MiB
    pieces from 64 MiB up; a shard's items take its tensor's sizes, so sharding adds no CRCs."""
    assert piece_bytes(2**20) == 16 << 10 and piece_bytes(100) == MIN_PIECE_BYTES
    assert piece_bytes(64 << 20) == piece_bytes(4 << 30) == PIECE_BYTES
    matrix = torch.zeros(512, 512)
    tiles = band_checks(memoryview(matrix.numpy()).cast("B"), matrix.shape, 4, 512)
    assert (tiles.bands, tiles.rows_per_tile, len(tiles.crcs)) == (8, 64, 64)
    quarter = matrix[:128]  # an FSDP shard's item: its tiles stay the tensor's
    assert band_checks(memoryview(quarter.numpy()).cast("B"), quarter.shape, 4, 512).rows_per_tile == 64
    embedding = torch.zeros(8192, 2048)  # a 64 MiB block: tiles of 256 KiB, as before
    assert band_checks(memoryview(embedding.numpy()).cast("B"), embedding.shape, 4, 8192).rows_per_tile == 256


def _as_format_1(path: Path) -> None:
    """Rewrite a checkpoint's checksums as format version 1 recorded them: 1 MiB pieces from the raw
    bytes' start in every item, one ``piece_bytes`` for all, four fields an item."""
    manifest = json.loads((path / "seedckpt.json").read_text())
    record = manifest["checksums"]
    for file, entries in record["items"].items():
        data = memoryview((path / file).read_bytes())
        for k, (offset, length, start, _, _) in enumerate(entries):
            hasher = PieceHasher(file, offset)
            hasher.update(data[offset:start])
            hasher.mark_start(PIECE_BYTES)
            hasher.update(data[start : offset + length])
            entries[k] = [offset, length, start, list(hasher.finish().crcs)]
    record["piece_bytes"] = PIECE_BYTES
    manifest["format_version"] = 1
    (path / "seedckpt.json").write_text(json.dumps(manifest))


def test_a_format_1_checkpoint_loads_verifies_and_catches_a_flip(tmp_path, debug_seed):
    old = tmp_path / "old"
    shutil.copytree(debug_seed, old)
    _as_format_1(old)
    assert DcpCheckpoint(old).verify() == []
    expected = open_model_checkpoint(debug_seed).read_tensor("output.weight")
    assert torch.equal(open_model_checkpoint(old).read_tensor("output.weight"), expected)
    _flip_middle_of(old, "output.weight")
    with pytest.raises(SeedckptError, match="output.weight .*corrupt"):
        open_model_checkpoint(old).read_tensor("output.weight")


# -- broken files: one line, exit 2, from every command ---------------------------------------------


def _damaged(tmp_path: Path, debug_seed: Path, how: str) -> Path:
    path = tmp_path / how
    shutil.copytree(debug_seed, path)
    data = path / "__0_0.distcp"
    if how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    else:
        data.unlink()
    return path


@pytest.mark.parametrize("how", ["truncated", "missing"])
@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "diff"])
def test_incomplete_checkpoints_are_one_line_exit_2(tmp_path, debug_seed, capsys, how, command):
    path = _damaged(tmp_path, debug_seed, how)
    args = {
        "inspect": [str(path)],
        "verify": [str(path)],
        "convert": [str(path), str(tmp_path / "out.pt"), "--to", "torch"],
        "diff": [str(debug_seed), str(path)],
    }[command]
    assert cli([command, *args]) == 2  # diff: 2 = error, never 1 ("different")
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "incomplete" in err and "__0_0.distcp" in err, err
    assert not (tmp_path / "out.pt").exists()


def test_diff_exit_status_is_0_equal_1_different_2_error(tmp_path, debug_seed):
    assert cli(["diff", str(debug_seed), str(debug_seed)]) == 0
    other = tmp_path / "other"
    cli(["seed", "--config", "configs/debug.toml", "--output", str(other), "--seed", "1", "--quiet"])
    assert cli(["diff", str(debug_seed), str(other)]) == 1
    assert cli(["diff", str(debug_seed), str(tmp_path / "nothing")]) == 2


def _safetensors(path: Path, header: bytes, declared: int | None = None, data: bytes = b"") -> Path:
    path.write_bytes((len(header) if declared is None else declared).to_bytes(8, "little") + header + data)
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        ("huge_length", "header length"),
        ("nested", "header is not JSON"),
        ("offsets_disagree", "do not hold shape"),
        ("beyond_the_file", "truncated"),
        ("bad_dtype", "entry 'w' has dtype F128: not a safetensors dtype"),
        ("overlapping", "entries 'v' and 'w' overlap at byte 8"),
        ("fp8", "entry 'w' has dtype F8_E5M2: a safetensors dtype this version does not read (it reads F64, F32"),
    ],
)
def test_crafted_safetensors_headers_are_refused(tmp_path, capsys, case, message):
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    files = {
        "huge_length": lambda p: _safetensors(p, b"{}", declared=2**62),
        "nested": lambda p: _safetensors(p, b"[" * 100_000),
        "offsets_disagree": lambda p: _safetensors(
            p, json.dumps({"w": {**entry, "shape": [2**26, 2**26]}}).encode(), data=bytes(16)
        ),
        "beyond_the_file": lambda p: _safetensors(p, json.dumps({"w": entry}).encode(), data=bytes(8)),
        "bad_dtype": lambda p: _safetensors(p, json.dumps({"w": {**entry, "dtype": "F128"}}).encode(), data=bytes(16)),
        "fp8": lambda p: _safetensors(p, json.dumps({"w": {**entry, "dtype": "F8_E5M2"}}).encode(), data=bytes(16)),
        "overlapping": lambda p: _safetensors(
            p, json.dumps({"v": entry, "w": {**entry, "data_offsets": [8, 24]}}).encode(), data=bytes(24)
        ),
    }
    path = files[case](tmp_path / "x.safetensors")
    for command in ("inspect", "verify"):  # the header is checked before either trusts it
        assert cli([command, str(path)]) == 2, command
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_hf_index_entries_outside_the_directory_are_refused(tmp_path, capsys):
    from seedckpt.cli.convert import convert

    hf = convert(_seed_for_hf(tmp_path), tmp_path / "hf", "hf", progress=False)
    index = hf / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    data["weight_map"][name] = "../outside.safetensors"
    index.write_text(json.dumps(data))
    assert cli(["inspect", str(hf)]) == 2
    assert "not a file in" in capsys.readouterr().err


def _seed_for_hf(tmp_path: Path) -> Path:
    from seedckpt.materialize.seed import create_seed_checkpoint

    return create_seed_checkpoint(tiny_config("--model.n_layers", "1"), tmp_path / "seed", seed=0, progress=False)


def test_oversized_dcp_metadata_is_refused_before_reading(tmp_path, debug_seed, monkeypatch):
    from seedckpt.checkpoint import safe_pickle

    monkeypatch.setattr(safe_pickle, "MAX_METADATA_BYTES", 100)
    with pytest.raises(SeedckptError, match="more than the 100 a checkpoint's metadata may take"):
        safe_pickle.read_dcp_metadata(debug_seed / ".metadata")


# -- a manifest or config that does not describe the tensors --------------------------------------


def test_a_manifest_that_does_not_describe_its_tensors_is_refused(tmp_path, debug_seed):
    path = tmp_path / "lying"
    shutil.copytree(debug_seed, path)
    manifest = json.loads((path / "seedckpt.json").read_text())
    manifest["model"]["args"]["n_layers"] = 4  # 6 layers are stored beside it
    (path / "seedckpt.json").write_text(json.dumps(manifest))
    with pytest.raises(
        SeedckptError,
        match=r"weights do not match the model configuration: it has 18 model "
        r"tensors this model does not use, e.g. layers\.4\.",
    ):
        open_model_checkpoint(path)


def test_extra_layers_of_a_checkpoint_without_manifest_are_an_error_listing_them(tmp_path, debug_seed):
    """A foreign checkpoint with 6 layers loaded into a 4-layer model: refused, naming layers 4 and 5;
    a pipeline stage's unowned layers (2 and 3 for the first of two stages) are fine."""
    import torch.distributed.checkpoint as dcp

    from seedckpt.materialize.stages import build_stages
    from seedckpt.parallel.pipeline import plan_rank_stages
    from tests.conftest import stock_load

    dcp.save(stock_load(debug_seed), checkpoint_id=str(tmp_path / "foreign"), no_dist=True)
    six = tiny_config().model_args()
    [first] = build_stages(six, plan_rank_stages(six, 0, 2), "cpu", checkpoint=tmp_path / "foreign")
    assert sorted({k.split(".")[1] for k in first.state_dict() if k.startswith("layers.")}) == ["0", "1", "2"]
    four = tiny_config("--model.n_layers", "4").model_args()
    with pytest.raises(SeedckptError, match=r"it has 18 model tensors this model does not use, e.g. layers\.4\."):
        build_stages(four, plan_rank_stages(four, 0, 2), "cpu", checkpoint=tmp_path / "foreign")


def test_an_entry_pointed_at_another_tensors_bytes_is_refused(tmp_path, debug_seed, capsys):
    """``wq`` pointed at ``wo``'s bytes (same shape, ``.metadata``'s checksum re-recorded) is not a
    tie the model declares: every reader and ``verify`` refuse it; a declared tie still loads."""
    import pickle

    from seedckpt.checkpoint.integrity import crc

    crafted = tmp_path / "crafted"
    shutil.copytree(debug_seed, crafted)
    metadata = DcpCheckpoint(crafted).metadata
    by_fqn = {index.fqn: index for index in metadata.storage_data}
    wq, wo = by_fqn["layers.0.attention.wq.weight"], by_fqn["layers.0.attention.wo.weight"]
    metadata.storage_data[wq] = metadata.storage_data[wo]
    data = pickle.dumps(metadata)
    (crafted / ".metadata").write_bytes(data)
    manifest = json.loads((crafted / "seedckpt.json").read_text())
    manifest["checksums"]["metadata"] = crc(data)
    manifest.pop("raw_items")
    (crafted / "seedckpt.json").write_text(json.dumps(manifest))
    with pytest.raises(SeedckptError, match="a tie this model does not have") as refused:
        open_model_checkpoint(crafted)
    assert "attention.wq.weight" in str(refused.value) and "attention.wo.weight" in str(refused.value)
    assert cli(["verify", str(crafted), "--quiet"]) == 2
    assert "a tie this model does not have" in capsys.readouterr().err


def test_verify_warns_about_tensors_holding_nan_or_inf(tmp_path, capsys):
    from seedckpt.checkpoint import make_manifest, write_checkpoint

    weights = {
        "layers.0.attention.wq.weight": torch.ones(128, 128),  # finite
        "layers.0.attention.wk.weight": torch.ones(tiny_config().model_args().n_kv_heads * 16, 128),
        "layers.0.attention_norm.weight": torch.ones(128, dtype=torch.bfloat16),
        # optimizer state another tool kept in float8, which has no aminmax: checked all the same
        "optimizer.state.layers.0.attention.wq.weight.exp_avg": torch.full((4,), float("nan")).to(torch.float8_e4m3fn),
        "optimizer.state.layers.0.attention.wq.weight.exp_avg_sq": torch.ones(4, dtype=torch.float8_e5m2),
        "train_state": {"step": 7},
    }
    weights["layers.0.attention.wk.weight"][5, 7] = float("inf")
    weights["layers.0.attention_norm.weight"][1] = float("nan")
    manifest = make_manifest("train", "llama3", "debug", tiny_config().model_args().to_dict())
    path = write_checkpoint(tmp_path / "ckpt", weights, manifest)
    assert cli(["verify", str(path), "--quiet"]) == 0  # the bytes are intact: a warning, not damage
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: layers.0.{name} holds NaN or Inf values (its bytes are intact; training from it stops at load)"
        for name in ("attention.wk.weight", "attention_norm.weight")
    ] + [
        "warning: optimizer.state.layers.0.attention.wq.weight.exp_avg holds NaN or Inf values (its bytes are "
        "intact; training from it stops at load)"
    ], out
    assert "intact:" in out


def test_a_checkpoint_deleted_while_it_is_read_says_so(tmp_path, debug_seed):
    """Opened, then pruned away (a run's keep_latest_k) before its bytes are read."""
    import shutil

    from seedckpt.checkpoint import DcpCheckpoint

    step = tmp_path / "step-2"
    shutil.copytree(debug_seed, step)
    checkpoint = DcpCheckpoint(step)
    shutil.rmtree(step)
    with pytest.raises(SeedckptError, match=rf"{step} was deleted while it was being read .*keep_latest_k"):
        checkpoint.read_tensor("norm.weight")
