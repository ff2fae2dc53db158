"""File checksums (xxh3-128) and file identities.

A checkpoint lists every file it holds with its size and checksum, and a
restart verifies them all before touching anything.  Files the job maps or
reads are identified by size and content hash, so a restart on another node,
where modification times differ, still recognises the same library.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import xxhash

CHUNK = 8 << 20
ALGORITHM = "xxh3_128"

Progress = Callable[[int], None]


def hash_file(path: Path | str, progress: Progress | None = None) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress:
                progress(n)
    return h.hexdigest()


# The digest a checkpoint's writer leaves on the pages.img it wrote, "HEX
# SIZE" (native/shim/checksum.c, CK_CHECKSUM_XATTR): it hashed the pages
# from memory as it wrote them, so the agent need not read them back.
WRITER_XATTR = "user.ckptd.xxh3_128"


def writer_digest(path: Path | str) -> str | None:
    """The xxh3-128 the writer recorded for the file, if it recorded one for
    the file as it is now (same size), else None: hash it then."""
    try:
        value = os.getxattr(path, WRITER_XATTR).decode("ascii")
        size = os.stat(path).st_size
    except (OSError, UnicodeDecodeError):
        return None
    digest, _, recorded = value.partition(" ")
    if len(digest) != 32 or recorded != str(size) or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def forget_writer_digest(path: Path | str) -> None:
    """Before the file is changed in place (dedup punches holes in it)."""
    with contextlib.suppress(OSError):
        os.removexattr(path, WRITER_XATTR)


def fsync_path(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class IdentityCache:
    """Content hashes of files keyed by (dev, inode, size, mtime): a library is
    hashed once per agent, not at every checkpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, int, int, int], str] = {}

    def content_hash(self, path: str) -> str | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        try:
            digest = hash_file(path)
        except OSError:
            return None
        with self._lock:
            self._cache[key] = digest
        return digest
