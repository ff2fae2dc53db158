"""Unix sockets: each made once (native/restorer/plan_unix.c): a pair whose
two ends are both in the job is one socketpair; a listener binds its old
address, and the connections in its backlog (made, not yet accepted) are
made again by connecting their client ends to it, in accept order; the
bytes and datagrams in flight are sent again, a message that carried
descriptors (SCM_RIGHTS) with the objects they were made again as, at the
same boundaries; a socket connected to a process outside the job is
refused."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from ..core import constant
from .planner import Data, Kind, Options, PlanError, Planner, ProcessImage, Steps, data_of, hex_arg, options_of

SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET = 1, 2, 5
SHUT_RD, SHUT_WR, SHUT_RDWR = 0, 1, 2


@dataclass
class _Socket:
    ino: int
    type: int
    state: int
    peer: int
    name: bytes
    shutdown: int
    backlog: int
    data: Data | None
    holders: list[tuple[ProcessImage, int]] = field(default_factory=list)
    options: Options | None = None
    # a listener's backlog: the inodes of its connections' client ends, in
    # accept order (native/shim/dump_sockets.c save_backlog)
    pending: list[int] = field(default_factory=list)
    # the messages that carry descriptors (native/shim/dump_sockets.c): (at,
    # len, descriptor numbers in rights_from's image), at: a stream's offset,
    # else the record's index
    rights: list[tuple[int, int, list[int]]] = field(default_factory=list)
    rights_from: ProcessImage | None = None
    raw: bytes = b""  # the queue's saved bytes, where rights must split them


def _rights_of(p: ProcessImage, fd: Any) -> list[tuple[int, int, list[int]]]:
    out = []
    raw = p.core.blob_bytes(int(fd.rights_off), len(p.core.blobs["blob"]) - int(fd.rights_off))
    pos = 0
    for _ in range(int(fd.nrights)):
        if pos + 16 > len(raw):
            raise PlanError(f"{p.label()} fd {int(fd.fd)}: corrupt image (descriptors in flight outside its data)")
        at, length, nfds = struct.unpack_from("<QII", raw, pos)
        pos += 16
        fds = list(struct.unpack_from(f"<{nfds}i", raw, pos))
        pos += (nfds * 4 + 7) // 8 * 8
        out.append((at, length, fds))
    return out


class UnixSockets(Kind):
    fd_types = ("CK_FD_UNIX",)

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.sockets: dict[int, _Socket] = {}

    def gather(self, p: ProcessImage, fd: Any) -> None:
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
                options=options_of(p, fd),
            )
            self.sockets[ino] = s
        data = data_of(p, fd)
        if s.state == constant("CK_SOCK_LISTEN"):
            if data is not None and not s.pending:
                raw = p.core.blob_bytes(int(fd.data_off), int(fd.data_len))
                s.pending = list(struct.unpack(f"<{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
        elif s.data is None and data is not None and data.length:
            s.data = data
            if fd.nrights:
                s.rights, s.rights_from = _rights_of(p, fd), p
                s.raw = p.core.blob_bytes(int(fd.data_off), int(fd.data_len))
        s.holders.append((p, int(fd.fd)))

    def plan(self, st: Steps) -> None:
        done: set[int] = set()
        listen = constant("CK_SOCK_LISTEN")
        # listeners first: the client ends of their backlogs are made with them
        for s in sorted(self.sockets.values(), key=lambda s: s.state != listen):
            if s.ino in done:
                continue
            self._plan_socket(s, done, st)
        slots = self.planner.slots.by_key
        for s in self.sockets.values():
            if s.options and ("unix", s.ino) in slots:
                st.finish.append(s.options.line(slots["unix", s.ino]))

    def _refuse_socket(self, s: _Socket, why: str) -> None:
        # a socket inherited from outside on stdin/stdout/stderr is replaced by the log
        if all(fd <= 2 for _, fd in s.holders):
            return
        p, fd = next((h for h in s.holders if h[1] > 2), s.holders[0])
        raise PlanError(f"{p.label()} fd {fd}: Unix socket {why}")

    def _send_queue(self, s: _Socket, via: int, st: Steps) -> None:
        if not s.data:
            return
        op = "write" if s.type == SOCK_STREAM else "messages"
        if not s.rights or s.rights_from is None:
            st.data.append(f"{op} {via} {s.data.args()}")
            return
        # split where the messages that carry descriptors are: the rest as before
        file, base = hex_arg(str(s.data.file)), s.data.offset
        if s.type == SOCK_STREAM:
            spans = [(at, length, fds) for at, length, fds in s.rights]
        else:
            starts, pos = [], 0  # each record: (offset of its length word, its length)
            while pos + 4 <= len(s.raw):
                (n,) = struct.unpack_from("<I", s.raw, pos)
                starts.append((pos, n))
                pos += 4 + n
            spans = []
            for at, length, fds in s.rights:
                if at >= len(starts) or starts[at][1] != length:
                    raise PlanError(f"{s.rights_from.label()}: corrupt image (a message with descriptors in flight)")
                spans.append((starts[at][0], 4 + length, fds))
        done = 0
        for at, length, fds in spans:
            if at > done:
                st.data.append(f"{op} {via} {file} {base + done} {at - done}")
            slots = [self.planner.flight_slot(s.rights_from, n, st) for n in fds]
            skip = 0 if s.type == SOCK_STREAM else 4
            st.data.append(f"rights {via} {file} {base + at + skip} {length - skip} {','.join(map(str, slots))}")
            done = at + length
        if done < s.data.length:
            st.data.append(f"{op} {via} {file} {base + done} {s.data.length - done}")

    def _plan_pending(self, listener: _Socket, ino: int, done: set[int], st: Steps) -> None:
        """A connection in listener's backlog: its client end connects to the
        rebuilt listener (the connects run in order: accept order is kept)."""
        client = self.sockets.get(ino)
        if client is None or ino in done:
            return self._refuse_socket(
                listener, f"has a connection not yet accepted from a process outside the job (inode {ino})"
            )
        done.add(ino)
        if client.data:  # the server cannot have sent anything yet
            return self._refuse_socket(client, "has queued data from a connection not yet accepted")
        slot = self.planner.slots.of("unix", ino)
        st.create.append(f"socket {slot} {ino} {client.type}")
        if client.name:
            st.bind.append(f"bind {slot} {hex_arg(client.name)}")
        st.connect.append(f"connect {slot} {hex_arg(listener.name)}")
        how = {1: SHUT_RD, 2: SHUT_WR, 3: SHUT_RDWR}.get(client.shutdown & 3)
        if how is not None:
            st.finish.append(f"shutdown {slot} {how}")
        return None

    def _plan_socket(self, s: _Socket, done: set[int], st: Steps) -> None:
        done.add(s.ino)
        slots = self.planner.slots
        listen = constant("CK_SOCK_LISTEN")
        connected = s.state == constant("CK_SOCK_CONNECTED")
        peer = self.sockets.get(s.peer) if s.peer else None
        if s.state == listen:
            slot = slots.of("unix", s.ino)
            st.create.append(f"socket {slot} {s.ino} {s.type}")
            if not s.name:
                return self._refuse_socket(s, "listens without an address")
            st.bind.append(f"bind {slot} {hex_arg(s.name)}")
            st.bind.append(f"listen {slot} {max(s.backlog, 1)}")
            for ino in s.pending:
                self._plan_pending(s, ino, done, st)
            return None
        if peer is not None and peer.peer == s.ino:
            # both ends in the job: one socketpair
            done.add(peer.ino)
            a, b = slots.of("unix", s.ino), slots.of("unix", peer.ino)
            st.create.append(f"socketpair {a} {s.ino} {b} {peer.ino} {s.type}")
            self._send_queue(s, b, st)
            self._send_queue(peer, a, st)
            for sock, slot in ((s, a), (peer, b)):
                how = {1: SHUT_RD, 2: SHUT_WR, 3: SHUT_RDWR}.get(sock.shutdown & 3)
                if how is not None:
                    st.finish.append(f"shutdown {slot} {how}")
            return None
        if s.peer and peer is None:
            return self._refuse_socket(s, f"is connected to a process outside the job (peer inode {s.peer})")
        slot = slots.of("unix", s.ino)
        if connected and s.peer == 0 and s.type != SOCK_DGRAM:
            # the peer closed: a pair whose other end is closed once the data is back
            other = slots.anon()
            st.create.append(f"socketpair {slot} {s.ino} {other} 0 {s.type}")
            self._send_queue(s, other, st)
            st.finish.append(f"close {other}")
            return None
        st.create.append(f"socket {slot} {s.ino} {s.type}")
        if s.name:
            st.bind.append(f"bind {slot} {hex_arg(s.name)}")
        if peer is not None:
            # a datagram socket connected to a bound one that did not connect back
            if not peer.name:
                return self._refuse_socket(s, "is connected to a socket without an address")
            st.connect.append(f"connect {slot} {hex_arg(peer.name)}")
            if s.data:
                return self._refuse_socket(s, "has queued datagrams from the socket it is connected to")
            return None
        if s.data:
            if s.type != SOCK_DGRAM or not s.name:
                return self._refuse_socket(s, "has queued data but neither a peer nor an address")
            if s.rights:
                return self._refuse_socket(
                    s,
                    "has datagrams from unconnected senders that carry descriptors in flight; "
                    "ckptd cannot send them again",
                )
            st.data.append(f"sendto {s.type} {hex_arg(s.name)} {s.data.args()}")
        return None
