"""Encryption at rest (`ckptd launch --encrypt`): the key and sealed files.

The format is CK_GCM_* in native/include/ckptd/image_format.h, read here
through cffi like core.img: a sealed file is AES-256-GCM ciphertext of the
plaintext's length, cut into 64 KiB chunks (chunk i: IV = the file's random
8-byte nonce prefix || i, big-endian, no AAD), and its tags go into the
sidecar `<file>.gcm` (header, then one 16-byte tag per chunk).  The shim's
writer, the restorer and the pager seal and open the same format in C
(native/common/aesgcm.c, sealed.c); tests/test_encrypt.py checks the two
against each other.

The key: 32 bytes, raw or as 64 hex digits, in a file only its owner can
read.  ckptd never writes it anywhere: the job spec keeps the file's path
and the key's check value (HMAC-SHA256(key, "ckptd key check")[:16]), the
agent reads the file when it needs the key and hands it to the shim over
its socket, to the restorer and the pager through a memfd.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ckptd.errors import CkptdError, Code
from ckptd.nofollow import read_private

from .core import constant, ffi

KEY_BYTES = 32
SUFFIX = ".gcm"
KEY_ENV = "CKPTD_ENCRYPT_KEY"  # names the key file when --encrypt-key is not given
_CHECK_LABEL = b"ckptd key check"


@functools.cache
def _layout() -> tuple[int, int, int, int]:
    """magic, version, chunk size, header size (from image_format.h)."""
    f: Any = ffi()
    return (
        constant("CK_GCM_MAGIC"),
        constant("CK_GCM_VERSION"),
        constant("CK_GCM_CHUNK"),
        int(f.sizeof("struct ck_gcm_header")),
    )


def cpu_supported() -> bool:
    """Whether this CPU has what the C side needs (AES-NI, PCLMULQDQ)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return {"aes", "pclmulqdq", "ssse3", "sse4_1"} <= flags
    return False


def key_check(key: bytes) -> str:
    """The value a restart compares before touching anything: not the key."""
    return hmac.new(key, _CHECK_LABEL, hashlib.sha256).digest()[:16].hex()


def read_key_file(path: str) -> bytes:
    """The key in `path`; a one-line error if it is missing, malformed or
    readable by anyone but its owner."""
    try:
        # owned=False: the job's owner reads it (agent/runtime.py JobRuntime.key), whoever made it
        raw = read_private(path, "encryption key file", owned=False, limit=200)
    except OSError as e:
        raise CkptdError(Code.INVALID_ARGUMENT, f"cannot read the encryption key file {path}: {e.strerror}") from None
    text = raw.strip()
    if len(raw) == KEY_BYTES:
        return raw
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise CkptdError(
        Code.INVALID_ARGUMENT,
        f"encryption key file {path} must hold 32 bytes, raw or as 64 hex digits"
        " (make one with: head -c 32 /dev/urandom > FILE; chmod 600 FILE)",
    )


def job_key(spec: Any) -> bytes | None:
    """The key of an encrypted job (None: not encrypted), checked against
    the value the job was launched with."""
    path = getattr(spec, "encrypt_key_file", "")
    if not path:
        return None
    key = read_key_file(path)
    if not hmac.compare_digest(key_check(key), spec.encrypt_key_check):
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"wrong key for job {spec.name}: {path} does not hold the key the job was launched with"
            " (put the job's key back in that file)",
        )
    return key


def key_memfd(key: bytes) -> int:
    """A descriptor holding the key, for the restorer and the pager
    (--key-fd): never argv or the environment, which /proc shows."""
    fd = os.memfd_create("ckptd-key", 0)  # inherited: the restorer reads it, then closes it
    os.write(fd, key)
    return fd


def is_sealed(path: Path) -> bool:
    return Path(str(path) + SUFFIX).exists()


def _iv(prefix: bytes, chunk: int) -> bytes:
    return prefix + struct.pack(">I", chunk)


def seal_bytes(key: bytes, data: bytes) -> tuple[bytes, bytes]:
    """(ciphertext, sidecar) of data."""
    magic, version, chunk, header = _layout()
    prefix = os.urandom(8)
    aes = AESGCM(key)
    out, tags = bytearray(), bytearray()
    for i in range(0, len(data), chunk):
        sealed = aes.encrypt(_iv(prefix, i // chunk), data[i : i + chunk], None)
        out += sealed[:-16]
        tags += sealed[-16:]
    head = struct.pack("<QIIQ8s", magic, version, chunk, len(data), prefix)
    assert len(head) == header
    return bytes(out), head + bytes(tags)


def open_bytes(key: bytes, data: bytes, sidecar: bytes, what: str) -> bytes:
    """The plaintext of a sealed file; DATA_LOSS if it does not decrypt."""
    magic, version, chunk, header = _layout()
    bad = CkptdError(Code.DATA_LOSS, f"{what} does not decrypt with this key, or is damaged")
    if len(sidecar) < header:
        raise bad
    m, v, c, size, prefix = struct.unpack("<QIIQ8s", sidecar[:header])
    if (m, v, c, size) != (magic, version, chunk, len(data)) or len(sidecar) != header + 16 * (
        (size + chunk - 1) // chunk
    ):
        raise bad
    aes = AESGCM(key)
    out = bytearray()
    for n, i in enumerate(range(0, len(data), chunk)):
        tag = sidecar[header + 16 * n : header + 16 * n + 16]
        try:
            out += aes.decrypt(_iv(prefix, n), data[i : i + chunk] + tag, None)
        except InvalidTag:
            raise bad from None
    return bytes(out)


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)


def seal_into(key: bytes, data: bytes, dst: Path) -> None:
    """dst (new) and its sidecar: data sealed."""
    ct, side = seal_bytes(key, data)
    _write_new(dst, ct)
    _write_new(Path(str(dst) + SUFFIX), side)


def open_file(key: bytes, path: Path) -> bytes:
    return open_bytes(key, path.read_bytes(), Path(str(path) + SUFFIX).read_bytes(), str(path))
