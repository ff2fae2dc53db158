"""Bytes moved by the checkpoint or restart a job has in flight on this node,
for `ckptctl status` and the progress bars of `ckptctl checkpoint/restart`.

A Transfer either counts what it is told (checksums add each buffer) or
asks a probe (the dump's files grow while the shims write them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ckptd.v1 import ckptd_pb2 as pb


def resident_anon(pid: int, fields: tuple[str, ...] = ("RssAnon:", "RssShmem:")) -> int:
    """Bytes of anonymous and shared memory the process has resident: about
    what a full image of it holds, and what a restore has filled in so far
    (fields: which of the kernel's counters in /proc/PID/status, O(1) to read)."""
    total = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(fields):
                total += int(line.split()[1]) * 1024
    return total


class Transfer:
    def __init__(self, what: str, total: int = 0, probe: Callable[[], int] | None = None) -> None:
        self.what = what
        self.total = total  # 0: not known in advance
        self.done = 0
        self._probe = probe

    def add(self, n: int) -> None:
        self.done += n  # one writer per transfer: no lock needed

    def snapshot(self) -> pb.Progress:
        done = self.done
        if self._probe is not None:
            try:
                done = self._probe()
            except OSError:  # a file renamed or removed under the probe: report what was known
                done = self.done
            self.done = done
        if self.total:
            done = min(done, self.total)
        return pb.Progress(done=done, total=self.total, what=self.what)


class Transfers:
    """The transfer in flight for each job on this node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_job: dict[str, Transfer] = {}

    @contextlib.contextmanager
    def running(self, job: str, transfer: Transfer) -> Iterator[Transfer]:
        with self._lock:
            self._by_job[job] = transfer
        try:
            yield transfer
        finally:
            with self._lock:
                if self._by_job.get(job) is transfer:
                    del self._by_job[job]

    def snapshot(self, job: str) -> pb.Progress | None:
        with self._lock:
            t = self._by_job.get(job)
        return t.snapshot() if t is not None else None
