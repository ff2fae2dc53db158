"""Whose job it is: the user a job runs as on this node.

A job's owner (JobSpec.owner, a user name set by the coordinator from the
authenticated caller) is resolved on each node with pwd/grp.  A root agent
runs the job of any other user as that user: ckptd-init drops to the
owner's uid, gid and groups before it opens anything (--user/--group/
--groups) and then runs the job in a user namespace of its own (--userns),
exactly as a daemon of that user would.  A non-root agent runs only its own
user's jobs.

What the job's processes must reach lives where that user, and no one else,
can reach it:

    /run/ckptd/                       root 0711
      <home tag>/                     root 0711 (one per CKPTD_HOME)
        shim-<uid>-<node>.sock        the owner's shim socket: owner, 0600
        u<uid>/                       owner 0700
          <job digest>/               the job's restore plans, rollback journal
            gen-N/                    one incarnation: init.sock, exit.json,
                                      the restorer's status files, hosts

The agent works in the owner's directories (and on the files a restart
rolls back) with the owner's filesystem identity (files_as): setfsuid,
setfsgid and setgroups on the calling thread only, so a symbolic link the
owner planted leads nowhere the owner could not go itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import hashlib
import os
import platform
import pwd
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptd.errors import CkptdError, Code
from ckptd.paths import Home

# per-thread credential system calls (glibc's wrappers change every thread)
_SYSCALLS = {
    "x86_64": {"setgroups": 116, "setfsuid": 122, "setfsgid": 123},
    "aarch64": {"setgroups": 159, "setfsuid": 151, "setfsgid": 152},
}
RUN_BASE = Path("/run/ckptd")


@dataclass(frozen=True)
class Owner:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @property
    def switch(self) -> bool:
        """Whether the job runs as another user than the agent (a root agent's
        job of a non-root user)."""
        return self.uid != os.geteuid()

    @property
    def any_uid(self) -> bool:
        """Whether the job's processes may run as any uid: a root agent's job
        of root, which may drop privileges (setresuid, setgroups) as a root
        service does.  Its shim socket is open to every uid, its image
        directories go to the uid a process writes with (give_dir)."""
        return self.uid == 0 and os.geteuid() == 0

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def init_args(self) -> list[str]:
        """ckptd-init's options that make the incarnation this user's."""
        if not self.switch:
            return []
        groups = ",".join(str(g) for g in self.groups) or str(self.gid)
        return ["--user", str(self.uid), "--group", str(self.gid), "--groups", groups, "--userns"]


def resolve_owner(name: str, node: str) -> Owner:
    """The owner of a job on this node; "" (a job recorded before owners
    existed) is the agent's own user."""
    me = os.geteuid()
    if not name:
        try:
            pw = pwd.getpwuid(me)
        except KeyError:
            return Owner(str(me), me, os.getegid(), tuple(os.getgroups()), "/")
        name = pw.pw_name
    else:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"user {name} does not exist on node {node}; create it there (same name) "
                "or launch the job on a node that has it",
            ) from None
    if me not in (pw.pw_uid, 0):
        raise CkptdError(
            Code.PERMISSION_DENIED,
            f"node {node}'s agent runs as uid {me}, not root: it cannot run a job of user {name}; "
            "run the agent as root, or launch the job as that agent's user",
        )
    try:
        groups = tuple(sorted(set(os.getgrouplist(name, pw.pw_gid))))
    except OSError:
        groups = (pw.pw_gid,)
    return Owner(name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir or "/")


def group_names(owner: Owner) -> list[str]:
    out = []
    for g in owner.groups:
        try:
            out.append(grp.getgrgid(g).gr_name)
        except KeyError:
            out.append(str(g))
    return out


# ---- the owner's filesystem identity, on this thread only ----


