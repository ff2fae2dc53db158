"""The restore plan: how a checkpointed process tree is built again.

Every process's image describes only what that process holds: a pipe end
by inode, a socket with its peer's inode, a shared mapping by device and
inode.  This module matches them up across the whole job and writes the
plan that `ckptd-restore --build` (native/restorer/plan.c) carries out as
pid 2 of the new pid namespace: create each shared object once at a fixed
descriptor number (a "slot") that every process inherits, put back the
bytes that were in flight, then fork the tree with its old pids.

The same planning runs while a checkpoint is taken (before it is
committed), so a tree that could not be restored is refused at checkpoint
time, with the reason, and the job keeps running.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code

from .core import CoreImage, constant, ffi
from .sockaddr import Endpoint, endpoint, ip_sockaddr, show_endpoint

SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET = 1, 2, 5
SHUT_RD, SHUT_WR, SHUT_RDWR = 0, 1, 2
BIG_QUEUE = 64 << 10  # bytes in flight above which socket buffers are widened first


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


@dataclass
class Zombie:
    """A child that had exited but was not yet reaped: it comes back as one."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    wstatus: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Zombie:
        return cls(int(d["pid"]), int(d["ppid"]), int(d["pgid"]), int(d["sid"]), int(d["wstatus"]))


def _hex(data: bytes | str) -> str:
    raw = data.encode(errors="surrogateescape") if isinstance(data, str) else data
    return raw.hex() or "-"


@dataclass
class _Node:
    """A process of the tree to fork: a live one, a zombie, or a helper."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    label: str
    zombie: bool = False


@dataclass
class _Data:
    """Bytes in flight: a range of a saved file."""

    file: Path
    offset: int
    length: int

    def args(self) -> str:
        return f"{_hex(str(self.file))} {self.offset} {self.length}"


@dataclass
class _Pipe:
    ino: int
    readers: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    fifo_path: str = ""
    size: int = 0
    data: _Data | None = None
    packet: str = ""  # an end in packet mode (pipe2 O_DIRECT): who holds it


@dataclass
class _Options:
    """A socket's saved options: ck_sockopt records in a core.img (native/common/sockopts.h)."""

    file: Path
    offset: int
    count: int

    def line(self, slot: int) -> str:
        return f"sockopts {slot} {_hex(str(self.file))} {self.offset} {self.count}"


def _options_of(p: ProcessImage, fd: Any) -> _Options | None:
    off, count = int(fd.sockopt_off), int(fd.nsockopts)
    if not count:
        return None
    if off + count * ffi().sizeof("struct ck_sockopt") > len(p.core.blobs["blob"]):
        raise PlanError(f"{p.label()} fd {int(fd.fd)}: corrupt image (socket options outside its data)")
    return _Options(p.core.path, p.core.blob_file_offset() + off, count)


@dataclass
class _Socket:
    ino: int
    type: int
    state: int
    peer: int
    name: bytes
    shutdown: int
    backlog: int
    data: _Data | None
    holders: list[tuple[ProcessImage, int]] = field(default_factory=list)
    options: _Options | None = None


def _is_wildcard(addr: bytes) -> bool:
    return addr in (b"\0" * 16, b"\0" * 10 + b"\xff\xff" + b"\0" * 4)


@dataclass
class _Repair:
    snd_seq: int
    rcv_seq: int
    mss: int
    snd_wscale: int
    rcv_wscale: int
    tcpi_options: int
    timestamp: int
    window: tuple[int, int, int, int, int]  # snd_wl1 snd_wnd max_window rcv_wnd rcv_wup
    sendq: _Data | None  # the whole send queue: sent and not acknowledged, then unsent


@dataclass
class _Tcp:
    ino: int
    family: int
    state: int
    opts: int
    local: bytes  # raw sockaddr
    peer: bytes
    backlog: int
    rcvbuf: int
    sndbuf: int
    data: _Data | None  # the receive queue
    unsent: _Data | None  # written, not yet sent
    holders: list[tuple[ProcessImage, int]] = field(default_factory=list)
    # the repair-mode state (None without CAP_NET_ADMIN): rebuilds this end alone
    repair: _Repair | None = None
    options: _Options | None = None

    @property
    def local_ep(self) -> Endpoint:
        return endpoint(self.local)

    @property
    def peer_ep(self) -> Endpoint:
        return endpoint(self.peer)

    def label(self) -> str:
        p, fd = self.holders[0]
        return f"{p.label()} fd {fd}"


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


