"""Publishing outputs atomically: one writer per destination, a hidden sibling, a rename when complete.

A checkpoint (or converted file) ``NAME`` is written by one process at a time: the writer holds
an exclusive lock on ``.NAME.lock`` for the whole write, so a second writer fails before any work
instead of mixing its tensors with the first one's manifest. It writes into ``.NAME.<pid>.partial``
and renames that to ``NAME`` only when complete and fsynced, so any path with the final name is
complete, and a killed writer leaves only a ``.partial`` that no reader accepts (and the next
writer of ``NAME`` removes, saying so; a writer of another destination beside it names it).
``--force`` replaces only an output of the same kind: a checkpoint directory (or an empty one) by
a directory, a file by a file -- never an unrelated directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from seedckpt.checkpoint.manifest import TOKENIZER_DIR
from seedckpt.utils.errors import SeedckptError, interruption, write_failure

PARTIAL_SUFFIX = ".partial"  # every partial output's name ends with it; readers refuse such paths
LOCK_SUFFIX = ".lock"


def partial_of(path: Path) -> Path:
    """This process's partial output for ``path``: its own name, so no two writers ever share one."""
    return path.parent / f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}"


@contextlib.contextmanager
def destination_lock(path: str | os.PathLike):
    """Hold the exclusive right to write ``path`` (a ``flock`` on ``.NAME.lock`` beside it).

    Fails at once with a ``SeedckptError`` naming the holder when another process writes ``path``:
    waiting would only hide that two runs target one destination. The kernel drops a ``flock``
    when its process dies, so a crashed holder never blocks the next writer. The lock file is
    removed on release; a writer that opened it just before must not then hold a lock on a file
    nobody else can see, so after locking it checks that the path still names its file, else retries.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_of(path)
    fd = _lock(lock, path)
    try:
        since = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        command = shlex.join(sys.argv).replace("\n", " ")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, `{command}`, since {since}\n".encode(), 0)
        _clear_stale_partials(path)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # before unlocking: whoever locks the old file next sees it is gone
        os.close(fd)


def refuse_partial(path: Path) -> None:
    """A reader given ``.NAME[.<pid>].partial`` -- a writer's output before its rename -- stops here,
    saying whether a live writer still holds NAME's lock (then wait) or the write was interrupted
    (then delete it)."""
    destination = _destination_of(path)
    if destination is None:
        return
    holder = _live_holder(_lock_of(destination))
    if holder is not None:
        raise SeedckptError(
            f"{path} is the output of a write still in progress, by {holder}: wait for it to finish and read "
            f"{destination}"
        )
    raise SeedckptError(f"{path} is an incomplete output of an interrupted write; delete it and write it again")


def _destination_of(partial: Path) -> Path | None:
    """The output ``.NAME[.<pid>].partial`` is the partial output of (``NAME``), or None for any other path."""
    if not (partial.name.startswith(".") and partial.name.endswith(PARTIAL_SUFFIX)):
        return None
    name = partial.name.removeprefix(".").removesuffix(PARTIAL_SUFFIX)
    head, _, pid = name.rpartition(".")
    return partial.parent / (head if pid.isdigit() else name)


def _lock_of(path: Path) -> Path:
    return path.parent / f".{path.name}{LOCK_SUFFIX}"


def _clear_stale_partials(path: Path) -> None:
    """Deal with the partial outputs beside ``path`` that killed writers left (SIGKILL, a crash, a lost
    machine: nothing of theirs ran to remove them). ``path``'s own are removed, since every writer of
    ``path`` holds its lock, held here now; another destination's is named when no live writer holds
    that one's lock, but not deleted (not ours: its next writer removes it)."""
    for child in path.parent.iterdir():
        destination = _destination_of(child)
        if destination is not None and destination.name == path.name:
            remove(child)
            warnings.warn(
                f"removed {child}, the partial output of an earlier write of {path} that was killed", stacklevel=2
            )
        elif destination is not None and _live_holder(_lock_of(destination)) is None and child.exists():
            warnings.warn(
                f"{child} is the partial output of a write of {destination} that was killed; delete it", stacklevel=2
            )


def _live_holder(lock: Path) -> str | None:
    """Who holds ``lock``, or None when nobody does: a ``flock`` test, released at once."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # closing drops the test lock
    return None


def _holder(fd: int) -> str:
    """The first line of a held lock file: who holds it (empty: its holder has just started)."""
    lines = os.pread(fd, 65536, 0).decode(errors="replace").splitlines()
    return lines[0].strip() if lines and lines[0].strip() else "another process"


def _lock(lock: Path, path: Path) -> int:
    """Open and ``flock`` the lock file ``lock`` of ``path``; return its descriptor."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise SeedckptError(
                f"{path} is being written by {holder}; wait for it to finish or choose another destination"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        opened = os.fstat(fd)
        with contextlib.suppress(FileNotFoundError):
            current = os.stat(lock)
            if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                return fd
        os.close(fd)  # the previous holder removed this file as it finished: lock the new one


