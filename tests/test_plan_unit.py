"""The restore planner (ckptd/image/plan/) on synthetic images: small
core.img files written here through the very header the shim writes them
with (ckptd/image/core.py's cffi), read back by CoreImage.load, planned
without running any process.  Each test checks the plan lines its kind
emits; the restorer (native/restorer/plan*.c) parses exactly these words."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ckptd.image.core import CoreImage, constant, ffi
from ckptd.image.plan import PlanError, ProcessImage, Zombie, build_plan
from ckptd.image.sockaddr import ip_sockaddr

PIPE_SIZE = 65536
ABSTRACT = b"\0dgram"  # an abstract Unix socket name


def hx(data: bytes | str | Path) -> str:
    raw = data if isinstance(data, bytes) else str(data).encode()
    return raw.hex() or "-"


def _kernel_specials() -> list[bytes]:
    """The vdso mappings this kernel gives every process: an image without
    them is refused (a process that unmapped its vdso)."""
    with open("/proc/self/maps") as f:
        names = {line.split()[-1] for line in f if line.rstrip().endswith("]")}
    return [n.encode() for n in sorted(names & {"[vdso]", "[vvar]"})]


class Image:
    """One process's core.img, put together record by record."""

    def __init__(self, pid: int, ppid: int = 1, pgid: int | None = None, sid: int | None = None) -> None:
        self.proc = {"pid": pid, "ppid": ppid, "pgid": pgid or pid, "sid": sid or pid}
        self.strings = bytearray(b"\0")
        self.blob = bytearray()
        self.fds: list[dict[str, Any]] = []
        self.vmas: list[dict[str, Any]] = []
        self.proc["exe"] = self.string("/usr/bin/prog")
        for i, name in enumerate(_kernel_specials()):
            flag = "CK_VMA_VDSO" if name == b"[vdso]" else "CK_VMA_VVAR"
            start = 0x7FFF0000 + i * 0x4000
            self.vmas.append(
                {"start": start, "end": start + 0x2000, "flags": constant(flag), "path": self.string(name)}
            )

    def string(self, s: str | bytes) -> int:
        off = len(self.strings)
        self.strings += (s.encode() if isinstance(s, str) else s) + b"\0"
        return off

    def data(self, raw: bytes) -> tuple[int, int]:
        """raw in the BLOB section: (its offset there, its length)."""
        off = len(self.blob)
        self.blob += raw
        return off, len(raw)

    def fd(self, n: int, kind: str, *, queued: bytes = b"", path: str = "", **fields: Any) -> int:
        """A descriptor; queued: its bytes in flight; returns where they lie in the BLOB."""
        rec = {"fd": n, "type": constant(kind), **fields}
        if path:
            rec["path"] = self.string(path)
        off = 0
        if queued:
            off, rec["data_len"] = self.data(queued)
            rec["data_off"] = off
            rec["flags"] = rec.get("flags", 0) | constant("CK_FDF_DATA_SAVED")
        self.fds.append(rec)
        return off

    def write(self, directory: Path) -> ProcessImage:
        f = ffi()
        sections = [
            ("CK_SEC_PROC", [self._record("struct ck_proc", self.proc)], 1),
            ("CK_SEC_VMAS", [self._record("struct ck_vma", v) for v in self.vmas], len(self.vmas)),
            ("CK_SEC_FDS", [self._record("struct ck_fd", d) for d in self.fds], len(self.fds)),
            ("CK_SEC_STRINGS", [bytes(self.strings)], len(self.strings)),
            ("CK_SEC_BLOB", [bytes(self.blob)], len(self.blob)),
        ]
        header = f.new("struct ck_header *")
        header.magic = constant("CK_CORE_MAGIC")
        header.version = constant("CK_CORE_VERSION")
        header.nsections = len(sections)
        body = bytearray()
        offset = f.sizeof("struct ck_header")
        for i, (kind, parts, count) in enumerate(sections):
            raw = b"".join(parts)
            s = header.sections[i]
            s.type, s.count, s.offset, s.size = constant(kind), count, offset + len(body), len(raw)
            body += raw + b"\0" * (-len(raw) % 8)
        header.file_size = offset + len(body)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "core.img").write_bytes(bytes(f.buffer(header)) + bytes(body))
        return ProcessImage(directory, CoreImage.load(directory / "core.img"))

    @staticmethod
    def _record(ctype: str, fields: dict[str, Any]) -> bytes:
        f = ffi()
        rec = f.new(f"{ctype} *")
        for name, value in fields.items():
            setattr(rec, name, value)
        return bytes(f.buffer(rec))


