"""Pipes and FIFOs: each made once (native/restorer/plan_pipe.c), its
bytes in flight written back, an end no process holds any more closed;
the job's stdout and stderr pipes are the log's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..core import constant
from .file import reopen_by_path
from .planner import Data, Kind, PlanError, Planner, ProcessImage, Steps, data_of, hex_arg


@dataclass
class _Pipe:
    ino: int
    readers: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    fifo_path: str = ""
    size: int = 0
    data: Data | None = None
    packet: str = ""  # an end in packet mode (pipe2 O_DIRECT): who holds it


class Pipes(Kind):
    fd_types = ("CK_FD_PIPE",)

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.pipes: dict[int, _Pipe] = {}

    def gather(self, p: ProcessImage, fd: Any) -> None:
        ino = int(fd.ino)
        pipe = self.pipes.setdefault(ino, _Pipe(ino))
        who = f"{p.label()} fd {fd.fd}"
        if fd.flags & constant("CK_FDF_FIFO"):
            pipe.fifo_path = p.core.string(fd.path)
        if fd.flags & constant("CK_FDF_PIPE_WRITE_END"):
            pipe.writers.append(who)
        else:
            pipe.readers.append(who)
        pipe.size = max(pipe.size, int(fd.pipe_size))
        if fd.open_flags & os.O_DIRECT and not pipe.packet:
            pipe.packet = who
        data = data_of(p, fd)
        if pipe.data is None and data is not None and data.length:
            pipe.data = data

    def plan(self, st: Steps) -> None:
        slots, log_pipes = self.planner.slots, self.planner.log_pipes
        for pipe in self.pipes.values():
            if pipe.packet and pipe.data and pipe.data.length:
                raise PlanError(
                    f"{pipe.packet}: a packet-mode pipe (O_DIRECT) holds {pipe.data.length} bytes, "
                    "whose message boundaries ckptd cannot keep; checkpoint while it is empty"
                )
            if pipe.ino in log_pipes:
                st.create.append(f"log {slots.of('w', pipe.ino)} {pipe.ino} {log_pipes[pipe.ino]}")
                continue
            if pipe.fifo_path:
                slot = slots.of("fifo", pipe.ino)
                st.create.append(f"fifo {slot} {pipe.ino} {hex_arg(pipe.fifo_path)}")
                if pipe.data:
                    st.data.append(f"write {slot} {pipe.data.args()}")
                continue
            r, w = slots.of("r", pipe.ino), slots.of("w", pipe.ino)
            st.create.append(f"pipe {r} {w} {pipe.ino} {pipe.size}")
            if pipe.data and pipe.readers:
                st.data.append(f"write {w} {pipe.data.args()}")
            # an end no process of the job holds any more was closed
            if not pipe.readers:
                st.finish.append(f"close {r}")
            if not pipe.writers:
                st.finish.append(f"close {w}")

    def reopens(self, fd: Any) -> bool:
        # a FIFO is opened by its path; one description shared is opened once
        return bool(fd.flags & constant("CK_FDF_FIFO"))

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        return reopen_by_path(holder, fd, slot)
