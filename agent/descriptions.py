"""Open file descriptions several processes of a job share.

open(), then fork(): parent and child hold one open file description, and
both move its one offset.  Each process's image records only its own
descriptors, by path and offset; which descriptors of *different*
processes are one description is the kernel's to say: kcmp(KCMP_FILE), as
CRIU asks it.  The agent asks while every process is parked (after the
dump, before the resume), for every pair that names the same file; the
restore plan (ckptd/image/plan/) then makes each shared description
once, at a slot every process inherits.
"""

from __future__ import annotations

import ctypes
import os
import stat

from ckptd.errors import CkptdError, Code

SYS_KCMP = 312  # x86_64
KCMP_FILE = 0

_libc = ctypes.CDLL(None, use_errno=True)

_SHAREABLE_ANON = (
    "anon_inode:[eventfd]",
    "anon_inode:[timerfd]",
    "anon_inode:[signalfd]",
    "anon_inode:[pidfd]",  # refused when shared (plan/pidfd.py)
    "anon_inode:inotify",  # refused when shared (plan/inotify.py)
)


def _kcmp_file(pid1: int, fd1: int, pid2: int, fd2: int) -> bool:
    rc = _libc.syscall(SYS_KCMP, pid1, pid2, KCMP_FILE, fd1, fd2)
    if rc < 0:
        err = ctypes.get_errno()
        if err == 9:  # EBADF: closed meanwhile (only the shim's own descriptors move)
            return False
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"cannot tell which open files processes {pid1} and {pid2} share (kcmp: {os.strerror(err)}); "
            "ckptd needs kcmp (CONFIG_KCMP) and the right to inspect the job's processes",
        )
    return rc == 0


def _files(host_pid: int) -> list[tuple[tuple[int, int], int]]:
    """((dev, ino), fd) of each descriptor a process could share by
    description: not pipes and sockets (the plan makes those once anyway)."""
    out = []
    d = f"/proc/{host_pid}/fd"
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for name in names:
        try:
            link = os.readlink(f"{d}/{name}")
            st = os.stat(f"{d}/{name}")
        except OSError:
            continue
        if link.startswith(("pipe:", "socket:")) or stat.S_ISSOCK(st.st_mode):
            continue
        # the kinds the plan makes once for several processes, or refuses (plan/*.py's reopen)
        if link.startswith("anon_inode:") and link not in _SHAREABLE_ANON:
            continue
        out.append(((st.st_dev, st.st_ino), int(name)))
    return out


def shared_descriptions(procs: list[tuple[int, int]]) -> list[list[list[int]]]:
    """procs: (pid in the job, host pid) of every parked process.  Returns each
    open file description held by two processes or more as its [pid, fd]
    pairs (pids in the job)."""
    if len(procs) < 2:  # one process shares nothing with another (a rank of one process)
        return []
    by_file: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for pid, host in procs:
        for key, fd in _files(host):
            by_file.setdefault(key, []).append((pid, host, fd))
    groups: list[list[list[int]]] = []
    for holders in by_file.values():
        if len({pid for pid, _, _ in holders}) < 2:
            continue
        classes: list[list[tuple[int, int, int]]] = []
        for h in holders:
            for c in classes:
                if _kcmp_file(h[1], h[2], c[0][1], c[0][2]):
                    c.append(h)
                    break
            else:
                classes.append([h])
        groups.extend(sorted([pid, fd] for pid, _, fd in c) for c in classes if len({h[0] for h in c}) > 1)
    return sorted(groups)