@dataclass
class _Steps:
    """The plan's object lines, grouped in the order the builder needs them."""

    create: list[str] = field(default_factory=list)  # every object made once
    bind: list[str] = field(default_factory=list)  # named; listening
    connect: list[str] = field(default_factory=list)  # connected to each other
    data: list[str] = field(default_factory=list)  # the bytes in flight put back
    finish: list[str] = field(default_factory=list)  # unheld ends closed, options set

    def __iter__(self) -> Iterator[str]:
        for group in (self.create, self.bind, self.connect, self.data, self.finish):
            yield from group


def _in_blob(p: ProcessImage, off: int, length: int) -> _Data:
    """A range of p's BLOB section, as a range of its core.img."""
    return _Data(p.core.path, p.core.blob_file_offset() + off, length)


def _data_of(p: ProcessImage, fd: Any) -> _Data | None:
    if not fd.flags & constant("CK_FDF_DATA_SAVED"):
        return None
    return _in_blob(p, int(fd.data_off), int(fd.data_len))


def _kernel_specials() -> set[str]:
    """The vdso mappings every process gets from this kernel (this one's own):
    [vdso] and [vvar] where it has them ([vvar_vclock] is newer, left out)."""
    try:
        with open("/proc/self/maps") as f:
            names = {line.split()[-1] for line in f if line.rstrip().endswith("]")}
    except OSError:
        return set()
    return names & {"[vdso]", "[vvar]"}


def _shm_name(path: str) -> str:
    name = path.removesuffix(" (deleted)")
    if name.startswith("/memfd:"):
        return name.removeprefix("/memfd:")  # exactly, empty or with a '/' in it
    return os.path.basename(name) or "ckptd-shm"


