"""A fault-injecting FUSE filesystem for the tests (issue 20): a passthrough
to a real directory whose fault can be switched while it runs.

    python faultfs.py ROOT MOUNTPOINT CONTROL

serves ROOT at MOUNTPOINT (in the foreground: the caller owns the process)
and reads its fault from CONTROL, a JSON file outside the mount, again each
time the file changes::

    {"errno": "ENOSPC",          # what the faulty calls fail with (any errno name)
     "ops": "write",             # "write": calls that change the storage (write, create,
                                 #   mkdir, rename, fsync, truncate, unlink, xattrs...);
                                 # "read": open and read; "all": every call, lookups too
     "pattern": "*/pages.img",   # only paths (relative to ROOT, "/"-led) matching it
     "calls": ["fsync"],         # only these calls (default: every call of the kind;
                                 #   ENOSPC: only calls that allocate, never unlink or rmdir)
     "after_bytes": 65536,       # only once that many bytes went to matching files since
                                 #   the fault was set (a write that crosses it is cut short)
     "spread": true,             # once it fires, every call on every path fails: storage
                                 #   that goes away at a chosen moment (with ENOTCONN)
     "times": 1}                 # only the first that many calls fail: a blip, storage
                                 #   that comes back by itself

`{}` (or no file) turns faults off.  Every fault injected adds a line to
CONTROL + ".log" (the call and the path), so a test can tell where it
landed.  Storage that disappears is this process killed: every call on the
mount then fails with ENOTCONN, as when a network filesystem's server goes.

`FaultFS` in this module mounts one from a test and cleans it up.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

WRITE_OPS = frozenset(
    "write create mkdir rename fsync fsyncdir truncate unlink rmdir symlink link chmod chown utimens "  # noqa: SIM905
    "setxattr removexattr mknod open_write".split()
)
READ_OPS = frozenset(["read", "open_read"])
# a full disk still lets files go: only calls that may need a block fail
ALLOCATING = frozenset(
    ["write", "create", "mkdir", "rename", "fsync", "fsyncdir", "setxattr", "symlink", "link", "mknod"]
)


class Control:
    """The fault now in force, re-read whenever CONTROL changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.log = path + ".log"
        self.stamp: tuple[int, int] | None = None
        self.rule: dict[str, Any] = {}
        self.written = 0
        self.fired = 0
        self.lock = threading.Lock()

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            stamp = None
        else:
            stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self.stamp:
            return
        self.stamp = stamp
        rule: dict[str, Any] = {}
        if stamp is not None:
            with contextlib.suppress(ValueError, OSError):
                rule = json.loads(Path(self.path).read_text() or "{}")
        self.rule, self.written, self.fired = rule, 0, 0

    def check(self, op: str, path: str, size: int = 0) -> int:
        """How many of size bytes the call may go on with (size when no fault
        applies); raises the fault's OSError when none."""
        with self.lock:
            self._reload()
            rule = self.rule
            if not rule.get("errno"):
                return size
            ops = rule.get("ops", "write")
            kinds = {"write": WRITE_OPS, "read": READ_OPS}.get(ops)
            if kinds is not None and op not in kinds:
                return size
            calls = rule.get("calls") or (ALLOCATING if rule["errno"] == "ENOSPC" and ops == "write" else None)
            if calls is not None and op not in calls:
                return size
            pattern = rule.get("pattern")
            if pattern and not fnmatch.fnmatch(path, pattern):
                return size
            after = int(rule.get("after_bytes", 0))
            left = after - self.written
            if left > 0:
                if op != "write":
                    return size
                take = min(size, left)
                self.written += take
                if take == size:
                    return size
                return take  # a short write: the next one fails
            if rule.get("spread"):  # the first fault takes the whole filesystem with it
                self.rule = {"errno": rule["errno"], "ops": "all"}
            self.fired += 1
            if self.fired == int(rule.get("times", 0)):
                self.rule = {}
            code = getattr(errno, rule["errno"])
            with open(self.log, "a") as f:
                f.write(f"{op} {path} {rule['errno']}\n")
        raise OSError(code, os.strerror(code))


