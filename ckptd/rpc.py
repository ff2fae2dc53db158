"""gRPC plumbing shared by the CLI, the coordinator and the agents.

Addresses are "unix:/path/to.sock" (one machine) or "host:port". A TCP
address always means mutual TLS (ckptd/tls.py): a server binds one only with
its certificate and demands a client certificate from the same CA; a client
dials one only with its own. A Unix socket is plaintext, made 0600.
Servicer methods are wrapped with @rpc_method so that a CkptdError reaches
the caller as its status code and message, and anything unexpected as
INTERNAL with a pointer to the daemon log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from ckptd.errors import ANSWERED, STORAGE_ERRNOS, TRANSIENT, CkptdError, Code
from ckptd.tls import TlsFiles, default_dir
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.enable_retries", 0),
]

F = TypeVar("F", bound=Callable[..., Any])


_identity: TlsFiles | None = None  # what this process presents over TCP (use_tls)


def use_tls(files: TlsFiles | None) -> None:
    """The certificate this process presents as a TCP client (a daemon's own)."""
    global _identity
    _identity = files


def _client_tls(address: str) -> TlsFiles:
    if _identity is not None:
        return _identity
    d = default_dir()
    if d is None:
        raise CkptdError(
            Code.PERMISSION_DENIED,
            f"{address} is a TCP address and needs a client certificate: set CKPTD_TLS_DIR to a directory "
            "from `ckptd certs issue` (ca.pem, cert.pem, key.pem)",
        )
    return TlsFiles.load(d)


def _credentials(address: str) -> grpc.ChannelCredentials | None:
    """None for a Unix socket (plaintext); this process's TLS identity for a TCP address."""
    if address.startswith("unix:"):
        return None
    tls = _client_tls(address)
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def channel(address: str) -> grpc.Channel:
    creds = _credentials(address)
    if creds is None:
        return grpc.insecure_channel(address, options=_OPTIONS)
    return grpc.secure_channel(address, creds, options=_OPTIONS)


def coordinator_stub(address: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(channel(address))


def agent_stub(address: str) -> AgentStub:
    return AgentStub(address)


def call(method: Callable[..., Any], request: Any, timeout: float | None, what: str) -> Any:
    """Invoke a unary RPC, turning transport and remote errors into CkptdError."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as e:
        raise CkptdError.from_rpc(e, what) from None


# RPCs one caller keeps in flight at once (call_many): enough for every rank
# of a large job to work at the same time, without a thread per call
FAN_OUT = 256


# how often call_many asks whether a peer that has not answered still lives
STOPPED_POLL_S = 2.0


class AgentStub(pb_grpc.AgentStub):
    """An agent's stub that knows its address, so that call_many can reach
    the same agent on its own channel."""

    def __init__(self, address: str) -> None:
        super().__init__(channel(address))
        self.address = address


class _Fanout:
    """The event loop call_many's RPCs run on: one thread, one grpc.aio
    channel per address, for the life of the process.

    The synchronous API puts each channel's calls on a thread of their own
    (grpc's channel spin thread), started whenever the channel goes from no
    call in flight to one, and every round's phase starts from none.  At 64
    ranks over 16 agents on 2 busy cores those starts took 4-77 ms each and
    1.3 s of a round's requests in all (BENCHMARKS.md, the barrier's own
    cost): the coordinator's serial part.  Here a request is a coroutine
    handed to a loop that is already running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stubs: dict[str, pb_grpc.AgentStub] = {}
        self._pid = 0

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # a forked child starts its own
                self._loop = asyncio.new_event_loop()
                self._stubs = {}
                self._pid = os.getpid()
                threading.Thread(target=self._loop.run_forever, name="ckptd-fanout", daemon=True).start()
            return self._loop

    def _stub(self, address: str) -> pb_grpc.AgentStub:
        """address's stub on its grpc.aio channel; only ever called on the loop's thread."""
        stub = self._stubs.get(address)
        if stub is None:
            creds = _credentials(address)
            if creds is None:
                ch = grpc.aio.insecure_channel(address, options=_OPTIONS)
            else:
                ch = grpc.aio.secure_channel(address, creds, options=_OPTIONS)
            stub = self._stubs[address] = pb_grpc.AgentStub(ch)
        return stub

    async def call(self, address: str, method: str, request: Any, timeout: float | None, stamp: list[float]) -> Any:
        call = getattr(self._stub(address), method)
        stamp[0] = time.monotonic()
        try:
            return await call(request, timeout=timeout)
        finally:
            stamp[1] = time.monotonic()


_fanout = _Fanout()


def call_many(
    calls: Iterable[tuple[AgentStub, str, Any, float | None, str]],
    stopped: Callable[[int], str | None] | None = None,
    times: list[tuple[float, float]] | None = None,
    each: Callable[[int, Any, tuple[float, float]], None] | None = None,
) -> list[Any]:
    """Unary RPCs (an agent's stub, the method's name, request, timeout,
    what) all at once, at most FAN_OUT in flight, on one event loop
    (_Fanout) rather than a thread each; each answer, or the CkptdError it
    failed with, in the order given.  Each call is sent as soon as calls
    yields it: a caller that builds its requests one by one has the first
    in flight before it builds the second.  stopped(i), when given, is asked
    every STOPPED_POLL_S while call i is unanswered: a reason (its peer
    stopped: no heartbeats) fails that call at once, UNAVAILABLE, instead of
    at its timeout, which may be hours.  times, when given, gets each call's
    (sent, answered) on time.monotonic(), in the order given.  each(i,
    answer, (sent, answered)), when given, is called on this thread as each
    call ends, in the order they end: what the caller does with an answer
    overlaps the calls still out, and only the last one's waits for all."""
    loop = _fanout.loop()
    slots = asyncio.Semaphore(FAN_OUT)  # bound to the loop where first awaited (3.10+)

    async def bounded(address: str, method: str, request: Any, timeout: float | None, stamp: list[float]) -> Any:
        async with slots:
            return await _fanout.call(address, method, request, timeout, stamp)

    pending: dict[concurrent.futures.Future[Any], int] = {}
    whats: list[str] = []
    stamps: list[list[float]] = []
    for stub, method, request, timeout, what in calls:
        stamp = [0.0, 0.0]
        future = asyncio.run_coroutine_threadsafe(bounded(stub.address, method, request, timeout, stamp), loop)
        pending[future] = len(whats)
        whats.append(what)
        stamps.append(stamp)
    out: list[Any] = [None] * len(whats)

    def answer(future: concurrent.futures.Future[Any], i: int) -> Any:
        try:
            return future.result(timeout=0)
        except concurrent.futures.CancelledError:
            return CkptdError(Code.ABORTED, f"{whats[i]}: the call was cancelled")
        except grpc.RpcError as e:
            return CkptdError.from_rpc(e, whats[i])

    def ended(i: int, result: Any) -> None:
        out[i] = result
        if each is not None:
            sent, answered = stamps[i]
            now = time.monotonic()
            each(i, result, (sent or now, answered or now))

    while pending:
        done, _ = concurrent.futures.wait(
            pending, timeout=STOPPED_POLL_S if stopped else None, return_when=concurrent.futures.FIRST_COMPLETED
        )
        for future in sorted(done, key=pending.__getitem__):
            i = pending.pop(future)
            ended(i, answer(future, i))
        if not done and stopped is not None:
            for future, i in list(pending.items()):
                why = stopped(i)
                if why is not None:
                    future.cancel()
                    del pending[future]
                    ended(i, CkptdError(Code.UNAVAILABLE, why))
    if times is not None:
        now = time.monotonic()
        times.extend((sent or now, answered or now) for sent, answered in stamps)
    return out


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a server listens at address.  A Unix socket is tried with a
    plain connect: closing a gRPC channel takes 0.2 s here (its poller's
    wake-up), which every ckptctl command paid before its own RPC."""
    if address.startswith("unix:"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(address.removeprefix("unix:").removeprefix("//"))
                return True
            except OSError:
                return False
    ch = channel(address)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ch.close()


def answer_error(name: str, exc: BaseException) -> CkptdError:
    """What a failure in a servicer's name (a method, or a step of Steps)
    tells its caller: a CkptdError as it is; storage that failed under the
    request, which file (not "internal error"); anything else INTERNAL, with
    its traceback in the daemon log."""
    if isinstance(exc, CkptdError):
        return exc
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        log.warning("%s: storage failed: %s", name, exc)
        where = f"{exc.filename}: " if exc.filename else ""
        return CkptdError(
            Code.UNAVAILABLE, f"storage failed in {name}: {where}{exc.strerror} (errno {exc.errno}); fix it and retry"
        )
    log.exception("%s failed", name)
    return CkptdError(Code.INTERNAL, f"internal error in {name}: {exc!r} (see the daemon log)")


def _abort(context: grpc.ServicerContext, name: str, exc: BaseException) -> None:
    err = answer_error(name, exc)
    # marked as ckptd's own answer: an UNAVAILABLE from here is about a
    # node behind the service, not the service itself
    # (and whether it is transient: a caller may try again)
    context.set_trailing_metadata(((ANSWERED, "1"), (TRANSIENT, "1" if err.transient else "0")))
    context.abort(err.code.status, err.message)


def rpc_method(fn: F) -> F:
    """Error translation for servicer methods, unary or server-streaming."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from fn(self, request, context)
            except Exception as e:
                _abort(context, fn.__name__, e)

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as e:
            _abort(context, fn.__name__, e)
            raise  # unreachable: abort raises

    return unary  # type: ignore[return-value]


def make_server(max_workers: int = 32) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)


def bind(server: grpc.Server, address: str, tls: TlsFiles | None = None) -> str:
    """Listen on address; returns the address clients should use.

    TCP needs tls (a client certificate is then required of every caller);
    a Unix socket is made 0600, its owner's alone."""
    if address.startswith("unix:"):
        if server.add_insecure_port(address) == 0:
            raise CkptdError(Code.UNAVAILABLE, f"cannot listen on {address}")
        os.chmod(address[len("unix:") :], 0o600)
        return address
    if tls is None:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"refusing to listen on {address} without TLS: anyone who reaches it would control every job; "
            "give --tls DIR (from `ckptd certs issue`), or listen on unix:PATH on one machine",
        )
    creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True)
    port = server.add_secure_port(address, creds)
    if port == 0:
        raise CkptdError(Code.UNAVAILABLE, f"cannot listen on {address}")
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"
