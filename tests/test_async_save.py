"""Asynchronous saves (``checkpoint.async_mode = "async"``): the same checkpoints as synchronous
ones, bitwise, and a resume from them is the same run; one save in flight; a failed background
write stops every rank with one line and publishes nothing; a SIGKILL mid-write leaves the previous
step loadable. Real gloo ranks, real DCP files."""

from __future__ import annotations

import functools
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from seedckpt.checkpoint import DcpCheckpoint, complete_steps
from seedckpt.cli.main import main as seedckpt
from seedckpt.utils.errors import SeedckptError
from tests.dist import HANG_S, run_distributed
from tests.test_train import REPO, _killed_mid_checkpoint_worker, losses, model_state, torchrun

ASYNC = ["--checkpoint.async_mode", "async"]
# dp_shard = 2: the saved weights and AdamW moments are DTensor shards, staged with their placements.
LAYOUT = [
    "--parallelism.pipeline_parallel_degree",
    "1",
    "--training.local_batch_size",
    "4",
    "--training.steps",
    "4",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
]


def _assert_same_tensors(a: Path, b: Path) -> None:
    """Every tensor but the per-rank RNG states, which ``model_state`` leaves out (as the resume tests
    in test_train.py compare)."""
    x, y = model_state(a), model_state(b)
    assert x.keys() == y.keys() and any(k.startswith("optimizer.") for k in x)
    for key in x:
        assert torch.equal(x[key], y[key]), f"{a.name}: {key}"


def test_async_saves_are_the_sync_checkpoints_and_resume_the_same_run(tmp_path, debug_seed):
    torchrun(tmp_path / "sync", debug_seed, 2, *LAYOUT)
    run = torchrun(tmp_path / "async", debug_seed, 2, *LAYOUT, *ASYNC)
    assert "step-2 (stall" in run.stdout and "background" in run.stdout, run.stdout
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for step in (2, 4):
        _assert_same_tensors(tmp_path / "sync" / "ckpt" / f"step-{step}", tmp_path / "async" / "ckpt" / f"step-{step}")
        assert DcpCheckpoint(tmp_path / "async" / "ckpt" / f"step-{step}").verify() == []
    # A resume from the asynchronously saved step-2 trains the synchronous run's steps 3 and 4, bitwise.
    shutil.rmtree(tmp_path / "async" / "ckpt" / "step-4")
    again = torchrun(tmp_path / "async", debug_seed, 2, *LAYOUT, *ASYNC)
    assert "resuming from" in again.stdout and "step-2" in again.stdout
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    _assert_same_tensors(tmp_path / "sync" / "ckpt" / "step-4", tmp_path / "async" / "ckpt" / "step-4")


def _failing_write_worker(rank, world_size, seed, folder, dump):
    """An async run whose rank 1 cannot write step 4 (disk full); returns each rank's error line and
    the last step it trained."""
    from seedckpt.checkpoint import StreamingFileSystemWriter
    from seedckpt.config.job_config import load_config
    from seedckpt.config.resolve import resolve
    from seedckpt.train.trainer import Trainer

    original = StreamingFileSystemWriter.write_data

    def disk_full_at_step_4(self, plan, planner):
        if rank == 1 and "step-4" in str(self.path):
            raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    StreamingFileSystemWriter.write_data = disk_full_at_step_4
    cfg = load_config(
        REPO / "configs/debug.toml",
        [
            "--training.global_batch_size",
            "8",
            "--training.seq_len",
            "32",
            "--data.kind",
            "synthetic",
            *LAYOUT,
            *ASYNC,
            "--training.steps",
            "8",
            "--checkpoint.seed_checkpoint",
            seed,
            "--checkpoint.folder",
            folder,
            "--job.dump_folder",
            dump,
        ],
    )
    trainer = Trainer(resolve(cfg, world_size).with_start())
    try:
        trainer.run()
    except SeedckptError as e:
        return str(e), trainer.state.step
    return None, trainer.state.step


def test_a_failed_background_write_stops_every_rank_with_one_line_and_publishes_nothing(tmp_path, debug_seed):
    folder = tmp_path / "ckpt"
    results = run_distributed(_failing_write_worker, 2, str(debug_seed), str(folder), str(tmp_path))
    for rank, (error, step) in enumerate(results):
        assert error is not None, f"rank {rank} trained on to step {step}"
        assert len(error.splitlines()) == 1 and "step-4" in error and "fix the cause" in error, error
        assert 4 <= step < 8, step  # stopped at a step after the failed save, never reaching the end
    assert "no space left on the device writing" in results[1][0]  # the cause, named
    assert sorted(complete_steps(folder)) == [2]
    assert not any(p.name.endswith(".partial") for p in folder.iterdir())


