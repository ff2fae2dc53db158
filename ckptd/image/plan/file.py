"""Files opened by path (regular files, directories, devices): each process
opens its own again (native/restorer/fds.c), except an open file
description several processes share, made once (native/restorer/plan_file.c)
so that they move one offset again."""

from __future__ import annotations

from typing import Any

from .planner import Kind, ProcessImage, hex_arg


def reopen_by_path(holder: ProcessImage, fd: Any, slot: int) -> str:
    """The line that opens fd's path once, with its flags and offset."""
    path = holder.core.string(fd.path)
    return f"file {slot} {int(fd.open_flags)} {int(fd.pos)} {hex_arg(path)}"


class Files(Kind):
    fd_types = ("CK_FD_REG", "CK_FD_DIR", "CK_FD_CHR")

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        return reopen_by_path(holder, fd, slot)
