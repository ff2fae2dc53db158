"""Policies the coordinator applies on its own: periodic checkpoints (--interval)
and automatic restarts (--auto-restart)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptd.errors import CkptdError
from ckptd.jobstate import RESTARTABLE, JobState
from ckptd.v1 import ckptd_pb2 as pb

from .jobs import JobRecord, JobRegistry
from .nodes import DEAD_AFTER_S

log = logging.getLogger(__name__)


class IntervalScheduler:
    """Checkpoints every job whose spec has interval_s > 0, that often."""

    def __init__(self, registry: JobRegistry, checkpoint: Callable[[JobRecord], object]) -> None:
        self.registry = registry
        self.checkpoint = checkpoint
        self._stop = threading.Event()
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="interval", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for record in self.registry.all():
                interval = record.spec.interval_s
                if interval <= 0 or record.status.state != JobState.RUNNING.pb:
                    continue
                if not record.last_checkpoint_at:
                    record.last_checkpoint_at = now  # first one an interval after launch
                    continue
                if now - record.last_checkpoint_at < interval:
                    continue
                with self._lock:
                    if record.name in self._busy:
                        continue
                    self._busy.add(record.name)
                threading.Thread(target=self._take, args=(record,), daemon=True).start()

    def _take(self, record: JobRecord) -> None:
        try:
            self.checkpoint(record)
        except CkptdError as e:
            log.warning("periodic checkpoint of %s failed: %s", record.name, e.message)
            record.last_checkpoint_at = time.monotonic()  # retry after another interval
        finally:
            with self._lock:
                self._busy.discard(record.name)


STARTUP_GRACE_S = 3 * DEAD_AFTER_S


class AutoRestarter:
    """Jobs launched with --auto-restart come back from their latest committed
    checkpoint on their own when they die abnormally: a process SIGKILLed
    (the OOM killer, kill -9: the job is FAILED) or a rank's node stopping
    answering (LOST).  The surviving ranks are stopped and every rank is
    rebuilt, the dead node's ranks on the least busy live nodes.  An exit,
    whatever its status, or death by another signal is the program's own
    end (EXITED) and is not restarted.  --max-restarts N: at most N
    automatic restarts (counted by this coordinator)."""

    POLL_S = 1.0
    BACKOFF_S = 10.0

    def __init__(self, coordinator: Any) -> None:
        self.c = coordinator
        self._stop = threading.Event()
        self._started = time.monotonic()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="auto-restart", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.POLL_S):
            for record in self.c.registry.all():
                if not record.spec.auto_restart or record.op_lock.locked() or record.gave_up:
                    continue
                if time.monotonic() - record.last_auto_restart < self.BACKOFF_S:
                    continue
                try:
                    self._check(record)
                except CkptdError as e:
                    log.warning(
                        "auto-restart of %s failed: %s (next try in %.0f s)", record.name, e.message, self.BACKOFF_S
                    )

    def _check(self, record: JobRecord) -> None:
        status = self.c.status(record)
        state = JobState.of(status.state)
        if state not in RESTARTABLE or not status.checkpoints:
            return
        if state is JobState.LOST and time.monotonic() - self._started < STARTUP_GRACE_S:
            return  # a coordinator that just started has not heard from the agents yet
        limit = record.spec.max_restarts
        if limit and record.auto_restarts >= limit:
            record.gave_up = True
            log.warning("auto-restart: job %s is %s again after %d automatic restarts (--max-restarts %d): "
                        "not restarting it", record.name, state, record.auto_restarts, limit)  # fmt: skip
            return
        record.last_auto_restart = time.monotonic()
        record.auto_restarts += 1
        log.info("auto-restart: job %s is %s (%s); restarting from its last checkpoint", record.name,
                 status.state, status.message)  # fmt: skip
        resp = self.c.restart(record, pb.RestartRequest(job=record.name, force=True))
        log.info("auto-restart: job %s restarted from %s", record.name, resp.checkpoint.name)
