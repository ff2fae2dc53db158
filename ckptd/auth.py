"""Who is calling, and what they may do (ARCHITECTURE.md, Security).

A caller is authenticated by its transport:
- over TCP, by its client certificate (mutual TLS, ckptd/tls.py): the
  certificate's CN is its name and its OU its role;
- on a Unix socket, by the socket itself: the socket is 0600 in a 0700
  directory, so only the daemon's own user (and root) can connect, and the
  caller is the daemon's user, with every role (its own daemon).

What each role may call:

    user         launch; see, checkpoint, restart, kill, signal, prune and
                 read the logs of its own jobs (an admin: of every job);
                 list nodes; an admin may also shut the coordinator down
                 and launch on behalf of another user (--as-user)
    node         register itself (its certificate's name is the node's
                 name), send heartbeats and job events for itself
    coordinator  every Agent call (the barrier, start, restore, stop)

Admins are user names (`--admin`, default: root).
"""

from __future__ import annotations

import enum
import functools
import os
import pwd
from dataclasses import dataclass

import grpc

from ckptd.errors import CkptdError, Code

DEFAULT_ADMINS = ("root",)


class Role(enum.Enum):
    USER = "user"
    NODE = "node"
    COORDINATOR = "coordinator"


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role
    admin: bool = False
    local: bool = False  # the daemon's own user on its Unix socket: every role

    def has(self, role: Role) -> bool:
        return self.local or self.role is role

    def owns(self, owner: str) -> bool:
        """May act on a job of `owner` ('' : recorded before owners existed)."""
        return self.admin or (self.role is Role.USER and bool(owner) and owner == self.name)

    def __str__(self) -> str:
        return f"{self.role.value} {self.name}" + (" (local)" if self.local else "")


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@functools.lru_cache(maxsize=1)
def local_identity() -> Identity:
    return Identity(user_name(os.geteuid()), Role.USER, admin=True, local=True)


@functools.lru_cache(maxsize=256)
def _tls_identity(pem: bytes) -> tuple[str, str]:
    from ckptd.tls import subject_of

    return subject_of(pem)


class Policy:
    """The admins of one daemon; turns a call's context into its Identity."""

    def __init__(self, admins: tuple[str, ...] | list[str] = DEFAULT_ADMINS) -> None:
        self.admins = frozenset(admins)

    def caller(self, context: grpc.ServicerContext) -> Identity:
        auth = context.auth_context() or {}
        if auth.get("transport_security_type") != [b"ssl"]:
            # ckptd binds plaintext ports on Unix sockets only (rpc.bind)
            return local_identity()
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        if not pem:
            raise CkptdError(Code.PERMISSION_DENIED, "no client certificate; give one with CKPTD_TLS_DIR")
        name, role = _tls_identity(pem)
        r = Role(role)
        return Identity(name, r, admin=r is Role.USER and name in self.admins)

    def require(self, context: grpc.ServicerContext, role: Role, what: str) -> Identity:
        who = self.caller(context)
        if not who.has(role):
            raise CkptdError(Code.PERMISSION_DENIED, f"{what} is for a {role.value} certificate, not {who}")
        return who

    def require_owner(self, context: grpc.ServicerContext, owner: str, job: str) -> Identity:
        """A caller that may act on job (its owner, an admin, or the
        coordinator on an agent)."""
        who = self.caller(context)
        if who.local or who.role is Role.COORDINATOR or who.owns(owner):
            return who
        raise CkptdError(
            Code.PERMISSION_DENIED, f"job {job} belongs to another user; only its owner or an admin may act on it"
        )
