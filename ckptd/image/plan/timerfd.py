"""timerfds: each process makes its own again (native/restorer/fds.c),
except one several processes share (open, then fork), made once
(native/restorer/plan_timerfd.c) so that they read one count of
expirations again."""

from __future__ import annotations

from typing import Any

from .planner import Kind, ProcessImage


class Timerfds(Kind):
    fd_types = ("CK_FD_TIMERFD",)

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        times = f"{int(fd.it_interval_ns)} {int(fd.it_value_ns)} {int(fd.ticks)} {int(fd.settime_flags)}"
        return f"timerfd {slot} {int(fd.clockid)} {times}"
