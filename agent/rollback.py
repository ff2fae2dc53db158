"""Putting a job's world back to a checkpoint before its processes are
rebuilt: the files it writes get their saved contents, its log is cut back
to its size at the checkpoint.

Each change is journaled first (what the file held, the log's tail), so a
restart that fails afterwards (a memory image failing its checksum, which
is checked while the processes are rebuilt) undoes it: a failed restart
leaves the job's files as it found them.  The list of changes is written
to the journal too (undo.json, before each change is made): an agent that
dies in the middle of a restart (its restored processes never ran: they
wait for its word) leaves the journal, and the next agent to start plays it
back (replay_leftovers), so the files and the log come back as well.

A restart writes only where the job wrote, whatever its manifest says (the
manifest is authenticated, see ckptd/image/seal.py; these checks hold even
without that).  The whole list is checked before anything is written:
every path absolute and normalised, with no `..`; recorded by the shim in
the image of the process that wrote it (check_recorded); never a mode with
setuid, setgid or sticky bits; and no symlink on any component: each path
is walked from / with openat(O_NOFOLLOW) (ckptd/nofollow.py), then as it is
written.  Files and directories a restart creates go to the job's owner.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ckptd.errors import CkptdError, Code
from ckptd.image import crypt
from ckptd.image.checksum import ALGORITHM
from ckptd.image.core import CoreImage
from ckptd.nofollow import UnsafePath, open_dir, open_file

log = logging.getLogger(__name__)

HINT = "restart from another checkpoint with --from ID (`ckptctl list JOB`)"
Owner = tuple[int, int]


def _copy_chunk(src: int, dst: int, left: int) -> int:
    """Copy up to `left` bytes at both files' offsets; returns how many."""
    try:
        return os.copy_file_range(src, dst, left)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    # across filesystems (tmpfs /dev/shm, say) on kernels that refuse it
    data = os.read(src, min(left, 1 << 20))
    view = memoryview(data)
    while view:
        view = view[os.write(dst, view) :]
    return len(data)


def copy_into(src: Path, fd_out: int, size: int, shown: Path) -> None:
    """Overwrite the open file fd_out in place (keeping its inode, owner and
    links) with the first `size` bytes of src."""
    os.lseek(fd_out, 0, os.SEEK_SET)
    with open(src, "rb") as f:
        left = size
        while left:
            n = _copy_chunk(f.fileno(), fd_out, left)
            if n <= 0:
                raise CkptdError(Code.DATA_LOSS, f"saved copy of {shown} is shorter than recorded")
            left -= n
    os.ftruncate(fd_out, size)
    os.fsync(fd_out)


def _hash_fd(fd: int) -> str:
    h = xxhash.xxh3_128()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 8 << 20):
        h.update(chunk)
    return h.hexdigest()


def _prefix_equal(a: Path, fd: int, size: int) -> bool:
    os.lseek(fd, 0, os.SEEK_SET)
    with open(a, "rb") as fa:
        left = size
        while left:
            n = min(left, 1 << 20)
            if fa.read(n) != os.read(fd, n):
                return False
            left -= n
    return True


# ---- which files a restart may write ----


@dataclass(frozen=True)
class WrittenFile:
    """One file to put back, its path checked."""

    path: Path
    data: str  # its saved copy, relative to the checkpoint
    size: int
    mode: int  # permission bits only
    mtime_ns: int


def _refuse(checkpoint: Path, path: object, why: str) -> CkptdError:
    return CkptdError(Code.DATA_LOSS, f"checkpoint {checkpoint.name} would write {path}, which {why}; refused: {HINT}")


def _check_path(checkpoint: Path, raw: object) -> Path:
    if not isinstance(raw, str) or not raw or "\0" in raw:
        raise _refuse(checkpoint, repr(raw), "is not a path")
    if not raw.startswith("/"):
        raise _refuse(checkpoint, raw, "is a relative path")
    if ".." in raw.split("/"):
        raise _refuse(checkpoint, raw, "has a '..' component")
    if os.path.normpath(raw) != raw or raw.startswith("//") or raw == "/":
        raise _refuse(checkpoint, raw, "is not a normalised absolute file path")
    return Path(raw)


def _check_on_disk(checkpoint: Path, path: Path) -> None:
    """No symlink on any component, the file itself regular if it exists."""
    try:
        fd = open_dir(path.parent)
    except FileNotFoundError:
        return  # made when restored, unfollowed
    except UnsafePath as e:
        raise _refuse(checkpoint, path, f"lies beneath {e.where}, {e.kind}; a restart never follows one") from None
    except OSError as e:
        raise CkptdError(Code.FAILED_PRECONDITION, f"cannot restore {path}, which the job writes: {e.strerror}") from e
    try:
        st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    finally:
        os.close(fd)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(checkpoint, path, "is a symbolic link now; a restart never follows one")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(checkpoint, path, "is no longer a regular file")


