"""Process states the shim cannot save from inside, found from outside.

A stopped process cannot run its shim to be dumped, and two processes that
share one descriptor table or one address space without being threads of
one process (raw clone(CLONE_FILES or CLONE_VM)) cannot be rebuilt as they
were (and their child never reaches the shim).  The agent looks for them in
/proc and with kcmp(2) so that the checkpoint is refused naming the real
cause, while the job runs on."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterable

KCMP_VM, KCMP_FILES = 1, 2
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


def state_of(pid: int) -> str:
    """The state letter of /proc/PID/stat ("" if the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def tgid_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


def _same(kind: int, a: int, b: int) -> bool:
    """Whether processes a and b share one kernel object of kind (False when kcmp cannot tell)."""
    if _SYS_KCMP is None:
        return False
    rc = _libc.syscall(_SYS_KCMP, ctypes.c_long(a), ctypes.c_long(b), ctypes.c_long(kind), 0, 0)
    return rc == 0


def stopped(pid: int, traced: bool = False) -> str:
    """Why pid cannot be saved because it is stopped, or "".  A traced stop
    counts only with traced (strace stops its tracee at every system call,
    a moment each: the quiesce signal still gets through)."""
    st = state_of(pid)
    if st == "T":
        return "is stopped (SIGSTOP or another stop signal): ckptd cannot save a stopped process; continue it first"
    if st == "t" and traced:
        return "is stopped by a debugger (ptrace): ckptd cannot save a traced process; detach the debugger first"
    return ""


def shared_with(pid: int, others: Iterable[int], ns_pid_of: dict[int, int]) -> str:
    """Why pid cannot be saved because it shares its descriptor table or its
    memory with another process of the job (not as a thread), or ""."""
    for other in others:
        if other == pid or tgid_of(other) == tgid_of(pid):
            continue
        where = f"process {other} (pid {ns_pid_of.get(other, '?')} in the job)"
        if _same(KCMP_FILES, pid, other):
            return (
                f"shares one descriptor table with {where} without being a thread of it (clone with "
                "CLONE_FILES): ckptd cannot restore a descriptor table shared between processes"
            )
        if _same(KCMP_VM, pid, other):
            return (
                f"shares its memory with {where} without being a thread of it (clone with CLONE_VM): "
                "ckptd cannot restore an address space shared between processes"
            )
    return ""


def why_not_saveable(pid: int, others: Iterable[int], ns_pid_of: dict[int, int]) -> str:
    """The real cause a process of the job cannot be checkpointed, or ""."""
    return stopped(pid, traced=True) or shared_with(pid, others, ns_pid_of)