def images(tmp: Path, *imgs: Image) -> list[ProcessImage]:
    return [img.write(tmp / f"proc-{img.proc['pid']}") for img in imgs]


def blob_at(p: ProcessImage, off: int, length: int) -> str:
    """The plan's reference to a range of p's BLOB section (a range of its core.img)."""
    return f"{hx(p.core.path)} {p.core.blob_file_offset() + off} {length}"


def plan_lines(procs: list[ProcessImage], zombies: list[Zombie] | None = None, **kw: Any) -> list[str]:
    text = build_plan(procs, zombies or [], kw.pop("log_pipes", {}), **kw)
    assert text.endswith("\n")
    lines = text.splitlines()
    assert lines[0] == "ckptd-plan 1"
    return lines


def body(lines: list[str]) -> list[str]:
    """The object lines: without the header and the process lines."""
    return [ln for ln in lines[2:] if not ln.startswith(("proc ", "zombie ", "helper "))]


def procs_of(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith(("proc ", "zombie ", "helper "))]


# ---- pipes ----


def test_pipe_shared_by_two_processes(tmp_path: Path) -> None:
    parent, child = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    wend = constant("CK_FDF_PIPE_WRITE_END")
    off = parent.fd(4, "CK_FD_PIPE", ino=77, flags=wend, pipe_size=PIPE_SIZE, queued=b"in flight")
    child.fd(3, "CK_FD_PIPE", ino=77, pipe_size=PIPE_SIZE)
    p2, p3 = images(tmp_path, parent, child)
    lines = plan_lines([p3, p2])
    assert lines[1] == "slots 64 2"
    assert body(lines) == ["pipe 0 1 77 65536", f"write 1 {blob_at(p2, off, 9)}"]
    assert procs_of(lines) == [f"proc 2 1 2 2 {hx(p2.dir)}", f"proc 3 2 2 2 {hx(p3.dir)}"]


def test_pipe_ends_fifo_and_log(tmp_path: Path) -> None:
    img = Image(2)
    img.fd(3, "CK_FD_PIPE", ino=10, pipe_size=PIPE_SIZE)  # its write end was closed
    img.fd(4, "CK_FD_PIPE", ino=11, flags=constant("CK_FDF_FIFO"), path="/tmp/fifo", queued=b"x")
    img.fd(100, "CK_FD_PIPE", ino=12, flags=constant("CK_FDF_PIPE_WRITE_END"))  # the job's stdout
    (p,) = images(tmp_path, img)
    assert plan_lines([p], log_pipes={12: 1})[1:-1] == [
        "slots 116 4",
        "pipe 0 1 10 65536",
        f"fifo 2 11 {hx('/tmp/fifo')}",
        "log 3 12 1",
        f"write 2 {blob_at(p, 0, 1)}",
        "close 1",
    ]


def test_packet_pipe_with_data_is_refused(tmp_path: Path) -> None:
    img = Image(2)
    img.fd(5, "CK_FD_PIPE", ino=9, open_flags=os.O_DIRECT, queued=b"msg")
    with pytest.raises(PlanError, match=r"pid 2 \(prog\) fd 5: a packet-mode pipe \(O_DIRECT\) holds 3 bytes"):
        build_plan(images(tmp_path, img), [], {})


# ---- Unix sockets ----


def test_unix_socketpair_across_processes(tmp_path: Path) -> None:
    a, b = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    stream, connected = 1, constant("CK_SOCK_CONNECTED")
    off = a.fd(3, "CK_FD_UNIX", ino=20, peer_ino=21, sock_type=stream, sock_state=connected, queued=b"to b")
    b.fd(3, "CK_FD_UNIX", ino=21, peer_ino=20, sock_type=stream, sock_state=connected, shutdown=2)
    pa, pb = images(tmp_path, a, b)
    assert body(plan_lines([pa, pb])) == [
        "socketpair 0 20 1 21 1",
        f"write 1 {blob_at(pa, off, 4)}",
        "shutdown 1 1",
    ]


