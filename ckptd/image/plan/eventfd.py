"""eventfds: each process makes its own again from its count
(native/restorer/fds.c), except one several processes share, made once
(native/restorer/plan_eventfd.c)."""

from __future__ import annotations

from typing import Any

from ..core import constant
from .planner import Kind, ProcessImage


class Eventfds(Kind):
    fd_types = ("CK_FD_EVENTFD",)

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        semaphore = int(bool(fd.flags & constant("CK_FDF_EVENTFD_SEMAPHORE")))
        return f"eventfd {slot} {int(fd.evcount)} {semaphore}"
