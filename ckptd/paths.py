"""Where ckptd keeps its state: everything hangs off CKPTD_HOME.

    $CKPTD_HOME/
        jobs/<job>.json            the coordinator's job registry (spec, node)
        agents/<node>/jobs/<job>/  an agent's runtime files for a job incarnation
        checkpoints/               the default checkpoint storage
        logs/                      daemon logs
    <ckpt_dir>/<job>/              a job's directory on checkpoint storage
        job.json                   its spec
        output.log, output.idx     its stdout+stderr, and which bytes came from which
        ckpt-000001/ ...           committed checkpoints
        .ckpt-000002.tmp-*/        a checkpoint being written (never visible as committed)

Unix socket paths are limited to 107 bytes, so the sockets live in a short
per-home runtime directory in $XDG_RUNTIME_DIR (when it is the user's own)
or /tmp.  It is the user's alone: created 0700, and refused when it exists
as anything else (another user could have made it to plant a lock symlink or
a fake coordinator socket).  The daemons run with umask 077: everything they
create under CKPTD_HOME and on checkpoint storage is 0600/0700, while the
jobs they start keep the umask of whoever started the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from ckptd.errors import CkptdError, Code

CHECKPOINT_PREFIX = "ckpt-"

_job_umask: int | None = None  # the umask the daemon started with: its jobs get it


def private_umask() -> None:
    """A daemon's files are its user's alone (umask 077); the jobs it starts
    keep the umask it was started with (job_umask)."""
    global _job_umask
    old = os.umask(0o077)
    if _job_umask is None:
        _job_umask = old


def job_umask() -> int:
    """The umask for a job's processes (-1: leave it as it is, for Popen)."""
    return -1 if _job_umask is None else _job_umask


def default_home() -> Path:
    env = os.environ.get("CKPTD_HOME")
    if env:
        return Path(env).expanduser().resolve()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ckptd"


