"""UDP, ICMP ping and raw sockets (native/restorer/plan_dgram.c): each made
once at its slot (processes that share one through fork dup it from there),
bound to its old address and connected to its old peer again, its multicast
groups joined again on interfaces of the same names, then its buffer sizes
and options set.  Queued datagrams are never in an image: the
shim refuses the round until they are read (native/shim/dump_dgram.c)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from ..core import constant
from ..sockaddr import AF_INET, AF_INET6, endpoint
from .planner import Kind, Options, PlanError, Planner, ProcessImage, Steps, hex_arg, options_of

_MCAST = struct.Struct("<II16s16s")  # struct ck_mcast_group: family, ifindex, group, ifname


def _bound(raw: bytes, sock_type: int) -> bool:
    """Whether the socket has a local address to bind again: a UDP or ping
    socket has a port (or ICMP id) once bound, connected or used; a raw
    socket's "port" is its protocol, so only its address tells."""
    if not raw:
        return False
    addr, port = endpoint(raw)
    if sock_type == 3:  # SOCK_RAW
        return addr not in (b"\0" * 16, b"\0" * 10 + b"\xff\xff" + b"\0" * 4)
    return port != 0


@dataclass
class _Dgram:
    ino: int
    family: int
    type: int
    protocol: int
    opts: int
    local: bytes
    peer: bytes
    rcvbuf: int
    sndbuf: int
    options: Options | None
    groups: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (family, address, interface name)


class DgramSockets(Kind):
    fd_types = ("CK_FD_UDP", "CK_FD_RAW")

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.socks: dict[int, _Dgram] = {}

    def gather(self, p: ProcessImage, fd: Any) -> None:
        ino = int(fd.ino)
        if ino in self.socks:
            return  # one socket several processes hold (fork): made once
        self.socks[ino] = _Dgram(
            ino=ino,
            family=int(fd.sock_family),
            type=int(fd.sock_type),
            protocol=int(fd.sock_protocol),
            opts=int(fd.sock_opts),
            local=p.core.blob_bytes(int(fd.name_off), int(fd.name_len)),
            peer=p.core.blob_bytes(int(fd.peer_off), int(fd.peer_len)) if fd.peer_len else b"",
            rcvbuf=int(fd.rcvbuf),
            sndbuf=int(fd.sndbuf),
            options=options_of(p, fd),
            groups=self._groups(p, fd),
        )

    @staticmethod
    def _groups(p: ProcessImage, fd: Any) -> list[tuple[int, bytes, bytes]]:
        n, off = int(fd.nmcast), int(fd.mcast_off)
        raw = p.core.blob_bytes(off, n * _MCAST.size)
        if len(raw) != n * _MCAST.size:
            raise PlanError(f"{p.label()} fd {int(fd.fd)}: corrupt image (multicast groups outside its data)")
        out = []
        for i in range(n):
            family, _, group, name = _MCAST.unpack_from(raw, i * _MCAST.size)
            out.append((family, group[:4] if family == AF_INET else group, name.rstrip(b"\0")))
        return out

    @staticmethod
    def _bind_address(d: _Dgram) -> bytes:
        """The address to bind: the local one, except for an IPv6 socket that
        connect() gave its address and that is not v6-only: binding a
        specific IPv6 address would make it v6-only (the kernel does so), so
        it binds its port on the wildcard and the connect picks the address."""
        addr, _ = endpoint(d.local)
        mapped = addr[:12] == b"\0" * 10 + b"\xff\xff"
        if d.family != AF_INET6 or not d.peer or d.opts & constant("CK_SOCKOPT_V6ONLY") or mapped:
            return d.local
        return d.local[:8] + b"\0" * 16 + d.local[24:]

    def plan(self, st: Steps) -> None:
        for d in self.socks.values():
            slot = self.planner.slots.of("dgram", d.ino)
            st.create.append(f"dgram {slot} {d.ino} {d.family} {d.type} {d.protocol} {d.opts}")
            if _bound(d.local, d.type):
                st.bind.append(f"dgrambind {slot} {hex_arg(self._bind_address(d))}")
            if d.peer:
                st.connect.append(f"dgramconnect {slot} {hex_arg(d.peer)}")
            for family, group, name in d.groups:
                st.connect.append(f"mcast {slot} {family} {hex_arg(name)} {hex_arg(group)}")
            # getsockopt reports twice what setsockopt asked for (the kernel's overhead)
            if d.sndbuf or d.rcvbuf:
                st.finish.append(f"sockbuf {slot} {d.sndbuf // 2} {d.rcvbuf // 2}")
            if d.options:
                st.finish.append(d.options.line(slot))
