"""Asynchronous saves (``checkpoint.async_mode = "async"``): the training loop waits only for a copy
of the step's state; a background thread writes, checksums and publishes it.

The write itself is the one writer's (``write_checkpoint``: destination lock, partial directory,
checksums, manifest, atomic rename), so an asynchronous ``step-N`` is the same files as a
synchronous one and a crash mid-write publishes nothing. What this module adds:

* **Staging** into host buffers of its own (``StagingBuffers``), one per state-dict entry, kept by
  the entry's key and reused at every save: allocated once (on CUDA, pinned once), whatever tensor
  objects the next state dict holds. torch's ``DefaultStager`` keys its buffers by the *source
  storage*, so a state dict built anew at each save gets new buffers each time: manual FSDP's
  gathered tensors (0 of 229 buffers reused between two saves of the debug model on 2 ranks) and
  the RNG state; on torch 2.11 and 2.12 it cannot stage twice at all, so there every save allocated
  and pinned new buffers. Measured here (one thread), a copy into fresh memory costs 1.31 s per GiB
  (the kernel zeroes and maps every page), into warm buffers 0.26 s. On CUDA the buffers are pinned
  with ``cudaHostRegister`` at their exact size (the caching host allocator behind
  ``pin_memory=True`` rounds each block up to a power of two), and the copies are issued
  ``non_blocking`` on a side stream, ordered after the step's kernels on the GPU rather than by a
  host synchronize. On CPU a staging thread copies (``copy_`` releases the GIL), its first save's
  page faults included. Either way the copies overlap the next step's forward and backward, and
  the training thread waits only for what is left of them, before anything changes the state
  (``wait_for_staging``). DTensors keep their mesh and placements. The checksums are computed by
  the write, in the background thread, on the staged copy.
* **Its own gloo group** for the write's collectives (DCP's plan exchange, the partial directory's
  name, the final barrier). Two threads must not issue collectives on one group: the background
  write would interleave with training's all-reduces on the default group. Created once, by every
  rank, before the first save.
* **One save in flight.** Reused staging buffers must not change under a write that still reads
  them, so the next save waits for the previous one, and so does the end of the run.
* **Agreement.** Whether the in-flight save is done, still running or failed is decided by every
  rank together (one tiny all-reduce per step while a save is in flight): a rank that stopped alone
  would leave the others waiting in a collective. A failure anywhere stops every rank at the same
  step with one line; ``write_checkpoint`` has already removed the partial directory.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from seedckpt.utils.errors import SeedckptError

# write(staged_state_dict, group=...) -> the published path: ``write_checkpoint`` with everything
# else bound.
Write = Callable[..., Path]


class StagingBuffers:
    """Host copies of a state dict, in buffers kept by each entry's key path (a tensor's buffer is
    reallocated only when its shape or dtype changes; a key no longer saved releases its own).

    ``stage`` returns the staged state dict at once: the buffers (the writer reads them directly:
    each owns exactly its tensor's bytes), DTensors rebuilt over them with their mesh and
    placements, and a deep copy of everything else. The tensors' copies are still running then:
    ``copied`` is what they end at (CUDA: an event on the side stream; CPU: a future, the copies
    running in a thread, which ``copy_`` lets run beside the training thread). The sources are kept
    alive until ``wait``: the caching allocator must not hand their memory to a new tensor while a
    copy still reads it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: torch.cuda.Event | Future | None = None
        self.sources: dict | None = None

    @torch.no_grad()
    def stage(self, state_dict: dict) -> dict:
        used: dict[tuple, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._plan(state_dict, (), used, copies)
        self.buffers, self.sources = used, state_dict
        self.copied = self._start(copies)
        return staged

    def wait(self) -> None:
        """Until the copies are done. A failed copy is not raised here: the write, which waits for
        them too (``copies_done``), fails with it, and every rank hears of it."""
        if isinstance(self.copied, Future):
            futures.wait([self.copied])
        elif self.copied is not None:
            self.copied.synchronize()
        self.copied = self.sources = None

    def _start(self, copies: list) -> torch.cuda.Event | Future:
        if not self.cuda:
            done: Future = Future()
            threading.Thread(target=_copy_all, args=(copies, done), daemon=True, name="seedckpt-staging").start()
            return done
        # The side stream starts after the step's last kernels (the optimizer's), on the GPU.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), torch.no_grad():
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=True)
        return self.stream.record_event()

    def _plan(self, value, key: tuple, used: dict, copies: list):
        """``value``'s staged counterpart; each tensor's (buffer, source) appended to ``copies``."""
        if isinstance(value, DTensor):
            return DTensor(self._plan(value.to_local(), key, used, copies), value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = self._allocate(value)
            used[key] = buffer
            copies.append((buffer, value.detach()))
            return buffer
        if isinstance(value, dict):
            return {k: self._plan(v, (*key, k), used, copies) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._plan(v, (*key, i), used, copies) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(like.shape, dtype=like.dtype)
        if self.cuda and buffer.nbytes:
            _pin(buffer)
        return buffer


def _copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]], done: Future) -> None:
    try:
        with torch.no_grad():
            for buffer, source in copies:
                buffer.copy_(source)
    except BaseException as e:  # noqa: BLE001 -- reported by the write that waits for it
        done.set_exception(e)
    else:
        done.set_result(None)


