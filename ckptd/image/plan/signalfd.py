"""signalfds: each process makes its own again from its mask
(native/restorer/fds.c), except one several processes share (open, then
fork), made once (native/restorer/plan_signalfd.c) so that they share its
status flags again."""

from __future__ import annotations

from typing import Any

from .planner import Kind, ProcessImage


class Signalfds(Kind):
    fd_types = ("CK_FD_SIGNALFD",)

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        return f"signalfd {slot} {int(fd.sigmask)}"