def check_written_files(checkpoint: Path, manifest: dict[str, Any]) -> list[WrittenFile]:
    """Every file the restart would write, checked (module doc), or a
    DATA_LOSS error naming the first that may not be.  Touches nothing."""
    saved = {e.get("path") for e in manifest.get("files", []) if isinstance(e, dict)}
    out: list[WrittenFile] = []
    seen: set[Path] = set()
    for entry in manifest.get("written_files", []):
        if not isinstance(entry, dict) or not entry.get("saved"):
            continue
        path = _check_path(checkpoint, entry.get("path"))
        mode, size, mtime, data = (entry.get(k) for k in ("mode", "size", "mtime_ns", "data"))
        if not all(isinstance(v, int) and v >= 0 for v in (mode, size, mtime)) or not isinstance(data, str):
            raise _refuse(checkpoint, path, "has a malformed entry")
        assert isinstance(mode, int) and isinstance(size, int) and isinstance(mtime, int)
        if mode & 0o7000:
            raise _refuse(
                checkpoint, path, f"has mode {mode & 0o7777:04o}: setuid, setgid and sticky bits are never restored"
            )
        if data not in saved or ".." in data.split("/") or data.startswith("/"):
            raise _refuse(checkpoint, path, f"has no saved copy among the checkpoint's files ({data})")
        if path in seen:
            raise _refuse(checkpoint, path, "is listed twice")
        seen.add(path)
        out.append(WrittenFile(path, data, size, mode & 0o777, mtime))
    for f in out:
        _check_on_disk(checkpoint, f.path)
    return out


def check_recorded(checkpoint: Path, manifest: dict[str, Any]) -> None:
    """Each written file is one the shim recorded in the image of the process
    that wrote it (core.img, whose checksum the manifest lists and which
    was verified): a manifest that names another file is refused."""
    dirs = {p.get("dir") for p in manifest.get("processes", []) if isinstance(p, dict)}
    cores: dict[str, dict[int, dict[str, Any]]] = {}
    for entry in manifest.get("written_files", []):
        if not isinstance(entry, dict) or not entry.get("saved"):
            continue
        proc, _, name = str(entry.get("data", "")).rpartition("/files/")
        if proc not in dirs or name != f"{entry.get('index')}.data":
            raise _refuse(checkpoint, entry.get("path"), "no process of the checkpoint saved")
        if proc not in cores:
            try:
                core = CoreImage.load(checkpoint / proc / "core.img")
            except CkptdError as e:
                raise CkptdError(Code.DATA_LOSS, f"checkpoint {checkpoint.name}: {e.message}") from None
            cores[proc] = {int(wf["index"]): wf for wf in core.written_files()}
        recorded = cores[proc].get(entry.get("index", -1))  # type: ignore[arg-type]
        if recorded is None or recorded != {k: v for k, v in entry.items() if k != "data"}:
            raise _refuse(
                checkpoint, entry.get("path"), f"the job did not write (its image in {proc} does not record it)"
            )


# ---- the rollback ----


