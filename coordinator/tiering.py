"""Tiering: checkpoints commit on a fast stage, then go up to shared storage.

A job launched with `--stage-dir FAST --ckpt-dir SHARED` checkpoints into
FAST (spec.ckpt_dir) exactly as any job does, so its stall and commit cost
what the fast disk costs.  After each commit the Uploader copies the new
checkpoint to SHARED (spec.shared_dir) in the background, in commit order
(a child never lands before its parent), memory images optionally
zstd-compressed.  The shared copy is written under a temporary name, fsynced,
then renamed: a checkpoint is on the shared tier only once it is durable
there.

A restart from a checkpoint whose stage copy is gone (its node died with its
disk) first fetches it, and every checkpoint it builds on, back down to the
stage (decompressed), then restores from there as usual.

The stage must be reachable by the coordinator and the job's agents, as
--ckpt-dir is without tiering.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import zstandard

from ckptd import faults
from ckptd.errors import CkptdError, Code
from ckptd.image.manifest import load_manifest, verify_files
from ckptd.image.transfer import fetch_copy, tree_bytes, upload_copy
from ckptd.paths import JobDir, parse_checkpoint_name
from ckptd.v1 import ckptd_pb2 as pb

from .catalog import Catalog, storage_error
from .jobs import JobRecord

log = logging.getLogger(__name__)

# Pruning the shared tier and fetching from it never overlap (a fetch must
# not lose a checkpoint of its chain half way); both are rare.
SHARED_TIER_LOCK = threading.Lock()


class TransferBoard:
    """The tier transfers in flight, per job, for `ckptctl status` and the
    progress bars of `checkpoint --wait-shared` and `restart`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[str, pb.Progress]] = {}

    def begin(self, job: str, operation: str, what: str, total: int) -> Callable[[int], None]:
        with self._lock:
            self._jobs[job] = (operation, pb.Progress(done=0, total=total, what=what))

        def advance(n: int) -> None:
            with self._lock:
                if job in self._jobs:
                    self._jobs[job][1].done += n

        return advance

    def end(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    def get(self, job: str) -> tuple[str, pb.Progress] | None:
        with self._lock:
            found = self._jobs.get(job)
            if found is None:
                return None
            progress = pb.Progress()
            progress.CopyFrom(found[1])
            return found[0], progress


class Uploader:
    """One background thread uploading committed checkpoints, oldest first."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.board = TransferBoard()
        self._cond = threading.Condition()
        self._queue: deque[tuple[JobRecord, str]] = deque()
        self._current: tuple[str, str] | None = None
        self._failed: dict[tuple[str, str], str] = {}
        self._plain_bw: dict[str, float] = {}  # shared dir -> bytes/s of its last uncompressed upload
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="uploader", daemon=True)
        catalog.uploading = self.uploading

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def submit(self, record: JobRecord) -> None:
        """Queue every committed stage checkpoint of the job that the shared
        tier lacks (the new one; and any whose upload failed or was cut off
        by a coordinator restart)."""
        shared = record.shared_dir
        if shared is None:
            return
        missing = [
            c.name
            for c in self.catalog.list(record.name, record.job_dir)
            if c.created != "corrupt" and not shared.path.joinpath(c.name).is_dir()
        ]
        with self._cond:
            queued = {(r.name, n) for r, n in self._queue} | ({self._current} if self._current else set())
            for name in missing:
                if (record.name, name) not in queued:
                    self._queue.append((record, name))
                    self._failed.pop((record.name, name), None)
            self._cond.notify_all()

    def uploading(self, job: str, name: str) -> bool:
        with self._cond:
            return self._current == (job, name) or any(r.name == job and n == name for r, n in self._queue)

    def wait(self, record: JobRecord, name: str, timeout: float) -> None:
        """Until checkpoint name is on the shared tier; raises if its upload
        failed or took longer than timeout."""
        assert record.shared_dir is not None
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.uploading(record.name, name):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CkptdError(
                        Code.DEADLINE_EXCEEDED,
                        f"{name} is committed on the stage, but its upload to {record.shared_dir.path} "
                        f"is still running after {timeout:.0f} s; `ckptctl list {record.name}` shows when it lands",
                    )
                self._cond.wait(min(left, 1.0))
            failure = self._failed.get((record.name, name))
        if failure:
            raise CkptdError(
                Code.UNAVAILABLE,
                f"{name} is committed on the stage, but its upload to the shared tier failed: {failure}; "
                "it is retried after the next checkpoint",
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                record, name = self._queue.popleft()
                self._current = (record.name, name)
            try:
                self._upload(record, name)
            except CkptdError as e:
                log.warning("job %s: upload of %s failed: %s", record.name, name, e.message)
                with self._cond:
                    self._failed[(record.name, name)] = e.message
            except Exception as e:  # never let one upload end the thread
                log.exception("job %s: upload of %s failed", record.name, name)
                with self._cond:
                    self._failed[(record.name, name)] = str(e)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _upload(self, record: JobRecord, name: str) -> None:
        shared = record.shared_dir
        ckpt_id = parse_checkpoint_name(name)
        assert shared is not None and ckpt_id is not None
        src = record.job_dir.path / name
        if shared.path.joinpath(name).is_dir() or not src.is_dir():
            return  # already there, or pruned from the stage before its turn
        t0 = time.monotonic()
        tmp = self.catalog.create_tmp(shared, ckpt_id)
        try:
            advance = self.board.begin(record.name, f"uploading {name} to the shared tier", "uploading",
                                       tree_bytes(src))  # fmt: skip
            codec, known_bw = record.spec.compress, self._plain_bw.get(str(shared.path), 0.0)
            if codec == "auto" and not known_bw:
                codec = ""  # auto's first upload goes plain: it measures the shared tier's bandwidth
            report = upload_copy(src, tmp, codec, advance, known_bw)
            faults.point("upload", "coordinator")
            self.catalog.commit(tmp, shared, ckpt_id)
        except FileNotFoundError:
            self.catalog.discard(tmp)
            if not src.is_dir():
                log.info("job %s: %s was pruned while uploading", record.name, name)
                return
            raise
        except OSError as e:
            self.catalog.discard(tmp)
            raise storage_error(e, shared.path) from e
        except BaseException:
            self.catalog.discard(tmp)
            raise
        finally:
            self.board.end(record.name)
        took = time.monotonic() - t0
        if not report.compressed:
            self._plain_bw[str(shared.path)] = report.bytes / max(took, 1e-9)
        log.info(
            "job %s: %s uploaded to %s: %d bytes stored for %d (%s), %.2f s, %.0f MB/s",
            record.name, name, shared.path, report.stored, report.bytes,
            "zstd" if report.compressed else "uncompressed", took, report.bytes / max(took, 1e-9) / 1e6,
        )  # fmt: skip
        spec = record.spec
        if spec.keep_last or spec.keep_every:
            prune_shared(record, self.catalog, spec.keep_last, spec.keep_every)


def prune_shared(record: JobRecord, catalog: Catalog, keep_last: int, keep_every: int) -> list[str]:
    """The retention policy on the shared tier, as on the stage."""
    if record.shared_dir is None:
        return []
    with SHARED_TIER_LOCK:
        removed = catalog.prune(record.name, record.shared_dir, keep_last, keep_every)
    if removed:
        log.info("job %s: retention removed %s from the shared tier", record.name, ", ".join(removed))
    return removed


def fetch_chain(
    record: JobRecord, catalog: Catalog, checkpoint: pb.CheckpointInfo, board: TransferBoard
) -> pb.CheckpointInfo:
    """Bring checkpoint, and every one it builds on, down to the stage from
    the shared tier where the stage lacks them.  Returns its stage entry."""
    shared = record.shared_dir
    if shared is None:
        return checkpoint
    with SHARED_TIER_LOCK:
        names = [n for n in [*checkpoint.depends_on, checkpoint.name] if not record.job_dir.path.joinpath(n).is_dir()]
        if names:
            total = sum(tree_bytes(shared.path / n) for n in names)
            advance = board.begin(record.name, f"fetching {checkpoint.name} from the shared tier", "fetching", total)
            try:
                for name in names:
                    _fetch_one(record, catalog, shared, name, advance)
            finally:
                board.end(record.name)
    for c in catalog.list(record.name, record.job_dir):
        if c.name == checkpoint.name:
            out = pb.CheckpointInfo()
            out.CopyFrom(c)
            return out
    raise AssertionError(f"{checkpoint.name} fetched but not listed")


def _fetch_one(record: JobRecord, catalog: Catalog, shared: JobDir, name: str, advance: Callable[[int], None]) -> None:
    ckpt_id = parse_checkpoint_name(name)
    assert ckpt_id is not None
    if record.job_dir.path.joinpath(name).is_dir():
        return
    src: Path = shared.path / name
    t0 = time.monotonic()
    try:  # authentic before a byte of it is copied (the MAC covers the content, not the tier)
        load_manifest(src)
    except CkptdError as e:
        raise CkptdError(e.code, f"the shared copy of {name}: {e.message}") from None
    tmp = catalog.create_tmp(record.job_dir, ckpt_id)
    try:
        report = fetch_copy(src, tmp, advance)
        # proven whole before it counts as a stage checkpoint (the restore checks it again)
        verify_files(tmp, load_manifest(tmp))
        catalog.commit(tmp, record.job_dir, ckpt_id)
    except CkptdError as e:
        catalog.discard(tmp)
        raise CkptdError(e.code, f"the shared copy of {name}: {e.message}") from None
    except zstandard.ZstdError as e:
        catalog.discard(tmp)
        raise CkptdError(
            Code.DATA_LOSS, f"the shared copy of {name} is corrupt ({e}); restart from another with --from ID"
        ) from None
    except OSError as e:
        catalog.discard(tmp)
        raise storage_error(e, record.job_dir.path) from e
    except BaseException:
        catalog.discard(tmp)
        raise
    log.info(
        "job %s: fetched %s from the shared tier: %d bytes (%d stored), %.2f s",
        record.name, name, report.bytes, report.stored, time.monotonic() - t0,
    )  # fmt: skip