class _Planner:
    def __init__(
        self,
        procs: list[ProcessImage],
        zombies: list[Zombie],
        log_pipes: dict[int, int],
        shared: Iterable[Iterable[Iterable[int]]] = (),
    ) -> None:
        self.procs = sorted(procs, key=lambda p: p.pid)
        # open file descriptions several processes share: [(pid, fd), ...] each
        self.shared = [[(int(pid), int(fd)) for pid, fd in group] for group in shared]
        self.zombies = zombies
        self.log_pipes = log_pipes
        self.pipes: dict[int, _Pipe] = {}
        self.sockets: dict[int, _Socket] = {}
        self.tcp: dict[int, _Tcp] = {}
        self.other_ranks: set[bytes] = set()
        self.shm: dict[tuple[int, int], _Shm] = {}
        self.next_slot = 0
        self.slots: dict[tuple[str, int], int] = {}
        self.helpers: dict[int, _Node] = {}  # the sessions and groups whose leader has exited, by pid

    # ---- gathering ----

    def gather(self) -> None:
        for p in self.procs:
            for fd in p.core.records["fds"]:
                if fd.type == constant("CK_FD_PIPE"):
                    self._gather_pipe(p, fd)
                elif fd.type == constant("CK_FD_UNIX"):
                    self._gather_socket(p, fd)
                elif fd.type == constant("CK_FD_TCP"):
                    self._gather_tcp(p, fd)
                elif fd.type == constant("CK_FD_SHMEM"):
                    key = (int(fd.dev), int(fd.ino))
                    obj = self.shm.setdefault(key, _Shm(key[0], key[1], 0, _shm_name(p.core.string(fd.path))))
                    obj.file_size = int(fd.size)
                    saved = p.dir / "files" / f"shm-{int(fd.ino)}.data"
                    if obj.fill is None:
                        obj.fill = saved
            for v in p.core.records["vmas"]:
                if v.flags & constant("CK_VMA_SHMEM"):
                    key = (int(v.dev), int(v.ino))
                    obj = self.shm.setdefault(key, _Shm(key[0], key[1], 0, _shm_name(p.core.string(v.path))))
                    obj.size = max(obj.size, int(v.pgoff) + int(v.end) - int(v.start))

    def _gather_pipe(self, p: ProcessImage, fd: Any) -> None:
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
        data = _data_of(p, fd)
        if pipe.data is None and data is not None and data.length:
            pipe.data = data

    def _gather_socket(self, p: ProcessImage, fd: Any) -> None:
        ino = int(fd.ino)
        s = self.sockets.get(ino)
        if s is None:
            name = p.core.blob_bytes(int(fd.name_off), int(fd.name_len))
            s = _Socket(
                ino=ino,
                type=int(fd.sock_type),
                state=int(fd.sock_state),
                peer=int(fd.peer_ino),
                name=name,
                shutdown=int(fd.shutdown),
                backlog=int(fd.backlog),
                data=None,
                options=_options_of(p, fd),
            )
            self.sockets[ino] = s
        data = _data_of(p, fd)
        if s.data is None and data is not None and data.length:
            s.data = data
        s.holders.append((p, int(fd.fd)))

    def _gather_tcp(self, p: ProcessImage, fd: Any) -> None:
        ino = int(fd.ino)
        t = self.tcp.get(ino)
        if t is None:
            unsent = _in_blob(p, int(fd.sndq_off), int(fd.sndq_len)) if fd.sndq_len else None
            t = _Tcp(
                ino=ino,
                family=int(fd.sock_family),
                state=int(fd.sock_state),
                opts=int(fd.sock_opts),
                local=p.core.blob_bytes(int(fd.name_off), int(fd.name_len)),
                peer=p.core.blob_bytes(int(fd.peer_off), int(fd.peer_len)),
                backlog=int(fd.backlog),
                rcvbuf=int(fd.rcvbuf),
                sndbuf=int(fd.sndbuf),
                data=_data_of(p, fd),
                unsent=unsent,
                options=_options_of(p, fd),
            )
            if fd.repair:
                t.repair = _Repair(
                    snd_seq=int(fd.snd_seq),
                    rcv_seq=int(fd.rcv_seq),
                    mss=int(fd.mss),
                    snd_wscale=int(fd.snd_wscale),
                    rcv_wscale=int(fd.rcv_wscale),
                    tcpi_options=int(fd.tcpi_options),
                    timestamp=int(fd.timestamp),
                    window=(int(fd.snd_wl1), int(fd.snd_wnd), int(fd.max_window), int(fd.rcv_wnd), int(fd.rcv_wup)),
                    sendq=_in_blob(p, int(fd.sendq_off), int(fd.sendq_len)) if fd.sendq_len else None,
                )
            self.tcp[ino] = t
        t.holders.append((p, int(fd.fd)))

    # ---- checks on the tree ----

    def check_tree(self) -> None:
        """Every process comes back with its pid, parent, session and group.
        A process forks its children (clone3 set_tid).  An orphan (a child
        of the job's init) is forked with CLONE_PARENT by a child of init in
        its session: pid 2, the orphan leading that session, or a helper.
        A session or group whose leader has exited gets a helper: a process
        with the leader's pid that makes it, forks its orphans and exits
        before the job runs (plan.c)."""
        live = {p.pid: p for p in self.procs}
        if 2 not in live:
            raise PlanError("the job's first process (pid 2) is not in the checkpoint")
        for z in self.zombies:
            if z.ppid not in live:
                raise PlanError(f"zombie pid {z.pid} has a parent (pid {z.ppid}) that is not part of the job")
        nodes = {p.pid: _Node(p.pid, p.ppid, p.pgid, p.sid, p.label()) for p in self.procs}
        nodes.update(
            {z.pid: _Node(z.pid, z.ppid, z.pgid, z.sid, f"zombie pid {z.pid}", zombie=True) for z in self.zombies}
        )
        for n in sorted(nodes.values(), key=lambda n: n.pid):
            if n.sid and n.sid not in nodes:
                nodes[n.sid] = self.helpers[n.sid] = _Node(n.sid, 1, n.sid, n.sid, f"session {n.sid}")
        for n in sorted(nodes.values(), key=lambda n: n.pid):
            if n.pgid and n.pgid not in nodes:
                nodes[n.pgid] = self.helpers[n.pgid] = _Node(n.pgid, 1, n.pgid, n.sid, f"process group {n.pgid}")
        for n in nodes.values():
            if n.pid == 2 or not n.sid or not n.pgid:
                continue
            if n.ppid != 1 and n.ppid not in live:
                raise PlanError(f"{n.label} has a parent (pid {n.ppid}) that is not part of the job")
            if n.ppid == 1:
                spawner = nodes[2 if n.sid == n.pid else n.sid]
                if spawner.ppid != 1 or spawner.zombie:
                    raise PlanError(
                        f"{n.label} was orphaned in session {n.sid}, whose leader (pid {n.sid}) is not a child "
                        "of the job's init; such a tree cannot be rebuilt"
                    )
            elif n.sid not in (n.pid, nodes[n.ppid].sid):
                raise PlanError(
                    f"{n.label} is in session {n.sid}, which its parent left; such a tree cannot be rebuilt"
                )
            if n.pgid != n.pid and nodes[n.pgid].sid != n.sid:
                raise PlanError(
                    f"{n.label} is in process group {n.pgid} of another session; such a group cannot be rebuilt"
                )

    def check_processes(self) -> None:
        """What each process holds that the restorer cannot give back."""
        here = _kernel_specials()
        for p in self.procs:
            has = {
                "[vdso]" if v.flags & constant("CK_VMA_VDSO") else p.core.string(v.path)
                for v in p.core.records["vmas"]
                if v.flags & (constant("CK_VMA_VDSO") | constant("CK_VMA_VVAR"))
            }
            missing = sorted(here - has)
            if missing:
                raise PlanError(
                    f"{p.label()} has unmapped its {' and '.join(missing)}: ckptd cannot restore a process "
                    "without the kernel's vdso"
                )

    # ---- writing ----

    def slot(self, kind: str, ino: int) -> int:
        key = (kind, ino)
        if key not in self.slots:
            self.slots[key] = self.next_slot
            self.next_slot += 1
        return self.slots[key]

    def anon_slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def lines(self) -> Iterator[str]:
        st = _Steps()

        for pipe in self.pipes.values():
            if pipe.packet and pipe.data and pipe.data.length:
                raise PlanError(
                    f"{pipe.packet}: a packet-mode pipe (O_DIRECT) holds {pipe.data.length} bytes, "
                    "whose message boundaries ckptd cannot keep; checkpoint while it is empty"
                )
            if pipe.ino in self.log_pipes:
                st.create.append(f"log {self.slot('w', pipe.ino)} {pipe.ino} {self.log_pipes[pipe.ino]}")
                continue
            if pipe.fifo_path:
                slot = self.slot("fifo", pipe.ino)
                st.create.append(f"fifo {slot} {pipe.ino} {_hex(pipe.fifo_path)}")
                if pipe.data:
                    st.data.append(f"write {slot} {pipe.data.args()}")
                continue
            r, w = self.slot("r", pipe.ino), self.slot("w", pipe.ino)
            st.create.append(f"pipe {r} {w} {pipe.ino} {pipe.size}")
            if pipe.data and pipe.readers:
                st.data.append(f"write {w} {pipe.data.args()}")
            # an end no process of the job holds any more was closed
            if not pipe.readers:
                st.finish.append(f"close {r}")
            if not pipe.writers:
                st.finish.append(f"close {w}")

        done: set[int] = set()
        for s in self.sockets.values():
            if s.ino in done:
                continue
            self._plan_socket(s, done, st)
        for s in self.sockets.values():
            if s.options and ("unix", s.ino) in self.slots:
                st.finish.append(s.options.line(self.slots["unix", s.ino]))

        self._plan_tcp(st)

        for obj in self.shm.values():
            slot = self.slot("shm", obj.ino)
            st.create.append(f"shm {slot} {obj.dev} {obj.ino} {obj.exact_size} {_hex(obj.name)}")
            if obj.fill is not None:
                st.data.append(f"shmfill {slot} {_hex(str(obj.fill))}")

        self._plan_shared(st)

        maxfd = max((int(fd.fd) for p in self.procs for fd in p.core.records["fds"]), default=2)
        base = max(64, maxfd + 16)
        yield "ckptd-plan 1"
        yield f"slots {base} {self.next_slot}"
        yield from st
        for p in self.procs:
            yield f"proc {p.pid} {p.ppid} {p.pgid} {p.sid} {_hex(str(p.dir))}"
        for z in self.zombies:
            yield f"zombie {z.pid} {z.ppid} {z.pgid} {z.sid} {z.wstatus}"
        for h in self.helpers.values():
            yield f"helper {h.pid} {h.sid}"

    def _plan_shared(self, st: _Steps) -> None:
        """An open file description several processes share (open, then
        fork; kcmp found them at checkpoint time: agent/descriptions.py) is
        one object, so that they move one offset again.  Pipes and sockets
        are such objects already; these are the kinds each process would
        otherwise open again on its own."""
        fds = {(p.pid, int(fd.fd)): fd for p in self.procs for fd in p.core.records["fds"]}
        kinds = {constant(k) for k in ("CK_FD_REG", "CK_FD_DIR", "CK_FD_CHR", "CK_FD_SHMEM", "CK_FD_EVENTFD")}
        fifo = constant("CK_FDF_FIFO")

        def reopened(fd: Any) -> bool:
            return fd.type in kinds or (fd.type == constant("CK_FD_PIPE") and bool(fd.flags & fifo))

        for group in self.shared:
            members = [(pid, n) for pid, n in group if (pid, n) in fds and reopened(fds[(pid, n)])]
            if len({pid for pid, _ in members}) < 2:
                continue
            pid, n = members[0]
            holder = next(p for p in self.procs if p.pid == pid)
            fd = fds[(pid, n)]
            slot = self.anon_slot()
            flags = int(fd.open_flags)
            if fd.type == constant("CK_FD_EVENTFD"):
                semaphore = int(bool(fd.flags & constant("CK_FDF_EVENTFD_SEMAPHORE")))
                st.finish.append(f"eventfd {slot} {int(fd.evcount)} {semaphore}")
            elif fd.type == constant("CK_FD_SHMEM"):
                st.finish.append(f"fileshm {slot} {self.slot('shm', int(fd.ino))} {flags} {int(fd.pos)}")
            else:
                path = holder.core.string(fd.path)
                st.finish.append(f"file {slot} {flags} {int(fd.pos)} {_hex(path)}")
            st.finish.extend(f"desc {slot} {p} {f}" for p, f in members)

    def _plan_tcp(self, st: _Steps) -> None:
        """Listeners first, bound to their old addresses; then each connection
        made again with its old four addresses: the client end binds its old
        port and connects, the server end is accepted (from the job's own
        listener on that port, or a temporary one); then the bytes in flight."""
        listen, connected = constant("CK_SOCK_LISTEN"), constant("CK_SOCK_CONNECTED")
        listeners: dict[int, list[tuple[bytes, int]]] = {}
        for t in self.tcp.values():
            slot = self.slot("tcp", t.ino)
            st.create.append(f"tcp {slot} {t.ino} {t.family} {t.opts}")
            st.finish.append(f"tcpopts {slot} {t.opts}")
            if t.options:
                st.finish.append(t.options.line(slot))
            if t.state == listen:
                addr, port = t.local_ep
                st.bind.append(f"tcpbind {slot} {_hex(t.local)}")
                st.bind.append(f"listen {slot} {max(t.backlog, 1)}")
                listeners.setdefault(port, []).append((addr, slot))
            elif t.state != connected and t.local_ep[1]:
                st.bind.append(f"tcpbind {slot} {_hex(t.local)}")

        def listener_for(ep: Endpoint) -> int | None:
            found = listeners_for(ep)
            return found[0] if found else None

        def listeners_for(ep: Endpoint) -> list[int]:
            # several with SO_REUSEPORT: the kernel may hand a connection to any
            return [slot for addr, slot in listeners.get(ep[1], []) if addr == ep[0] or _is_wildcard(addr)]

        ends = {(t.local_ep, t.peer_ep): t for t in self.tcp.values() if t.state == connected}
        done: set[int] = set()
        for t in self.tcp.values():
            if t.state != connected or t.ino in done:
                continue
            peer = ends.get((t.peer_ep, t.local_ep))
            if peer is None and t.peer_ep[0] in self.other_ranks:
                self._plan_tcp_repair(t, st)
                continue
            if peer is None:
                if self.other_ranks:
                    raise PlanError(
                        f"{t.label()}: TCP connection {show_endpoint(t.local_ep)} -> {show_endpoint(t.peer_ep)} "
                        "leads outside the job (not to one of its ranks); only connections between the job's "
                        "own processes and ranks can be restored"
                    )
                raise PlanError(
                    f"{t.label()}: TCP connection {show_endpoint(t.local_ep)} -> {show_endpoint(t.peer_ep)} "
                    "leads outside the job; only connections between the job's own processes can be restored"
                )
            done |= {t.ino, peer.ino}
            # the server end is the one on a port the job listens on (the
            # placeholder socket made for it is replaced by the accepted one)
            if listener_for(t.peer_ep) is not None:
                client, server = t, peer
            elif listener_for(peer.peer_ep) is not None:
                client, server = peer, t
            else:
                client, server = (t, peer) if t.ino < peer.ino else (peer, t)
            c, s = self.slot("tcp", client.ino), self.slot("tcp", server.ino)
            lslots = ",".join(str(slot) for slot in listeners_for(server.local_ep)) or "-1"
            st.connect.append(
                f"tcppair {c} {s} {lslots} {server.family} "
                f"{_hex(server.local)} {_hex(client.local)} {_hex(client.peer)}"
            )
            for sender, receiver, ss, rs in ((client, server, c, s), (server, client, s, c)):
                queued = [q for q in (receiver.data, sender.unsent) if q and q.length]
                size = sum(q.length for q in queued)
                if size > BIG_QUEUE:
                    st.data.append(f"sockbuf {ss} {max(sender.sndbuf, size)} 0")
                    st.data.append(f"sockbuf {rs} 0 {max(receiver.rcvbuf, size)}")
                # what the receiver had not read yet, then what the sender had not sent
                st.data.extend(f"write {ss} {q.args()}" for q in queued)

    def _plan_tcp_repair(self, t: _Tcp, st: _Steps) -> None:
        """One end of a connection to another rank: rebuilt alone, in repair
        mode, from its own saved sequence numbers and queues (its peer's rank
        does the same for the other end)."""
        r = t.repair
        if r is None:
            raise PlanError(
                f"{t.label()}: TCP connection {show_endpoint(t.local_ep)} -> {show_endpoint(t.peer_ep)} "
                "to another rank was saved without its repair-mode state (ckptd needs CAP_NET_ADMIN for "
                "connections between ranks; run the agents as root)"
            )
        slot = self.slot("tcp", t.ino)
        st.connect.append(
            f"tcprepair {slot} {_hex(t.local)} {_hex(t.peer)} {r.snd_seq} {r.rcv_seq} {r.mss} "
            f"{r.snd_wscale} {r.rcv_wscale} {r.tcpi_options} {r.timestamp}"
        )
        rcv = t.data.length if t.data else 0
        snd = r.sendq.length if r.sendq else 0
        if rcv or snd:
            st.data.append(f"sockbuf {slot} {max(t.sndbuf, 2 * snd + 65536)} {max(t.rcvbuf, 2 * rcv + 65536)}")
        if t.data and t.data.length:
            st.data.append(f"repairq {slot} 1 {t.data.args()}")
        if r.sendq:
            st.data.append(f"repairq {slot} 2 {r.sendq.args()}")
        st.data.append(f"repairoff {slot} {' '.join(str(w) for w in r.window)}")

    def _refuse_socket(self, s: _Socket, why: str) -> None:
        # a socket inherited from outside on stdin/stdout/stderr is replaced by the log
        if all(fd <= 2 for _, fd in s.holders):
            return
        p, fd = next((h for h in s.holders if h[1] > 2), s.holders[0])
        raise PlanError(f"{p.label()} fd {fd}: Unix socket {why}")

    def _send_queue(self, s: _Socket, via: int, data: list[str]) -> None:
        if not s.data:
            return
        op = "write" if s.type == SOCK_STREAM else "messages"
        data.append(f"{op} {via} {s.data.args()}")

    def _plan_socket(self, s: _Socket, done: set[int], st: _Steps) -> None:
        done.add(s.ino)
        listen = constant("CK_SOCK_LISTEN")
        connected = s.state == constant("CK_SOCK_CONNECTED")
        peer = self.sockets.get(s.peer) if s.peer else None
        if s.state == listen:
            slot = self.slot("unix", s.ino)
            st.create.append(f"socket {slot} {s.ino} {s.type}")
            if not s.name:
                return self._refuse_socket(s, "listens without an address")
            st.bind.append(f"bind {slot} {_hex(s.name)}")
            st.bind.append(f"listen {slot} {max(s.backlog, 1)}")
            return None
        if peer is not None and peer.peer == s.ino:
            # both ends in the job: one socketpair
            done.add(peer.ino)
            a, b = self.slot("unix", s.ino), self.slot("unix", peer.ino)
            st.create.append(f"socketpair {a} {s.ino} {b} {peer.ino} {s.type}")
            self._send_queue(s, b, st.data)
            self._send_queue(peer, a, st.data)
            for sock, slot in ((s, a), (peer, b)):
                how = {1: SHUT_RD, 2: SHUT_WR, 3: SHUT_RDWR}.get(sock.shutdown & 3)
                if how is not None:
                    st.finish.append(f"shutdown {slot} {how}")
            return None
        if s.peer and peer is None:
            return self._refuse_socket(s, f"is connected to a process outside the job (peer inode {s.peer})")
        slot = self.slot("unix", s.ino)
        if connected and s.peer == 0 and s.type != SOCK_DGRAM:
            # the peer closed: a pair whose other end is closed once the data is back
            other = self.anon_slot()
            st.create.append(f"socketpair {slot} {s.ino} {other} 0 {s.type}")
            self._send_queue(s, other, st.data)
            st.finish.append(f"close {other}")
            return None
        st.create.append(f"socket {slot} {s.ino} {s.type}")
        if s.name:
            st.bind.append(f"bind {slot} {_hex(s.name)}")
        if peer is not None:
            # a datagram socket connected to a bound one that did not connect back
            if not peer.name:
                return self._refuse_socket(s, "is connected to a socket without an address")
            st.connect.append(f"connect {slot} {_hex(peer.name)}")
            if s.data:
                return self._refuse_socket(s, "has queued datagrams from the socket it is connected to")
            return None
        if s.data:
            if s.type != SOCK_DGRAM or not s.name:
                return self._refuse_socket(s, "has queued data but neither a peer nor an address")
            st.data.append(f"sendto {s.type} {_hex(s.name)} {s.data.args()}")
        return None


