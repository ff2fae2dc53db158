"""The agent's side of the shim protocol (native/shim/shim.c has the other side).

Every process started under ckptd connects to the agent's shim socket and
says HELLO; the connection then carries request/reply lines:

    PREMAP [dir=]         ->  PREMAPPED              read /proc/self/smaps early (still running);
                          dir: the image directory, where core.img, pages.img.part and files/
                          are made now (native/shim/image_dir.c)
    QUIESCE timeout_ms=N  ->  QUIESCED threads=N     park every thread
    SETTLE timeout_ms=N   ->  SETTLED stuck=N        let unsent TCP bytes leave (all parked)
    DUMP dir= base= image= depth=  ->  DUMPED <stats>   write core.img and files/, fork
                          the writer of pages.img (base: the checkpoint it may build on;
                          image: its final place)
    RESUME | ABORT        ->  RESUMED                let the threads run again (ABORT: kill the writer)
    FLUSH                 ->  FLUSHED written=0|1    wait until the writer has finished pages.img
    DISCARD               ->  DISCARDED              kill the writer (a round aborted after RESUME)
    REBASE core= image=   ->  REBASED                take the runs of a deduplicated image
    ADOPT core= image=    ->  ADOPTED                restored: take the image it came from as
                                                    the last one (native/shim/track.c)
    TERM_HOLD | TERM_DELIVER  ->  TERM_OK            the decision on a held SIGTERM (below)
    PING                  ->  PONG
    any of them           ->  ERROR [retry=1] msg=TEXT   (retry: a passing state, try again:
                                                    ShimError.transient)

Unasked, between replies, a process says TERM tid= sender= when it holds
a SIGTERM at its default disposition (native/shim/sigterm.c): the agent
answers TERM_HOLD or TERM_DELIVER (AgentNode._on_term).

Fields are tab-separated key=value pairs; values are percent-encoded.  The
peer's host pid comes from SO_PEERCRED, so it is right across pid namespaces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.errors import CkptdError, Code

log = logging.getLogger(__name__)

SO_PEERPIDFD = 77  # <linux/socket.h>; not in Python 3.11's socket module


def encode_value(value: str) -> bytes:
    if value.isascii() and value.isprintable() and "%" not in value:
        return value.encode()  # nothing to escape: most values (paths, numbers), at once
    out = bytearray()
    for b in value.encode(errors="surrogateescape"):
        if b < 0x20 or b in (0x25, 0x7F):
            out += b"%%%02X" % b
        else:
            out.append(b)
    return bytes(out)


def decode_value(raw: bytes) -> str:
    if b"%" not in raw:
        return raw.decode(errors="surrogateescape")  # nothing escaped: most values, at once
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == 0x25 and i + 3 <= len(raw):
            try:
                out.append(int(raw[i + 1 : i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        out.append(raw[i])
        i += 1
    return out.decode(errors="surrogateescape")


def format_message(command: str, **fields: object) -> bytes:
    parts = [command.encode()] + [k.encode() + b"=" + encode_value(str(v)) for k, v in fields.items()]
    return b"\t".join(parts) + b"\n"


@dataclass
class Message:
    command: str
    fields: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, line: bytes) -> Message:
        command, *rest = line.rstrip(b"\n").split(b"\t")
        fields = {}
        for part in rest:
            key, _, value = part.partition(b"=")
            fields[key.decode(errors="replace")] = decode_value(value)
        return cls(command.decode(errors="replace"), fields)

    def int(self, key: str, default: int = 0) -> int:
        try:
            return int(self.fields.get(key, default))
        except ValueError:
            return default


class ShimError(CkptdError):
    pass


class ShimConnection:
    """One process's connection; requests are serialised, replies come in order."""

    def __init__(
        self,
        sock: socket.socket,
        on_close: Callable[[ShimConnection], None],
        on_term: Callable[[ShimConnection, Message], None] | None = None,
    ) -> None:
        self.sock = sock
        self._on_term = on_term
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.host_pid, self.uid, self.gid = struct.unpack("3i", creds)
        # the peer process itself (Linux >= 6.5), whatever becomes of its pid:
        # JobRuntime.refuses checks it is still alive after reading its ancestry
        try:
            self.pidfd: int | None = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:
            self.pidfd = None
        self.hello: Message | None = None
        self._replies: queue.Queue[Message | None] = queue.Queue()
        self._late = 0  # requests that timed out: their replies, if any, are still to come
        self._request_lock = threading.Lock()
        self._on_close = on_close
        self.closed = threading.Event()
        self._file = sock.makefile("rb")

    def _alive(self) -> bool:
        """Whether the process that connected still lives (its pid was not
        reused meanwhile); True where the kernel gives no pidfd."""
        if self.pidfd is None:
            return True
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True  # a zombie, or EPERM: the pid is still its own
        return True

    def drop_pidfd(self) -> None:
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            os.close(fd)

    @property
    def job(self) -> str:
        return self.hello.fields.get("job", "") if self.hello else ""

    @property
    def pid(self) -> int:
        """pid inside the job's namespace"""
        return self.hello.int("pid") if self.hello else 0

    @property
    def exe(self) -> str:
        return self.hello.fields.get("exe", "") if self.hello else ""

    @property
    def restored(self) -> bool:
        return bool(self.hello and self.hello.fields.get("restored") == "1")

    def read_hello(self, timeout: float) -> Message:
        self.sock.settimeout(timeout)
        line = self._file.readline()
        self.sock.settimeout(None)
        if not line:
            raise ConnectionError("closed before HELLO")
        msg = Message.parse(line)
        if msg.command != "HELLO":
            raise ConnectionError(f"expected HELLO, got {msg.command}")
        self.hello = msg
        return msg

    def start_reader(self) -> None:
        threading.Thread(target=self._read_loop, name=f"shim-{self.host_pid}", daemon=True).start()

    def _read_loop(self) -> None:
        try:
            while True:
                line = self._file.readline()
                if not line:
                    break
                msg = Message.parse(line)
                if msg.command == "TERM":  # unasked: not a reply (the answer is a request of its own)
                    if self._on_term is not None:
                        threading.Thread(target=self._on_term, args=(self, msg), daemon=True).start()
                    continue
                self._replies.put(msg)
        except OSError:
            pass
        finally:
            self.closed.set()
            self._replies.put(None)
            with contextlib.suppress(OSError):
                self.sock.close()
            self._on_close(self)

    def request(self, command: str, timeout: float, **fields: object) -> Message:
        with self._request_lock:
            if self.closed.is_set():
                raise ShimError(Code.FAILED_PRECONDITION, f"process {self.host_pid} has exited")
            try:
                self.sock.sendall(format_message(command, **fields))
            except OSError as e:
                # its end is closed: it exits (or exec'd) during the round, as when no reply comes
                # below; gone() may not see it yet (not yet a zombie): the next round leaves it out
                raise ShimError(Code.ABORTED, f"process {self.host_pid} is gone ({e})", transient=True) from e
            deadline = time.monotonic() + timeout
            try:
                # the replies to earlier requests that timed out come first, in order
                while self._late:
                    if self._replies.get(timeout=max(0.0, deadline - time.monotonic())) is None:
                        break
                    self._late -= 1
                reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._late += 1
                raise ShimError(
                    Code.DEADLINE_EXCEEDED,
                    f"process {self.host_pid} did not answer {command} within {timeout:.0f} s",
                ) from None
            if reply is None:
                # a process that exits during a round: the next round leaves it out
                raise ShimError(Code.ABORTED, f"process {self.host_pid} exited during {command}", transient=True)
            if reply.command == "ERROR":
                # retry=1, a passing state: the coordinator runs the round again a moment later
                if reply.fields.get("retry") == "1":
                    raise ShimError(Code.ABORTED, reply.fields.get("msg", "unknown error"), transient=True)
                raise ShimError(Code.FAILED_PRECONDITION, reply.fields.get("msg", "unknown error"))
            return reply

    def gone(self) -> bool:
        """Whether the process that said HELLO on this connection has ended:
        it closed its end (an exit, or an exec: the descriptor is
        close-on-exec), its pidfd finds it dead, or it is a zombie its parent
        has not reaped yet (a short-lived child).  The one answer to "is it
        still there" for a HELLO's registration and refusal and for a
        round's QUIESCE."""
        if self._hung_up() or not self._alive():
            return True
        try:
            with open(f"/proc/{self.host_pid}/stat") as f:  # the pidfd says the pid is still its own
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            return True

    def _hung_up(self) -> bool:
        """The process closed its end, whether or not the reader has seen it yet."""
        if self.closed.is_set():
            return True
        try:
            p = select.poll()
            p.register(self.sock, select.POLLRDHUP)
            return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class ShimServer:
    """Accepts shim connections on the node's shim socket."""

    def __init__(
        self,
        path: Path,
        on_hello: Callable[[ShimConnection], None],
        on_close: Callable[[ShimConnection], None],
        *,
        owner: tuple[int, int] | None = None,
        any_uid: bool = False,
        on_term: Callable[[ShimConnection, Message], None] | None = None,
    ) -> None:
        """owner (uid, gid): the socket of another user's jobs (agent/owner.py),
        theirs and 0600 (connecting needs write permission), in a directory
        only root may change; any_uid: 0666, the socket of root's jobs, whose
        processes may have dropped to any uid (Owner.any_uid)."""
        self.path = path
        self._on_hello = on_hello
        self._on_close = on_close
        self._on_term = on_term
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        if owner is not None:
            os.chown(path, *owner, follow_symlinks=False)
            os.chmod(path, 0o666 if any_uid else 0o600)
        else:
            os.chmod(path, 0o700)
        self._sock.listen(128)
        self._stopped = False

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="shim-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._stopped:
                    return
                continue
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        conn = ShimConnection(sock, self._on_close, self._on_term)
        try:
            conn.read_hello(timeout=10)
        except (OSError, ConnectionError) as e:
            log.warning("shim connection from pid %d dropped: %s", conn.host_pid, e)
            conn.drop_pidfd()
            sock.close()
            return
        conn.start_reader()
        self._on_hello(conn)

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