@dataclass
class _Undo:
    """How to give one path back what it held before the rollback."""

    path: Path
    kind: str  # "file": copy back (or remove); "tail": cut at `size`, append; "replace": the whole file; "dir": rmdir
    saved: Path | None  # the journal's copy; None: the path did not exist
    stat: os.stat_result | None = None
    size: int = 0  # "tail": where the rollback cut (a lazy restart's job may have written past it since)
    beneath: Path = Path("/")  # walked from here without following symlinks

    def to_json(self) -> dict[str, Any]:
        st = self.stat
        return {
            "path": str(self.path),
            "kind": self.kind,
            "saved": str(self.saved) if self.saved is not None else None,
            "stat": [st.st_mode, st.st_atime_ns, st.st_mtime_ns] if st is not None else None,
            "size": self.size,
            "beneath": str(self.beneath),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Undo:
        st = None
        if d.get("stat"):
            mode, atime_ns, mtime_ns = (int(x) for x in d["stat"])
            # what _undo_one reads of it: the mode and the times, in ns
            st = os.stat_result((mode, 0, 0, 0, 0, 0, 0, 0, 0, 0), {"st_atime_ns": atime_ns, "st_mtime_ns": mtime_ns})
        return cls(
            Path(d["path"]),
            str(d["kind"]),
            Path(d["saved"]) if d.get("saved") else None,
            st,
            int(d.get("size", 0)),
            Path(d.get("beneath", "/")),
        )


JOURNAL_INDEX = "undo.json"  # the list of changes, in the journal's directory


class WorldRollback:
    """The rollback of one restart, with its journal in `journal` (a
    directory of its own, removed by forget).  owner (uid, gid): who gets
    the files and directories it creates (None: this process's user)."""

    def __init__(self, journal: Path, owner: Owner | None = None, key: bytes | None = None) -> None:
        self.journal = journal
        self.owner = owner
        self.key = key  # launch --encrypt: saved files and logs are sealed (ckptd/image/crypt.py)
        self._undo: list[_Undo] = []
        self._clear = 0

    def _in_clear(self, saved: Path) -> Path:
        """saved itself, or (sealed) its plaintext in a file of the journal,
        which is the agent's own (0700)."""
        if self.key is None or not crypt.is_sealed(saved):
            return saved
        self.journal.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._clear += 1
        dst = self.journal / f"clear-{self._clear}"
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as out:
            out.write(crypt.open_file(self.key, saved))
        return dst

    def _record(self, *undos: _Undo) -> None:
        """Note changes about to be made, in memory and in the journal's index
        (written whole, then renamed: an agent killed at any moment leaves
        either the old list or the new one)."""
        self._undo.extend(undos)
        if not undos:
            return
        self.journal.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.journal / f"{JOURNAL_INDEX}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w") as f:
            owner = list(self.owner) if self.owner else None
            json.dump({"owner": owner, "changes": [u.to_json() for u in self._undo]}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.journal / JOURNAL_INDEX)

    @classmethod
    def replay_leftovers(cls, jobs_dir: Path, busy: set[str]) -> None:
        """Journals a dead agent left (jobs_dir/JOB/undo-CKPT/undo.json): each
        restart they belong to never finished, so its changes are undone.  A
        job in `busy` (re-adopted and running: its restart was released) keeps
        its files, and its journal goes."""
        for index in sorted(jobs_dir.glob(f"*/undo-*/{JOURNAL_INDEX}")):
            journal = index.parent
            if journal.parent.name in busy:  # its restart went through (released): nothing to undo, ever
                shutil.rmtree(journal, ignore_errors=True)
                continue
            try:
                saved = json.loads(index.read_text())
                owner = saved.get("owner")
                world = cls(journal, (int(owner[0]), int(owner[1])) if owner else None)
                entries = saved["changes"]
                world._undo = [_Undo.from_json(e) for e in entries]
            except (OSError, ValueError, TypeError, KeyError) as e:
                log.error("cannot read the journal of an unfinished restart %s: %s; its copies stay there", index, e)
                continue
            log.warning("putting back what an unfinished restart changed (%d change(s), %s)", len(entries), journal)
            world.undo()

    def _save(self, fd: int, offset: int = 0) -> Path:
        self.journal.mkdir(mode=0o700, parents=True, exist_ok=True)
        dst = self.journal / str(len(self._undo))
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.lseek(fd, offset, os.SEEK_SET)
            while chunk := os.read(fd, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        finally:
            os.close(out)
        return dst

    def roll_back_files(self, checkpoint: Path, manifest: dict[str, Any]) -> int:
        """Give every file the job writes its contents at checkpoint time,
        once every one of them is known to be allowed (check_written_files)."""
        files = check_written_files(checkpoint, manifest)
        # the saved copies' checksums were just verified against the manifest
        saved_hash = {e["path"]: e[ALGORITHM] for e in manifest.get("files", [])}
        restored = 0
        for f in files:
            try:
                saved = checkpoint / f.data
                clear = self._in_clear(saved)
                restored += self._roll_back_one(clear, f, saved_hash.get(f.data) if clear == saved else None)
            except UnsafePath as e:
                raise _refuse(checkpoint, f.path, f"became unsafe while restoring ({e.why})") from None
            except OSError as e:
                raise CkptdError(
                    Code.FAILED_PRECONDITION, f"cannot restore {f.path}, which the job writes: {e.strerror}"
                ) from e
        return restored

    def _roll_back_one(self, src: Path, f: WrittenFile, digest: str | None) -> int:
        made: list[Path] = []
        try:
            d = open_dir(f.path.parent, create=0o755, owner=self.owner, created=made)
        finally:
            self._record(*(_Undo(p, "dir", None) for p in made))
        try:
            try:
                fd = open_file(d, f.path.name, os.O_RDWR, shown=f.path)
                before: os.stat_result | None = os.fstat(fd)
            except FileNotFoundError:
                fd = open_file(d, f.path.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, shown=f.path)
                before = None
                if self.owner is not None:
                    os.fchown(fd, *self.owner)
            try:
                unchanged = before is not None and before.st_size == f.size and _hash_fd(fd) == digest
                if not unchanged:
                    self._record(_Undo(f.path, "file", self._save(fd) if before else None, before))
                    copy_into(src, fd, f.size, f.path)
                with contextlib.suppress(OSError):
                    os.chmod(fd, f.mode)
                    os.utime(fd, ns=(f.mtime_ns, f.mtime_ns))
            finally:
                os.close(fd)
        finally:
            os.close(d)
        return 0 if unchanged else 1

    def put_back_log(self, saved: Path, live: Path, beneath: Path | None = None) -> None:
        """The job's log as it was at the checkpoint: output the lost run produced
        afterwards goes, and output an earlier restart cut away comes back.
        The path below beneath (the checkpoint root, default the log's
        directory) is never followed through a symlink."""
        base = live.parent if beneath is None else beneath
        saved = self._in_clear(saved)
        size = saved.stat().st_size
        try:
            d = open_dir(live.parent, base)
        except UnsafePath as e:
            raise CkptdError(Code.PERMISSION_DENIED, f"refusing the job's log {live}: {e.why}; remove it") from None
        try:
            try:
                fd: int | None = open_file(d, live.name, os.O_RDWR, shown=live)
            except FileNotFoundError:
                fd = None
            except UnsafePath as e:
                raise CkptdError(Code.PERMISSION_DENIED, f"refusing the job's log {live}: {e.why}; remove it") from None
            if fd is not None:
                try:
                    if os.fstat(fd).st_size >= size and _prefix_equal(saved, fd, size):
                        self._record(_Undo(live, "tail", self._save(fd, size), size=size, beneath=base))
                        os.ftruncate(fd, size)  # the usual case: only cut the tail
                        return
                    self._record(_Undo(live, "replace", self._save(fd), beneath=base))
                finally:
                    os.close(fd)
            else:
                self._record(_Undo(live, "replace", None, beneath=base))
            self._replace_with_copy(saved, d, live)
        finally:
            os.close(d)

    def _replace_with_copy(self, src: Path, d: int, live: Path) -> None:
        """live becomes a copy of src, in one rename (a new inode)."""
        tmp = live.name + ".restore"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=d)
        fd = open_file(d, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, shown=live.with_name(tmp))
        try:
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            copy_into(src, fd, src.stat().st_size, live)
        finally:
            os.close(fd)
        os.replace(tmp, live.name, src_dir_fd=d, dst_dir_fd=d)

    def _undo_one(self, u: _Undo) -> None:
        d = open_dir(u.path.parent, u.beneath)
        try:
            if u.kind == "dir":
                with contextlib.suppress(OSError):  # not empty: something else is there now
                    os.rmdir(u.path.name, dir_fd=d)
            elif u.kind == "tail" and u.saved is not None:
                fd = open_file(d, u.path.name, os.O_WRONLY, shown=u.path)
                try:
                    os.ftruncate(fd, u.size)
                    os.lseek(fd, u.size, os.SEEK_SET)
                    with open(u.saved, "rb") as tail:
                        while chunk := tail.read(1 << 20):
                            view = memoryview(chunk)
                            while view:
                                view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
            elif u.saved is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(u.path.name, dir_fd=d)
            elif u.kind == "file":
                fd = open_file(d, u.path.name, os.O_WRONLY | os.O_CREAT, 0o600, shown=u.path)
                try:
                    copy_into(u.saved, fd, u.saved.stat().st_size, u.path)
                    if u.stat is not None:
                        os.chmod(fd, u.stat.st_mode & 0o777)
                        os.utime(fd, ns=(u.stat.st_atime_ns, u.stat.st_mtime_ns))
                finally:
                    os.close(fd)
            else:
                self._replace_with_copy(u.saved, d, u.path)
        finally:
            os.close(d)

    def undo(self) -> None:
        """Everything back as it was before the rollback, newest change first.
        Best effort: what cannot be put back is logged with where its copy is."""
        failed = False
        for u in reversed(self._undo):
            try:
                self._undo_one(u)
            except (OSError, UnsafePath, CkptdError) as e:
                failed = True
                why = e.strerror if isinstance(e, OSError) else str(e)
                log.error("cannot put %s back as it was before the failed restart (%s); its copy is %s",
                          u.path, why, u.saved)  # fmt: skip
        self._undo.clear()
        if not failed:
            self.forget()

    def forget(self) -> None:
        """The restart went through (or was undone): drop the journal."""
        self._undo.clear()
        shutil.rmtree(self.journal, ignore_errors=True)
