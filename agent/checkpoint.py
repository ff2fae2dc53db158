"""The agent's part of a checkpoint round (the coordinator drives the order):

    prepare   every process of the job parks its threads (QUIESCE)
    dump      each process writes its image into the checkpoint's temporary
              directory (DUMP), then the relay flushes the job's output so the
              log size at this instant is known
    resume    the threads run again (RESUME); the job's stall ends here
    finalize  after resuming: checksums, identities of the files the job
              reads or maps, fsync; returned as part of the manifest
    abort     on any failure: RESUME whoever is parked; the job runs on

A job that cannot be checkpointed (a process outside the shim, an
unsupported descriptor) is refused with the reason and keeps running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from ckptd.errors import CkptdError, Code
from ckptd.image.checksum import ALGORITHM, IdentityCache, fsync_path
from ckptd.image.core import CoreImage
from ckptd.image.manifest import checksum_entries, list_files
from ckptd.v1 import ckptd_pb2 as pb

from .runtime import JobRuntime, exe_of
from .shim_link import ShimConnection, ShimError

log = logging.getLogger(__name__)

SHIM_REGISTRATION_WAIT_S = 5.0
DUMP_TIMEOUT_S = 6 * 3600.0

_ERRNO = re.compile(r"\(errno (\d+)\)")


def _storage_error(message: str, directory: str) -> CkptdError:
    """Map the shim's errno to what the user should do about the storage."""
    m = _ERRNO.search(message)
    errno = int(m.group(1)) if m else 0
    if errno in (28, 122):  # ENOSPC, EDQUOT
        return CkptdError(Code.RESOURCE_EXHAUSTED, f"checkpoint storage {directory} is full: {message}")
    if errno in (13, 30, 1):  # EACCES, EROFS, EPERM
        return CkptdError(Code.PERMISSION_DENIED, f"checkpoint storage {directory} is not writable: {message}")
    if errno in (2, 5, 116):  # ENOENT, EIO, ESTALE: storage vanished mid-write
        return CkptdError(Code.UNAVAILABLE, f"checkpoint storage {directory} failed during the write: {message}")
    return CkptdError(Code.FAILED_PRECONDITION, f"cannot checkpoint: {message}")


