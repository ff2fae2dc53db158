"""The checkpoint catalog, read from storage: the directories are the truth.

A checkpoint is committed when its directory is renamed from
.ckpt-NNNNNN.tmp-XXXX to ckpt-NNNNNN with a valid manifest inside.  After a
reboot the catalog is simply re-read; leftover temporary directories are
removed, never promoted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ckptd.errors import STORAGE_ERRNOS, CkptdError, Code
from ckptd.image.checksum import fsync_path
from ckptd.image.manifest import load_manifest, total_bytes
from ckptd.image.transfer import read_upload_record
from ckptd.nofollow import UnsafePath, create_file, open_dir
from ckptd.paths import CHECKPOINT_PREFIX, JobDir, checkpoint_name, parse_checkpoint_name
from ckptd.v1 import ckptd_pb2 as pb

log = logging.getLogger(__name__)

TMP_PREFIX = "." + CHECKPOINT_PREFIX
DELETING = ".del-"  # .ckpt-N.del-XXXX: a pruned checkpoint on its way out
# (inside Catalog, "list" is its method)
Names = list[str]
Infos = list[pb.CheckpointInfo]


class TieredJob(Protocol):
    """What listing needs of a job (a jobs.JobRecord)."""

    @property
    def name(self) -> str: ...
    @property
    def job_dir(self) -> JobDir: ...
    @property
    def shared_dir(self) -> JobDir | None: ...


def storage_error(e: OSError, path: Path) -> CkptdError:
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return CkptdError(
            Code.PERMISSION_DENIED,
            f"checkpoint directory {path} is not writable ({e.strerror}); "
            "fix its permissions or choose another --ckpt-dir",
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CkptdError(
            Code.RESOURCE_EXHAUSTED,
            f"checkpoint storage {path} is full; free space or choose another --ckpt-dir",
        )
    return CkptdError(Code.UNAVAILABLE, f"checkpoint storage {path} failed: {e.strerror}")


def info_from_manifest(job: str, path: Path) -> pb.CheckpointInfo:
    m = load_manifest(path)
    t = m.get("timings", {})
    chain = m.get("chain") or {}
    sizes = m.get("sizes", {})
    deduped = int(sizes.get("dedup_bytes", 0))  # punched out of the files: listed, not stored
    stored = total_bytes(m) - deduped
    return pb.CheckpointInfo(
        job=job,
        id=int(m["id"]),
        name=path.name,
        path=str(path),
        created=m.get("created", ""),
        size_bytes=stored,
        logical_bytes=stored + deduped + int(sizes.get("ref_bytes", 0)),
        dedup_bytes=deduped,
        parent=chain.get("parent", ""),
        depends_on=chain.get("depends_on", []),
        duration_s=float(t.get("total_s", 0)),
        stall_s=float(t.get("stall_s", 0)),
        processes=len(m.get("processes", [])),
        node=m.get("node", ""),
        phases=[
            pb.PhaseTiming(
                name=str(p["name"]),
                rpc_s=float(p["rpc_s"]),
                local_s=float(p["local_s"]),
                issue_s=float(p.get("issue_s", 0)),  # none before they were recorded
                wire_s=float(p.get("wire_s", 0)),
                requests=int(p.get("requests", 0)),
                busy_s=float(p.get("busy_s", 0)),
            )
            for p in m.get("phases", [])  # none in a manifest from before phases were recorded
        ],
    )


class Catalog:
    def __init__(self) -> None:
        # whether an upload of (job, checkpoint) is queued or running (tiering.Uploader)
        self.uploading: Callable[[str, str], bool] = lambda job, name: False

    def list(self, job: str, job_dir: JobDir, shared: JobDir | None = None) -> Infos:
        """The job's checkpoints, oldest first.  With a shared tier, the
        stage's and the shared tier's together, each with its tier."""
        local = self._list_dir(job, job_dir)
        if shared is None:
            return local
        try:
            up = {c.id: c for c in self._list_dir(job, shared)}
        except OSError as e:  # the shared tier is down: the stage's checkpoints serve, listed as local only
            if e.errno not in STORAGE_ERRNOS:
                raise
            log.warning("job %s: cannot list the shared tier %s: %s", job, shared.path, e.strerror)
            up = {}
        for c in up.values():
            record = read_upload_record(Path(c.path))
            c.shared_bytes = int(record.get("stored_bytes", 0))
            c.upload_s = float(record.get("seconds", 0.0))
        out = []
        for c in local:
            s = up.pop(c.id, None)
            if s is not None and s.created != "corrupt":
                c.tier, c.shared_bytes, c.upload_s = "local+shared", s.shared_bytes, s.upload_s
            else:
                c.tier = "uploading" if self.uploading(job, c.name) else "local"
            out.append(c)
        for s in up.values():
            s.tier = "shared"  # its stage copy is gone: a restart fetches it first
            out.append(s)
        return sorted(out, key=lambda c: c.id)

    def list_job(self, record: TieredJob) -> Infos:
        return self.list(record.name, record.job_dir, record.shared_dir)

    def _list_dir(self, job: str, job_dir: JobDir) -> Infos:
        out = []
        try:
            entries = list(os.scandir(job_dir.path))
        except (FileNotFoundError, NotADirectoryError):  # nothing committed there (yet)
            return []
        for entry in entries:
            ckpt_id = parse_checkpoint_name(entry.name)
            if ckpt_id is None or not entry.is_dir():
                continue
            try:
                out.append(info_from_manifest(job, Path(entry.path)))
            except CkptdError as e:
                # listed so the user sees it (a forged one too: it fails its
                # authentication); a restart from it fails its verification
                log.warning("%s", e.message)
                out.append(pb.CheckpointInfo(job=job, id=ckpt_id, name=entry.name, path=entry.path, created="corrupt"))
        return sorted(out, key=lambda c: c.id)

    def newest(self, job_dir: JobDir) -> tuple[str, dict[str, Any] | None] | None:
        """The newest committed checkpoint's name and its verified manifest
        (None if it is corrupt), or None when there is none: one manifest
        read, however many checkpoints the job has (a round starts with it)."""
        try:
            entries = [e for e in os.scandir(job_dir.path) if parse_checkpoint_name(e.name) is not None and e.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not entries:
            return None
        last = max(entries, key=lambda e: parse_checkpoint_name(e.name) or 0)
        try:
            return last.name, load_manifest(Path(last.path))
        except CkptdError as e:
            log.warning("%s", e.message)
            return last.name, None

    def next_id(self, job_dir: JobDir) -> int:
        ids = [0]
        try:
            for name in os.listdir(job_dir.path):
                base = name[1:].split(".tmp-")[0] if name.startswith(TMP_PREFIX) else name
                n = parse_checkpoint_name(base)
                if n is not None:
                    ids.append(n)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return max(ids) + 1

    def create_tmp(self, job_dir: JobDir, ckpt_id: int) -> Path:
        """A new temporary checkpoint directory, 0700, in the job's directory
        (made if need be; refused if it, or the new one, is a symlink: the
        checkpoint storage may be shared with other users)."""
        tmp = job_dir.path / f".{checkpoint_name(ckpt_id)}.tmp-{secrets.token_hex(4)}"
        try:
            job_dir.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(open_dir(job_dir.path, job_dir.path.parent, create=0o700))
            tmp.mkdir(mode=0o700)
            os.close(open_dir(tmp, job_dir.path))
            probe = tmp / ".probe"
            create_file(probe, b"x")
            probe.unlink()
        except UnsafePath as e:
            raise CkptdError(
                Code.PERMISSION_DENIED,
                f"refusing the job directory {job_dir.path}: {e.why} (planted in the checkpoint storage?); remove it",
            ) from None
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise storage_error(e, job_dir.path) from e
        return tmp

    def commit(self, tmp: Path, job_dir: JobDir, ckpt_id: int) -> Path:
        final = job_dir.checkpoint(ckpt_id)
        if os.path.lexists(final):
            raise CkptdError(Code.ABORTED, f"{final} already exists; another coordinator is writing this job?")
        try:
            os.rename(tmp, final)
        except OSError as e:
            raise storage_error(e, job_dir.path) from e
        try:
            fsync_path(job_dir.path)
        except OSError as e:
            # the name is not durable, and the round is about to say it failed:
            # take the name back, so that no checkpoint stays that its caller was told is not there
            with contextlib.suppress(OSError):
                os.rename(final, tmp)
            raise storage_error(e, job_dir.path) from e
        return final

    @staticmethod
    def discard(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def prune(self, job: str, job_dir: JobDir, keep_last: int, keep_every: int) -> Names:
        """Remove the committed checkpoints a retention policy does not keep:
        the last keep_last, every keep_every-th id, and always the newest,
        with every checkpoint whose pages a kept one refers to (incremental
        images).  Each goes by a rename first (atomic: never half a checkpoint under
        its committed name), then its files.  Returns the names removed."""
        ids = [c.id for c in self._list_dir(job, job_dir)]
        keep = set(ids[-keep_last:]) if keep_last else set(ids)
        if keep_every:
            keep |= {i for i in ids if i % keep_every == 0}
        keep |= set(ids[-1:])
        infos = {c.id: c for c in self._list_dir(job, job_dir)}
        by_name = {c.name: c.id for c in infos.values()}
        for ckpt_id in list(keep):  # depends_on is already transitive: one pass
            keep |= {by_name[d] for d in infos[ckpt_id].depends_on if d in by_name}
        removed: Names = []
        for ckpt_id in ids:
            if ckpt_id in keep:
                continue
            path = job_dir.checkpoint(ckpt_id)
            doomed = job_dir.path / f".{path.name}{DELETING}{secrets.token_hex(4)}"
            try:
                os.rename(path, doomed)
            except OSError as e:
                raise storage_error(e, job_dir.path) from e
            self.discard(doomed)
            removed.append(path.name)
        if removed:
            fsync_path(job_dir.path)
        return removed

    def remove_all(self, job_dir: JobDir) -> Names:
        """Remove every checkpoint of a job directory (`ckptctl rm`), each by a
        rename first as prune does; returns the names removed."""
        removed: Names = []
        try:
            names = sorted(os.listdir(job_dir.path))
        except (FileNotFoundError, NotADirectoryError):
            return removed
        for name in names:
            if parse_checkpoint_name(name) is None:
                continue
            doomed = job_dir.path / f".{name}{DELETING}{secrets.token_hex(4)}"
            try:
                os.rename(job_dir.path / name, doomed)
            except OSError as e:
                raise storage_error(e, job_dir.path) from e
            self.discard(doomed)
            removed.append(name)
        self.remove_stale(job_dir)
        if removed:
            fsync_path(job_dir.path)
        return removed

    def remove_stale(self, job_dir: JobDir) -> None:
        try:
            names = os.listdir(job_dir.path)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(TMP_PREFIX) and (".tmp-" in name or DELETING in name):
                log.info("removing unfinished or pruned checkpoint %s/%s", job_dir.path, name)
                self.discard(job_dir.path / name)