def test_sigkill_during_a_background_write_leaves_the_previous_step_loadable(tmp_path, debug_seed):
    folder = tmp_path / "ckpt"
    with pytest.raises(AssertionError, match=r"died|Connection reset|Connection closed"):
        run_distributed(
            _killed_mid_checkpoint_worker, 2, str(debug_seed), str(folder), str(tmp_path), *ASYNC, timeout=HANG_S
        )
    assert sorted(complete_steps(folder)) == [2]
    assert list(folder.glob(".step-4.*.partial"))  # the write was under way, unpublished
    assert DcpCheckpoint(folder / "step-2").verify() == []
    assert model_state(folder / "step-2")["layers.0.attention.wq.weight"].abs().sum() > 0


def _one_in_flight_worker(rank, world_size, folder):
    """Two saves back to back through ``BackgroundSaver`` with a slow write: how many writes ran at
    once, how long the second save stalled, and whether each write saw its state as it was staged
    (the tensors are changed once staged, as the next optimizer step does)."""
    from seedckpt.checkpoint.background import BackgroundSaver

    saver = BackgroundSaver(torch.device("cpu"))
    running, most, seen = [0], [0], []
    lock = threading.Lock()
    gate = threading.Event()  # a write finishes only once the gate opens: no race with the machine's speed
    gate.set()

    def slow_write(staged, group):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.5)
        gate.wait(timeout=HANG_S)
        torch.distributed.barrier(group=group)  # the write's collectives run on the saver's group
        seen.append(staged["w"].clone())
        with lock:
            running[0] -= 1
        return Path(folder)

    weight = torch.full((1000,), 1.0)
    saver.save(Path(folder) / "step-1", {"w": weight}, slow_write)
    saver.wait_for_staging()  # as the trainer does before the state changes
    weight.fill_(2.0)
    first = saver.wait()
    gate.clear()
    saver.save(Path(folder) / "step-2", {"w": weight}, slow_write)
    saver.wait_for_staging()
    weight.fill_(3.0)
    returned_while_writing = len(seen) == 1  # save() came back with its write still held at the gate
    try:
        saver.save(Path(folder) / "step-3", {"w": weight}, slow_write)
        refused = False
    except RuntimeError:
        refused = True
    gate.set()
    second = saver.wait()
    return {
        "most": most[0],
        "first": first.background_s,
        "returned_while_writing": returned_while_writing,
        "refused": refused,
        "seen": [t[0].item() for t in seen],
        "second": second.path.name,
        "done": saver.wait() is None,
    }


def test_one_save_in_flight_and_each_writes_the_state_it_staged(tmp_path):
    for result in run_distributed(_one_in_flight_worker, 2, str(tmp_path)):
        assert result["most"] == 1 and result["refused"] and result["second"] == "step-2" and result["done"]
        assert result["first"] >= 0.5 and result["returned_while_writing"]  # staged, not written, in the loop
        assert result["seen"] == [1.0, 2.0]


def _cuda_staging_worker(rank, world_size):
    from seedckpt.checkpoint.background import BackgroundSaver

    device = torch.device("cuda", 0)
    saver = BackgroundSaver(device)
    seen = []

    def write(staged, group):
        seen.append(
            [(t.clone(), t.is_pinned(), t.untyped_storage().data_ptr()) for t in (staged["w"], staged["gathered"])]
        )
        return Path("unused")

    weight = torch.full((1 << 20,), 1.0, device=device)
    for value in (2.0, 3.0):
        # "gathered": a tensor made anew for each save, as manual FSDP's full tensors are.
        saver.save(Path("step"), {"w": weight, "gathered": weight * 2}, write)
        saver.wait_for_staging()  # what the trainer does before the state changes
        weight.fill_(value)
        saver.wait()
    return [[(t.unique().tolist(), pinned, ptr) for t, pinned, ptr in save] for save in seen]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_reuses_pinned_buffers():
    [seen] = run_distributed(_cuda_staging_worker, 1)
    assert [[values for values, _, _ in save] for save in seen] == [[[1.0], [2.0]], [[2.0], [4.0]]]
    assert all(pinned for save in seen for _, pinned, _ in save)
    first, second = ([ptr for _, _, ptr in save] for save in seen)
    assert first == second  # the same pinned buffers at the second save, the rebuilt tensor's too


def test_a_saver_saves_again_after_its_first_save(tmp_path):
    """Each of three saves writes what it staged, through the same buffers."""
    [seen] = run_distributed(_saves_three_times_worker, 1, str(tmp_path))
    assert seen == [[1.0], [2.0], [3.0]]