def copies_done(copied: torch.cuda.Event | Future | None) -> None:
    """Wait for ``StagingBuffers.copied``; raises what a copy raised."""
    if isinstance(copied, Future):
        copied.result()
    elif copied is not None:
        copied.synchronize()


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer``'s memory for asynchronous device-to-host copies, until it is freed."""
    cudart, ptr = torch.cuda.cudart(), buffer.data_ptr()
    status = int(cudart.cudaHostRegister(ptr, buffer.nbytes, 1))  # cudaHostRegisterPortable: any context
    if status != 0:
        raise RuntimeError(f"pinning {buffer.nbytes:,} bytes of host memory for staging failed (cudaError {status})")
    weakref.finalize(buffer, cudart.cudaHostUnregister, ptr).atexit = False


@dataclass
class SavedInBackground:
    """A published background save: ``stall_s``, what the training loop waited for it (the previous
    save, building and staging the state); ``background_s``, the write from start to publication."""

    path: Path
    stall_s: float
    background_s: float


@dataclass
class _InFlight:
    path: Path
    stall_s: float
    done: Future  # the background seconds, or the write's exception


class BackgroundSaver:
    """Stages a state dict and writes it with ``write_checkpoint`` in a background thread; at most
    one save in flight. Collective: every rank constructs it, saves, polls and waits in step."""

    def __init__(self, device: torch.device):
        self.group = dist.new_group(backend="gloo")  # all ranks; CPU tensors only (what is staged)
        self.device = device
        self.staging = StagingBuffers(device)
        self.in_flight: _InFlight | None = None

    def save(self, path: Path, state_dict: dict, write: Write, since: float | None = None) -> None:
        """Stage ``state_dict`` and start ``write(staged, group=...)`` in the background; ``wait``
        for the previous save first. ``since``: when the caller began building ``state_dict``
        (``time.perf_counter()``), so that the logged stall includes it."""
        start = time.perf_counter() if since is None else since
        if self.in_flight is not None:
            raise RuntimeError("BackgroundSaver.save: wait() for the save in flight first")
        staged = self.staging.stage(state_dict)
        done: Future = Future()
        thread = threading.Thread(
            target=self._write,
            args=(staged, self.staging.copied, write, done),
            daemon=True,
            name=f"seedckpt-save-{path.name}",
        )
        # Daemon: a run stopping on an error must not hang at exit on a write blocked in a collective
        # with a rank that is gone; an unfinished write publishes nothing. In flight before it starts:
        # ``start`` waits for the thread to run, and a Ctrl-C landing there must still find the write
        # to ``drain``.
        self.in_flight = _InFlight(path, 0.0, done)
        thread.start()
        self.in_flight.stall_s = time.perf_counter() - start

    def _write(self, staged: dict, copied: torch.cuda.Event | Future | None, write: Write, done: Future) -> None:
        start = time.perf_counter()
        try:
            copies_done(copied)  # the buffers are complete
            write(staged, group=self.group)
        except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
            done.set_exception(e)
        else:
            done.set_result(time.perf_counter() - start)

    def wait_for_staging(self) -> None:
        """Block until the staged copies are complete. Call before anything changes the tensors
        being saved (the trainer: after the step's backward); the wait counts as stall."""
        if self.staging.sources is None:
            return
        start = time.perf_counter()
        self.staging.wait()
        if self.in_flight is not None:
            self.in_flight.stall_s += time.perf_counter() - start

    def poll(self) -> SavedInBackground | None:
        """The save in flight if every rank has published its part of it, ``None`` while any is still
        writing (or none is in flight). Raises ``SeedckptError`` on every rank if it failed on any."""
        return self._settle(block=False)

    def wait(self) -> SavedInBackground | None:
        """Wait for the save in flight (if any) and return it, as ``poll``."""
        return self._settle(block=True)

    def drain(self, timeout_s: float) -> None:
        """On the way out of a stopped run (an error, Ctrl-C), let this rank's write in flight end by
        itself, with no collective (the ranks stop at different points): when every rank stopped,
        each one's thread finishes its part and the step is published; when a rank is gone, the
        write fails in its collective and removes its partial directory. Either way no partial
        directory is left, and the interpreter's exit does not cut a write short in C++. A write
        still running after ``timeout_s`` is left to the exit (it publishes nothing)."""
        if self.in_flight is not None:
            futures.wait([self.in_flight.done], timeout=timeout_s)

    def _settle(self, block: bool) -> SavedInBackground | None:
        job = self.in_flight
        if job is None:
            return None
        if block:
            start = time.perf_counter()
            self.wait_for_staging()
            # The write's own failure is agreed on and reported below; a Ctrl-C while waiting
            # propagates, and the caller drains the write (``drain``), which then publishes it.
            futures.wait([job.done])
            job.stall_s += time.perf_counter() - start
        failed = job.done.done() and job.done.exception() is not None
        flags = torch.tensor([float(failed), float(not job.done.done())], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed_anywhere, running_anywhere = flags.tolist()
        if failed_anywhere:
            self.in_flight = None
            cause = " ".join(str(job.done.exception()).split()) if failed else "another rank's write failed"
            raise SeedckptError(
                f"the background save of {job.path} failed: {cause}; nothing was published "
                f"(the run resumes from the newest complete step-N): fix the cause and run again"
            )
        if running_anywhere:
            return None
        self.in_flight = None
        return SavedInBackground(job.path, job.stall_s, job.done.result())
