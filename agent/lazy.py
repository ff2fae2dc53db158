"""Lazy restore (`ckptctl restart --lazy`): the pagers that fill a restored
job's memory while it runs.

Each restored process's shim names, in its HELLO, the userfaultfd its large
mappings are registered with (native/restorer/lazy.c).  Before the job may
run, the agent takes a copy of that descriptor (pidfd_getfd) and starts
`ckptd-restore --serve-lazy IMAGE_DIR --uffd N` with it; RESUME then closes
the process's own copy, so the registration ends when the pager closes its
copy, after the last page.

While any pager runs, a checkpoint of the job waits (LazyFill.wait), and so
does fork() in the job (the shim, until LAZY_DONE).  A pager that fails
leaves pages that would read as zeros: the job is killed at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.errors import CkptdError, Code
from ckptd.image.crypt import key_memfd
from ckptd.native import restorer_binary

from .shim_link import ShimConnection, ShimError

log = logging.getLogger(__name__)

SYS_PIDFD_GETFD = 438  # x86-64; os has pidfd_open but not pidfd_getfd
FILL_DELAY_MS = os.environ.get("CKPTD_LAZY_FILL_DELAY_MS", "")


def take_fd(pid: int, fd: int) -> int:
    """A copy of descriptor `fd` of process `pid` (needs ptrace rights over it)."""
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        copy = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
        return int(copy)
    finally:
        os.close(pidfd)


@dataclass
class Pager:
    conn: ShimConnection
    process: subprocess.Popen[bytes]
    status_file: Path
    out_file: Path


@dataclass
class LazyFill:
    """The pagers of one lazy restart."""

    job: str
    pagers: list[Pager] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    failure: str = ""
    cancelled: bool = False  # kill_all: the job goes anyway, for another reason
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    key: bytes | None = field(default=None, repr=False)  # launch --encrypt: handed over in a memfd

    def start(self, conns: list[ShimConnection], image_dirs: dict[int, Path], work: Path) -> None:
        """One pager per process that has lazily mapped memory; raises
        CkptdError (before anything runs) when one cannot be started."""
        for conn in conns:
            if conn.hello is None or "lazy_uffd" not in conn.hello.fields:
                continue
            try:
                fd = take_fd(conn.host_pid, conn.hello.int("lazy_uffd"))
            except OSError as e:
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"cannot take process {conn.host_pid}'s userfaultfd for the lazy restore ({e}); "
                    "restart without --lazy",
                ) from None
            key_fd = key_memfd(self.key) if self.key else None
            status = work / f"lazy-{conn.pid}.status"
            out = work / f"lazy-{conn.pid}.out"
            try:
                with open(out, "wb") as stdout:
                    proc = subprocess.Popen(
                        [
                            str(restorer_binary()),
                            "--serve-lazy",
                            str(image_dirs[conn.pid]),
                            "--uffd",
                            str(fd),
                            "--status-file",
                            str(status),
                            # tests: slow the background fill so the job's own
                            # changes to its memory land while it runs
                            *(["--fill-delay-ms", FILL_DELAY_MS] if FILL_DELAY_MS else []),
                            *(["--key-fd", str(key_fd)] if key_fd is not None else []),
                        ],
                        pass_fds=(fd,) if key_fd is None else (fd, key_fd),
                        stdin=subprocess.DEVNULL,
                        stdout=stdout,
                        start_new_session=True,  # not in the agent's process group
                    )
            finally:
                os.close(fd)
                if key_fd is not None:
                    os.close(key_fd)
            self.pagers.append(Pager(conn, proc, status, out))
        if not self.pagers:
            self.done.set()

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Wait for the pagers in the background: tell the shims when all are
        done, or call on_failure with the reason when one fails."""
        threading.Thread(target=self._watch, args=(on_failure,), name=f"lazy-{self.job}", daemon=True).start()

    def _watch(self, on_failure: Callable[[str], None]) -> None:
        for p in self.pagers:
            rc = p.process.wait()
            if rc != 0 and self.cancelled:
                self.done.set()
                return
            if rc != 0:
                why = ""
                with contextlib.suppress(OSError):
                    why = p.status_file.read_text(errors="replace").strip()
                self.failure = (
                    f"the lazy restore's pager for pid {p.conn.pid} failed "
                    f"({why or f'exit status {rc}'}); its memory is incomplete"
                )
                log.error("job %s: %s", self.job, self.failure)
                self.kill_all()
                self.done.set()
                on_failure(self.failure)
                return
        self.seconds = time.monotonic() - self.started
        for p in self.pagers:
            with contextlib.suppress(OSError):
                log.info("job %s: pid %d filled lazily (%s)", self.job, p.conn.pid, p.out_file.read_text().strip())
            with contextlib.suppress(ShimError):  # a process that exited meanwhile needs nothing
                p.conn.request("LAZY_DONE", timeout=30)
        log.info("job %s: lazy restore filled in %.2f s", self.job, self.seconds)
        self.done.set()

    def kill_all(self) -> None:
        self.cancelled = True
        for p in self.pagers:
            with contextlib.suppress(OSError):
                p.process.kill()

    def wait(self, job: str, timeout: float) -> None:
        """For a checkpoint: its memory must be whole first."""
        if not self.done.wait(timeout):
            raise CkptdError(
                Code.ABORTED,
                f"job {job} is still filling its memory after a lazy restart ({time.monotonic() - self.started:.0f} s "
                "so far); the checkpoint is retried",
                transient=True,
            )
        if self.failure:
            raise CkptdError(Code.FAILED_PRECONDITION, self.failure)
