"""Pseudo-terminals: each pair made once at its number, /dev/pts/N, in the
job's own devpts instance (native/restorer/plan_pty.c), with the slave's
termios, window size, lock, packet mode and the bytes its master had not
read; every holder of the master takes that one description, every holder
of the slave opens it again by path (native/restorer/fds.c).  A session's
controlling terminal that is one of them comes back to the whole session
(ctty lines, native/restorer/plan_tree.c)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..core import constant
from .planner import Data, Kind, PlanError, Planner, ProcessImage, Steps, data_of, hex_arg


@dataclass
class _Pty:
    index: int
    master: Any = None  # the first master record: the pair's state
    slaves: list[str] = field(default_factory=list)
    data: Data | None = None


class Ptys(Kind):
    fd_types = ("CK_FD_PTY_MASTER", "CK_FD_PTY_SLAVE")

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.ptys: dict[int, _Pty] = {}

    def gather(self, p: ProcessImage, fd: Any) -> None:
        index = int(fd.pty_index)
        pty = self.ptys.setdefault(index, _Pty(index))
        if fd.type == constant("CK_FD_PTY_SLAVE"):
            pty.slaves.append(f"{p.label()} fd {int(fd.fd)}")
            return
        if pty.master is None:
            pty.master = fd
        data = data_of(p, fd)
        if pty.data is None and data is not None and data.length:
            pty.data = data

    def plan(self, st: Steps) -> None:
        for index in sorted(self.ptys):  # in order: plan_pty.c takes the numbers below as fillers
            pty = self.ptys[index]
            if pty.master is None:
                raise PlanError(
                    f"{pty.slaves[0]}: the master of /dev/pts/{index} is held by no process of the job "
                    "(closed, or outside it): ckptd cannot make the pair again"
                )
            fd = pty.master
            state = int(fd.pty_state)
            if state & constant("CK_PTY_LOCKED") and pty.slaves:
                raise PlanError(
                    f"{pty.slaves[0]}: /dev/pts/{index} was locked again (TIOCSPTLCK) while its slave is open: "
                    "ckptd could not open the slave again; unlock it (unlockpt) before a checkpoint"
                )
            if pty.slaves:
                state &= ~constant("CK_PTY_HUP")
            termios = bytes(int(b) for b in fd.termios).hex()
            winsize = " ".join(str(int(v)) for v in fd.winsize)
            data = pty.data.args() if pty.data else f"{hex_arg('')} 0 0"
            st.create.append(f"pty {self.slot(index)} {index} {state} {termios} {winsize} {data}")
        self._controlling_terminals(st)

    def slot(self, index: int) -> int:
        return self.planner.slots.of("pty", index)

    def _controlling_terminals(self, st: Steps) -> None:
        """A controlling terminal belongs to a session: its leader takes it
        back before it forks, and every member inherits it."""
        procs = {p.pid: p for p in self.planner.procs}

        def ctty(p: ProcessImage | None) -> tuple[int, int] | None:
            kind = int(p.core.proc.ctty_kind) if p else 0
            return (kind, int(p.core.proc.ctty_index)) if p and kind else None

        for p in self.planner.procs:
            if ctty(p) != ctty(procs.get(p.sid)):
                raise PlanError(
                    f"{p.label()}: its controlling terminal is not its session leader's (pid {p.sid}): "
                    "ckptd gives a controlling terminal back to a whole session"
                )
            tty = ctty(p)
            if p.pid != p.sid or tty is None:
                continue
            kind, index = tty
            if index not in self.ptys or self.ptys[index].master is None:
                raise PlanError(
                    f"{p.label()}: its controlling terminal /dev/pts/{index} has no master in the job "
                    "(closed, or outside it): ckptd cannot make it again"
                )
            pgrp = int(p.core.proc.ctty_pgrp)
            if pgrp > 0 and pgrp not in {q.pgid for q in procs.values() if q.sid == p.sid}:
                raise PlanError(
                    f"{p.label()}: the foreground process group {pgrp} of its controlling terminal has no "
                    "process left: ckptd cannot make it the foreground again"
                )
            slave = int(kind == constant("CK_FD_PTY_SLAVE"))
            st.finish.append(f"ctty {p.sid} {slave} {self.slot(index)} {pgrp}")

    def reopens(self, fd: Any) -> bool:
        # a slave's description several processes share is opened once; a
        # master's is the pair's own (its slot)
        return bool(fd.type == constant("CK_FD_PTY_SLAVE"))

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        path = holder.core.string(fd.path)
        return f"file {slot} {int(fd.open_flags) | os.O_NOCTTY} 0 {hex_arg(path)}"
