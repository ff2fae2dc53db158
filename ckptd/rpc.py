"""gRPC plumbing shared by the CLI, the coordinator and the agents.

Addresses are "unix:/path/to.sock" (one machine) or "host:port".
Servicer methods are wrapped with @rpc_method so that a CkptdError reaches
the caller as its status code and message, and anything unexpected as
INTERNAL with a pointer to the daemon log.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from ckptd.errors import CkptdError, Code
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.enable_retries", 0),
]

F = TypeVar("F", bound=Callable[..., Any])


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=_OPTIONS)


def coordinator_stub(address: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(channel(address))


def agent_stub(address: str) -> pb_grpc.AgentStub:
    return pb_grpc.AgentStub(channel(address))


def call(method: Callable[..., Any], request: Any, timeout: float | None, what: str) -> Any:
    """Invoke a unary RPC, turning transport and remote errors into CkptdError."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as e:
        raise CkptdError.from_rpc(e, what) from None


def reachable(address: str, timeout: float = 1.0) -> bool:
    ch = channel(address)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ch.close()


ANSWERED = "ckptd-answered"


def _abort(context: grpc.ServicerContext, name: str, exc: BaseException) -> None:
    if isinstance(exc, CkptdError):
        # marked as ckptd's own answer: an UNAVAILABLE from here is about a
        # node behind the service, not the service itself
        context.set_trailing_metadata(((ANSWERED, "1"),))
        context.abort(exc.code.value, exc.message)
    log.exception("%s failed", name)
    context.abort(Code.INTERNAL.value, f"internal error in {name}: {exc!r} (see the daemon log)")


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


def bind(server: grpc.Server, address: str) -> str:
    """Listen on address; returns the address clients should use."""
    port = server.add_insecure_port(address)
    if port == 0:
        raise CkptdError(Code.UNAVAILABLE, f"cannot listen on {address}")
    if address.startswith("unix:"):
        return address
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"
