"""TCP sockets (native/restorer/plan_tcp.c): listeners bound to their old
addresses; a connection between two of the job's processes made again
with its old four addresses (one half closed, FIN-WAIT-2 to CLOSE-WAIT,
made established, then shut again after its bytes; a CLOSE-WAIT whose
peer was closed on this host gets that end again for the moment, which is
then closed); one end of a
connection to another rank rebuilt alone in repair mode; any other
connection refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core import constant
from ..sockaddr import Endpoint, endpoint, show_endpoint
from .planner import Data, Kind, Options, PlanError, Planner, ProcessImage, Steps, data_of, hex_arg, in_blob, options_of

BIG_QUEUE = 64 << 10  # bytes in flight above which socket buffers are widened first


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
    sendq: Data | None  # the whole send queue: sent and not acknowledged, then unsent


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
    data: Data | None  # the receive queue
    unsent: Data | None  # written, not yet sent
    # a half-closed connection: 1 the peer's FIN arrived (CLOSE-WAIT), 2 this end's FIN was acknowledged
    # (FIN-WAIT-2), 4 with 1: the peer's end was closed on this host, no process holds it
    shutdown: int = 0
    holders: list[tuple[ProcessImage, int]] = field(default_factory=list)
    # the repair-mode state (None without CAP_NET_ADMIN): rebuilds this end alone
    repair: _Repair | None = None
    options: Options | None = None

    @property
    def local_ep(self) -> Endpoint:
        return endpoint(self.local)

    @property
    def peer_ep(self) -> Endpoint:
        return endpoint(self.peer)

    def label(self) -> str:
        p, fd = self.holders[0]
        return f"{p.label()} fd {fd}"

    def show(self) -> str:
        state = {1: " (CLOSE-WAIT)", 2: " (FIN-WAIT-2)"}.get(self.shutdown & 3, "")
        return f"TCP connection {show_endpoint(self.local_ep)} -> {show_endpoint(self.peer_ep)}{state}"


class TcpSockets(Kind):
    fd_types = ("CK_FD_TCP",)

    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.tcp: dict[int, _Tcp] = {}

    def gather(self, p: ProcessImage, fd: Any) -> None:
        ino = int(fd.ino)
        t = self.tcp.get(ino)
        if t is None:
            unsent = in_blob(p, int(fd.sndq_off), int(fd.sndq_len)) if fd.sndq_len else None
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
                data=data_of(p, fd),
                unsent=unsent,
                shutdown=int(fd.shutdown) & 7,
                options=options_of(p, fd),
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
                    sendq=in_blob(p, int(fd.sendq_off), int(fd.sendq_len)) if fd.sendq_len else None,
                )
            self.tcp[ino] = t
        t.holders.append((p, int(fd.fd)))

    def plan(self, st: Steps) -> None:
        """Listeners first, bound to their old addresses; then each connection
        made again with its old four addresses: the client end binds its old
        port and connects, the server end is accepted (from the job's own
        listener on that port, or a temporary one); then the bytes in flight."""
        slots, other_ranks = self.planner.slots, self.planner.other_ranks
        listen, connected = constant("CK_SOCK_LISTEN"), constant("CK_SOCK_CONNECTED")
        listeners: dict[int, list[tuple[bytes, int]]] = {}
        for t in self.tcp.values():
            slot = slots.of("tcp", t.ino)
            st.create.append(f"tcp {slot} {t.ino} {t.family} {t.opts}")
            st.finish.append(f"tcpopts {slot} {t.opts}")
            if t.options:
                st.finish.append(t.options.line(slot))
            if t.state == listen:
                addr, port = t.local_ep
                st.bind.append(f"tcpbind {slot} {hex_arg(t.local)}")
                st.bind.append(f"listen {slot} {max(t.backlog, 1)}")
                listeners.setdefault(port, []).append((addr, slot))
            elif t.state != connected and t.local_ep[1]:
                st.bind.append(f"tcpbind {slot} {hex_arg(t.local)}")

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
            closed = -1  # the slot of a peer's end made again only to be closed
            if peer is None and t.peer_ep[0] in other_ranks:
                self._plan_repair(t, st)
                continue
            if peer is None and t.shutdown & 4:
                # its peer closed, no process holds it: made again for the moment, then closed
                peer = _Tcp(0, t.family, connected, 0, t.peer, t.local, 0, 0, 0, None, None, shutdown=2)
                closed = slots.anon()
                st.create.append(f"tcp {closed} 0 {t.family} 0")
            elif peer is None and t.shutdown & 1:
                raise PlanError(
                    f"{t.label()}: {t.show()} was half closed by a peer outside the job (held by another "
                    "process or on another host); only connections between the job's own processes can be restored"
                )
            if peer is None:
                if other_ranks:
                    raise PlanError(
                        f"{t.label()}: {t.show()} leads outside the job (not to one of its ranks); only "
                        "connections between the job's own processes and ranks can be restored"
                    )
                raise PlanError(
                    f"{t.label()}: {t.show()} leads outside the job; only connections between the job's own "
                    "processes can be restored"
                )
            if (t.shutdown & 3, peer.shutdown & 3) not in ((0, 0), (1, 2), (2, 1)):
                raise PlanError(f"{t.label()}: corrupt image ({t.show()}, its peer's end {peer.show()})")
            done |= {t.ino, peer.ino}
            # the server end is the one on a port the job listens on (the
            # placeholder socket made for it is replaced by the accepted one)
            if listener_for(t.peer_ep) is not None:
                client, server = t, peer
            elif listener_for(peer.peer_ep) is not None:
                client, server = peer, t
            else:
                client, server = (t, peer) if t.ino < peer.ino else (peer, t)
            c, s = (slots.of("tcp", end.ino) if end.ino else closed for end in (client, server))
            lslots = ",".join(str(slot) for slot in listeners_for(server.local_ep)) or "-1"
            st.connect.append(
                f"tcppair {c} {s} {lslots} {server.family} "
                f"{hex_arg(server.local)} {hex_arg(client.local)} {hex_arg(client.peer)}"
            )
            for sender, receiver, ss, rs in ((client, server, c, s), (server, client, s, c)):
                queued = [q for q in (receiver.data, sender.unsent) if q and q.length]
                size = sum(q.length for q in queued)
                if size > BIG_QUEUE:
                    st.data.append(f"sockbuf {ss} {max(sender.sndbuf, size)} 0")
                    st.data.append(f"sockbuf {rs} 0 {max(receiver.rcvbuf, size)}")
                # what the receiver had not read yet, then what the sender had not sent
                st.data.extend(f"write {ss} {q.args()}" for q in queued)
            # half closed: the FIN again, after the bytes; its peer is in CLOSE-WAIT again
            for end, slot, other in ((client, c, s), (server, s, c)):
                if end.shutdown & 2:
                    st.data.append(f"tcpfin {slot}" if end.ino else f"tcpgone {slot} {other}")

    def _plan_repair(self, t: _Tcp, st: Steps) -> None:
        """One end of a connection to another rank: rebuilt alone, in repair
        mode, from its own saved sequence numbers and queues (its peer's rank
        does the same for the other end)."""
        r = t.repair
        if t.shutdown:
            raise PlanError(
                f"{t.label()}: {t.show()} to another rank is half closed; ckptd restores a half-closed "
                "connection only between the job's own processes"
            )
        if r is None:
            raise PlanError(
                f"{t.label()}: TCP connection {show_endpoint(t.local_ep)} -> {show_endpoint(t.peer_ep)} "
                "to another rank was saved without its repair-mode state (ckptd needs CAP_NET_ADMIN for "
                "connections between ranks; run the agents as root)"
            )
        slot = self.planner.slots.of("tcp", t.ino)
        st.connect.append(
            f"tcprepair {slot} {hex_arg(t.local)} {hex_arg(t.peer)} {r.snd_seq} {r.rcv_seq} {r.mss} "
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
