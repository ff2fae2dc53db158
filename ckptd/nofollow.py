"""Files in directories other users may write (a shared --ckpt-dir, the
paths a restart rolls back), reached and created without following symlinks.

A path is walked from a trusted base one component at a time with
openat(O_PATH | O_DIRECTORY | O_NOFOLLOW): a symlink, or anything else that
is not a directory, on the way stops the walk with UnsafePath.  Files are
then opened relative to the last directory with O_NOFOLLOW (and O_EXCL when
new), so a symlink planted as the file itself is refused too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(Exception):
    """A path that cannot be used safely: `path` is what the caller asked
    for, `where` the component that is `kind`; `why` says it in words."""

    def __init__(self, path: Path | str, kind: str, where: Path | str = "") -> None:
        self.path = str(path)
        self.kind = kind  # "a symbolic link", "not a directory", ...
        self.where = str(where or path)  # the component that is
        self.why = f"{self.where} is {kind}"
        super().__init__(self.why)


def _kind(dir_fd: int, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "gone"
    return "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"


def open_dir(
    path: Path | str,
    beneath: Path | str = "/",
    *,
    create: int | None = None,
    owner: tuple[int, int] | None = None,
    created: list[Path] | None = None,
) -> int:
    """An O_PATH descriptor of directory `path`, every component below
    `beneath` (itself opened as it is: the operator's choice) opened without
    following a symlink.  With create (a mode), missing components are made,
    given to owner (uid, gid) when set, and appended to `created`."""
    path, base = Path(path), Path(beneath)
    if not path.is_absolute() or (path != base and base not in path.parents):
        raise UnsafePath(path, f"not under {base}")
    fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    here = base
    try:
        for name in path.relative_to(base).parts:
            here = here / name
            try:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create is None:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: opened below, unfollowed
                    os.mkdir(name, create, dir_fd=fd)
                    if owner is not None:
                        os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
                    if created is not None:
                        created.append(here)
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise UnsafePath(path, _kind(fd, name), here) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, name: str, flags: int, mode: int = 0o600, shown: Path | str = "") -> int:
    """openat(dir_fd, name) with O_NOFOLLOW and O_NONBLOCK (a FIFO planted
    there must not hang us); only a regular file is accepted."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(shown or name, "a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(shown or name, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def create_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """A new file (O_EXCL, O_NOFOLLOW) with data, fsynced."""
    fd = os.open(path, NEW_FILE, mode)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_private(path: Path | str, what: str, *, owned: bool = True, limit: int = 4096) -> bytes:
    """The contents of a secret file (a key): opened without following a
    symbolic link, and refused, in one line naming it, unless it is a
    regular file (of this user's, with owned) that nobody else may read or
    write. Raises OSError when it cannot be opened at all."""
    from ckptd.errors import CkptdError, Code

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CkptdError(Code.PERMISSION_DENIED, f"{what} {path} is not a regular file")
        if owned and st.st_uid != os.geteuid():
            raise CkptdError(
                Code.PERMISSION_DENIED,
                f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); chown it",
            )
        if st.st_mode & 0o077:
            raise CkptdError(
                Code.PERMISSION_DENIED,
                f"{what} {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"run chmod 600 {path} and keep it secret",
            )
        return os.read(fd, limit)
    finally:
        os.close(fd)
