"""The disk and memory a command may take, checked before it starts: hours of a conversion or a seed
would otherwise end in a full disk or the OOM killer."""

from __future__ import annotations

import shutil
from pathlib import Path

from seedckpt.utils.errors import SeedckptError

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# (folder under the root, limit, usage, the memory.stat key of reclaimable page cache): cgroup v2, then
# v1's memory controller
CGROUP_FILES = (
    ("", "memory.max", "memory.current", "inactive_file"),
    ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)


def check_free_space(output: Path, nbytes: int, what: str = "the seed") -> None:
    """Refuse, before any byte is written, an output of ``nbytes`` larger than the free space where
    ``output`` goes (its nearest existing folder): the whole output, since a replaced one is removed
    only once the new one is complete."""
    where = next(p for p in (output, *output.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if nbytes > free:
        raise SeedckptError(
            f"{what} needs {size_text(nbytes)} at {output}, but {where} has {size_text(free)} free; "
            "free space, choose another output, or write --dtype bfloat16 (half float32's bytes)"
        )


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def available_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP_ROOT, own: Path = SELF_CGROUP) -> int | None:
    """The bytes this process can allocate without swapping or meeting the OOM killer: the kernel's
    ``MemAvailable``, or less where a cgroup memory limit leaves less (a container's ``MemAvailable``
    is the host's); None where neither says. ``cgroup``: the cgroup file system's root; ``own``: the
    file naming this process's cgroup under it (``/proc/self/cgroup``)."""
    known = [n for n in (_mem_available(meminfo), _cgroup_room(cgroup, own)) if n is not None]
    return min(known, default=None)


def _mem_available(meminfo: Path) -> int | None:
    try:
        with open(meminfo) as f:
            found = next((line.split()[1] for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
    return int(found) * 1024 if found is not None else None


def _cgroup_room(root: Path, own: Path) -> int | None:
    """The least room any cgroup limit leaves this process: its own cgroup's and those above it (a
    systemd slice's), v2's or v1's; None without a limit."""
    rooms = [_room(folder, *files) for folder, files in _cgroup_folders(root, own)]
    return min((room for room in rooms if room is not None), default=None)


def _cgroup_folders(root: Path, own: Path):
    """``(folder, its files' names)`` of this process's cgroup and each above it that ``root`` holds:
    a container with its own cgroup namespace sees its cgroup as ``/``, the root itself."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        lines = []
    paths = {"": "/", "memory": "/"}
    for _, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        key = "" if not controllers else "memory" if "memory" in controllers.split(",") else None
        if key is not None:
            paths[key] = path
    for under, *names in CGROUP_FILES:
        base = root / under
        folder = base / paths[under].strip("/")
        for place in (folder, *folder.parents):
            if place.is_dir():
                yield place, names
            if place == base:
                break


def _room(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    """``folder``'s limit less its usage, its inactive page cache counted free (the kernel reclaims it
    before killing: usage after reading a large file sits at the limit); None without a limit
    (``max``; v1 writes a number near 2**63)."""
    limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
    if limit is None or usage is None or limit >= 2**62:
        return None
    return max(0, limit - usage + min(_stat(folder, cache_key), usage))


def _read_int(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(folder: Path, key: str) -> int:
    """``key``'s bytes in ``folder``'s ``memory.stat`` (0 where absent)."""
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    value = next((line.split()[1] for line in lines if line.split()[:1] == [key] and len(line.split()) > 1), "0")
    return int(value) if value.isdigit() else 0