def test_unix_listener_and_datagrams(tmp_path: Path) -> None:
    img = Image(2)
    name_off, name_len = img.data(b"/tmp/srv.sock\0")
    img.fd(3, "CK_FD_UNIX", ino=30, sock_type=1, sock_state=constant("CK_SOCK_LISTEN"), backlog=5,
           name_off=name_off, name_len=name_len)  # fmt: skip
    dgram_off, dgram_len = img.data(ABSTRACT)
    off = img.fd(4, "CK_FD_UNIX", ino=31, sock_type=2, name_off=dgram_off, name_len=dgram_len, queued=b"\3\0\0\0abc")
    (p,) = images(tmp_path, img)
    assert body(plan_lines([p])) == [
        "socket 0 30 1",
        "socket 1 31 2",
        f"bind 0 {hx(b'/tmp/srv.sock' + bytes(1))}",
        "listen 0 5",
        f"bind 1 {hx(ABSTRACT)}",
        f"sendto 2 {hx(ABSTRACT)} {blob_at(p, off, 7)}",
    ]


def _backlog(img: Image, ino: int, pending: list[int]) -> bytes:
    """A Unix listener at fd 3 whose backlog holds connections from these client inodes."""
    name = b"/tmp/srv.sock"
    name_off, name_len = img.data(name)
    img.fd(3, "CK_FD_UNIX", ino=ino, sock_type=1, sock_state=constant("CK_SOCK_LISTEN"), backlog=4,
           name_off=name_off, name_len=name_len, nqueued=len(pending),
           queued=b"".join(i.to_bytes(4, "little") for i in pending))  # fmt: skip
    return name


def test_unix_listener_backlog_connected_again_in_order(tmp_path: Path) -> None:
    """The client ends of a listener's pending connections (connected, no
    peer inode: the server end is in no process) connect to the rebuilt
    listener after it listens, in accept order; one shut for writing is shut again."""
    server, client = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    name = _backlog(server, 60, [62, 61])
    connected = constant("CK_SOCK_CONNECTED")
    client.fd(4, "CK_FD_UNIX", ino=61, sock_type=1, sock_state=connected)
    own_off, own_len = client.data(b"/tmp/cl.sock")
    client.fd(5, "CK_FD_UNIX", ino=62, sock_type=1, sock_state=connected, shutdown=2,
              name_off=own_off, name_len=own_len)  # fmt: skip
    lines = body(plan_lines(images(tmp_path, server, client)))
    assert lines == [
        "socket 0 60 1",
        "socket 1 62 1",
        "socket 2 61 1",
        f"bind 0 {hx(name)}",
        "listen 0 4",
        f"bind 1 {hx(b'/tmp/cl.sock')}",
        f"connect 1 {hx(name)}",
        f"connect 2 {hx(name)}",
        "shutdown 1 1",
    ], lines


def test_unix_listener_backlog_from_outside_is_refused(tmp_path: Path) -> None:
    img = Image(2)
    _backlog(img, 60, [61])
    with pytest.raises(PlanError, match=r"^pid 2 \(prog\) fd 3: Unix socket has a connection not yet accepted from a "):
        build_plan(images(tmp_path, img), [], {})


def test_unix_socket_to_outside_is_refused(tmp_path: Path) -> None:
    img = Image(2)
    img.fd(7, "CK_FD_UNIX", ino=40, peer_ino=41, sock_type=1, sock_state=constant("CK_SOCK_CONNECTED"))
    with pytest.raises(PlanError, match=r"^pid 2 \(prog\) fd 7: Unix socket is connected to a process outside the job"):
        build_plan(images(tmp_path, img), [], {})


# ---- TCP ----


def _tcp(img: Image, n: int, ino: int, state: str, local: bytes, *, peer: bytes = b"", **fields: Any) -> int:
    lo, ll = img.data(local)
    po, pl = img.data(peer) if peer else (0, 0)
    return img.fd(n, "CK_FD_TCP", ino=ino, sock_family=2, sock_state=constant(state), name_off=lo, name_len=ll,
                  peer_off=po, peer_len=pl, rcvbuf=131072, sndbuf=16384, **fields)  # fmt: skip


