"""pidfds: each process opens its own again with pidfd_open
(native/restorer/fds.c), once the tree exists with its pids.  One several
processes share (open, then fork) is refused: the plan makes shared
objects before the processes a pidfd would name exist."""

from __future__ import annotations

from typing import Any

from .planner import Kind, PlanError, ProcessImage


class Pidfds(Kind):
    fd_types = ("CK_FD_PIDFD",)

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        raise PlanError(
            f"{holder.label()} fd {int(fd.fd)}: a pidfd several processes share (opened, then inherited "
            "by fork): ckptd can restore only one per process; close it in the child"
        )
