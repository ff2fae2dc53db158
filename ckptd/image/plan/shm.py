"""Shared memory objects with no path to reopen (memfds, deleted tmpfs
files): each made once at its size (native/restorer/plan_shm.c), filled
from files/shm-<ino>.data, mapped or held by every process that had it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import constant
from .planner import Kind, Planner, ProcessImage, Steps, hex_arg


@dataclass
class _Shm:
    dev: int
    ino: int
    size: int  # the largest end of a mapping of it, where no descriptor says its size
    name: str
    fill: Path | None = None
    file_size: int | None = None  # its size, from a descriptor of it (a mapping may go past the end)

    @property
    def exact_size(self) -> int:
        return self.size if self.file_size is None else self.file_size


def _shm_name(path: str) -> str:
    name = path.removesuffix(" (deleted)")
    if name.startswith("/memfd:"):
        return name.removeprefix("/memfd:")  # exactly, empty or with a '/' in it
    return os.path.basename(name) or "ckptd-shm"


class SharedMemory(Kind):
    fd_types = ("CK_FD_SHMEM",)

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.shm: dict[tuple[int, int], _Shm] = {}

    def _object(self, p: ProcessImage, dev: int, ino: int, path: int) -> _Shm:
        key = (dev, ino)
        return self.shm.setdefault(key, _Shm(dev, ino, 0, _shm_name(p.core.string(path))))

    def gather(self, p: ProcessImage, fd: Any) -> None:
        obj = self._object(p, int(fd.dev), int(fd.ino), fd.path)
        obj.file_size = int(fd.size)
        saved = p.dir / "files" / f"shm-{int(fd.ino)}.data"
        if obj.fill is None:
            obj.fill = saved

    def gather_vma(self, p: ProcessImage, v: Any) -> None:
        if v.flags & constant("CK_VMA_SHMEM"):
            obj = self._object(p, int(v.dev), int(v.ino), v.path)
            obj.size = max(obj.size, int(v.pgoff) + int(v.end) - int(v.start))

    def plan(self, st: Steps) -> None:
        for obj in self.shm.values():
            slot = self.planner.slots.of("shm", obj.ino)
            st.create.append(f"shm {slot} {obj.dev} {obj.ino} {obj.exact_size} {hex_arg(obj.name)}")
            if obj.fill is not None:
                st.data.append(f"shmfill {slot} {hex_arg(str(obj.fill))}")

    def reopens(self, fd: Any) -> bool:
        return True

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        """One description of the object (its own flags and offset), opened from its slot."""
        return f"fileshm {slot} {self.planner.slots.of('shm', int(fd.ino))} {int(fd.open_flags)} {int(fd.pos)}"