def test_tcp_pair_inside_the_job(tmp_path: Path) -> None:
    server, client = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    srv, cli = ip_sockaddr("127.0.0.1", 5000), ip_sockaddr("127.0.0.1", 40000)
    _tcp(server, 3, 50, "CK_SOCK_LISTEN", ip_sockaddr("0.0.0.0", 5000), backlog=16)
    off = _tcp(server, 4, 51, "CK_SOCK_CONNECTED", srv, peer=cli, queued=b"request")
    _tcp(client, 3, 52, "CK_SOCK_CONNECTED", cli, peer=srv)
    ps, pc = images(tmp_path, server, client)
    assert body(plan_lines([ps, pc])) == [
        "tcp 0 50 2 0",
        "tcp 1 51 2 0",
        "tcp 2 52 2 0",
        f"tcpbind 0 {hx(ip_sockaddr('0.0.0.0', 5000))}",
        "listen 0 16",
        f"tcppair 2 1 0 2 {hx(srv)} {hx(cli)} {hx(srv)}",
        f"write 2 {blob_at(ps, off, 7)}",
        "tcpopts 0 0",
        "tcpopts 1 0",
        "tcpopts 2 0",
    ]


def test_tcp_leaving_the_job_is_refused(tmp_path: Path) -> None:
    img = Image(2)
    _tcp(img, 6, 60, "CK_SOCK_CONNECTED", ip_sockaddr("10.0.0.1", 999), peer=ip_sockaddr("10.0.0.9", 80))
    with pytest.raises(
        PlanError, match=r"^pid 2 \(prog\) fd 6: TCP connection 10\.0\.0\.1:999 -> 10\.0\.0\.9:80 leads "
    ):
        build_plan(images(tmp_path, img), [], {})


def test_tcp_to_another_rank_is_repaired(tmp_path: Path) -> None:
    img = Image(2)
    local, peer = ip_sockaddr("10.0.0.1", 999), ip_sockaddr("10.0.0.9", 80)
    window = {"snd_wl1": 1, "snd_wnd": 2, "max_window": 3, "rcv_wnd": 4, "rcv_wup": 5}
    sq_off, sq_len = img.data(b"unacked")
    _tcp(img, 6, 60, "CK_SOCK_CONNECTED", local, peer=peer, repair=1, snd_seq=100, rcv_seq=200, mss=1460, snd_wscale=7,
         rcv_wscale=7, tcpi_options=3, timestamp=9, sendq_off=sq_off, sendq_len=sq_len, **window)  # fmt: skip
    (p,) = images(tmp_path, img)
    assert body(plan_lines([p], other_ranks=["10.0.0.9"])) == [
        "tcp 0 60 2 0",
        f"tcprepair 0 {hx(local)} {hx(peer)} 100 200 1460 7 7 3 9",
        "sockbuf 0 65550 131072",
        f"repairq 0 2 {blob_at(p, sq_off, sq_len)}",
        "repairoff 0 1 2 3 4 5",
        "tcpopts 0 0",
    ]
    img2 = Image(2)
    _tcp(img2, 6, 60, "CK_SOCK_CONNECTED", local, peer=peer)
    with pytest.raises(PlanError, match="saved without its repair-mode state"):
        build_plan(images(tmp_path / "norepair", img2), [], {}, other_ranks=["10.0.0.9"])


def test_tcp_half_closed_pair_is_shut_again_after_its_bytes(tmp_path: Path) -> None:
    """FIN-WAIT-2 (shutdown 2) to CLOSE-WAIT (shutdown 1): the FIN again, after what the peer had not read."""
    img = Image(2)
    srv, cli = ip_sockaddr("127.0.0.1", 5000), ip_sockaddr("127.0.0.1", 40000)
    _tcp(img, 3, 50, "CK_SOCK_LISTEN", srv, backlog=4)
    off = _tcp(img, 4, 51, "CK_SOCK_CONNECTED", srv, peer=cli, queued=b"world", shutdown=1)
    _tcp(img, 5, 52, "CK_SOCK_CONNECTED", cli, peer=srv, shutdown=2)
    (p,) = images(tmp_path, img)
    assert body(plan_lines([p]))[5:8] == [
        f"tcppair 2 1 0 2 {hx(srv)} {hx(cli)} {hx(srv)}",
        f"write 2 {blob_at(p, off, 5)}",
        "tcpfin 2",
    ]


def test_tcp_close_wait_whose_peer_was_closed_gets_it_again_closed(tmp_path: Path) -> None:
    """CLOSE-WAIT, its peer's end closed on this host (shutdown 1|4): that end made in a slot of its own."""
    img = Image(2)
    srv, cli = ip_sockaddr("127.0.0.1", 5000), ip_sockaddr("127.0.0.1", 40000)
    _tcp(img, 3, 50, "CK_SOCK_LISTEN", srv, backlog=4)
    off = _tcp(img, 4, 51, "CK_SOCK_CONNECTED", srv, peer=cli, queued=b"world", shutdown=5)
    (p,) = images(tmp_path, img)
    lines = body(plan_lines([p]))
    assert "tcp 2 0 2 0" in lines
    assert lines[lines.index(f"tcppair 2 1 0 2 {hx(srv)} {hx(cli)} {hx(srv)}") :][:3] == [
        f"tcppair 2 1 0 2 {hx(srv)} {hx(cli)} {hx(srv)}",
        f"write 2 {blob_at(p, off, 5)}",
        "tcpgone 2 1",
    ]