def _runtime_base() -> Path:
    """$XDG_RUNTIME_DIR when it is a directory of ours that no one else may
    write to (su keeps another user's), else /tmp."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            return Path("/tmp")
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            return Path(xdg)
    return Path("/tmp")


def default_node() -> str:
    return os.environ.get("CKPTD_NODE") or socket.gethostname().split(".")[0] or "local"


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def from_env(cls) -> Home:
        return cls(default_home())

    @property
    def run_dir(self) -> Path:
        tag = hashlib.sha256(str(self.root).encode()).hexdigest()[:10]
        return _runtime_base() / f"ckptd-{os.getuid()}-{tag}"

    def remove_run_dir(self) -> None:
        """For a home used once (a test's, a benchmark's), once its daemons
        have ended: its runtime directory goes with it.  Otherwise it stays
        for the next daemon of the home, and one per home piles up in /tmp."""
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def check_run_dir(self, create: bool = True) -> bool:
        """Make sure the runtime directory is a directory of ours, mode 0700
        (made so when create and it does not exist); False when it does not
        exist and create is off."""
        d = self.run_dir
        if create:
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise CkptdError(
                    Code.PERMISSION_DENIED, f"cannot create the runtime directory {d}: {e.strerror}"
                ) from e
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            if create:
                raise CkptdError(Code.PERMISSION_DENIED, f"the runtime directory {d} vanished; try again") from None
            return False
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700:
            return True
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        if stat.S_ISDIR(st.st_mode):
            what = f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}"
        raise CkptdError(
            Code.PERMISSION_DENIED,
            f"refusing the runtime directory {d}: it is {what}, not a directory of uid {os.geteuid()} "
            "with mode 0700 (someone else may have made it); remove it, or set XDG_RUNTIME_DIR to a "
            "private directory of yours",
        )

    def our_socket(self, path: Path) -> bool:
        """Whether path is a Unix socket of ours (False: nothing there);
        anything else at that name is refused, never connected to."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
            return True
        raise CkptdError(
            Code.PERMISSION_DENIED,
            f"refusing {path}: it is not a socket of uid {os.geteuid()} (owner uid {st.st_uid}); "
            "remove it and try again",
        )

    def open_lock(self) -> int:
        """The runtime directory's daemon.lock, opened without following a
        symbolic link (its descriptor, for flock)."""
        path = self.run_dir / "daemon.lock"
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise CkptdError(
                Code.PERMISSION_DENIED, f"cannot open {path} ({e.strerror}); remove it and try again"
            ) from e

    @property
    def coordinator_socket(self) -> Path:
        return self.run_dir / "coordinator.sock"

    def agent_socket(self, node: str) -> Path:
        return self.run_dir / f"agent-{node}.sock"

    def shim_socket(self, node: str) -> Path:
        return self.run_dir / f"shim-{node}.sock"

    def init_socket(self, job: str, generation: int) -> Path:
        digest = hashlib.sha256(job.encode()).hexdigest()[:12]
        return self.run_dir / f"init-{digest}-{generation}.sock"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    def agent_dir(self, node: str) -> Path:
        return self.root / "agents" / node

    @property
    def default_ckpt_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def ensure(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (self.jobs_dir, self.logs_dir, self.default_ckpt_dir):
            d.mkdir(mode=0o700, exist_ok=True)
        self.check_run_dir()


def storage_error(e: OSError, what: str) -> CkptdError:
    """A launch's storage failure (exit 6): full, or not usable, with what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CkptdError(
            Code.RESOURCE_EXHAUSTED, f"{what}: checkpoint storage is full; free space or choose another --ckpt-dir"
        )
    return CkptdError(Code.PERMISSION_DENIED, f"{what}: {e.strerror}; choose another --ckpt-dir")


@dataclass(frozen=True)
class JobDir:
    """A job's directory on checkpoint storage."""

    path: Path

    @classmethod
    def of(cls, ckpt_dir: str | Path, job: str) -> JobDir:
        return cls(Path(ckpt_dir) / job)

    @property
    def spec_file(self) -> Path:
        return self.path / "job.json"

    def ensure(self, base: str | Path, uid: int) -> None:
        """Create the directory (0700), or check the one there: on shared
        storage every level below base must be a real directory (not a
        symbolic link) of this daemon's user, root or uid (the job's user),
        and its log and index regular files if they exist."""
        try:
            made = not self.path.is_dir()
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if made:  # its name is durable before a checkpoint is committed in it (the commit fsyncs only it)
                fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            raise storage_error(e, f"cannot create the job directory {self.path}") from e
        trusted = {os.geteuid(), 0, uid}
        d = self.path
        while d != Path(base) and d != d.parent:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid not in trusted:
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}"
                raise CkptdError(
                    Code.PERMISSION_DENIED,
                    f"refusing the job directory {d}: it is {what} (someone else may have made it); "
                    "remove it or choose another --job name",
                )
            d = d.parent
        for f in (self.log, self.index):  # ckptd-init opens them O_NOFOLLOW too: this says why
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(f)
                if not stat.S_ISREG(st.st_mode):
                    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                    raise CkptdError(
                        Code.PERMISSION_DENIED,
                        f"refusing {f}: it is {what}, and the job's output would go through it; "
                        "remove it or choose another --job name",
                    )

    @property
    def log(self) -> Path:
        return self.path / "output.log"

    @property
    def index(self) -> Path:
        return self.path / "output.idx"

    def checkpoint(self, ckpt_id: int) -> Path:
        return self.path / checkpoint_name(ckpt_id)


def write_private(path: Path, text: str) -> None:
    """Replace path with text, 0600: written to a new temporary file (never
    through a symbolic link planted at either name), then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checkpoint_name(ckpt_id: int) -> str:
    return f"{CHECKPOINT_PREFIX}{ckpt_id:06d}"


def parse_checkpoint_name(name: str) -> int | None:
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None
