"""The agent's part of a checkpoint round (the coordinator drives the order):

    prepare   every process of the job parks its threads (QUIESCE)
    dump      every process lets its unsent TCP bytes leave (SETTLE), then
              each writes its image into the checkpoint's temporary
              directory (DUMP), then the relay flushes the job's output so the
              log size at this instant is known
    resume    the threads run again (RESUME); the job's stall ends here
    finalize  after resuming: wait for each process's forked writer to
              finish its pages (FLUSH; native/shim/writeout.c), checksums,
              identities of the files the job reads or maps, fsync;
              returned as part of the manifest
    abort     on any failure: RESUME whoever is parked, stop the writers;
              the job runs on

A job is a process tree: every process is parked before any is dumped,
and the dump is checked against the restore plan (ckptd/image/plan/)
before anything is committed.  A job that cannot be checkpointed (a process
outside the shim, an unsupported descriptor, a tree that could not be
rebuilt) is refused with the reason and keeps running.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from ckptd.errors import STORAGE_ERRNOS, CkptdError, Code
from ckptd.image import dedup
from ckptd.image.checksum import ALGORITHM, IdentityCache, fsync_path, writer_digest
from ckptd.image.core import CoreImage, constant
from ckptd.image.crypt import seal_into
from ckptd.image.manifest import ProcessRecord, RankPart, checksum_entries, list_files
from ckptd.image.plan import PlanError, plan_for_checkpoint
from ckptd.jobstate import JobState
from ckptd.v1 import ckptd_pb2 as pb

from . import capture_budget, sysv_ipc
from .descriptions import shared_descriptions
from .gpu import DeviceMemory, cuda_pids
from .owner import Owner, check_owned_tree, fs_ids, give_dir, open_to_owner
from .process_state import stopped, why_not_saveable
from .progress import Transfer, Transfers, resident_anon
from .runtime import WRITER_COMM, JobRuntime, exe_of, ns_pid
from .shim_link import ShimConnection, ShimError

log = logging.getLogger(__name__)

SHIM_REGISTRATION_WAIT_S = 5.0
# how long a process may take to write its images (tests shorten it: a
# stopped writer must fail a round in seconds, not hours)
DUMP_TIMEOUT_S = float(os.environ.get("CKPTD_DUMP_TIMEOUT_S") or 6 * 3600.0)
# how long RESUME, ABORT and DISCARD wait for a process's answer (tests shorten it: a stopped process)
RELEASE_TIMEOUT_S = float(os.environ.get("CKPTD_RELEASE_TIMEOUT_S") or 30.0)
MAX_QUIESCE_PASSES = 20
PREMAP_TIMEOUT_S = 2.0  # reading smaps early; skipped past this
# a ready step's findings serve the prepare that follows it this soon (a
# round's next phase, a moment later), never a later round's
READY_FRESH_S = 30.0
SETTLE_MS = 500  # how long unsent TCP bytes may take to leave (a delayed ACK is up to 200 ms)
DUMP_PARALLEL = 8
# FLUSH is what lets a process's writer start (native/shim/writeout.c: each
# waits at its gate until then), so every process of the node is sent its
# FLUSH at once, up to this many; beyond, a writer starts as an earlier ends
FLUSH_PARALLEL = 64
# how a process's pages reached pages.img (DUMPED capture=, native/shim/writeout.c)
CAPTURE_MODES = {0: "pause", 1: "writer", 2: "staged"}

_ERRNO = re.compile(r"\(errno (\d+)\)")


_T = TypeVar("_T")
_R = TypeVar("_R")


def _side_by_side(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """fn over every item at once (at most DUMP_PARALLEL), each result in
    order; the first failure, in order, is raised once all have ended.  One
    item runs on the calling thread: a thread start costs 4-77 ms on a
    machine whose cores every rank shares (BENCHMARKS.md, the barrier's own
    cost), and most ranks are one process."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(len(items), DUMP_PARALLEL)) as pool:
        return list(pool.map(fn, items))


def _storage_error(message: str, directory: str) -> CkptdError:
    """Map the shim's errno to what the user should do about the storage."""
    m = _ERRNO.search(message)
    errno = int(m.group(1)) if m else 0
    if errno in (28, 122):  # ENOSPC, EDQUOT
        return CkptdError(Code.RESOURCE_EXHAUSTED, f"checkpoint storage {directory} is full: {message}")
    if errno in (13, 30, 1):  # EACCES, EROFS, EPERM
        return CkptdError(Code.PERMISSION_DENIED, f"checkpoint storage {directory} is not writable: {message}")
    if errno == 2 or errno in STORAGE_ERRNOS:  # ENOENT, EIO, ESTALE, ENOTCONN...: storage vanished mid-write
        return CkptdError(Code.UNAVAILABLE, f"checkpoint storage {directory} failed during the write: {message}")
    return CkptdError(Code.FAILED_PRECONDITION, f"cannot checkpoint: {message}")


def _depends_on(directory: Path, processes: Iterable[pb.ProcessDump], everyone: bool = False) -> list[str]:
    """The checkpoints whose pages these images refer to (the first
    component of each page source's job-relative path; the coordinator
    drops this checkpoint's own name, which deduplicated images name)."""
    names: set[str] = set()
    for p in processes:
        if p.ref_bytes or everyone:
            try:
                core = CoreImage.load(directory / p.dir / "core.img")
            except CkptdError as e:
                raise CkptdError(Code.INTERNAL, f"cannot read back the image just written: {e.message}") from None
            names.update(s["path"].split("/", 1)[0] for s in core.page_sources())
    return sorted(names)