class Checkpointer:
    def __init__(self, identities: IdentityCache) -> None:
        self.identities = identities
        self._parked: dict[str, list[ShimConnection]] = {}
        self._dumps: dict[str, list[pb.ProcessDump]] = {}

    # ---- prepare ----

    def _shims_for(self, job: JobRuntime) -> list[ShimConnection]:
        deadline = time.monotonic() + SHIM_REGISTRATION_WAIT_S
        while True:
            pids = job.live_pids()
            with job.cond:
                missing = [p for p in pids if p not in job.shims]
                conns = [job.shims[p] for p in pids if p in job.shims]
            if pids and not missing:
                return conns
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not pids:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} has no live process to checkpoint")
        exe = exe_of(missing[0]) or "?"
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"process {missing[0]} ({exe}) of job {job.name} is not running under the ckptd shim "
            "(a static or setuid program, or LD_PRELOAD removed); it cannot be checkpointed",
        )

    def prepare(self, job: JobRuntime, ckpt_id: int, timeout_s: float, directory: str) -> pb.PrepareResponse:
        with job.cond:
            if job.state != "running":
                raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} is {job.state}, not running")
            if job.name in self._parked:
                raise CkptdError(Code.ABORTED, f"a checkpoint of job {job.name} is already in progress")
        conns = self._shims_for(job)
        if len(conns) > 1:
            pids = ", ".join(str(c.host_pid) for c in conns)
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"job {job.name} has {len(conns)} processes ({pids}); this version checkpoints "
                "single-process jobs only (process trees come with the process-tree support)",
            )
        self._check_space(job, directory)
        with job.cond:
            job.state = "checkpointing"
            job.operation = f"checkpoint {ckpt_id}: quiescing"
        parked: list[ShimConnection] = []
        try:
            threads = 0
            for conn in conns:
                reply = conn.request("QUIESCE", timeout=timeout_s + 5, timeout_ms=int(timeout_s * 1000))
                parked.append(conn)
                threads += reply.int("threads")
        except CkptdError:
            self._release(parked, "ABORT")
            self._back_to_running(job)
            raise
        self._parked[job.name] = parked
        return pb.PrepareResponse(processes=len(parked), threads=threads)

    @staticmethod
    def _check_space(job: JobRuntime, directory: str) -> None:
        """Refuse before pausing anything when the storage obviously cannot hold the image."""
        try:
            st = os.statvfs(directory)
        except OSError as e:
            raise CkptdError(Code.UNAVAILABLE, f"checkpoint storage {directory} is not reachable: {e.strerror}") from e
        free = st.f_bavail * st.f_frsize
        need = 0
        for pid in job.live_pids():
            with contextlib.suppress(psutil.Error):
                need += psutil.Process(pid).memory_info().rss
        if free < need:
            raise CkptdError(
                Code.RESOURCE_EXHAUSTED,
                f"checkpoint storage {directory} has {free >> 20} MiB free; job {job.name} needs about "
                f"{need >> 20} MiB; free space or choose another --ckpt-dir",
            )

    # ---- dump ----

    def dump(self, job: JobRuntime, ckpt_id: int, directory: str) -> pb.DumpResponse:
        conns = self._parked.get(job.name)
        if not conns:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} is not quiesced (prepare first)")
        with job.cond:
            job.operation = f"checkpoint {ckpt_id}: writing"
        resp = pb.DumpResponse()
        for conn in conns:
            pdir = Path(directory) / f"proc-{conn.pid}"
            try:
                pdir.mkdir(parents=True, exist_ok=False)
            except OSError as e:
                raise _storage_error(f"{e.strerror} (errno {e.errno})", directory) from e
            t0 = time.monotonic()
            try:
                reply = conn.request("DUMP", timeout=DUMP_TIMEOUT_S, dir=str(pdir))
            except ShimError as e:
                raise _storage_error(e.message, directory) from None
            resp.processes.append(
                pb.ProcessDump(
                    pid=conn.pid,
                    host_pid=conn.host_pid,
                    dir=pdir.name,
                    pages_bytes=reply.int("pages_bytes"),
                    core_bytes=reply.int("core_bytes"),
                    files_bytes=reply.int("files_bytes"),
                    threads=reply.int("threads"),
                    vmas=reply.int("vmas"),
                    fds=reply.int("fds"),
                    written_files=reply.int("files"),
                    dump_s=time.monotonic() - t0,
                    exe=conn.exe,
                )
            )
        resp.log_bytes, resp.index_bytes = job.drain_output()
        # the log as it stands now, so that a restart from this checkpoint
        # recovers it even after a restart from an earlier one cut it back
        try:
            copy_prefix(job.job_dir.log, Path(directory) / "output.log", resp.log_bytes)
            copy_prefix(job.job_dir.index, Path(directory) / "output.idx", resp.index_bytes)
        except OSError as e:
            raise _storage_error(f"cannot save the job's log: {e.strerror} (errno {e.errno})", directory) from e
        self._dumps[job.name] = list(resp.processes)
        return resp

    # ---- resume / abort ----

    @staticmethod
    def _release(conns: list[ShimConnection], command: str) -> None:
        for conn in conns:
            with contextlib.suppress(CkptdError):
                conn.request(command, timeout=30)

    @staticmethod
    def _back_to_running(job: JobRuntime) -> None:
        with job.cond:
            if job.state == "checkpointing":
                job.state = "running"
            job.operation = ""
            job.cond.notify_all()

    def resume(self, job: JobRuntime) -> None:
        self._release(self._parked.pop(job.name, []), "RESUME")
        self._back_to_running(job)

    def abort(self, job: JobRuntime) -> None:
        self._release(self._parked.pop(job.name, []), "ABORT")
        self._dumps.pop(job.name, None)
        self._back_to_running(job)

    # ---- finalize (the job is running again) ----

    def finalize(self, job: JobRuntime, directory: str) -> dict[str, Any]:
        d = Path(directory)
        dumps = self._dumps.pop(job.name, [])
        processes, written, read, mapped = [], [], [], []
        for pd in dumps:
            core = CoreImage.load(d / pd.dir / "core.img")
            summary = core.summary()
            processes.append(
                {
                    "pid": pd.pid,
                    "host_pid": pd.host_pid,
                    "dir": pd.dir,
                    "exe": summary["exe"],
                    "cwd": summary["cwd"],
                    "threads": summary["threads"],
                    "vmas": summary["vmas"],
                    "fds": len(summary["fds"]),
                    "pages_bytes": pd.pages_bytes,
                    "core_bytes": pd.core_bytes,
                    "files_bytes": pd.files_bytes,
                    "dump_s": round(pd.dump_s, 6),
                }
            )
            for wf in core.written_files():
                written.append(dict(wf, data=f"{pd.dir}/files/{wf['index']}.data"))
            for rf in core.read_files():
                read.append(dict(rf, **{ALGORITHM: self.identities.content_hash(rf["path"])}))
            for mf in core.mapped_files():
                mapped.append(dict(mf, **{ALGORITHM: self.identities.content_hash(mf["path"])}))
        files = checksum_entries(d)
        # durable before the coordinator commits: data, then directories
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(fsync_path, list_files(d)))
        for sub in sorted({p.parent for p in list_files(d)}, key=lambda p: len(p.parts), reverse=True):
            fsync_path(sub)
        fsync_path(d)
        return {
            "processes": processes,
            "written_files": written,
            "read_files": read,
            "mapped_files": mapped,
            "files": files,
        }


def copy_prefix(src: Path, dst: Path, size: int) -> None:
    """The first `size` bytes of src into a new file dst."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        left = size
        while left:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), left) if _same_fs(fin, fout) else 0
            if n <= 0:
                data = fin.read(min(left, 1 << 20))
                if not data:
                    raise OSError(5, f"{src} is shorter than {size} bytes")
                fout.write(data)
                n = len(data)
            left -= n


def _same_fs(a: Any, b: Any) -> bool:
    return os.fstat(a.fileno()).st_dev == os.fstat(b.fileno()).st_dev