def test_tcp_half_closed_refused_outside_the_job_and_between_ranks(tmp_path: Path) -> None:
    local, peer = ip_sockaddr("10.0.0.1", 999), ip_sockaddr("10.0.0.9", 80)
    img = Image(2)
    _tcp(img, 6, 60, "CK_SOCK_CONNECTED", local, peer=peer, shutdown=1)
    with pytest.raises(PlanError, match=r"\(CLOSE-WAIT\) was half closed by a peer outside the job"):
        build_plan(images(tmp_path / "out", img), [], {})
    img = Image(2)
    _tcp(img, 6, 60, "CK_SOCK_CONNECTED", local, peer=peer, shutdown=2, repair=1)
    with pytest.raises(PlanError, match=r"\(FIN-WAIT-2\) to another rank is half closed"):
        build_plan(images(tmp_path / "rank", img), [], {}, other_ranks=["10.0.0.9"])


# ---- shared memory, shared descriptions ----


def test_shared_memory_object(tmp_path: Path) -> None:
    owner, mapper = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    owner.fd(5, "CK_FD_SHMEM", dev=9, ino=70, size=8192, path="/memfd:ring (deleted)")
    mapper.vmas.append({"start": 0x10000, "end": 0x14000, "pgoff": 0x1000, "flags": constant("CK_VMA_SHMEM"),
                        "dev": 9, "ino": 70, "path": mapper.string("/memfd:ring (deleted)")})  # fmt: skip
    mapper.vmas.append({"start": 0x20000, "end": 0x21000, "flags": constant("CK_VMA_SHMEM"), "dev": 9, "ino": 71,
                        "path": mapper.string("/dev/shm/seg (deleted)")})  # fmt: skip
    po, pm = images(tmp_path, owner, mapper)
    assert body(plan_lines([po, pm])) == [
        f"shm 0 9 70 8192 {hx('ring')}",
        f"shm 1 9 71 4096 {hx('seg')}",
        f"shmfill 0 {hx(po.dir / 'files' / 'shm-70.data')}",
    ]


def test_shared_mapping_of_a_deleted_file_no_descriptor_holds(tmp_path: Path) -> None:
    """Made again once from the mapping's own record (size, mode, owner) and the contents its process saved."""
    a, b = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    flags = constant("CK_VMA_SHARED") | constant("CK_VMA_DELETED")
    for img in (a, b):
        img.vmas.append({"start": 0x10000, "end": 0x12000, "flags": flags, "dev": 2049, "ino": 80,
                         "file_size": 12288, "file_mode": 0o100640, "file_uid": 7, "file_gid": 8,
                         "path": img.string("/data/d/seg (deleted)")})  # fmt: skip
    pa, pb = images(tmp_path, a, b)
    assert body(plan_lines([pa, pb])) == [
        f"deleted 0 2049 80 {0o100640} 7 8 12288 {hx('/data/d/seg')} {hx(str(pa.dir / 'files' / 'deleted-80.data'))}",
    ]


def test_shared_descriptions(tmp_path: Path) -> None:
    a, b = Image(2), Image(3, ppid=2, pgid=2, sid=2)
    for img in (a, b):
        img.fd(3, "CK_FD_REG", path="/data/log.txt", open_flags=os.O_WRONLY | os.O_APPEND, pos=42)
        img.fd(4, "CK_FD_EVENTFD", evcount=5, flags=constant("CK_FDF_EVENTFD_SEMAPHORE"))
        img.fd(5, "CK_FD_SHMEM", dev=9, ino=70, size=4096, pos=7, open_flags=os.O_RDWR, path="/memfd:x (deleted)")
    a.fd(6, "CK_FD_REG", path="/data/alone.txt")  # one process's: each process opens it again itself
    pa, pb = images(tmp_path, a, b)
    shared = [[[2, 3], [3, 3]], [[2, 4], [3, 4]], [[2, 5], [3, 5]], [[2, 6]]]
    assert body(plan_lines([pa, pb], shared=shared)) == [
        f"shm 0 9 70 4096 {hx('x')}",
        f"shmfill 0 {hx(pa.dir / 'files' / 'shm-70.data')}",
        f"file 1 {os.O_WRONLY | os.O_APPEND} 42 {hx('/data/log.txt')}",
        "desc 1 2 3",
        "desc 1 3 3",
        "eventfd 2 5 1",
        "desc 2 2 4",
        "desc 2 3 4",
        f"fileshm 3 0 {os.O_RDWR} 7",
        "desc 3 2 5",
        "desc 3 3 5",
    ]