def build_plan(
    procs: list[ProcessImage],
    zombies: list[Zombie],
    log_pipes: dict[int, int],
    other_ranks: Iterable[str] = (),
    shared: Iterable[Iterable[Iterable[int]]] = (),
) -> str:
    """The plan's text; PlanError says why a tree cannot be rebuilt.
    other_ranks: the addresses of the job's other ranks (their connections
    are rebuilt one end at a time); shared: the open file descriptions
    several processes share, each as its [pid, fd] pairs."""
    planner = _Planner(procs, zombies, log_pipes, shared)
    planner.other_ranks = {endpoint(ip_sockaddr(a))[0] for a in other_ranks}
    planner.gather()
    planner.check_tree()
    planner.check_processes()
    return "\n".join(planner.lines()) + "\n"


def load_processes(checkpoint: Path, manifest: dict[str, Any]) -> list[ProcessImage]:
    return [
        ProcessImage(checkpoint / p["dir"], CoreImage.load(checkpoint / p["dir"] / "core.img"))
        for p in manifest.get("processes", [])
    ]


def plan_for_checkpoint(checkpoint: Path, manifest: dict[str, Any]) -> str:
    zombies = [Zombie.from_dict(z) for z in manifest.get("zombies", [])]
    log_pipes = {int(ino): fd for fd, ino in ((1, manifest.get("stdout_ino", 0)), (2, manifest.get("stderr_ino", 0)))}
    log_pipes.pop(0, None)
    return build_plan(
        load_processes(checkpoint, manifest),
        zombies,
        log_pipes,
        manifest.get("other_ranks", []),
        manifest.get("shared_files", []),
    )
