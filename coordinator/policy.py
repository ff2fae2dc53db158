"""Policies the coordinator applies on its own: periodic checkpoints (--interval)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptd.errors import CkptdError

from .jobs import JobRecord, JobRegistry

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
                if interval <= 0 or record.status.state != "running":
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