def serve(root: str, mountpoint: str, control: str) -> None:
    from fuse import FUSE, FuseOSError, Operations  # fusepy, with libfuse2

    ctl = Control(control)
    root = os.path.realpath(root)

    def fault(op: str, path: str, size: int = 0) -> int:
        try:
            return ctl.check(op, path, size)
        except OSError as e:
            raise FuseOSError(e.errno) from None

    def real(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    class Passthrough(Operations):  # type: ignore[misc]
        use_ns = True

        def __call__(self, op: str, *args: Any) -> Any:
            if op not in ("write", "read", "open") and (op in WRITE_OPS or ctl.rule.get("ops") == "all"):
                fault(op, args[0] if args else "/")
            try:
                return super().__call__(op, *args)
            except OSError as e:
                if isinstance(e, FuseOSError):
                    raise
                raise FuseOSError(e.errno or errno.EIO) from None

        def access(self, path: str, mode: int) -> None:
            if not os.access(real(path), mode):
                raise FuseOSError(errno.EACCES)

        def chmod(self, path: str, mode: int) -> None:
            os.chmod(real(path), mode)

        def chown(self, path: str, uid: int, gid: int) -> None:
            os.lchown(real(path), uid, gid)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            st = os.lstat(real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks")
            d = {k: getattr(st, k) for k in keys}
            d.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return d

        def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
            try:
                return os.getxattr(real(path), name, follow_symlinks=False)
            except OSError as e:
                raise FuseOSError(e.errno) from None

        def listxattr(self, path: str) -> list[str]:
            return os.listxattr(real(path), follow_symlinks=False)

        def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> None:
            os.setxattr(real(path), name, value, options, follow_symlinks=False)

        def removexattr(self, path: str, name: str) -> None:
            os.removexattr(real(path), name, follow_symlinks=False)

        def link(self, target: str, source: str) -> None:
            os.link(real(source), real(target))

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(real(path), mode)

        def mknod(self, path: str, mode: int, dev: int) -> None:
            os.mknod(real(path), mode, dev)

        def open(self, path: str, flags: int) -> int:
            writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC)
            fault("open_write" if writing else "open_read", path)
            return os.open(real(path), flags)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            fault("read", path, size)
            return os.pread(fh, size, offset)

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(real(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(real(path))

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def rename(self, old: str, new: str) -> None:
            os.rename(real(old), real(new))

        def rmdir(self, path: str) -> None:
            os.rmdir(real(path))

        def statfs(self, path: str) -> dict[str, Any]:
            sv = os.statvfs(real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
            return {k: getattr(sv, k) for k in keys} | {"f_frsize": sv.f_frsize, "f_namemax": sv.f_namemax}

        def symlink(self, target: str, source: str) -> None:
            os.symlink(source, real(target))

        def truncate(self, path: str, length: int, fh: Any = None) -> None:
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(real(path), length)

        def unlink(self, path: str) -> None:
            os.unlink(real(path))

        def utimens(self, path: str, times: Any = None) -> None:
            os.utime(real(path), ns=times, follow_symlinks=False)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            n = fault("write", path, len(data))
            return os.pwrite(fh, data[:n], offset)

        def flush(self, path: str, fh: int) -> None:
            pass

        def fsync(self, path: str, datasync: int, fh: int) -> None:
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)

        def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
            fd = os.open(real(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    FUSE(
        Passthrough(),
        mountpoint,
        foreground=True,
        nothreads=False,
        allow_other=True,
        default_permissions=True,
        use_ino=True,
        big_writes=True,
        fsname="faultfs",
    )


class FaultFS:
    """A faultfs mounted for one test: `set(...)` switches its fault,
    `vanish()` kills it (the mount stays, every call fails ENOTCONN),
    `close()` unmounts it."""

    def __init__(self, root: Path, mountpoint: Path, control: Path) -> None:
        self.root, self.mountpoint, self.control = root, mountpoint, control
        root.mkdir(parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.control.write_text("{}")
        self._err = open(str(control) + ".stderr", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(root), str(mountpoint), str(control)],
            stdout=self._err,
            stderr=self._err,
        )
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"faultfs did not mount: {Path(str(control) + '.stderr').read_text()[-500:]}")
            time.sleep(0.02)

    def set(self, err: str | None, **rule: Any) -> None:
        """Fail calls with errno err (None: no fault) from now on."""
        text = json.dumps({"errno": err, **rule} if err else {})
        tmp = self.control.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, self.control)

    def injected(self) -> list[str]:
        """The faults injected so far: 'op path ERRNO' lines."""
        log = Path(str(self.control) + ".log")
        return log.read_text().splitlines() if log.exists() else []

    def vanish(self) -> None:
        """The storage goes away under its users."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        self.vanish()
        subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        self._err.close()


def _fuse_loads() -> bool:
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError):  # fusepy raises OSError without libfuse2
        return False
    return True


def require() -> None:
    """Skip where FUSE cannot be had at all (no /dev/fuse, not root); install
    libfuse2 when only it is missing (a fresh machine), and fail if it cannot."""
    import importlib.util

    import debian  # tests/debian.py, beside this file
    import pytest  # here: the filesystem itself runs this file as a script

    if os.getuid() != 0:
        pytest.skip("mounting a FUSE filesystem needs root (CI runs as root)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse in this kernel or container")
    if importlib.util.find_spec("fuse") is None:  # else apt would be blamed for a pip package
        pytest.fail("fusepy is needed: pip install '.[test]'")
    debian.install(["libfuse2"], _fuse_loads)


if __name__ == "__main__":
    serve(*sys.argv[1:4])
