"""Jobs as the coordinator knows them, persisted in $CKPTD_HOME/jobs/<job>.json.

The file holds the spec, the node and the last terminal state, so after a
reboot `ckptctl restart JOB` finds the job, and a job that had finished
still reads as finished.  Everything live comes from the agents' reports.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.agent.runtime import spec_from_json, spec_to_json

from ckptd import limits
from ckptd.errors import CkptdError, Code
from ckptd.jobstate import ENDED, JobState
from ckptd.paths import JobDir
from ckptd.v1 import ckptd_pb2 as pb

from .ranks import RankRecord, Target, aggregate, split_agent_job_name

log = logging.getLogger(__name__)

_ADJECTIVES = (
    "amber",
    "brisk",
    "calm",
    "deft",
    "eager",
    "fond",
    "glad",
    "keen",
    "lucid",
    "merry",
    "neat",
    "quiet",
)


def new_job_name() -> str:
    return f"{secrets.choice(_ADJECTIVES)}-{secrets.token_hex(3)}"


def check_name(name: str) -> None:
    limits.check_job_name(name)


def check_spec(spec: pb.JobSpec) -> None:
    """What LaunchJob accepts from a client (the CLI checks the same, but a
    client may call the RPC directly): a usable name, a command, an interval
    that cannot become a checkpoint storm, counts within bounds, and no NUL
    or '=' where the kernel would choke on it (INVALID_ARGUMENT)."""
    if spec.name:
        limits.check_job_name(spec.name)
    if not spec.argv:
        raise CkptdError(Code.INVALID_ARGUMENT, "no command to run; usage: ckptd launch [--job NAME] -- CMD [ARGS...]")
    limits.check_interval("--interval", spec.interval_s)
    for flag, value in (
        ("--keep", spec.keep_last),
        ("--keep-every", spec.keep_every),
        ("--full-every", spec.full_every),
    ):
        if value:  # 0: the default
            limits.in_range(flag, value, 1, limits.MAX_COUNT)
    if spec.nranks:
        limits.in_range("--ranks", spec.nranks, 1, limits.MAX_RANKS)
    if spec.HasField("umask") and spec.umask > 0o777:
        raise CkptdError(Code.INVALID_ARGUMENT, f"umask {spec.umask:o} is not a file mode mask (0-777)")
    if any("\0" in a for a in spec.argv) or any("\0" in s for s in (spec.cwd, spec.ckpt_dir, spec.shared_dir)):
        raise CkptdError(Code.INVALID_ARGUMENT, "a NUL byte in the command, its directory or a checkpoint directory")
    for key, value in spec.env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise CkptdError(Code.INVALID_ARGUMENT, f"invalid environment variable name or value {key[:64]!r}")


def check_checkpoint_timeout(timeout_s: float) -> None:
    """CheckpointRequest.timeout_s: 0 (the default) or a sane number of seconds."""
    if timeout_s:
        limits.in_range("--timeout", timeout_s, 0.001, limits.MAX_QUIESCE_S, "seconds")


@dataclass
class JobRecord:
    spec: pb.JobSpec
    node: str
    status: pb.JobStatus
    op_lock: threading.Lock = field(default_factory=threading.Lock)
    last_checkpoint_at: float = 0.0
    ranks: list[RankRecord] = field(default_factory=list)  # a multi-node job's; empty: a classic job
    vip_slot: int = 0
    last_auto_restart: float = 0.0
    auto_restarts: int = 0  # done by the AutoRestarter (--max-restarts)
    gave_up: bool = False  # it reached --max-restarts
    in_flight: pb.CheckpointInfo | None = None  # the round being written, until it commits or is discarded
    # the checkpoint the job's processes were last rebuilt from, until the
    # next one commits: their shims track its pages (ADOPT), so the next
    # checkpoint builds on it, the newest or not (CheckpointRound._parent)
    restored_from: str = ""

    def targets(self) -> list[Target]:
        if self.ranks:
            return [Target(f"{self.name}@{r.rank}", r.node, r) for r in self.ranks]
        return [Target(self.name, self.node, None)]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def job_dir(self) -> JobDir:
        """Where it checkpoints (with tiering: the stage)."""
        return JobDir.of(self.spec.ckpt_dir, self.spec.name)

    @property
    def shared_dir(self) -> JobDir | None:
        """With tiering, where its checkpoints are uploaded (coordinator/tiering.py)."""
        return JobDir.of(self.spec.shared_dir, self.spec.name) if self.spec.shared_dir else None


class JobRegistry:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._save_lock = threading.Lock()
        self.jobs: dict[str, JobRecord] = {}
        self._load()

    def _file(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def _load(self) -> None:
        for path in sorted(self.directory.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                spec = spec_from_json(json.dumps(data["spec"]))
            except (OSError, ValueError, KeyError) as e:
                log.warning("ignoring unreadable job record %s: %s", path, e)
                continue
            status = pb.JobStatus(name=spec.name, node=data.get("node", ""), spec=spec)
            last = data.get("last", {})
            ended = next((s for s in ENDED if s.value == last.get("state")), None)
            if ended is not None:
                status.state = ended.pb
                status.message = last.get("message", "")
                status.has_exit = True
                status.exit_code = int(last.get("exit_code", 0))
                status.exit_signal = int(last.get("exit_signal", 0))
            else:
                status.state = JobState.LOST.pb
                status.message = (
                    f"not running: its node or ckptd restarted; `ckptctl restart {spec.name}` "
                    "resumes it from its last checkpoint"
                )
            record = JobRecord(spec=spec, node=status.node, status=status, vip_slot=int(data.get("vip_slot", 0)))
            for r in data.get("ranks", []):
                rs = pb.JobStatus(name=f"{spec.name}@{r['rank']}", state=status.state, message=status.message)
                record.ranks.append(RankRecord(int(r["rank"]), str(r["node"]), str(r["vip"]), rs))
            self.jobs[spec.name] = record

    def save(self, record: JobRecord) -> None:
        last = {}
        if JobState.of(record.status.state).ended:
            last = {
                "state": JobState.of(record.status.state).value,
                "message": record.status.message,
                "exit_code": record.status.exit_code,
                "exit_signal": record.status.exit_signal,
            }
        data: dict[str, object] = {"spec": json.loads(spec_to_json(record.spec)), "node": record.node, "last": last}
        if record.ranks:
            data["ranks"] = [{"rank": r.rank, "node": r.node, "vip": r.vip} for r in record.ranks]
            data["vip_slot"] = record.vip_slot
        # callers hold the registry lock or not (a restart, a final checkpoint):
        # writes of one file take turns, each through its own temporary file
        with self._save_lock:
            tmp = self._file(record.name).with_suffix(f".tmp-{threading.get_ident()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self._file(record.name))

    def add(self, spec: pb.JobSpec, node: str, ranks: list[RankRecord] | None = None, vip_slot: int = 0) -> JobRecord:
        with self.lock:
            if spec.name in self.jobs:
                raise CkptdError(Code.ALREADY_EXISTS, f"job {spec.name} already exists; choose another --job name")
            record = JobRecord(
                spec=spec,
                node=node,
                status=pb.JobStatus(name=spec.name, state=JobState.STARTING.pb, node=node, spec=spec),
                ranks=ranks or [],
                vip_slot=vip_slot,
            )
            for r in record.ranks:
                r.status = pb.JobStatus(name=f"{spec.name}@{r.rank}", state=JobState.STARTING.pb, node=r.node)
            self.jobs[spec.name] = record
            self.save(record)
            return record

    def remove(self, name: str) -> None:
        with self.lock:
            self.jobs.pop(name, None)
            self._file(name).unlink(missing_ok=True)

    def used_vip_slots(self) -> set[int]:
        with self.lock:
            return {r.vip_slot for r in self.jobs.values() if r.vip_slot}

    def find(self, agent_job: str) -> tuple[JobRecord, RankRecord | None] | None:
        """The record an agent's job name belongs to ("<job>@<rank>" for a rank)."""
        job, rank = split_agent_job_name(agent_job)
        with self.lock:
            record = self.jobs.get(job if rank is not None else agent_job)
        if record is None:
            return None
        if rank is None:
            return (record, None) if not record.ranks else None
        for r in record.ranks:
            if r.rank == rank:
                return record, r
        return None

    def get(self, name: str) -> JobRecord:
        with self.lock:
            record = self.jobs.get(name)
            if record is not None:
                return record
            if name.isdigit():
                pid = int(name)
                for r in self.jobs.values():
                    if pid in r.status.pids and JobState.of(r.status.state).live:
                        return r
                raise CkptdError(
                    Code.NOT_FOUND,
                    f"process {pid} was not launched under ckptd (no job contains it); "
                    "start it with `ckptd launch -- COMMAND`",
                )
        raise CkptdError(Code.NOT_FOUND, f"unknown job {name!r}; `ckptctl jobs` lists the jobs")

    def all(self) -> list[JobRecord]:
        with self.lock:
            return sorted(self.jobs.values(), key=lambda r: r.spec.created)

    def update(self, record: JobRecord, status: pb.JobStatus, node: str, rank: RankRecord | None = None) -> None:
        """An agent's report of the job's (or one rank's) state.  A report of
        a live state is stale once the same incarnation (its generation) has
        been reported ended: StartJob's answer ("running") can arrive after
        the agent's report that a short job already exited, and taking it
        would leave the job running for ever to `ckptctl wait`."""
        with self.lock:
            old = rank.status if rank is not None else record.status
            if JobState.of(old.state).ended and JobState.of(status.state).live and old.generation == status.generation:
                return
            was_terminal = JobState.of(record.status.state).ended
            if rank is not None:
                rank.status = status
                rank.node = node
                status = aggregate(record.name, record.ranks)
                node = record.ranks[0].node
            record.status = status
            record.node = node
            if JobState.of(status.state).ended or was_terminal:
                self.save(record)
            self.changed.notify_all()

    def wait_change(self, timeout: float) -> None:
        with self.lock:
            self.changed.wait(timeout)


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
