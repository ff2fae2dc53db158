"""The planner and what every kind shares: the process image, the slots,
the steps the plan's lines are grouped in, ranges of saved bytes.

Each kind of object (pipe.py, unix.py, tcp.py, shm.py, file.py,
eventfd.py) is a Kind: its own small table of operations that the planner
calls in turn, in the spirit of CRIU's ops tables (criu/eventfd.c) and
DMTCP's per-connection verbs: gather (collect each process's descriptors
and mappings of that kind, matched up across the job), plan (write the
lines that make each object once), reopen (make one open file
description several processes share).  The process tree is tree.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code

from ..core import CoreImage, constant, ffi


class PlanError(CkptdError):
    def __init__(self, message: str) -> None:
        super().__init__(Code.FAILED_PRECONDITION, message)


@dataclass
class ProcessImage:
    """One process of the tree as its image describes it."""

    dir: Path
    core: CoreImage

    @property
    def pid(self) -> int:
        return int(self.core.proc.pid)

    @property
    def ppid(self) -> int:
        return int(self.core.proc.ppid)

    @property
    def pgid(self) -> int:
        return int(self.core.proc.pgid)

    @property
    def sid(self) -> int:
        return int(self.core.proc.sid)

    @property
    def exe(self) -> str:
        return self.core.string(self.core.proc.exe)

    def label(self) -> str:
        return f"pid {self.pid} ({os.path.basename(self.exe) or '?'})"


def hex_arg(data: bytes | str) -> str:
    """Bytes or a path as one word of the plan: hex, "-" for none."""
    raw = data.encode(errors="surrogateescape") if isinstance(data, str) else data
    return raw.hex() or "-"


@dataclass
class Data:
    """Bytes in flight: a range of a saved file."""

    file: Path
    offset: int
    length: int

    def args(self) -> str:
        return f"{hex_arg(str(self.file))} {self.offset} {self.length}"


def in_blob(p: ProcessImage, off: int, length: int) -> Data:
    """A range of p's BLOB section, as a range of its core.img."""
    return Data(p.core.path, p.core.blob_file_offset() + off, length)


def data_of(p: ProcessImage, fd: Any) -> Data | None:
    if not fd.flags & constant("CK_FDF_DATA_SAVED"):
        return None
    return in_blob(p, int(fd.data_off), int(fd.data_len))


@dataclass
class Options:
    """A socket's saved options: ck_sockopt records in a core.img (native/common/sockopts.h)."""

    file: Path
    offset: int
    count: int

    def line(self, slot: int) -> str:
        return f"sockopts {slot} {hex_arg(str(self.file))} {self.offset} {self.count}"


def options_of(p: ProcessImage, fd: Any) -> Options | None:
    off, count = int(fd.sockopt_off), int(fd.nsockopts)
    if not count:
        return None
    if off + count * ffi().sizeof("struct ck_sockopt") > len(p.core.blobs["blob"]):
        raise PlanError(f"{p.label()} fd {int(fd.fd)}: corrupt image (socket options outside its data)")
    return Options(p.core.path, p.core.blob_file_offset() + off, count)


@dataclass
class Steps:
    """The plan's object lines, grouped in the order the builder needs them."""

    create: list[str] = field(default_factory=list)  # every object made once
    bind: list[str] = field(default_factory=list)  # named; listening
    connect: list[str] = field(default_factory=list)  # connected to each other
    data: list[str] = field(default_factory=list)  # the bytes in flight put back
    finish: list[str] = field(default_factory=list)  # unheld ends closed, options set

    def __iter__(self) -> Iterator[str]:
        for group in (self.create, self.bind, self.connect, self.data, self.finish):
            yield from group


class Slots:
    """The descriptor numbers ("slots") the builder makes each object at, in
    the order they are first asked for; every process inherits them."""

    def __init__(self) -> None:
        self.count = 0
        self.by_key: dict[tuple[str, int], int] = {}

    def of(self, kind: str, ino: int) -> int:
        """The slot of one end of an object: ("r"/"w", pipe), ("unix", socket)..."""
        key = (kind, ino)
        if key not in self.by_key:
            self.by_key[key] = self.count
            self.count += 1
        return self.by_key[key]

    def anon(self) -> int:
        """A slot no other line asks for by name."""
        self.count += 1
        return self.count - 1


class Kind:
    """One kind of object: its operations, called by the planner in turn.
    The defaults do nothing, so that a kind says only what it does."""

    fd_types: tuple[str, ...] = ()  # the CK_FD_* descriptors gather() and reopen() get

    def __init__(self, planner: Planner) -> None:
        self.planner = planner

    def gather(self, p: ProcessImage, fd: Any) -> None:
        """One descriptor of this kind (every process's, in pid order)."""

    def gather_vma(self, p: ProcessImage, v: Any) -> None:
        """One mapping (every kind sees every process's)."""

    def plan(self, st: Steps) -> None:
        """The lines that make each object of this kind once, at its slot."""

    def reopens(self, fd: Any) -> bool:
        """Whether reopen() makes an open file description of this kind that
        several processes share (pipes and sockets are shared objects already)."""
        return False

    def reopen(self, holder: ProcessImage, fd: Any, slot: int) -> str:
        """The line that makes one shared open file description at slot."""
        raise NotImplementedError(type(self).__name__)


