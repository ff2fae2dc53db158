"""One error type for the whole control plane, carried over gRPC as a status code.

Every error message is one line that says what went wrong and what to do.
The CLI turns the code into its exit status (see EXIT_CODES and README).
"""

from __future__ import annotations

import enum
import errno as _errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc is imported where a call is made: the read-only CLI commands need none
    import grpc


class Code(enum.Enum):
    """A gRPC status code by name (`.status`: the grpc.StatusCode)."""

    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    DATA_LOSS = "DATA_LOSS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    INTERNAL = "INTERNAL"

    @property
    def status(self) -> grpc.StatusCode:
        import grpc

        return grpc.StatusCode[self.name]


# ckptctl / ckptd exit statuses (documented in README)
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CODES: dict[Code, int] = {
    Code.NOT_FOUND: 3,
    Code.FAILED_PRECONDITION: 4,
    Code.ALREADY_EXISTS: 4,
    Code.ABORTED: 4,
    Code.DATA_LOSS: 5,
    Code.PERMISSION_DENIED: 6,
    Code.RESOURCE_EXHAUSTED: 6,
    Code.UNAVAILABLE: 7,
    Code.INVALID_ARGUMENT: EXIT_USAGE,
    Code.DEADLINE_EXCEEDED: 124,
    Code.INTERNAL: EXIT_FAILED,
}


# trailers of a gRPC status that ckptd's servers set (ckptd/rpc.py)
ANSWERED = "ckptd-answered"  # ckptd's own answer, not the transport's
TRANSIENT = "ckptd-transient"  # CkptdError.transient


class CkptdError(Exception):
    """A failure with a status code and a one-line message for the user.

    transient: a passing state refused it (a connection not yet accepted, a
    process exiting, descriptors in flight): the same request moments later
    may succeed.  It travels with the error from the shim (ERROR retry=1)
    through the agent to the coordinator (TRANSIENT, a trailer of the gRPC
    status), which aborts the checkpoint round and runs it again; nothing
    else decides by the message or the code."""

    def __init__(self, code: Code, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.transient = transient

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.code, EXIT_FAILED)

    def abort(self, context: grpc.ServicerContext) -> None:
        context.abort(self.code.status, self.message)

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, what: str = "") -> CkptdError:
        import grpc

        status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        code = Code.__members__.get(status.name, Code.INTERNAL)
        trailers = _trailers(err) or ()
        answered = any(k == ANSWERED for k, _ in trailers)
        transient = any(k == TRANSIENT and v == "1" for k, v in trailers)
        if status == grpc.StatusCode.UNAVAILABLE and what and not answered:
            if "handshake" in details.lower():
                # mutual TLS refused: the certificates are not from one CA, or a name does not match
                return cls(
                    Code.PERMISSION_DENIED,
                    f"{what} and this client do not trust each other's TLS certificates: both must come "
                    f"from the cluster's CA (CKPTD_TLS_DIR; `ckptd certs issue`) ({details})",
                )
            if "Socket closed" in details and ("ipv4:" in details or "ipv6:" in details):
                # a TLS server drops a client whose certificate it does not trust, without a word
                details += "; or it refused this client's certificate (CKPTD_TLS_DIR): is it from the cluster's CA?"
            details = f"{what} is unreachable ({details})"
        return cls(code, details or str(status), transient=transient)


def _trailers(err: grpc.RpcError) -> tuple[tuple[str, str], ...] | None:
    """The trailing metadata of a failed call, when the error carries any."""
    fn = getattr(err, "trailing_metadata", None)
    try:
        return tuple(fn()) if fn else None
    except Exception:
        return None


# errnos that say the storage failed, not that a file is bad: a disk error, a
# network filesystem whose server went.  A read that fails with one of them is
# the storage's fault to report (exit 7), never a corrupt checkpoint to pass over.
STORAGE_ERRNOS = frozenset((_errno.EIO, _errno.ENOTCONN, _errno.ESTALE, _errno.EHOSTDOWN, _errno.ENXIO))
