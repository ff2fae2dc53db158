"""Deleted files and directories (an open file or directory whose name was
removed, not on tmpfs): each made once again (native/restorer/plan_deleted.c),
at its old path if that is free or at a new name beside it, filled from
files/deleted-<ino>.data, opened at its slot and removed again; every
descriptor of it, in every process, reopens that object with its own flags
and offset (native/restorer/fds.c), and every MAP_SHARED mapping of it maps
it again (native/restorer/mem.c), so they all see one file again."""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import constant
from .planner import Kind, PlanError, Planner, ProcessImage, Steps, hex_arg


@dataclass
class _Deleted:
    dev: int
    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    path: str
    fill: Path | None


class DeletedFiles(Kind):
    fd_types = ("CK_FD_DELETED",)

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.objects: dict[tuple[int, int], _Deleted] = {}
        self._shared_deleted = constant("CK_VMA_SHARED") | constant("CK_VMA_DELETED")

    def gather(self, p: ProcessImage, fd: Any) -> None:
        key = (int(fd.dev), int(fd.ino))
        if key in self.objects:
            return
        path = p.core.string(fd.path).removesuffix(" (deleted)")
        if not path.startswith("/"):
            raise PlanError(f"{p.label()} fd {int(fd.fd)}: corrupt image (a deleted file without a path)")
        mode = int(fd.mode)
        fill = None if stat.S_ISDIR(mode) else p.dir / "files" / f"deleted-{int(fd.ino)}.data"
        self.objects[key] = _Deleted(*key, mode, int(fd.uid), int(fd.gid), int(fd.size), path, fill)

    def gather_vma(self, p: ProcessImage, v: Any) -> None:
        """A MAP_SHARED mapping of a deleted file: mapped again from the same
        object; its contents were saved with the process's image, from a
        descriptor of it or through the mapping (native/shim/dump_deleted.c)."""
        if (int(v.flags) & self._shared_deleted) != self._shared_deleted:
            return
        key = (int(v.dev), int(v.ino))
        if key in self.objects:
            return
        path = p.core.string(v.path).removesuffix(" (deleted)")
        if not path.startswith("/"):
            raise PlanError(f"{p.label()}: corrupt image (a mapped deleted file without a path)")
        fill = p.dir / "files" / f"deleted-{int(v.ino)}.data"
        mode, owner = int(v.file_mode), (int(v.file_uid), int(v.file_gid))
        self.objects[key] = _Deleted(*key, mode, *owner, int(v.file_size), path, fill)

    def plan(self, st: Steps) -> None:
        for obj in self.objects.values():
            slot = self.planner.slots.of("deleted", obj.ino)
            fill = hex_arg(str(obj.fill)) if obj.fill is not None else "-"
            owner = f"{obj.mode} {obj.uid} {obj.gid}"
            st.create.append(f"deleted {slot} {obj.dev} {obj.ino} {owner} {obj.size} {hex_arg(obj.path)} {fill}")

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        """One description of the object (its own flags and offset), opened from its slot."""
        return f"fileshm {slot} {self.planner.slots.of('deleted', int(fd.ino))} {int(fd.open_flags)} {int(fd.pos)}"