def _saves_three_times_worker(rank, world_size, folder):
    from seedckpt.checkpoint import write_checkpoint
    from seedckpt.checkpoint.background import BackgroundSaver

    saver = BackgroundSaver(torch.device("cpu"))
    weight = torch.ones(16)
    for step in (1, 2, 3):
        path = Path(folder) / f"step-{step}"
        saver.save(path, {"w": weight}, functools.partial(write_checkpoint, path, manifest={"kind": "test"}))
        saver.wait_for_staging()
        weight.add_(1.0)
        saver.wait()
    return [DcpCheckpoint(Path(folder) / f"step-{s}").read_tensor("w").unique().tolist() for s in (1, 2, 3)]


def _reuse_worker(rank, world_size, seed, folder):
    """Two saves of the debug model's weights and this rank's RNG state, made anew for each save (as
    manual FSDP's gathered tensors and ``torch.get_rng_state()`` are): the storage each write read,
    and whether each step holds the embedding it staged."""
    from seedckpt.checkpoint import make_manifest, write_checkpoint
    from seedckpt.checkpoint.background import BackgroundSaver
    from seedckpt.checkpoint.manifest import RNG_PREFIX, read_manifest

    model = read_manifest(Path(seed))["model"]
    manifest = make_manifest("train", model["name"], model["flavor"], model["args"])
    seed_checkpoint = DcpCheckpoint(Path(seed))
    weights = {fqn: seed_checkpoint.read_tensor(fqn) for fqn in seed_checkpoint.tensors()}
    saver = BackgroundSaver(torch.device("cpu"))
    staged_seen = []  # kept alive: a buffer freed and allocated again could land at the same address

    def spying_write(path):
        def write(staged, group):
            staged_seen.append(staged)
            return write_checkpoint(path, staged, manifest=manifest, group=group)

        return write

    for step in (1, 2):
        path = Path(folder) / f"step-{step}"
        state = {fqn: t + step for fqn, t in weights.items()}
        saver.save(path, {**state, f"{RNG_PREFIX}rank0": torch.get_rng_state()}, spying_write(path))
        state.clear()  # the next step's tensors are others
        saver.wait()
    pointers = [{k: t.untyped_storage().data_ptr() for k, t in staged.items()} for staged in staged_seen]
    written = [DcpCheckpoint(Path(folder) / f"step-{s}").read_tensor("tok_embeddings.weight") for s in (1, 2)]
    return pointers, [torch.equal(t, weights["tok_embeddings.weight"] + s) for s, t in zip((1, 2), written)]


def test_staging_buffers_are_reused_across_saves_and_the_checksums_verify(tmp_path, debug_seed):
    [(pointers, as_staged)] = run_distributed(_reuse_worker, 1, str(debug_seed), str(tmp_path))
    assert len(pointers[0]) > 2 and pointers[0] == pointers[1]  # was: new buffers for every tensor made anew
    assert as_staged == [True, True]  # each step holds the state it staged
    for step in (1, 2):
        assert seedckpt(["verify", str(tmp_path / f"step-{step}"), "--quiet"]) == 0


def _ctrl_c_while_waiting_worker(rank, world_size, folder):
    """A Ctrl-C (SIGINT, turned into KeyboardInterrupt as train.py does) while the run waits for its
    last background save: it must reach the caller, and the drained write must still publish."""
    import signal

    from seedckpt.checkpoint import write_checkpoint
    from seedckpt.checkpoint.background import BackgroundSaver

    signal.signal(signal.SIGINT, signal.default_int_handler)
    saver = BackgroundSaver(torch.device("cpu"))
    path = Path(folder) / "step-4"

    def slow_write(state, group):
        time.sleep(1.0)
        return write_checkpoint(path, state, manifest={"kind": "test"}, group=group)

    saver.save(path, {"w": torch.arange(8.0)}, slow_write)
    threading.Timer(0.2, signal.raise_signal, args=(signal.SIGINT,)).start()
    try:
        saver.wait()
    except KeyboardInterrupt:
        interrupted = True
    else:
        interrupted = False
    saver.drain(30.0)
    return interrupted, sorted(p.name for p in Path(folder).iterdir())


def test_ctrl_c_while_waiting_for_the_last_save_is_raised_and_the_drained_save_publishes(tmp_path):
    [(interrupted, left)] = run_distributed(_ctrl_c_while_waiting_worker, 1, str(tmp_path))
    assert interrupted  # was: swallowed, the run went on to exit 0 with the save unpublished
    assert left == ["step-4"]  # published whole; no partial directory, no lock
    assert torch.equal(DcpCheckpoint(tmp_path / "step-4").read_tensor("w"), torch.arange(8.0))