def _wait_unlocked(path: Path, timeout_s: float) -> None:
    """Wait until nobody holds the writer's lock on path (or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
    finally:
        os.close(fd)


def _allocated_under(directory: Path, dumps: Iterable[pb.ProcessDump]) -> int:
    """Bytes the images' page files hold so far (written at offsets, so
    allocated blocks, not sizes)."""
    total = 0
    for pd in dumps:
        for name in ("pages.img.part", "pages.img"):
            with contextlib.suppress(OSError):
                total += os.stat(directory / pd.dir / name).st_blocks * 512
                break
    return total


def _image_parts(name: str, part: str, proc_dir: str) -> list[str]:
    """An image's directory relative to the job's, as the shim knows it
    (DUMP image=, REBASE image=): ckpt-N[/rank-R]/proc-P; none without a
    checkpoint name."""
    return [p for p in (name, part, proc_dir) if p] if name else []


def _bytes_under(directory: Path) -> int:
    """What the images under directory hold so far (their proc-*/ files)."""
    total = 0
    with os.scandir(directory) as procs:
        for proc in procs:
            if proc.name.startswith("proc-") and proc.is_dir():
                with os.scandir(proc.path) as files:
                    total += sum(f.stat().st_size for f in files if f.is_file())
    return total


def _kill_writers(host_pid: int) -> None:
    """SIGKILL the page writers a process forked (its shim reaps them)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(host_pid).children():
            with contextlib.suppress(psutil.Error):
                if child.name() == WRITER_COMM:
                    child.kill()


def _cannot_save(job: JobRuntime, pid: int, why: str) -> CkptdError:
    exe = exe_of(pid) or "?"
    return CkptdError(
        Code.FAILED_PRECONDITION, f"process {pid} (pid {ns_pid(pid)} in the job, {exe}) of job {job.name} {why}"
    )


@dataclass
class Ready:
    """What a round's ready step found while the job still ran
    (Checkpointer.ready), for the prepare and the dump that follow."""

    ckpt_id: int
    at: float  # time.monotonic(): a ready older than READY_FRESH_S is not used
    live: list[int]  # the job's processes (host pids) as its scan found them; each was sent PREMAP
    sync: str  # why the pages must be written during the pause ("": a writer may fork)
    total: int  # their anonymous resident bytes: the write's expected size
    # the image directories it made (proc-P, by path), each with the ids it
    # was given to (Checkpointer._image_dir): the dump makes none of these again
    dirs: dict[str, tuple[int, int] | None]
    # those of live with an NVIDIA device open (gpu.cuda_pids: a listing of
    # every descriptor, too slow for every rank's pause); one opened after
    # this is refused at its dump, as a passing state (native/shim/dump_fds.c)
    cuda: list[int]

    def matches(self, ckpt_id: int, pids: Iterable[int] | None = None) -> bool:
        """For this round, recent, and (pids given) for exactly these processes."""
        fresh = self.ckpt_id == ckpt_id and time.monotonic() - self.at < READY_FRESH_S
        return fresh and (pids is None or sorted(pids) == sorted(self.live))