def test_slots_numbered_kind_by_kind(tmp_path: Path) -> None:
    """Pipes, then Unix sockets, TCP sockets, shared memory, then shared
    descriptions: the plan's text is the same from one ckptd to the next."""
    img = Image(2)
    img.fd(3, "CK_FD_UNIX", ino=20, sock_type=1)
    img.fd(4, "CK_FD_SHMEM", dev=9, ino=70, size=4096, path="/memfd:m (deleted)")
    _tcp(img, 5, 50, "CK_SOCK_UNCONNECTED", ip_sockaddr("0.0.0.0", 0))
    img.fd(6, "CK_FD_PIPE", ino=10, flags=constant("CK_FDF_PIPE_WRITE_END"))
    img.fd(7, "CK_FD_PIPE", ino=10)
    (p,) = images(tmp_path, img)
    assert body(plan_lines([p]))[:5] == [
        "pipe 0 1 10 0",
        "socket 2 20 1",
        "tcp 3 50 2 0",
        f"shm 4 9 70 4096 {hx('m')}",
        f"shmfill 4 {hx(p.dir / 'files' / 'shm-70.data')}",
    ]


# ---- the process tree ----


def test_tree_with_a_zombie_an_orphan_and_a_helper(tmp_path: Path) -> None:
    init = Image(2)
    child = Image(3, ppid=2, pgid=3, sid=2)
    orphan = Image(5, ppid=1, pgid=5, sid=5)  # setsid, then its parent exited
    lost = Image(8, ppid=1, pgid=8, sid=7)  # its session's leader (pid 7) has exited
    procs = images(tmp_path, init, child, orphan, lost)
    zombie = Zombie.from_dict({"pid": 4, "ppid": 3, "pgid": 3, "sid": 2, "wstatus": 256})
    lines = plan_lines(procs, [zombie])
    assert lines[1] == "slots 64 0"
    assert procs_of(lines) == [
        *(f"proc {p.pid} {p.ppid} {p.pgid} {p.sid} {hx(p.dir)}" for p in procs),
        "zombie 4 3 3 2 256",
        "helper 7 7",
    ]


@pytest.mark.parametrize(
    ("tree", "zombies", "message"),
    [
        ([(3, 1, 3, 3)], [], r"^the job's first process \(pid 2\) is not in the checkpoint$"),
        ([(2, 1, 2, 2)], [(4, 9, 2, 2)], r"^zombie pid 4 has a parent \(pid 9\) that is not part of the job$"),
        ([(2, 1, 2, 2), (3, 9, 3, 2)], [], r"^pid 3 \(prog\) has a parent \(pid 9\) that is not part of the job$"),
        ([(2, 1, 2, 2), (3, 2, 3, 3), (4, 3, 4, 2)], [], r"^pid 4 \(prog\) is in session 2, which its parent left"),
        ([(2, 1, 2, 2), (3, 2, 3, 3), (4, 2, 3, 2)], [], r"^pid 4 \(prog\) is in process group 3 of another session"),
        ([(2, 1, 2, 2), (3, 2, 3, 3), (4, 1, 4, 3)], [], r"^pid 4 \(prog\) was orphaned in session 3, whose leader"),
    ],
)
def test_tree_refused(
    tmp_path: Path, tree: list[tuple[int, ...]], zombies: list[tuple[int, ...]], message: str
) -> None:
    procs = images(tmp_path, *(Image(*t) for t in tree))
    dead = [Zombie(*z, wstatus=0) for z in zombies]
    with pytest.raises(PlanError, match=message):
        build_plan(procs, dead, {})


def test_process_without_vdso_is_refused(tmp_path: Path) -> None:
    img = Image(2)
    img.vmas.clear()
    with pytest.raises(PlanError, match=r"^pid 2 \(prog\) has unmapped its .*without the kernel's vdso$"):
        build_plan(images(tmp_path, img), [], {})
