"""The manifest key: an HMAC-SHA256 over every manifest, so that a
checkpoint can only come from a daemon of this installation.

The key is 32 random bytes in a file only the daemons' user can read:
$CKPTD_HOME/manifest.key, made by the first daemon that needs it, or the file
CKPTD_MANIFEST_KEY (`--manifest-key`) names, which an operator gives every
node and the coordinator of a cluster (like munge.key).  A key file that
others could read, or that another user owns, is refused: whoever reads it
can forge checkpoints that a restart trusts.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path

from ckptd.errors import CkptdError, Code
from ckptd.nofollow import read_private

KEY_FILE = "manifest.key"
KEY_ENV = "CKPTD_MANIFEST_KEY"
KEY_BYTES = 32
_DOMAIN = b"ckptd manifest v1\0"  # a MAC of this key means nothing else

_lock = threading.Lock()
_installed: bytes | None = None


def key_path(home_root: Path | None = None) -> Path:
    """CKPTD_MANIFEST_KEY, else the key in CKPTD_HOME (default: this user's)."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env).expanduser().absolute()
    if home_root is None:
        from ckptd.paths import default_home

        home_root = default_home()
    return home_root / KEY_FILE


def _create(path: Path) -> None:
    """A new key, whole or not at all: written under a temporary name, then
    linked into place (two daemons starting at once end with one key)."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_key(path: Path, *, create: bool = False, own: bool = True) -> bytes:
    """The key in path, checked: a regular file (of this user's, with own),
    mode 0600 or stricter, of at least 32 bytes.  With create, made when
    missing."""
    try:
        key = read_private(path, "manifest key", owned=own)
    except FileNotFoundError:
        if not create:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"manifest key {path} does not exist; every node and the coordinator need the same key "
                f"(see README, Several nodes)",
            ) from None
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _create(path)
        except OSError as e:
            raise CkptdError(Code.PERMISSION_DENIED, f"cannot create the manifest key {path}: {e.strerror}") from None
        return read_key(path, own=own)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise CkptdError(Code.PERMISSION_DENIED, f"cannot read the manifest key {path}: {why}") from None
    if len(key) < KEY_BYTES:
        raise CkptdError(
            Code.PERMISSION_DENIED,
            f"manifest key {path} holds {len(key)} bytes, fewer than {KEY_BYTES}; "
            f"make one with `head -c 32 /dev/urandom > {path}`",
        )
    return key


def install(home_root: Path) -> Path:
    """At a daemon's start: its key, made in CKPTD_HOME on first use unless
    CKPTD_MANIFEST_KEY names one.  Raises when the key is unsafe."""
    global _installed
    path = key_path(home_root)
    key = read_key(path, create=KEY_ENV not in os.environ or not os.environ[KEY_ENV])
    with _lock:
        _installed = key
    return path


def key() -> bytes:
    """The daemon's key; in any other process (a CLI, which only checks
    manifests with it), read from key_path()."""
    with _lock:
        if _installed is not None:
            return _installed
    return read_key(key_path(), own=False)


def mac(key: bytes, canonical: bytes) -> str:
    return hmac.new(key, _DOMAIN + canonical, hashlib.sha256).hexdigest()


def matches(key: bytes, canonical: bytes, claimed: object) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(mac(key, canonical), claimed)
