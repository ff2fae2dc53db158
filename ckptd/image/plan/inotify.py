"""inotify descriptors: each process makes its own again with its watches
(native/restorer/inotify.c).  One several processes share (open, then
fork) is refused: two instances would each get every event."""

from __future__ import annotations

from typing import Any

from .planner import Kind, PlanError, ProcessImage


class Inotifies(Kind):
    fd_types = ("CK_FD_INOTIFY",)

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        raise PlanError(
            f"{holder.label()} fd {int(fd.fd)}: an inotify descriptor several processes share (opened, then "
            "inherited by fork): ckptd can restore only one per process; close it in the child"
        )
