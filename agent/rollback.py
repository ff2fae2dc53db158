"""Putting a job's world back to a checkpoint before its processes are
rebuilt: the files it writes get their saved contents, its log is cut back
to its size at the checkpoint.

Each change is journaled first (what the file held, the log's tail), so a
restart that fails afterwards (a memory image failing its checksum, which
is checked while the processes are rebuilt) undoes it: a failed restart
leaves the job's files as it found them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.image.checksum import ALGORITHM, hash_file

log = logging.getLogger(__name__)


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


def copy_into(src: Path, dst: Path, size: int) -> None:
    """Overwrite dst in place (keeping its inode, owner and links) with the
    first `size` bytes of src."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with open(src, "rb") as f:
            left = size
            while left:
                n = _copy_chunk(f.fileno(), fd_out, left)
                if n <= 0:
                    raise CkptdError(Code.DATA_LOSS, f"saved copy of {dst} is shorter than recorded")
                left -= n
        os.ftruncate(fd_out, size)
        os.fsync(fd_out)
    finally:
        os.close(fd_out)


def _prefix_equal(a: Path, b: Path, size: int) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        left = size
        while left:
            n = min(left, 1 << 20)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def _replace_with_copy(src: Path, live: Path) -> None:
    """live becomes a copy of src, in one rename (a new inode)."""
    tmp = live.with_name(live.name + ".restore")
    shutil.copyfile(src, tmp)
    os.replace(tmp, live)


@dataclass
class _Undo:
    """How to give one path back what it held before the rollback."""

    path: Path
    kind: str  # "file": copy back (or remove); "tail": cut at `size`, append; "replace": put the whole file back
    saved: Path | None  # the journal's copy; None: the path did not exist
    stat: os.stat_result | None = None
    size: int = 0  # "tail": where the rollback cut (a lazy restart's job may have written past it since)


class WorldRollback:
    """The rollback of one restart, with its journal in `journal` (a
    directory of its own, removed by forget)."""

    def __init__(self, journal: Path) -> None:
        self.journal = journal
        self._undo: list[_Undo] = []

    def _save(self, src: Path, offset: int = 0) -> Path:
        self.journal.mkdir(parents=True, exist_ok=True)
        dst = self.journal / str(len(self._undo))
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            fin.seek(offset)
            shutil.copyfileobj(fin, fout, 1 << 20)
        return dst

    def roll_back_files(self, checkpoint: Path, manifest: dict[str, Any]) -> int:
        """Give every file the job writes its contents at checkpoint time."""
        restored = 0
        # the saved copies' checksums were just verified against the manifest
        saved_hash = {e["path"]: e[ALGORITHM] for e in manifest.get("files", [])}
        for entry in manifest.get("written_files", []):
            if not entry.get("saved"):
                continue
            dst = Path(entry["path"])
            src = checkpoint / entry["data"]
            try:
                before: os.stat_result | None = dst.stat()
            except OSError:
                before = None
            try:
                unchanged = (
                    before is not None
                    and before.st_size == entry["size"]
                    and hash_file(dst) == saved_hash.get(entry["data"])
                )
            except OSError:
                unchanged = False
            if not unchanged:
                try:
                    self._undo.append(_Undo(dst, "file", self._save(dst) if before else None, before))
                    copy_into(src, dst, int(entry["size"]))
                except OSError as e:
                    raise CkptdError(
                        Code.FAILED_PRECONDITION, f"cannot restore {dst}, which the job writes: {e.strerror}"
                    ) from e
                restored += 1
            with contextlib.suppress(OSError):
                os.chmod(dst, entry["mode"] & 0o7777)
                os.utime(dst, ns=(entry["mtime_ns"], entry["mtime_ns"]))
        return restored

    def put_back_log(self, saved: Path, live: Path) -> None:
        """The job's log as it was at the checkpoint: output the lost run produced
        afterwards goes, and output an earlier restart cut away comes back."""
        size = saved.stat().st_size
        try:
            same_prefix = live.stat().st_size >= size and _prefix_equal(saved, live, size)
        except OSError:
            same_prefix = False
        if same_prefix:
            self._undo.append(_Undo(live, "tail", self._save(live, size), size=size))
            os.truncate(live, size)  # the usual case: only cut the tail
            return
        self._undo.append(_Undo(live, "replace", self._save(live) if live.exists() else None))
        _replace_with_copy(saved, live)

    def undo(self) -> None:
        """Everything back as it was before the rollback, newest change first.
        Best effort: what cannot be put back is logged with where its copy is."""
        failed = False
        for u in reversed(self._undo):
            try:
                if u.kind == "tail" and u.saved is not None:
                    os.truncate(u.path, u.size)
                    with open(u.path, "ab") as out, open(u.saved, "rb") as tail:
                        shutil.copyfileobj(tail, out, 1 << 20)
                elif u.saved is None:
                    u.path.unlink(missing_ok=True)
                elif u.kind == "file":
                    copy_into(u.saved, u.path, u.saved.stat().st_size)
                    if u.stat is not None:
                        os.chmod(u.path, u.stat.st_mode & 0o7777)
                        os.utime(u.path, ns=(u.stat.st_atime_ns, u.stat.st_mtime_ns))
                else:
                    _replace_with_copy(u.saved, u.path)
            except OSError as e:
                failed = True
                log.error("cannot put %s back as it was before the failed restart (%s); its copy is %s",
                          u.path, e.strerror, u.saved)  # fmt: skip
        self._undo.clear()
        if not failed:
            self.forget()

    def forget(self) -> None:
        """The restart went through (or was undone): drop the journal."""
        self._undo.clear()
        shutil.rmtree(self.journal, ignore_errors=True)
