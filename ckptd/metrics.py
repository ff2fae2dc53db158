"""Prometheus metrics: every metric ckptd serves, defined here and nowhere else.

A daemon started with `--metrics HOST:PORT` (the embedded one: CKPTD_METRICS)
serves them over HTTP at /metrics.  Each daemon has its own registry (no
process-wide default one: the embedded daemon and tests may host several).

Recorded where a result is decided (coordinator/server.py: Coordinator.checkpoint
and .restart, which every caller goes through: ckptctl, the interval
scheduler, a preemption, the auto-restarter); the job and node gauges are
read from the coordinator's (or the agent's) own tables at scrape time.

    ckptd_checkpoints_total{job,result}           result: ok, or the refusal's code
                                                  (failed_precondition, aborted, ...)
    ckptd_checkpoint_duration_seconds             request to commit (histogram)
    ckptd_checkpoint_pause_seconds                how long the job was paused (histogram)
    ckptd_checkpoint_bytes_total{job,kind}        written: what the ranks wrote this round;
                                                  stored: what stays on storage;
                                                  deduplicated: written, then stored once in rank 0's images
    ckptd_last_checkpoint_timestamp_seconds{job}  when the last committed checkpoint of the job committed
    ckptd_restarts_total{job,result}              result as for checkpoints
    ckptd_jobs{state}                             jobs in each state (ckptd/jobstate.py)
    ckptd_node_up{node}                           1 while the node's agent answers, else 0

`job` is the ckptd job's name, which Prometheus's own `job` label (the scrape
job) would rename to exported_job: scrape ckptd with `honor_labels: true`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptd.errors import CkptdError, Code
from ckptd.jobstate import JobState

log = logging.getLogger(__name__)

# a pause is milliseconds to tens of seconds; a whole round up to an hour (a big GPU job's dump)
PAUSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def result_of(error: BaseException | None) -> str:
    """A result label: "ok", or the error's code (an unexpected exception: internal)."""
    if error is None:
        return "ok"
    if isinstance(error, CkptdError):
        return error.code.name.lower()
    return Code.INTERNAL.name.lower()


class _Gauges(Collector):
    """ckptd_jobs and ckptd_node_up, read at scrape time from the daemon's own tables."""

    def __init__(self) -> None:
        self.jobs: Callable[[], Iterable[JobState]] = list
        self.nodes: Callable[[], Iterable[tuple[str, bool]]] = list

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("ckptd_jobs", "Jobs in each state", labels=["state"])
        counts = dict.fromkeys(JobState, 0)
        for state in self.jobs():
            counts[state] += 1
        for state, n in counts.items():
            jobs.add_metric([state.value], n)
        yield jobs
        up = GaugeMetricFamily("ckptd_node_up", "1 while the node's agent answers, else 0", labels=["node"])
        for node, alive in self.nodes():
            up.add_metric([node], 1.0 if alive else 0.0)
        yield up


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.checkpoints = Counter("ckptd_checkpoints", "Checkpoint requests by result", ["job", "result"], registry=r)
        self.duration = Histogram(
            "ckptd_checkpoint_duration_seconds", "Committed checkpoints: request to commit",
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.pause = Histogram(
            "ckptd_checkpoint_pause_seconds", "Committed checkpoints: how long the job was paused",
            buckets=PAUSE_BUCKETS, registry=r,
        )  # fmt: skip
        self.bytes = Counter(
            "ckptd_checkpoint_bytes", "Committed checkpoints' bytes: written, stored, deduplicated",
            ["job", "kind"], registry=r,
        )  # fmt: skip
        self.last = Gauge(
            "ckptd_last_checkpoint_timestamp_seconds", "When the job's last checkpoint committed (Unix time)",
            ["job"], registry=r,
        )  # fmt: skip
        self.restarts = Counter("ckptd_restarts", "Restarts by result", ["job", "result"], registry=r)
        self.gauges = _Gauges()
        r.register(self.gauges)

    def checkpoint(self, job: str, duration_s: float, pause_s: float, stored: int, deduplicated: int) -> None:
        """A committed checkpoint."""
        self.checkpoints.labels(job, "ok").inc()
        self.duration.observe(duration_s)
        self.pause.observe(pause_s)
        self.bytes.labels(job, "written").inc(stored + deduplicated)
        self.bytes.labels(job, "stored").inc(stored)
        self.bytes.labels(job, "deduplicated").inc(deduplicated)
        self.last.labels(job).set(time.time())

    def checkpoint_failed(self, job: str, error: BaseException) -> None:
        self.checkpoints.labels(job, result_of(error)).inc()

    def restart(self, job: str, error: BaseException | None = None) -> None:
        self.restarts.labels(job, result_of(error)).inc()

    def serve(self, address: str) -> str:
        """Serve /metrics on HOST:PORT (port 0: any free one); returns the address bound."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise CkptdError(Code.INVALID_ARGUMENT, f"--metrics wants HOST:PORT (e.g. 0.0.0.0:9464), not {address!r}")
        host = host.strip("[]") or "0.0.0.0"
        try:
            server, _thread = start_http_server(int(port), host, registry=self.registry)
        except OSError as e:
            raise CkptdError(Code.UNAVAILABLE, f"cannot serve metrics on {address}: {e.strerror}") from None
        bound = f"{host}:{server.server_port}"
        log.info("metrics on http://%s/metrics", bound)
        return bound