class Checkpointer:
    def __init__(self, identities: IdentityCache, transfers: Transfers) -> None:
        self.identities = identities
        self.transfers = transfers
        self._parked: dict[str, list[ShimConnection]] = {}
        self._dumps: dict[str, tuple[list[pb.ProcessDump], dict[str, Any], tuple[int, int]]] = {}
        self._drained: set[str] = set()
        self._preparing: dict[str, int] = {}  # job -> checkpoint whose prepare is running
        self._cancelled: dict[str, int] = {}  # job -> checkpoint aborted while its prepare ran
        self._device: dict[str, DeviceMemory] = {}  # job -> its CUDA processes' memory, moved to host
        self._cuda_dumped: dict[str, set[int]] = {}  # job -> host pids dumped with their GPU memory
        self._writing: dict[str, list[ShimConnection]] = {}  # job -> processes whose writers may still run
        self._ready: dict[str, Ready] = {}  # job -> what its round's ready step found, for prepare and dump
        # the image format's parser is built once per process (cffi parsing
        # image_format.h, about 60 ms of CPU): now, not in a job's first pause
        threading.Thread(target=constant, args=("CK_MAX_SOURCES",), name="ckptd-ffi", daemon=True).start()

    def parked_jobs(self) -> list[str]:
        return list(self._parked)

    # ---- ready (the job still runs) ----

    def ready(
        self, job: JobRuntime, ckpt_id: int, timeout_s: float, directory: str, *, check_space: bool = True
    ) -> None:
        """Before the pause, on every rank, the job still running: what
        needs no parked process is done here, once, rather than in every
        rank's pause, where the ranks sharing a node's cores would wait for
        each other's (the stall starts after this step): the storage's free
        space, each process's image directory and files (made by the agent,
        then by its shim at PREMAP: creating a file can cost a metadata
        server's round trip), each process's memory map read early (PREMAP),
        and whether its pages fit to be copied by a writer (capture_budget).
        The prepare and dump that follow use it if the job's processes are
        the same ones, and do again what changed."""
        with job.cond:
            self._ready.pop(job.name, None)
        self._check_running(job)
        if job.lazy is not None:  # after restart --lazy: the memory must be whole first (agent/lazy.py)
            job.lazy.wait(job.name, timeout_s)
        live = job.live_pids()
        if check_space:
            self._check_space(job, directory, live)
        conns = self._shims_for(job, set(), live)  # a process the shim cannot reach is refused now
        writers = self._open_round(job, directory, conns)
        dirs = {c.host_pid: self._image_dir(directory, c, job.owner, writers.get(c.host_pid), {}) for c in conns}
        self._premap(conns, dirs)
        pids = [c.host_pid for c in conns]
        room = capture_budget.budget(pids)
        total = sum(resident_anon(p) for p in pids)
        made = {str(pdir): writers.get(pid) for pid, pdir in dirs.items()}
        found = Ready(ckpt_id, time.monotonic(), pids, "" if room.fits else room.why(), total, made, cuda_pids(pids))
        with job.cond:
            self._ready[job.name] = found

    @staticmethod
    def _check_running(job: JobRuntime) -> None:
        with job.cond:
            if job.state != JobState.RUNNING:
                raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} is {job.state}, not running")

    # ---- prepare ----

    def _shims_for(self, job: JobRuntime, known: set[int], live: list[int] | None = None) -> list[ShimConnection]:
        """Connections of the job's live processes not in `known` (host pids);
        a process still without a connection after a few seconds escaped the shim.
        live: the job's processes as a scan just found them (a scan of /proc is
        the costly part of a rank's pause on a busy node), else one is made."""
        deadline = time.monotonic() + SHIM_REGISTRATION_WAIT_S
        while True:
            pids = [p for p in (job.live_pids() if live is None else live) if p not in known]
            live = None  # a second look scans again
            if not pids and not known and job.alive() and time.monotonic() < deadline:
                time.sleep(0.05)  # just launched: its first process is still being made
                continue
            for pid in pids:  # it would never answer: refused at once
                if why := stopped(pid):
                    raise _cannot_save(job, pid, why)
            with job.cond:
                missing = [p for p in pids if p not in job.shims]
                conns = [job.shims[p] for p in pids if p in job.shims]
            if not missing:
                return conns
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        pid = missing[0]
        everyone = job.live_pids()
        why = why_not_saveable(pid, everyone, {p: ns_pid(p) for p in everyone})
        raise _cannot_save(
            job,
            pid,
            why
            or "is not running under the ckptd shim (a static or setuid program, or LD_PRELOAD removed); "
            "it cannot be checkpointed",
        )

    @staticmethod
    def _premap(conns: list[ShimConnection], dirs: dict[int, Path] | None = None) -> None:
        """Every process reads its memory map while still running (slow for
        big mappings, and the parked ones would wait for it); the dump uses
        that copy if nothing was mapped or unmapped since.  dirs (host pid:
        its image directory): the shim also creates its image's files there
        now (native/shim/image_dir.c).  Best effort."""

        def one(conn: ShimConnection) -> None:
            where = {"dir": str(dirs[conn.host_pid])} if dirs and conn.host_pid in dirs else {}
            # short: a process that cannot answer (stopped, say) is the
            # QUIESCE's to report, within the deadline the coordinator keeps
            with contextlib.suppress(CkptdError):
                conn.request("PREMAP", timeout=PREMAP_TIMEOUT_S, **where)

        _side_by_side(one, conns)

    def _quiesce_tree(
        self, job: JobRuntime, timeout_s: float, live: list[int], premapped: set[int]
    ) -> tuple[list[ShimConnection], int, int]:
        """Park every process of the job.  A process that forks while others are
        being parked adds one more: repeat until a pass finds nobody new.  The
        first pass parks those of `live` (the ready's or the prepare's scan),
        each later pass those a new scan finds.  premapped: those that read
        their maps early in the ready step.  Returns the parked, their
        threads, and how many of their TCP sockets hold unsent bytes."""
        parked: list[ShimConnection] = []
        threads = unsent = 0
        new = self._shims_for(job, set(), live)
        self._premap([c for c in new if c.host_pid not in premapped])
        try:
            for i in range(MAX_QUIESCE_PASSES):
                if i:
                    new = self._shims_for(job, {c.host_pid for c in parked})
                if not new:
                    if not parked:
                        raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} has no live process to checkpoint")
                    return parked, threads, unsent
                for conn in new:
                    try:
                        reply = conn.request("QUIESCE", timeout=timeout_s + 5, timeout_ms=int(timeout_s * 1000))
                    except ShimError as e:
                        if conn.gone():
                            continue  # exited (or exec'd) meanwhile: the next pass sees what is left
                        if e.code is Code.DEADLINE_EXCEEDED:
                            # a process that did not answer (stopped, say) may still park once it runs
                            # again: an ABORT queued behind the QUIESCE releases it then
                            with contextlib.suppress(ShimError):
                                conn.request("ABORT", timeout=1)
                        raise
                    parked.append(conn)
                    threads += reply.int("threads")
                    unsent += reply.int("unsent", 1)  # a shim that does not say: as if it had some
            raise CkptdError(
                Code.ABORTED,
                f"job {job.name} keeps creating processes faster than they can be paused",
                transient=True,
            )
        except CkptdError:
            self._release(parked, "ABORT")
            raise

    def prepare(
        self, job: JobRuntime, ckpt_id: int, timeout_s: float, directory: str, *, check_space: bool = True
    ) -> pb.PrepareResponse:
        # an abort counts for the prepare it overlaps, not for the coordinator's
        # next try of the same round (same id) after one that failed here
        with job.cond:
            self._cancelled.pop(job.name, None)
            self._preparing[job.name] = ckpt_id
        try:
            return self._prepare(job, ckpt_id, timeout_s, directory, check_space)
        finally:
            with job.cond:
                self._preparing.pop(job.name, None)
                self._cancelled.pop(job.name, None)

    def _prepare(
        self, job: JobRuntime, ckpt_id: int, timeout_s: float, directory: str, check_space: bool
    ) -> pb.PrepareResponse:
        self._check_running(job)
        with job.cond:
            if job.name in self._parked:
                raise CkptdError(Code.ABORTED, f"a checkpoint of job {job.name} is already in progress")
            ready = self._ready.get(job.name)
        if ready is not None and not ready.matches(ckpt_id):
            ready = None
        if job.lazy is not None:  # after restart --lazy: the memory must be whole first (agent/lazy.py)
            job.lazy.wait(job.name, timeout_s)
        # one scan for the checks below and the first pass of the quiesce: the
        # ready step's, made a moment ago (a process forked since is found by
        # the quiesce's next pass; one that exited, by its connection)
        live = ready.live if ready is not None else job.live_pids()
        if check_space and ready is None:
            # an incremental one needs far less than the resident size; a full disk still fails cleanly
            self._check_space(job, directory, live)
        with job.cond:
            job.state = JobState.CHECKPOINTING
            job.operation = f"checkpoint {ckpt_id}: quiescing"
        try:
            if self._cancelled.get(job.name) == ckpt_id:
                raise CkptdError(Code.ABORTED, f"checkpoint {ckpt_id} of job {job.name} was aborted before it began")
            self._device_to_host(job, ckpt_id, timeout_s, ready.cuda if ready is not None else cuda_pids(live))
            parked, threads, unsent = self._quiesce_tree(job, timeout_s, live, set(ready.live) if ready else set())
        except CkptdError:
            self._device_back(job, quiet=True)  # the first error is the one to report
            self._back_to_running(job)
            raise
        with job.cond:  # against an abort() arriving in between
            abandoned = self._cancelled.pop(job.name, None) == ckpt_id
            if not abandoned:
                self._parked[job.name] = parked
        if abandoned:
            self._release(parked, "ABORT")
            self._device_back(job)
            self._back_to_running(job)
            raise CkptdError(
                Code.DEADLINE_EXCEEDED, f"checkpoint {ckpt_id} of job {job.name} was abandoned while pausing it"
            )
        # parked, no process writes: with nothing unsent now, no byte can move
        # from one image to another, and the drain has nothing to wait for
        if unsent:
            self._drained.discard(job.name)
        else:
            self._drained.add(job.name)
        return pb.PrepareResponse(processes=len(parked), threads=threads, drained=not unsent)

    def _device_to_host(self, job: JobRuntime, ckpt_id: int, timeout_s: float, pids: list[int]) -> None:
        """CUDA processes (pids: those of the job with an NVIDIA device
        open): their device memory into their host memory, before anything
        is parked (agent/gpu.py).  A job that never touched CUDA has
        nothing to do here."""
        self._cuda_dumped[job.name] = set(pids)
        if not pids:
            return
        with job.cond:
            job.operation = f"checkpoint {ckpt_id}: moving GPU memory to host memory"
        device = DeviceMemory(pids)
        device.move_to_host(int(timeout_s * 1000))
        self._device[job.name] = device

    def _device_back(self, job: JobRuntime, *, quiet: bool = False) -> None:
        device = self._device.pop(job.name, None)
        if device is None:
            return
        try:
            device.back_to_device()
        except CkptdError as e:
            if not quiet:
                raise
            log.error("job %s: %s", job.name, e.message)

    @staticmethod
    def _check_space(job: JobRuntime, directory: str, live: list[int]) -> None:
        """Refuse before pausing anything when the storage obviously cannot hold the image."""
        try:
            st = os.statvfs(directory)
        except OSError as e:
            raise CkptdError(Code.UNAVAILABLE, f"checkpoint storage {directory} is not reachable: {e.strerror}") from e
        free = st.f_bavail * st.f_frsize
        need = 0
        for pid in live:
            with contextlib.suppress(psutil.Error):
                need += psutil.Process(pid).memory_info().rss
        if free < need:
            raise CkptdError(
                Code.RESOURCE_EXHAUSTED,
                f"checkpoint storage {directory} has {free >> 20} MiB free; job {job.name} needs about "
                f"{need >> 20} MiB; free space or choose another --ckpt-dir",
            )

    # ---- dump ----

    @staticmethod
    def _settle(conn: ShimConnection) -> None:
        try:
            reply = conn.request("SETTLE", timeout=SETTLE_MS / 1000 + 10, timeout_ms=SETTLE_MS)
        except ShimError as e:
            # a process that exited meanwhile is left out of the next round
            transient = e.transient or conn.gone()
            raise CkptdError(
                Code.ABORTED if transient else e.code,
                f"pid {conn.pid} in the job ({conn.exe}): {e.message}",
                transient=transient,
            ) from None
        if reply.int("stuck"):
            log.info("pid %d: %d TCP socket(s) keep unsent bytes (a full window)", conn.pid, reply.int("stuck"))

    @staticmethod
    def _image_dir(
        directory: str,
        conn: ShimConnection,
        owner: Owner,
        writer: tuple[int, int] | None,
        made: dict[str, tuple[int, int] | None],
    ) -> Path:
        """A process's image directory, proc-P under the round's directory:
        the process writes its image there as the job's owner (or, in a
        root job, as the filesystem ids it has taken: writer).  made: those
        the ready step made, with the ids each was given to; one made for
        the same ids is left as it is."""
        pdir = Path(directory) / f"proc-{conn.pid}"
        key = str(pdir)
        if key in made and made[key] == writer:
            return pdir
        try:
            pdir.mkdir(parents=True, exist_ok=key in made)
            give_dir(pdir, owner, writer)
        except OSError as e:
            raise _storage_error(f"{e.strerror} (errno {e.errno})", directory) from e
        return pdir

    @staticmethod
    def _open_round(job: JobRuntime, directory: str, conns: list[ShimConnection]) -> dict[int, tuple[int, int] | None]:
        """The job's processes, as its owner, pass through the round's
        directories; so do a root job's processes that write as other ids
        (and the job's directory then too): only then, else they stay 0700.
        Returns the filesystem ids each process writes with, in a root job
        (fs_ids; none otherwise)."""
        writers = {c.host_pid: fs_ids(c.host_pid) for c in conns} if job.owner.any_uid else {}
        others = any(ids is not None and ids[0] != job.owner.uid for ids in writers.values())
        if job.owner.switch or others:
            rdir = Path(directory)
            try:
                dirs = (rdir.parent, rdir) if rdir.name.startswith("rank-") else (rdir,)
                for d in (job.job_dir.path, *dirs) if others else dirs:
                    open_to_owner(d, job.owner)
            except OSError as err:
                raise _storage_error(f"{err.strerror} (errno {err.errno})", directory) from err
        return writers

    def _dump_one(
        self,
        conn: ShimConnection,
        request: pb.DumpRequest,
        owner: Owner,
        *,
        key: bytes | None = None,
        sync: str = "",
        writer: tuple[int, int] | None = None,
        made: dict[str, tuple[int, int] | None],
    ) -> tuple[pb.ProcessDump, bool]:
        """sync: why the process must write its pages during the pause ("": it may fork a writer);
        writer: the filesystem ids it writes with (fs_ids), when a root job's process may have dropped them;
        made: the image directories the ready step made (Ready.dirs).
        Also returns whether its IPC namespace holds System V objects, as its shim saw it."""
        pdir = self._image_dir(request.dir, conn, owner, writer, made)
        # the image's final place, relative to the job's directory: a later
        # incremental image of this process refers to its pages there
        parts = _image_parts(request.name, request.part, pdir.name)
        t0 = time.monotonic()
        try:
            # the shim reads these keys in this order
            reply = conn.request(
                "DUMP",
                timeout=DUMP_TIMEOUT_S,
                dir=str(pdir),
                base=request.parent,
                image="/".join(parts),
                depth=len(parts),
                cached=int(request.keep_cached),
                sync=int(bool(sync)),
                dedup=int(request.dedup),
                # launch --encrypt: the shim encrypts with it and keeps it nowhere an image holds
                **({"key": key.hex()} if key else {}),
            )
        except ShimError as e:
            what = f"pid {conn.pid} in the job ({conn.exe}): {e.message}"
            if e.transient or conn.gone():  # a passing state, or it exited: the coordinator tries again
                raise CkptdError(Code.ABORTED, f"cannot checkpoint now: {what}", transient=True) from None
            raise _storage_error(what, request.dir) from None
        dump = pb.ProcessDump(
            pid=conn.pid,
            host_pid=conn.host_pid,
            dir=pdir.name,
            pages_bytes=reply.int("pages_bytes"),
            ref_bytes=reply.int("ref_bytes"),
            core_bytes=reply.int("core_bytes"),
            files_bytes=reply.int("files_bytes"),
            threads=reply.int("threads"),
            vmas=reply.int("vmas"),
            fds=reply.int("fds"),
            written_files=reply.int("files"),
            dump_s=time.monotonic() - t0,
            exe=conn.exe,
            capture=CAPTURE_MODES.get(reply.int("capture"), "pause"),
            capture_why=sync,
        )
        return dump, bool(reply.int("sysv", 1))

    def drain(self, job: JobRuntime) -> None:
        """Bytes still leaving one process for another land in the peer's
        receive queue before any process is dumped, never in between.  The
        coordinator drains every rank before it dumps any."""
        conns = self._parked.get(job.name)
        if not conns:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} is not quiesced (prepare first)")
        with job.cond:
            job.operation = "checkpoint: draining bytes in flight"
        _side_by_side(self._settle, conns)
        self._drained.add(job.name)

    def dump(self, job: JobRuntime, request: pb.DumpRequest) -> pb.DumpResponse:
        ckpt_id = request.checkpoint_id
        conns = self._parked.get(job.name)
        if not conns:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {job.name} is not quiesced (prepare first)")
        if job.name not in self._drained:
            self.drain(job)
        with job.cond:
            job.operation = f"checkpoint {ckpt_id}: writing"
            ready = self._ready.pop(job.name, None)
        made = ready.dirs if ready is not None else {}  # made, whatever else changed since
        if ready is not None and not ready.matches(ckpt_id, (c.host_pid for c in conns)):
            ready = None  # a process forked or exited since: decided again, now
        # a full image holds about the processes' anonymous memory; what an
        # incremental one holds is known only once written
        total = 0 if request.parent else ready.total if ready else sum(resident_anon(c.host_pid) for c in conns)
        writing = Transfer("writing", total, probe=lambda: _bytes_under(Path(request.dir)))
        writers = self._open_round(job, request.dir, conns)
        with self.transfers.running(job.name, writing):
            # every process is parked: they write their images side by side
            key = job.key()  # re-read each time: never kept on disk by ckptd
            if ready is not None:
                sync = ready.sync
            else:
                room = capture_budget.budget([c.host_pid for c in conns])
                sync = "" if room.fits else room.why()
            if sync:
                log.warning("job %s: checkpoint %d written during the pause: %s", job.name, ckpt_id, sync)
            dumped = _side_by_side(
                lambda conn: self._dump_one(
                    conn, request, job.owner, key=key, sync=sync, writer=writers.get(conn.host_pid), made=made
                ),
                conns,
            )
            resp = pb.DumpResponse(processes=[d for d, _ in dumped])
            # the objects of the job's own IPC namespace, once for the job, still
            # parked; only if a shim saw some (native/shim/dump_sysv.c): most jobs
            # hold none, and joining the namespace costs the pause a thread
            if any(holds for _, holds in dumped):
                sysv_ipc.save(conns[0].host_pid, Path(request.dir), encrypted=key is not None)
        self._writing[job.name] = list(conns)
        relay = job.drain_output()
        resp.log_bytes, resp.index_bytes = relay["log"], relay["index"]
        tree = {
            "zombies": job.zombies(parked=True),  # the quiesce's last look is still true
            "stdout_ino": relay.get("stdout_ino", 0),
            "stderr_ino": relay.get("stderr_ino", 0),
            # asked while every process is still parked: which of their files are one description
            "shared_files": shared_descriptions([(c.pid, c.host_pid) for c in conns]),
        }
        rank = job.spec.rank
        if rank.vip:
            # connections to these addresses are rebuilt one end at a time
            tree["rank"] = rank.rank
            tree["other_ranks"] = [r.vip for r in rank.ranks if r.rank != rank.rank]
        # what needs no parked process (the plan check, the log, reading the
        # images back) happens in finalize, after the job runs again
        self._dumps[job.name] = (list(resp.processes), tree, (resp.log_bytes, resp.index_bytes))
        return resp

    # ---- resume / abort ----

    @staticmethod
    def _release(conns: list[ShimConnection], command: str) -> None:
        """Every process at once: one that cannot answer (stopped) delays none of the others."""

        def one(conn: ShimConnection) -> None:
            with contextlib.suppress(CkptdError):
                conn.request(command, timeout=RELEASE_TIMEOUT_S)

        _side_by_side(one, conns)

    @staticmethod
    def _back_to_running(job: JobRuntime) -> None:
        with job.cond:
            if job.state == JobState.CHECKPOINTING:
                job.state = JobState.RUNNING
            job.operation = ""
            job.cond.notify_all()

    def resume(self, job: JobRuntime) -> None:
        self._drained.discard(job.name)
        self._release(self._parked.pop(job.name, []), "RESUME")
        try:
            self._device_back(job)  # the driver's threads run again: the GPU memory goes back
        finally:
            self._back_to_running(job)

    def forget(self, job: JobRuntime) -> None:
        """The job is stopped while parked (preemption): nothing to release."""
        self._drained.discard(job.name)
        self._parked.pop(job.name, None)
        self._ready.pop(job.name, None)
        self._dumps.pop(job.name, None)
        self._writing.pop(job.name, None)
        self._device.pop(job.name, None)  # the processes are gone, and their device memory with them

    def abort(self, job: JobRuntime, ckpt_id: int = 0) -> None:
        with job.cond:
            if ckpt_id and job.name not in self._parked and self._preparing.get(job.name) == ckpt_id:
                # its prepare is still running (the coordinator gave up
                # waiting): what it parks is released as soon as it is done
                self._cancelled[job.name] = ckpt_id
        self._drained.discard(job.name)
        self._ready.pop(job.name, None)
        self._release(self._parked.pop(job.name, []), "ABORT")
        self._release(self._writing.pop(job.name, []), "DISCARD")
        self._dumps.pop(job.name, None)
        try:
            self._device_back(job)
        finally:
            self._back_to_running(job)

    # ---- finalize (the job is running again) ----

    def _wait_for_pages(self, job: JobRuntime, d: Path, dumps: list[pb.ProcessDump]) -> None:
        """Each process forked a writer for its pages at the end of its dump
        (native/shim/writeout.c), which starts on FLUSH, now that every rank
        of the round runs again: wait until every pages.img is complete.
        A process that exited meanwhile leaves its writer running on; its
        lock on pages.img.part says when it is done."""
        conns = {c.host_pid: c for c in self._writing.pop(job.name, [])}
        key = job.key()  # staged pages are encrypted when FLUSH writes them
        flush_fields = {"key": key.hex()} if key else {}

        def one(pd: pb.ProcessDump) -> None:
            pdir = d / pd.dir
            conn = conns.get(pd.host_pid)
            failure = ""
            if conn is not None and not conn.closed.is_set():
                try:
                    conn.request("FLUSH", timeout=DUMP_TIMEOUT_S, **flush_fields)
                except ShimError as e:
                    # one that exited meanwhile (a short-lived worker, say: its end is
                    # closed, or the request could not be sent) left its writer to
                    # finish, or finished it on its way out
                    failure = "" if conn.closed.is_set() or e.transient else e.message
                    if e.code is Code.DEADLINE_EXCEEDED:
                        # a writer that makes no progress (stopped, hung on storage): the
                        # process's checkpoint thread waits for it, and would answer nothing more
                        _kill_writers(pd.host_pid)
            if not failure:
                _wait_unlocked(pdir / "pages.img.part", DUMP_TIMEOUT_S)
            if (pdir / "pages.img").exists():
                return
            what = f"pid {pd.pid} in the job ({pd.exe}): "
            if _ERRNO.search(failure):
                raise _storage_error(what + failure, str(d))
            if failure:
                raise CkptdError(Code.ABORTED, what + failure + "; the checkpoint is discarded")
            # it exited (or was killed) between its dump and now: the next round leaves it out
            raise CkptdError(
                Code.ABORTED,
                what + "its memory image was not finished (the process or its writer was killed); "
                "the checkpoint is discarded",
                transient=True,
            )

        operation = "checkpoint: writing memory images"
        with job.cond:
            if not job.operation:  # the job runs again: say what is still going on
                job.operation = operation
        total = sum(pd.pages_bytes for pd in dumps)
        writing = Transfer("writing", total, probe=lambda: _allocated_under(d, dumps))
        try:
            with (
                self.transfers.running(job.name, writing),
                ThreadPoolExecutor(max_workers=max(1, min(len(dumps), FLUSH_PARALLEL))) as pool,
            ):
                futures = [pool.submit(one, pd) for pd in dumps]
                errors = [e for f in futures if (e := f.exception()) is not None]
        finally:
            with job.cond:
                if job.operation == operation:
                    job.operation = ""
                    job.cond.notify_all()
        if errors:
            raise errors[0]

    def _dedup_peer(
        self, job: JobRuntime, d: Path, dumps: list[pb.ProcessDump], peer_dir: str, peer_final: str
    ) -> dedup.PeerPages | None:
        """Hand each of our processes' writers the pages rank 0's images of
        this round hold (dedup.spec): they compare as rank 0's writers write,
        and leave out what rank 0 holds (native/shim/writeout_dedup.c).
        Rank 0's images were dumped (its writers may still be writing);
        returns their list, None where it cannot be read (no deduplication
        this round: the writers are told "none")."""
        peer = None
        try:
            peer = dedup.index_peer(Path(peer_dir), peer_final, written=False)
        except (OSError, CkptdError) as e:
            log.warning("job %s: no deduplication against %s: %s", job.name, peer_dir, e)
        # elsewhere the writers write every page, and ckptd-dedup compares after them
        to_writers = peer if peer is not None and dedup.compared_while_written(Path(peer_dir)) else None
        for pd in dumps:
            try:  # a writer without its list writes every page, after a while
                dedup.write_spec(d / pd.dir, to_writers)
            except OSError as e:
                log.warning("job %s: pid %d's writer gets no list of rank 0's pages: %s", job.name, pd.pid, e)
        return peer

    def _wait_for_peer(self, job: JobRuntime, peer: dedup.PeerPages, peer_dir: str) -> dedup.PeerPages | None:
        """Rank 0's images complete (its writers may still be filling its
        pages, in parallel with ours): the matches refer to them as they are."""
        with self.transfers.running(job.name, Transfer("deduplicating", 0)), contextlib.suppress(OSError):
            for proc in Path(peer_dir).glob("proc-*"):
                _wait_unlocked(proc / "pages.img.part", DUMP_TIMEOUT_S)
        try:
            peer.settle()
        except OSError as e:
            log.warning("job %s: no deduplication against %s: %s", job.name, peer_dir, e)
            return None
        return peer

    def _dedup(
        self, job: JobRuntime, d: Path, dumps: list[pb.ProcessDump], peer: dedup.PeerPages, peer_final: str
    ) -> int:
        """Pages rank 0's images of this round hold alike are stored once, in
        rank 0's (ckptd/image/dedup.py): the writer left them out
        (pages.match), or ckptd-dedup finds them now.  Returns the bytes no
        longer stored here.  Each process's shim takes its rewritten runs
        first (REBASE); one that cannot keeps an image of its own: the
        pages its writer left out are copied back from rank 0's."""
        saved = 0
        t0 = time.monotonic()
        t_plan = t_rebase = t_apply = 0.0
        by_writer = 0
        with self.transfers.running(job.name, Transfer("deduplicating", 0)):
            for pd in dumps:
                proc_dir = d / pd.dir
                t = time.monotonic()
                try:
                    written = dedup.writer_matches(proc_dir, peer)
                except (OSError, CkptdError) as e:  # holes, and no saying where: not an image
                    raise CkptdError(
                        Code.INTERNAL,
                        f"pid {pd.pid}'s writer left pages out but no readable list of them ({e}); "
                        "the checkpoint is discarded",
                    ) from None
                left_out = None
                if written is not None:
                    left_out, counts = written
                    log.info("job %s: pid %d's writer: %s", job.name, pd.pid, counts)
                try:
                    rw = dedup.plan(proc_dir, peer, left_out)
                except (OSError, CkptdError) as e:  # the image stays as it was, or as it would have been
                    log.warning("job %s: pid %d keeps its own pages: %s", job.name, pd.pid, e)
                    if left_out:
                        dedup.fill(proc_dir, peer, left_out)
                    continue
                finally:
                    t_plan += time.monotonic() - t
                    (proc_dir / dedup.WRITER_MATCHES).unlink(missing_ok=True)
                by_writer += left_out is not None
                if rw is None:  # nothing to refer to after all (no room for the sections, say)
                    if left_out:
                        dedup.fill(proc_dir, peer, left_out)
                    continue
                with job.cond:
                    conn = job.shims.get(pd.host_pid)
                try:
                    if conn is None:
                        raise ShimError(Code.UNAVAILABLE, "the process is gone")
                    image = "/".join(_image_parts(peer_final.split("/", maxsplit=1)[0], d.name, pd.dir))
                    t = time.monotonic()
                    conn.request("REBASE", timeout=30, core=str(rw.new_core), image=image)
                    t_rebase += time.monotonic() - t
                except ShimError as e:
                    log.info("job %s: pid %d keeps its own pages: %s", job.name, pd.pid, e.message)
                    dedup.discard(rw)
                    if left_out:
                        dedup.fill(proc_dir, peer, left_out)
                    continue
                t = time.monotonic()
                dedup.apply(rw, peer)
                t_apply += time.monotonic() - t
                saved += rw.deduped_bytes
        log.info(
            "job %s: dedup: %d MiB stored once (%d of %d processes by their writers); plan %.3f s, rebase %.3f s, "
            "apply %.3f s, in all %.3f s", job.name, saved >> 20, by_writer, len(dumps), t_plan, t_rebase, t_apply,
            time.monotonic() - t0,
        )  # fmt: skip
        return saved

    def _warm_identities(self, d: Path, dumps: list[pb.ProcessDump]) -> threading.Thread:
        """Hash the files the processes map or read while their writers are
        still writing, not after: at a job's first checkpoint that is every
        library it loaded (0.2-0.6 s here), later only what changed.  Best
        effort: finalize computes, and reports, what this could not."""

        def run() -> None:
            for pd in dumps:
                try:
                    core = CoreImage.load(d / pd.dir / "core.img")
                    for f in core.mapped_files() + core.read_files():
                        self.identities.content_hash(f["path"])
                except (OSError, ValueError, CkptdError) as e:
                    log.debug("identities of %s not hashed early: %s", pd.dir, e)

        t = threading.Thread(target=run, name="ckptd-identities", daemon=True)
        t.start()
        return t

    def finalize(self, job: JobRuntime, directory: str, dedup_with: str = "", dedup_with_final: str = "") -> RankPart:
        try:
            return self._finalize(job, directory, dedup_with, dedup_with_final)
        except OSError as e:  # an fsync or a read-back of the storage failed: say so, not "internal error"
            what = f" ({Path(e.filename).name})" if e.filename else ""
            raise _storage_error(f"finalize{what}: {e.strerror} (errno {e.errno})", directory) from e

    def _finalize(self, job: JobRuntime, directory: str, dedup_with: str, dedup_with_final: str) -> RankPart:
        d = Path(directory)
        dumps, tree, (log_bytes, index_bytes) = self._dumps.pop(job.name, ([], {}, (0, 0)))
        t0 = time.monotonic()
        warming = self._warm_identities(d, dumps)
        peer = self._dedup_peer(job, d, dumps, dedup_with, dedup_with_final) if dedup_with else None
        try:
            self._wait_for_pages(job, d, dumps)
        finally:
            for pd in dumps:
                (d / pd.dir / dedup.PROGRESS).unlink(missing_ok=True)  # rank 0's: said to the others
                if dedup_with:
                    dedup.forget_spec(d / pd.dir)
        job.fault("flush")
        warming.join()
        # a process the ready step made an image directory for, gone before
        # its dump, left it behind with its empty files: not part of the image
        dumped = {pd.dir for pd in dumps}
        for stray in d.glob("proc-*"):
            if stray.name not in dumped:
                shutil.rmtree(stray, ignore_errors=True)
        for pd in dumps:  # written as the job's owner, read here as root: nothing but its own files
            check_owned_tree(d / pd.dir, job.owner)
        t_pages = time.monotonic()
        if peer is not None:
            t = time.monotonic()
            peer = self._wait_for_peer(job, peer, dedup_with)
            log.info("job %s: waited %.3f s for rank 0's pages after our own", job.name, time.monotonic() - t)
            if peer is None and any((d / pd.dir / dedup.WRITER_MATCHES).exists() for pd in dumps):
                # rank 0's round failed too, and with it the checkpoint: never commit holes
                raise CkptdError(
                    Code.ABORTED,
                    f"rank 0's images, whose pages job {job.name}'s writers left out, were not finished; "
                    "the checkpoint is discarded",
                    transient=True,
                )
        deduped = self._dedup(job, d, dumps, peer, dedup_with_final) if peer is not None else 0
        cuda = self._cuda_dumped.pop(job.name, set())
        # a tree that could not be rebuilt is refused: the checkpoint is
        # discarded, and the job, already running again, runs on
        procs = [{"dir": pd.dir} for pd in dumps]
        cores = [CoreImage.load(d / pd.dir / "core.img") for pd in dumps]
        sysv_ipc.check_sem_undo(cores)  # the images alone: nothing parked
        try:
            plan_for_checkpoint(d, dict(tree, processes=procs))
        except PlanError as e:
            raise CkptdError(Code.FAILED_PRECONDITION, f"cannot checkpoint job {job.name}: {e.message}") from None
        # the log as it stood at the checkpoint, so that a restart from it
        # recovers it even after a restart from an earlier one cut it back
        try:
            key = job.key()
            copy_prefix(job.job_dir.log, d / "output.log", log_bytes, key)
            copy_prefix(job.job_dir.index, d / "output.idx", index_bytes, key)
        except OSError as e:
            raise _storage_error(f"cannot save the job's log: {e.strerror} (errno {e.errno})", directory) from e
        depends_on = _depends_on(d, dumps, everyone=bool(deduped))
        processes: list[ProcessRecord] = []
        written: dict[str, dict[str, Any]] = {}
        read: dict[str, dict[str, Any]] = {}
        mapped: dict[str, dict[str, Any]] = {}
        for pd, core in zip(dumps, cores, strict=True):
            summary = core.summary()
            processes.append(
                ProcessRecord(
                    pid=pd.pid,
                    ppid=int(core.proc.ppid),
                    pgid=int(core.proc.pgid),
                    sid=int(core.proc.sid),
                    host_pid=pd.host_pid,
                    dir=pd.dir,
                    exe=summary["exe"],
                    cwd=summary["cwd"],
                    threads=summary["threads"],
                    vmas=summary["vmas"],
                    fds=len(summary["fds"]),
                    pages_bytes=pd.pages_bytes,
                    ref_bytes=pd.ref_bytes,
                    core_bytes=pd.core_bytes,
                    files_bytes=pd.files_bytes,
                    dump_s=round(pd.dump_s, 6),
                    capture=pd.capture,
                    capture_why=pd.capture_why,
                    cuda=pd.host_pid in cuda,
                )
            )
            # several processes may hold the same file: the first copy
            # serves (every process was parked, so the copies are the same)
            for wf in core.written_files():
                written.setdefault(wf["path"], dict(wf, data=f"{pd.dir}/files/{wf['index']}.data"))
            for rf in core.read_files():
                read.setdefault(rf["path"], rf)
            for mf in core.mapped_files():
                if mf["path"] in mapped:
                    mapped[mf["path"]]["executable"] |= mf["executable"]
                else:
                    mapped[mf["path"]] = mf
        # a file the job writes comes back from its saved copy: no identity to check
        read_entries = [
            dict(e, **{ALGORITHM: self.identities.content_hash(path)})
            for path, e in read.items()
            if path not in written
        ]
        mapped_entries = [
            dict(e, **{ALGORITHM: self.identities.content_hash(path)})
            for path, e in mapped.items()
            if path not in written
        ]
        listed = list_files(d)  # complete now: nothing below adds a file
        # memory images their writer hashed as it wrote them are not read back
        known = {p: digest for p in listed if p.name == "pages.img" and (digest := writer_digest(p))}
        hashing = Transfer("checksums", sum(p.stat().st_size for p in listed if p not in known))
        # durable before the coordinator commits: data, then directories.  The
        # data's fsyncs wait for the disk while the checksums read the page
        # cache: side by side, not one after the other
        with ThreadPoolExecutor(max_workers=4) as pool:
            synced = pool.map(fsync_path, listed)
            with self.transfers.running(job.name, hashing):
                files = checksum_entries(d, hashing.add, listed, known)
            t_hashed = time.monotonic()
            list(synced)
        for sub in sorted({p.parent for p in listed}, key=lambda p: len(p.parts), reverse=True):
            fsync_path(sub)
        fsync_path(d)
        t_end = time.monotonic()
        log.info(
            "job %s: finalize: pages written after %.3f s, checksums %.3f s (%d of %d images by their writer), "
            "fsync %.3f s more", job.name, t_pages - t0, t_hashed - t_pages, len(known),
            sum(1 for p in listed if p.name == "pages.img"), t_end - t_hashed,
        )  # fmt: skip
        return RankPart(
            processes=processes,
            tree=tree,
            written_files=list(written.values()),
            read_files=read_entries,
            mapped_files=mapped_entries,
            files=files,
            depends_on=depends_on,
            dedup_bytes=deduped,
        )


def copy_prefix(src: Path, dst: Path, size: int, key: bytes | None = None) -> None:
    """The first `size` bytes of src into a new file dst (never through a
    symlink: the checkpoint storage may be shared with other users); with
    key, sealed (dst and dst.gcm, ckptd/image/crypt.py)."""
    if key is not None:
        with open(os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fin:
            data = fin.read(size)
        if len(data) < size:
            raise OSError(5, f"{src} is shorter than {size} bytes")
        seal_into(key, data, dst)
        return
    with (
        open(os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fin,
        open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb") as fout,
    ):
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