class Planner:
    def __init__(
        self,
        procs: list[ProcessImage],
        log_pipes: dict[int, int],
        shared: Iterable[Iterable[Iterable[int]]],
        other_ranks: set[bytes],
        kinds: Sequence[type[Kind]],
    ) -> None:
        self.procs = sorted(procs, key=lambda p: p.pid)
        # open file descriptions several processes share: [(pid, fd), ...] each
        self.shared = [[(int(pid), int(fd)) for pid, fd in group] for group in shared]
        self.log_pipes = log_pipes
        self.other_ranks = other_ranks
        self.slots = Slots()
        self.kinds = [kind(self) for kind in kinds]  # planned in this order
        self.by_type = {constant(t): k for k in self.kinds for t in k.fd_types}
        self.fds = {(p.pid, int(fd.fd)): fd for p in self.procs for fd in p.core.records["fds"]}
        # open file descriptions made at a slot for a descriptor in flight, by each [pid, fd] that holds them
        self.desc_slots: dict[tuple[int, int], int] = {}

    def gather(self) -> None:
        in_flight, fifo = constant("CK_FDF_IN_FLIGHT"), constant("CK_FDF_FIFO")
        slot_kinds = (constant("CK_FD_PIPE"), constant("CK_FD_UNIX"))
        for p in self.procs:
            for fd in p.core.records["fds"]:
                kind = self.by_type.get(int(fd.type))
                # a descriptor in flight (a copy the dump took from a socket's
                # queue) is no process's: only a pipe or socket it is one end
                # of must exist; the rest is made when it is sent (flight_slot)
                if fd.flags & in_flight and not (int(fd.type) in slot_kinds and not fd.flags & fifo):
                    continue
                if kind is not None:
                    kind.gather(p, fd)
            for v in p.core.records["vmas"]:
                for kind in self.kinds:
                    kind.gather_vma(p, v)

    def lines(self, processes: Iterable[str]) -> Iterator[str]:
        """The whole plan: its header, the objects, then the processes' lines."""
        st = Steps()
        for kind in self.kinds:
            kind.plan(st)
        self._plan_shared(st)
        maxfd = max((int(fd.fd) for p in self.procs for fd in p.core.records["fds"]), default=2)
        base = max(64, maxfd + 16)
        yield "ckptd-plan 1"
        yield f"slots {base} {self.slots.count}"
        yield from st
        yield from processes

    def flight_slot(self, p: ProcessImage, n: int, st: Steps) -> int:
        """The slot of the object descriptor n of p's image (a copy of a
        descriptor in flight) is, made before the queues are sent again: a
        pipe's or socket's end, or its open file description opened again
        once (every [pid, fd] that shares it takes it from there)."""
        fd = self.fds[(p.pid, n)]
        for _ in range(len(self.fds)):
            if int(fd.type) != constant("CK_FD_DUP"):
                break
            n = int(fd.dup_of)
            fd = self.fds[(p.pid, n)]
        t, ino = int(fd.type), int(fd.ino)
        if t == constant("CK_FD_PIPE") and not fd.flags & constant("CK_FDF_FIFO"):
            return self.slots.of("w" if fd.flags & constant("CK_FDF_PIPE_WRITE_END") else "r", ino)
        if t == constant("CK_FD_UNIX"):
            return self.slots.of("unix", ino)
        kind = self.by_type.get(t)
        if kind is None or not kind.reopens(fd):
            raise PlanError(
                f"{p.label()}: a descriptor in flight in a Unix socket is of a kind ckptd cannot send again"
            )
        root = (p.pid, n)
        if root in self.desc_slots:
            return self.desc_slots[root]
        members = next((g for g in self.shared if root in g), [root])
        slot = self.slots.anon()
        # before the queues (data): the messages are sent with it
        st.connect.append(kind.reopen(p, fd, slot))
        for pid, m in sorted({root, *members}):
            self.desc_slots[(pid, m)] = slot
            st.finish.append(f"desc {slot} {pid} {m}")
        return slot

    def _plan_shared(self, st: Steps) -> None:
        """An open file description several processes share (open, then
        fork; kcmp found them at checkpoint time: agent/descriptions.py) is
        one object, so that they move one offset again.  Pipes and sockets
        are such objects already; these are the kinds each process would
        otherwise open again on its own (each kind's reopens())."""
        fds = {(p.pid, int(fd.fd)): fd for p in self.procs for fd in p.core.records["fds"]}

        def reopened(fd: Any) -> bool:
            kind = self.by_type.get(int(fd.type))
            return kind is not None and kind.reopens(fd)

        for group in self.shared:
            if any(tuple(m) in self.desc_slots for m in group):
                continue  # made already for a descriptor in flight (flight_slot)
            members = [(pid, n) for pid, n in group if (pid, n) in fds and reopened(fds[(pid, n)])]
            if len({pid for pid, _ in members}) < 2:
                continue
            pid, n = members[0]
            holder = next(p for p in self.procs if p.pid == pid)
            fd = fds[(pid, n)]
            slot = self.slots.anon()
            st.finish.append(self.by_type[int(fd.type)].reopen(holder, fd, slot))
            st.finish.extend(f"desc {slot} {p} {f}" for p, f in members)
