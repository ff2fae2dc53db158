"""Whether a copy-on-write capture can cost what it might (issue 20).

A checkpoint's writer is a forked copy of each process (native/shim/
writeout.c): every page the job rewrites before the writer has read it is
copied by the kernel.  In the worst case (a job rewriting all its memory)
that is every private page it has, so the checkpoint may need the job's
anonymous memory once more.  A job in a memory cgroup near its limit, or a
machine near its end, would be OOM-killed by its own checkpoint.

Before the DUMP the agent compares that worst case with what can still be
had: MemAvailable, and the headroom of the job's memory cgroup and of each
of its ancestors (v2 memory.max - memory.current; v1 memory.limit_in_bytes
- memory.usage_in_bytes, the controller this machine's kernel mounts), the
inactive file cache counted as headroom (the kernel drops it before it
kills).  When the copy might not fit, the processes write their pages during
the pause instead (DUMP sync=1): a longer stall, no extra memory.  The
checkpoint's record says so (manifest processes[].capture "pause" and
capture_why).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from .progress import resident_anon

CGROUP_ROOT = Path("/sys/fs/cgroup")
# what stays free besides the copy: page tables, the writer's buffers, slack
RESERVE = 64 << 20
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Budget:
    cost: int  # bytes a writer could copy at worst: the processes' anonymous memory
    available: int  # bytes that can still be had
    bound: str  # what bounds `available`, for the record

    @property
    def fits(self) -> bool:
        return self.cost + RESERVE <= self.available

    def why(self) -> str:
        mib = 1 << 20
        return (
            f"a copy-on-write capture could need {self.cost // mib} MiB; "
            f"{self.available // mib} MiB available ({self.bound})"
        )


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return UNLIMITED


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _headroom(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    limit, usage = _read_int(directory / limit_file), _read_int(directory / usage_file)
    if limit is None or usage is None or limit >= UNLIMITED:
        return None
    return limit - usage + _stat(directory / "memory.stat", inactive_key)


def cgroup_headrooms(pid: int) -> list[tuple[int, str]]:
    """(bytes, the cgroup's path) for the process's memory cgroup and every
    ancestor that has a limit, v1 or v2."""
    out: list[tuple[int, str]] = []
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: memory.* files sit in the unified tree
            base, files = CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file")
            if not (base / "cgroup.controllers").exists():
                continue  # a v1 machine's empty unified hierarchy
        elif "memory" in controllers.split(","):
            base = CGROUP_ROOT / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        rel = Path(path.lstrip("/"))
        for d in [rel, *rel.parents]:
            room = _headroom(base / d, *files)
            if room is not None:
                out.append((room, f"memory cgroup {('/' / d).as_posix()}"))
    return out


def budget(host_pids: list[int]) -> Budget:
    """The worst case of a copy-on-write capture of these processes, and what
    the machine and their cgroups can still give."""
    # the kernel's counter (status RssAnon), not smaps_rollup: this runs while
    # the job is parked, and smaps_rollup walks every page table
    cost = sum(resident_anon(p, ("RssAnon:",)) for p in host_pids)
    candidates = [(_mem_available(), "MemAvailable")]
    if host_pids:
        candidates += cgroup_headrooms(host_pids[0])
    available, bound = min(candidates)
    return Budget(cost=cost, available=available, bound=bound)
