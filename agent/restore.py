"""Restoring a job on this node from a committed checkpoint.

Nothing is touched until the checkpoint is proven whole and authentic and
the node proven able to take it:
  0. the checkpoint is the job's own, in its own directory (check_checkpoint_dir);
  1. the manifest's digest and MAC (ckptd/image/seal.py), every file's size
     and checksum, and the files it would write (agent/rollback.py);
  2. the files the job maps (libraries, its executable) and reads are the
     ones it had, by size and content: code must match exactly, other files
     may differ only with --allow-changed-files;
then the job's world is rolled back to the checkpoint:
  3. files the job writes get their saved contents back;
  4. the job's log is cut back to its size at the checkpoint, so the output
     the lost run produced after it is not duplicated;
and finally:
  5. the restore plan (ckptd/image/plan/) is written: the shared objects
     (pipes, sockets, shared memory) and the process tree;
  6. ckptd-init starts `ckptd-restore --build PLAN` as pid 2 in a fresh pid
     namespace; it creates the shared objects, forks the tree with the old
     pids, and every process rebuilds itself from its image;
  7. once every process's restored shim has reconnected (HELLO restored=1),
     all of them are told to RESUME together.

With --lazy (agent/lazy.py) step 7 comes before the memory is back, and so
before the memory images' checksums are known: they are checked while the
job runs, and a mismatch kills it and undoes steps 3-4 then.

The memory images (pages.img, and those of earlier checkpoints an
incremental one reads from) are the exception to "verified first": step 1
proves their sizes, and their checksums are computed while step 6 reads
them, so a restart reads them from storage once, not twice.  The rebuilt
processes stay parked until every checksum has matched; if one does not,
they are killed and steps 3-4 are undone (agent/rollback.py), which leaves
the job's files as they were.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.image.checksum import ALGORITHM, IdentityCache
from ckptd.image.core import CoreImage
from ckptd.image.crypt import key_memfd
from ckptd.image.manifest import PendingChecksum, check_pending, load_manifest, verify_files
from ckptd.image.plan import PlanError, plan_for_checkpoint
from ckptd.image.transfer import is_memory_image  # checked while the restore reads it (module doc)
from ckptd.jobstate import LIVE, JobState
from ckptd.native import restorer_binary
from ckptd.nofollow import UnsafePath, open_dir
from ckptd.paths import Home, JobDir, checkpoint_name, parse_checkpoint_name
from ckptd.v1 import ckptd_pb2 as pb

from . import gpu, sysv_ipc
from .lazy import LazyFill
from .progress import Transfer, Transfers, resident_anon
from .rollback import WorldRollback, check_recorded, check_written_files
from .runtime import JobRuntime
from .shim_link import ShimConnection, ShimError

log = logging.getLogger(__name__)

RESTORE_BASE_TIMEOUT_S = 60.0
RESTORE_MIN_BANDWIDTH = 100 << 20  # bytes/s assumed when sizing the timeout


def _same_file(entry: dict[str, Any], identities: IdentityCache) -> tuple[bool, str]:
    path = entry["path"]
    try:
        st = os.stat(path)
    except OSError:
        return False, "no longer exists"
    if st.st_size != entry["size"]:
        return False, f"has {st.st_size} bytes instead of {entry['size']}"
    if st.st_mtime_ns == entry.get("mtime_ns"):
        return True, ""
    want = entry.get(ALGORITHM)
    if want and identities.content_hash(path) != want:
        return False, "has different contents"
    return True, ""


def check_identities(manifest: dict[str, Any], allow_changed: bool, identities: IdentityCache) -> None:
    for entry in manifest.get("mapped_files", []):
        same, why = _same_file(entry, identities)
        if same:
            continue
        if entry.get("executable") or not allow_changed:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"{entry['path']}, which the job has mapped{' as code' if entry.get('executable') else ''}, {why} "
                "since the checkpoint; put the original back or restart on a node that has it"
                + ("" if entry.get("executable") else " (or pass --allow-changed-files)"),
            )
    for entry in manifest.get("read_files", []):
        same, why = _same_file(entry, identities)
        if not same and not (allow_changed and os.path.exists(entry["path"])):
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"{entry['path']}, which the job reads, {why} since the checkpoint; restore it, "
                "or pass --allow-changed-files to continue with the new contents",
            )


def check_checkpoint_dir(spec: pb.JobSpec, checkpoint: Path) -> None:
    """A restore reads only a checkpoint of the job itself, in the job's own
    directory: <ckpt_dir>/<job>/ckpt-NNNNNN (a rank's part: .../rank-R),
    reached without a symlink (ckpt_dir is resolved when the job is
    launched; a tiered job's checkpoints are fetched to it first)."""
    job = spec.rank.job or spec.name
    expected = JobDir.of(spec.ckpt_dir, job).path
    parts = [checkpoint.name] if not spec.rank.job else [checkpoint.parent.name, checkpoint.name]
    ckpt_id = parse_checkpoint_name(parts[0])
    where = expected / parts[0] if spec.rank.job else expected
    ok = (
        Path(spec.ckpt_dir).is_absolute()
        and ckpt_id is not None
        and checkpoint_name(ckpt_id) == parts[0]
        and (not spec.rank.job or parts[1] == f"rank-{spec.rank.rank}")
        and str(checkpoint) == os.path.normpath(checkpoint)
        and checkpoint.parent == where
    )
    if ok:
        try:
            os.close(open_dir(checkpoint, "/"))
        except UnsafePath as e:
            raise CkptdError(
                Code.PERMISSION_DENIED, f"refusing checkpoint {checkpoint}: {e.why}; a restore never follows one"
            ) from None
        except OSError as e:
            raise CkptdError(Code.FAILED_PRECONDITION, f"cannot open checkpoint {checkpoint}: {e.strerror}") from None
        return
    raise CkptdError(
        Code.PERMISSION_DENIED,
        f"{checkpoint} is not a checkpoint in job {job}'s own directory {expected}; "
        "a node restores only a job's own checkpoints",
    )


def owner_ids(owner: str) -> tuple[int, int] | None:
    """Whom the files a root agent creates for the job go to: its owner's
    uid and primary group (None: this process's own user, or no owner)."""
    if os.geteuid() != 0 or not owner:
        return None
    try:
        pw = pwd.getpwnam(owner)
    except KeyError:
        raise CkptdError(Code.FAILED_PRECONDITION, f"user {owner}, who owns the job, is unknown on this node") from None
    return pw.pw_uid, pw.pw_gid


@dataclass
class VerifiedCheckpoint:
    """A checkpoint proven whole but for the checksums of its memory images
    (`pending`, sizes proven), and the plan that rebuilds its process tree."""

    path: Path
    manifest: dict[str, Any]
    plan: str
    pending: list[PendingChecksum]

    @property
    def pending_bytes(self) -> int:
        return sum(p.size for p in self.pending)


def page_sources(checkpoint: Path, manifest: dict[str, Any]) -> list[PendingChecksum]:
    """An incremental image reads unchanged pages from earlier checkpoints'
    pages.img: each must be there, of the size the image expects (checked
    here), and pass the checksum its own checkpoint's manifest recorded
    (returned, to be checked during the rebuild)."""
    seen: set[Path] = set()
    pending = []
    for proc in manifest["processes"]:
        image = checkpoint / proc["dir"]
        try:
            core = CoreImage.load(image / "core.img")
        except CkptdError as e:
            raise CkptdError(Code.DATA_LOSS, f"checkpoint {checkpoint.name}: {e.message}") from None
        job_dir = image.joinpath(*[".."] * int(core.proc.job_depth)).resolve() if core.proc.job_depth else image
        for src in core.page_sources():
            path = (job_dir / src["path"]).resolve()
            if path in seen:
                continue
            seen.add(path)
            owner = src["path"].split("/", 1)[0]
            hint = f"it builds on {owner}; restart from another checkpoint with --from ID (`ckptctl list JOB`)"
            try:
                size = path.stat().st_size
            except OSError:
                raise CkptdError(
                    Code.DATA_LOSS, f"checkpoint {checkpoint.name} needs {src['path']}, which is missing; {hint}"
                ) from None
            if size != src["size"]:
                raise CkptdError(
                    Code.DATA_LOSS,
                    f"checkpoint {checkpoint.name} needs {src['path']} of {src['size']} bytes, found {size}; {hint}",
                )
            # the manifest nearest above the file lists its checksum
            for d in path.parents:
                if (d / "manifest.json").exists():
                    rel = str(path.relative_to(d))
                    entry = [e for e in load_manifest(d).get("files", []) if e["path"] == rel]
                    if entry:
                        failure = f"checkpoint {checkpoint.name} needs {src['path']}, which fails its checksum; {hint}"
                        pending.append(PendingChecksum(path, entry[0][ALGORITHM], size, failure))
                    break
                if d == job_dir:
                    break
    return pending


def verify_checkpoint(
    job: str, checkpoint: Path, allow_changed: bool, identities: IdentityCache, transfers: Transfers
) -> VerifiedCheckpoint:
    """Steps 1-2 (and the plan, 5): prove the checkpoint whole (the memory
    images' checksums excepted, see the module's doc) and this node able to
    take it.  Touches nothing, so a refusal here leaves the job exactly as
    it was."""
    manifest = load_manifest(checkpoint)
    if manifest.get("job") != job:
        raise CkptdError(Code.INVALID_ARGUMENT, f"{checkpoint} belongs to job {manifest.get('job')}, not {job}")
    if not manifest.get("processes"):
        raise CkptdError(Code.DATA_LOSS, f"{checkpoint.name} holds no process; cannot restore")
    small = sum(int(e["size"]) for e in manifest.get("files", []) if not is_memory_image(e["path"]))
    verifying = Transfer("verifying", small)
    with transfers.running(job, verifying):
        pending = verify_files(checkpoint, manifest, verifying.add, defer=is_memory_image)
        pending += page_sources(checkpoint, manifest)
    # the files a restart writes: ones the job wrote, where it wrote them (agent/rollback.py)
    check_recorded(checkpoint, manifest)
    check_written_files(checkpoint, manifest)
    check_identities(manifest, allow_changed, identities)
    try:
        plan = plan_for_checkpoint(checkpoint, manifest)
    except PlanError as e:
        raise CkptdError(Code.FAILED_PRECONDITION, f"cannot restore {checkpoint.name}: {e.message}") from None
    return VerifiedCheckpoint(checkpoint, manifest, plan, pending)


def restore_job(
    home: Home,
    job: JobRuntime,
    verified: VerifiedCheckpoint,
    transfers: Transfers,
    *,
    hold: bool = False,
    lazy: bool = False,
) -> list[ShimConnection] | None:
    """Steps 3-7, on a verified checkpoint.  With hold (a rank of a
    multi-node job) the rebuilt processes stay parked and are returned: they
    run once every rank is rebuilt.  With lazy the job runs before its
    memory is filled (agent/lazy.py)."""
    checkpoint, manifest = verified.path, verified.manifest
    # a rank's part of a multi-node checkpoint is ckpt-N/rank-R: named as ckpt-N
    name = checkpoint.parent.name if job.spec.rank.job else checkpoint.name
    procs = manifest["processes"]
    if lazy and job.owner.switch:
        # its pagers would read the images as root (agent/lazy.py): not yet
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"restart --lazy of job {job.name}, which runs as user {job.owner.name}, is not supported; "
            "restart it without --lazy",
        )
    # launch --encrypt: a wrong key is refused here, before anything is touched
    key = job.key()
    work = job.home.agent_dir(job.node) / "jobs" / job.name
    work.mkdir(parents=True, exist_ok=True)
    world = WorldRollback(work / f"undo-{name}", owner_ids(job.spec.owner), key)
    started = False
    try:
        with job.cond:
            job.operation = f"restart from {name}: rolling back files"
        world.roll_back_files(checkpoint, manifest)
        root = Path(job.spec.ckpt_dir)  # below it, no symlink is followed
        world.put_back_log(checkpoint / "output.log", job.job_dir.log, root)
        world.put_back_log(checkpoint / "output.idx", job.job_dir.index, root)

        # read by the restorer, which runs as the job's owner (agent/owner.py)
        plan = job.work_dir / f"plan-{name}.txt"
        with job.owner_files():
            plan.write_text(verified.plan)
        key_fd = key_memfd(key) if key else None
        inc = job.spawn(
            [
                str(restorer_binary()),
                "--build",
                str(plan),
                "--status-dir",
                "{runtime_dir}",
                "--agent-socket",
                str(job.shim_socket),
                "--checkpoint",
                name,
                *(["--lazy"] if lazy else []),
                *(["--key-fd", str(key_fd)] if key_fd is not None else []),
            ],
            restore=True,
            restored_from=name,
            keep_fd=key_fd,
        )
        if key_fd is not None:
            os.close(key_fd)
        started = True
        job.fault("rebuild")
        with job.cond:
            job.operation = f"restart from {name}: rebuilding {len(procs)} process(es)"
        job.restored_cuda = {int(p["pid"]) for p in procs if p.get("cuda")}
        pages = sum(int(p.get("pages_bytes", 0)) for p in procs)
        deadline = time.monotonic() + RESTORE_BASE_TIMEOUT_S + pages / RESTORE_MIN_BANDWIDTH
        # the memory filled in so far, against what the images hold (pages
        # taken from earlier checkpoints included), and never ahead of the
        # checksums: the bar shows the slower of the two
        filled = sum(int(p.get("pages_bytes", 0)) + int(p.get("ref_bytes", 0)) for p in procs)
        checked = Transfer("verifying", verified.pending_bytes)
        rebuilding = Transfer(
            "rebuilding",
            filled,
            probe=lambda: min(
                sum(resident_anon(pid) for pid in job.live_pids()),
                filled * checked.done // max(checked.total, 1),
            ),
        )
        with transfers.running(job.name, rebuilding):
            # the restorers read the images while this thread checks them
            # (lazily: while the job runs, below)
            if not lazy:
                check_pending(verified.pending, checked.add)
            status_dir = Path(inc.status_dir or inc.runtime_dir)
            conns = _wait_restored(
                job, inc.generation, {int(p["pid"]) for p in procs}, deadline, lambda: _restore_failed(status_dir)
            )
        if conns is None:
            with job.owner_files():  # the restorer wrote them, as the job's owner
                failure = _restore_failure(status_dir)
            reason = failure or job.message or "the restorer did not report back in time"
            raise CkptdError(Code.FAILED_PRECONDITION, f"restart of job {job.name} from {name} failed: {reason}")
        # every segment is attached again: those removed while attached are removed again
        sysv_ipc.remove_destroyed(conns[0].host_pid, checkpoint)
        adopt_images(conns, checkpoint, procs, [name, checkpoint.name] if job.spec.rank.job else [name])
        if lazy:
            fill = LazyFill(job.name, key=key)
            job.lazy = fill
            fill.start(conns, {int(p["pid"]): checkpoint / p["dir"] for p in procs}, work)
    except BaseException as e:
        if job.lazy is not None:
            job.lazy.kill_all()
        _fail_restore(job, world, started, e)
        raise
    if lazy:
        resume_restored(job, conns, name)
        _after_lazy_resume(job, verified, world, transfers, name)
        return None
    world.forget()
    if hold:
        with job.cond:
            job.operation = f"restart from {name}: rebuilt, waiting for the other ranks"
        return conns
    resume_restored(job, conns, name)
    return None


def adopt_images(conns: list[ShimConnection], checkpoint: Path, procs: list[dict[str, Any]], parts: list[str]) -> None:
    """Every restored process, still parked, takes the image it was rebuilt
    from as its last one (ADOPT, native/shim/track.c): the restorer
    write-protected its memory before anything ran in it, so the job's
    first checkpoint after this restart stores only what changed since,
    as any incremental one does, instead of every page again.  parts: the
    checkpoint's directory relative to the job's (ckpt-N[/rank-R]).  Best
    effort: a process that cannot (no userfaultfd here, CKPTD_TRACK=hash)
    writes a full image next time, as before."""
    dirs = {int(p["pid"]): str(p["dir"]) for p in procs}
    for conn in conns:
        pdir = dirs.get(conn.pid)
        if pdir is None:
            continue
        try:
            conn.request("ADOPT", timeout=10, core=str(checkpoint / pdir / "core.img"), image="/".join([*parts, pdir]))
        except ShimError as e:
            log.info("pid %d in the job: its next image is a full one: %s", conn.pid, e.message)


def _after_lazy_resume(
    job: JobRuntime, verified: VerifiedCheckpoint, world: WorldRollback, transfers: Transfers, name: str
) -> None:
    """The job runs; its memory fills and its images are checked meanwhile.
    Either failing kills it; a checksum mismatch also puts its files back."""
    fill = job.lazy
    assert fill is not None
    generation = job.generation
    job.fault("lazy fill")
    fill.watch(lambda why: job.fail_running(generation, f"lazy restart from {name} failed: {why}"))

    def check() -> None:
        checked = Transfer("verifying", verified.pending_bytes)
        try:
            with transfers.running(job.name, checked):
                check_pending(verified.pending, checked.add)
        except CkptdError as e:
            log.error("job %s: %s", job.name, e.message)
            job.fail_running(generation, f"lazy restart from {name} failed: {e.message}", world.undo)
            fill.kill_all()
            return
        world.forget()

    threading.Thread(target=check, name=f"verify-{job.name}", daemon=True).start()


def _fail_restore(job: JobRuntime, world: WorldRollback, started: bool, error: BaseException) -> None:
    """A restart that cannot finish: its parked processes go (they never ran),
    the job's files are put back as they were, and the job stays failed,
    ready for `restart --from` an earlier checkpoint."""
    if started:
        job.kill(requested=False)
    with job.cond:
        deadline = time.monotonic() + 30
        while started and job.state in LIVE and time.monotonic() < deadline:
            job.cond.wait(0.2)  # until its monitor has seen the incarnation end
    world.undo()
    why = error.message if isinstance(error, CkptdError) else str(error) or type(error).__name__
    with job.cond:
        job.state, job.operation = JobState.FAILED, ""
        job.message = why if why.startswith("restart") else f"restart failed: {why}"
        job.cond.notify_all()


def resume_restored(job: JobRuntime, conns: list[ShimConnection], name: str) -> None:
    """Every process is rebuilt and parked: they run again together."""
    for conn in conns:
        conn.request("RESUME", timeout=30)
    job.fault("release")
    inc = job.incarnation
    if inc is not None and not inc.released:
        inc.released = True  # after the last RESUME: one agent restart sooner kills them all
        inc.save()
    # GPU memory comes back once the driver's threads run again (agent/gpu.py)
    cuda = [c.host_pid for c in conns if c.pid in job.restored_cuda]
    if cuda:
        try:
            gpu.restore_after_rebuild(cuda)
        except CkptdError as e:
            job.kill()
            raise CkptdError(
                Code.FAILED_PRECONDITION, f"restart of job {job.name} from {name} failed: {e.message}"
            ) from None
    with job.cond:
        if job.state is not JobState.RESTORING:  # it ended meanwhile (its monitor said how): not running
            return
        job.state = JobState.RUNNING
        job.message = f"restored from {name}"
        job.operation = ""
        job.cond.notify_all()


def _restore_failure(runtime_dir: Path) -> str:
    """What the restorers wrote to their status files (empty ones succeeded)."""
    reasons = []
    for f in sorted(runtime_dir.glob("restore-*.status")):
        with contextlib.suppress(OSError):
            text = f.read_text(errors="replace").strip()
            if text:
                who = f.stem.removeprefix("restore-")
                reasons.append(text if who == "build" else f"pid {who}: {text}")
    return "; ".join(reasons)


def _restore_failed(runtime_dir: Path) -> bool:
    """Whether a restorer wrote a failure (a status file that is not empty).
    Only sizes, with lstat: reading them is for the job's owner's identity,
    which cannot be taken in a loop (setgroups changes every thread's)."""
    for f in runtime_dir.glob("restore-*.status"):
        with contextlib.suppress(OSError):
            st = f.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_size:
                return True
    return False


def _wait_restored(
    job: JobRuntime, generation: int, pids: set[int], deadline: float, failed: Callable[[], bool]
) -> list[ShimConnection] | None:
    """The restored shims of every process in `pids` (ids in the job), or None:
    at the deadline, or as soon as one restorer reported a failure (the
    others stay parked, waiting for it: without this, until the deadline)."""
    while True:
        with job.cond:
            found = {c.pid: c for c in job.shims.values() if c.restored and c.pid in pids}
            if len(found) == len(pids):
                return [found[p] for p in sorted(pids)]
            if job.generation != generation or job.state is not JobState.RESTORING:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            job.cond.wait(min(left, 0.5))
        if failed():
            return None