def check_destination(path: str | os.PathLike, force: bool, directory: bool = True) -> Path:
    """Fail early (before any work) unless ``path`` may be written: it does not exist, or ``force``
    is set and it is an output of the kind being written (see ``_why_not_replaceable``)."""
    path = Path(path)
    if path.exists():
        refusal = _why_not_replaceable(path, directory)
        if refusal:
            raise SeedckptError(
                f"{path} {refusal}; --force replaces only "
                f"{'a checkpoint directory or an empty one' if directory else 'a file'}: choose "
                "another destination or remove it yourself"
            )
        if not force:
            raise SeedckptError(f"{path} already exists; pass --force to replace it or choose another destination")
    return path


def _why_not_replaceable(path: Path, directory: bool) -> str | None:
    """Why a ``directory`` (or file) output may not replace the existing ``path``; None if it may.

    ``--force`` means "replace my previous output", so it must not delete a directory of other
    data, nor turn a directory into a file. A checkpoint directory is DCP (``.metadata``) or
    Hugging Face (``config.json`` plus safetensors weights), and holds files only, besides its
    ``tokenizer`` folder: one that also holds other directories (a run's ``step-N`` written inside a
    seed) is not replaced with them.
    """
    if not directory:
        if path.is_file():
            return None
        return "is a directory" if path.is_dir() else "is not a regular file"
    if not path.is_dir():
        return "is a file"
    entries = sorted(child.name for child in path.iterdir())
    inside = sorted(
        child.name
        for child in path.iterdir()
        if child.is_dir() and not child.name.startswith(".") and child.name != TOKENIZER_DIR
    )
    if inside:
        return (
            f"holds {len(inside)} director{'y' if len(inside) == 1 else 'ies'} ({', '.join(inside[:3])}), which "
            "replacing it would delete"
        )
    weights = (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
    if not entries or (path / ".metadata").is_file() or ((path / "config.json").is_file() and weights):
        return None
    return (
        f"is a directory that is not a checkpoint (holds {len(entries)} "
        f"entr{'y' if len(entries) == 1 else 'ies'}, e.g. {', '.join(entries[:3])})"
    )


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike,
    force: bool = False,
    directory: bool = True,
    check: Callable[[Path], None] | None = None,
    replaces: Callable[[Path], None] | None = None,
):
    """Yield this writer's hidden partial sibling of ``path`` to write into; publish it as ``path``
    on success, after ``check(partial)`` (if given) has accepted it. An existing file at ``path`` is
    replaced (``force``) only if ``replaces(path)`` (if given) accepts it: a file of the format written.

    The destination's lock is held throughout, so a second writer fails before doing any work and
    every partial of ``path`` that exists meanwhile is a killed writer's: those are removed
    (``destination_lock``). On any error (a failed ``check`` included) this writer's partial output
    is removed, so a failed or rejected write leaves nothing behind and publishes nothing.
    """
    path = Path(path)
    with destination_lock(path):
        check_destination(path, force, directory)
        if not directory and replaces is not None and path.exists():
            _check_same_format(path, replaces)
        partial = partial_of(path)
        if directory:
            partial.mkdir()
        try:
            yield partial
            if check is not None:
                check(partial)
            check_destination(path, force, directory)  # nothing else appeared there meanwhile
            _publish(partial, path)
        except BaseException as e:
            remove(partial)
            stop = interruption(e)
            if stop is not None:  # torch.save reports Ctrl-C (or SIGTERM, ``Stopped``) as a failed write
                raise stop from None
            failure = write_failure(e, f"writing {path}")
            if failure is not None:
                raise failure from None
            raise


def _check_same_format(path: Path, replaces: Callable[[Path], None]) -> None:
    """``--force`` replaces a file output only with one of its own format (``replaces`` reads it as
    one): a file of any other kind is somebody else's data."""
    try:
        replaces(path)
    except Exception as e:  # noqa: BLE001 -- whatever the reader says, it is not such a file
        reason = " ".join(str(e).split())[:200]
        raise SeedckptError(
            f"{path} is not a file of the format being written ({reason}); --force replaces only "
            "such a file: choose another destination or remove it yourself"
        ) from None


def remove(path: Path) -> None:
    """Delete a file or a directory tree; a symlink itself, never what it points to."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.is_symlink() or path.exists():
        path.unlink()


def write_json_synced(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _publish(partial: Path, path: Path) -> None:
    """Rename the complete ``partial`` to ``path``, replacing an existing one last."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        remove(old)
        path.rename(old)
    partial.rename(path)
    remove(old)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