def _syscall(name: str, *args: int | ctypes.Array[ctypes.c_uint32]) -> int:
    table = _SYSCALLS.get(platform.machine())
    if table is None:
        raise CkptdError(
            Code.FAILED_PRECONDITION, f"running jobs as their owners is not supported on {platform.machine()}"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    rc: int = libc.syscall(ctypes.c_long(table[name]), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return rc


def _set_groups(groups: tuple[int, ...] | list[int]) -> None:
    arr = (ctypes.c_uint32 * max(len(groups), 1))(*groups)
    _syscall("setgroups", len(groups), arr)


def _set_fs_ids(uid: int, gid: int) -> None:
    _syscall("setfsgid", gid)
    _syscall("setfsuid", uid)
    # both return the previous id and cannot fail visibly: an invalid id
    # (-1) reads the current one back
    if _syscall("setfsuid", 0xFFFFFFFF) != uid or _syscall("setfsgid", 0xFFFFFFFF) != gid:
        raise CkptdError(Code.INTERNAL, f"cannot take the filesystem identity {uid}:{gid}")


@contextlib.contextmanager
def files_as(owner: Owner) -> Iterator[None]:
    """File operations in this block are checked as the owner's (this thread
    only: setfsuid and setfsgid drop the capabilities that bypass file
    permissions, setgroups the agent's groups).  A no-op for the agent's own
    user."""
    if not owner.switch:
        yield
        return
    saved = os.getgroups()
    _set_groups(owner.groups)
    try:
        _set_fs_ids(owner.uid, owner.gid)
        yield
    finally:
        _set_fs_ids(os.geteuid(), os.getegid())
        _set_groups(saved)


# ---- directories for the job's processes ----


def _root_dir(path: Path, mode: int) -> None:
    """A directory of root's (made if missing) with exactly `mode`; refused
    when it is anything else (someone may have made it first)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != 0:
            raise CkptdError(
                Code.PERMISSION_DENIED,
                f"refusing {path}: it is owned by uid {st.st_uid}, not root (someone else may have made it); "
                "remove it and try again",
            )
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _tag(*parts: str, n: int = 12) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


def area(home: Home) -> Path:
    """Root's directory for one CKPTD_HOME's jobs of other users."""
    base = RUN_BASE if RUN_BASE.parent.is_dir() else Path("/tmp") / "ckptd-owners"
    d = base / _tag(str(home.root), n=10)
    try:
        _root_dir(base, 0o711)
        _root_dir(d, 0o711)
    except OSError as e:
        raise CkptdError(Code.PERMISSION_DENIED, f"cannot create {d} for jobs of other users: {e.strerror}") from e
    return d


def shim_socket(home: Home, node: str, owner: Owner) -> Path:
    return area(home) / f"shim-{owner.uid}-{_tag(node, n=8)}.sock"


def user_dir(home: Home, owner: Owner) -> Path:
    """The owner's own directory (0700) in root's area."""
    d = area(home) / f"u{owner.uid}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
        os.chown(d, owner.uid, owner.gid, follow_symlinks=False)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner.uid or st.st_mode & 0o077:
        raise CkptdError(
            Code.PERMISSION_DENIED, f"refusing {d}: it is not a 0700 directory of user {owner.name}; remove it"
        )
    return d


def job_work_dir(home: Home, node: str, job: str, owner: Owner) -> Path:
    """The job's directory among the owner's (made with the owner's identity)."""
    d = user_dir(home, owner) / _tag(node, job)
    with files_as(owner):
        d.mkdir(mode=0o700, exist_ok=True)
    return d


# ---- the job's directory on checkpoint storage ----


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CkptdError(
            Code.PERMISSION_DENIED, f"refusing the directory {path}: {e.strerror} (a symbolic link?)"
        ) from e


def open_to_owner(directory: Path, owner: Owner) -> None:
    """A directory of the agent's on checkpoint storage that the owner's
    processes must pass through (the job's, a round's): 0711, so that they
    reach their own files in it and list nothing."""
    if not owner.switch and not owner.any_uid:
        return
    fd = _open_dir(directory)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o711 != 0o711:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o711)
    finally:
        os.close(fd)


def give_dir(path: Path, owner: Owner, writer: tuple[int, int] | None = None) -> None:
    """A directory the agent has just made for the owner's processes (a
    process's image directory): theirs, 0700.  writer (uid, gid): the
    filesystem ids the process writes with, when a root job's process has
    dropped privileges (Owner.any_uid): the directory is that uid's."""
    if owner.switch:
        uid, gid = owner.uid, owner.gid
    elif owner.any_uid and writer is not None and writer[0] != owner.uid:
        uid, gid = writer
    else:
        return
    fd = _open_dir(path)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def fs_ids(host_pid: int) -> tuple[int, int] | None:
    """A process's filesystem uid and gid (what it creates files as)."""
    try:
        fd = os.open(f"/proc/{host_pid}/status", os.O_RDONLY)
        try:
            status = os.read(fd, 65536)
        finally:
            os.close(fd)
        # "Uid:\treal\teffective\tsaved\tfilesystem" (and Gid:), each on a line of its own
        uid, gid = (status.split(b"\n" + key, 1)[1].split(b"\n", 1)[0].split()[3] for key in (b"Uid:", b"Gid:"))
        return int(uid), int(gid)
    except (OSError, ValueError, IndexError):
        return None


def check_storage(ckpt_dir: Path, owner: Owner, node: str) -> None:
    """A root agent creates a job's directory only where its owner could:
    a user may not have root make directories and files in a place closed to
    them (`--ckpt-dir /etc`)."""
    if not owner.switch:
        return
    with files_as(owner):
        writable = os.access(ckpt_dir, os.W_OK | os.X_OK, effective_ids=True)
    if not writable:
        raise CkptdError(
            Code.PERMISSION_DENIED,
            f"user {owner.name} may not write in --ckpt-dir {ckpt_dir} on node {node}; "
            "choose a checkpoint directory that user can write",
        )


def prepare_job_dir(path: Path, log_files: list[Path], owner: Owner, node: str) -> None:
    """The job's directory (and a rank's parent, the job's) passable by the
    owner, its log files the owner's (0600, created without following a
    symbolic link): ckptd-init writes them as the owner."""
    if not owner.switch:
        return
    for d in (path.parent, path) if path.name.startswith("rank-") else (path,):
        open_to_owner(d, owner)
    with files_as(owner):
        reachable = os.access(path, os.X_OK, effective_ids=True)
    if not reachable:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"user {owner.name} cannot reach the job directory {path} on node {node} (a directory above it "
            "is closed to that user); use a --ckpt-dir that user can reach",
        )
    dfd = _open_dir(path)
    try:
        for f in log_files:
            try:
                fd = os.open(f.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)  # fmt: skip
            except OSError as e:
                raise CkptdError(Code.PERMISSION_DENIED, f"refusing {f}: {e.strerror} (a symbolic link?)") from e
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid not in (owner.uid, os.geteuid()):
                    raise CkptdError(
                        Code.PERMISSION_DENIED,
                        f"refusing {f}: not a regular file of user {owner.name} or of the agent; remove it",
                    )
                os.fchown(fd, owner.uid, owner.gid)
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
    finally:
        os.close(dfd)


def check_owned_tree(directory: Path, owner: Owner) -> None:
    """What the owner's processes wrote into a directory the agent reads as
    root (a process's image directory): only directories and regular files
    of the owner's, each with one name, or the checkpoint is refused."""
    uid = owner.uid
    if not owner.switch:
        uid = os.lstat(directory).st_uid  # given to a root job's process with other ids (give_dir)
        if not owner.any_uid or uid == os.geteuid():
            return
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            p = Path(root) / name
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            if (
                kind not in (stat.S_IFDIR, stat.S_IFREG)
                or st.st_uid != uid
                or (kind == stat.S_IFREG and st.st_nlink != 1)
            ):
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"{p} is not a file of user {owner.name} written by the checkpoint (a link, or another "
                    "user's); the checkpoint is refused",
                )
