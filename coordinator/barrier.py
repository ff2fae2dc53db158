"""The checkpoint round (barrier protocol v2), driven by the coordinator.

A job is one or more targets: a classic job's single process tree, or the
ranks of a multi-node job, each on its node's agent.  Every phase runs on
all targets in parallel and completes on all before the next one starts;
an agent gets one Agent.Steps request per phase holding a step for each of
its node's targets (RankStep):

    0 reserve   next id; create <job dir>/.ckpt-N.tmp-XXXX (fails early on
                read-only or missing storage, before the job is touched)
      ready     the job still runs: every rank checks the storage's free
                space, has its processes read their memory maps early
                (PREMAP) and decides whether their pages fit a writer's
                copy on write (step ready), so that no rank's pause waits
                for another's reads on a shared core; the stall starts after
    1 prepare   every rank quiesces: all its processes parked (step prepare)
    2 drain     every rank lets its unsent TCP bytes leave into its parked
                peers' receive queues (step drain); connections between
                ranks are also saved in repair mode, whole, so any byte
                still in flight is replayed exactly once.  Sent only if
                some rank's prepare found unsent bytes: parked processes
                write nothing, so where there are none, none can move
    3 dump      every rank writes its images into <tmp>/rank-R (a classic
                job: <tmp>) in parallel, with its output log position
    4 resume    the job runs again (step resume); the stall ends here.
                With then_stop (preemption) the ranks stay parked instead
    5 finalize  checksums, identities, fsync (step finalize)
    6 commit    every rank's manifest, then the job's manifest.json, fsynced;
                then the directory is renamed to ckpt-N: atomic, and only
                now visible.  With then_stop the ranks are stopped now

Abort at any step, on any rank's failure or timeout: step abort on every
rank (release parked threads), remove the temporary directory.  The last
committed checkpoint is never touched.  A failure marked transient (a
passing state: CkptdError.transient, from the shim's ERROR retry=1 or a
process that exited meanwhile) runs the whole round again after a short
backoff, within the checkpoint's own timeout; the manifest records how many
attempts it took, and a round that never succeeds says how many it made
and the last cause.  A coordinator that dies mid-round
leaves only a temporary directory, which the next one removes; its agents
notice its absence (or its new instance id) and release their parked ranks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from ckptd import faults
from ckptd.errors import CkptdError, Code
from ckptd.image.checksum import ALGORITHM
from ckptd.image.manifest import Chain, Manifest, Phase, RankEntry, RankPart, Sizes, load_manifest, write_manifest
from ckptd.jobstate import JobState
from ckptd.rpc import AgentStub, call_many
from ckptd.v1 import ckptd_pb2 as pb

from .catalog import Catalog, info_from_manifest, storage_error
from .jobs import JobRecord, now_rfc3339
from .nodes import NodeRegistry
from .ranks import Target
from .steps import Sent, on_nodes

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
DEFAULT_QUIESCE_TIMEOUT_S = 10.0
LONG_RPC_S = 6 * 3600.0
# a round that failed on a passing state (CkptdError.transient: descriptors
# in flight between two processes, a connection not yet accepted, a process
# that exits or forks faster than it can be parked) is aborted, the job runs
# on for a moment, and the round starts again: after these delays, then once
# a second, for as long as the checkpoint's quiesce timeout (at least
# RETRY_FOR_S) allows.  Any other failure is final at once
RETRY_DELAYS_S = (0.2, 0.5, 1.0)
RETRY_FOR_S = 10.0
# an incremental checkpoint builds on the newest committed one; a full one
# starts a new chain at least this often, so that a restore never reads
# more than this many checkpoints (JobSpec.full_every overrides it)
DEFAULT_FULL_EVERY = 16
# threads writing (and fsyncing) the ranks' manifests at the commit
COMMIT_WRITERS = 16


def dedup_role(dedup: bool, t: Target) -> pb.DedupRole:
    """launch --dedup: rank 0's writers say how far they have written, the
    other ranks' writers leave out what rank 0's hold (native/shim/writeout_dedup.c)."""
    if not dedup or t.rank is None:
        return pb.DEDUP_ROLE_NONE
    return pb.DEDUP_ROLE_SOURCE if t.rank.rank == 0 else pb.DEDUP_ROLE_COMPARE


class CheckpointRound:
    def __init__(
        self,
        record: JobRecord,
        nodes: NodeRegistry,
        catalog: Catalog,
        timeout_s: float,
        set_operation: Callable[[str], None],
        *,
        then_stop: bool = False,
    ) -> None:
        self.record = record
        self.nodes = nodes
        self.catalog = catalog
        self.timeout_s = timeout_s or DEFAULT_QUIESCE_TIMEOUT_S
        self.set_operation = set_operation
        self.then_stop = then_stop
        self.sent = Sent()  # the last phase's requests (_on_all)

    def run(self) -> pb.CheckpointInfo:
        record = self.record
        if not record.op_lock.acquire(blocking=False):
            raise CkptdError(
                Code.ABORTED,
                f"a checkpoint or restart of job {record.name} is already in progress; retry when it is done",
            )
        try:
            start = time.monotonic()
            until = start + max(self.timeout_s, RETRY_FOR_S)
            attempt = 0
            while True:
                attempt += 1
                try:
                    return self._run(attempt)
                except CkptdError as e:
                    if not e.transient:
                        log.warning("job %s: checkpoint failed: %s", record.name, e.message)  # the operator's record
                        raise
                    delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S)) - 1]
                    if time.monotonic() + delay > until:
                        message = (
                            f"{e.message} (the checkpoint was tried {attempt} times in "
                            f"{time.monotonic() - start:.0f} s and the job runs on; a longer --timeout waits longer)"
                        )
                        log.warning("job %s: checkpoint failed: %s", record.name, message)
                        raise CkptdError(e.code, message) from None
                    log.info("job %s: round aborted on a passing state, trying again: %s", record.name, e.message)
                    self.set_operation(f"checkpoint: trying again ({e.message})")
                    time.sleep(delay)
        finally:
            record.in_flight = None
            self.set_operation("")
            record.op_lock.release()

    def _on_all(
        self, stubs: dict[Target, AgentStub], step: str, make: Callable[[Target], Any], timeout: float
    ) -> dict[Target, Any]:
        """One phase on every target at once, one request per node
        (steps.on_nodes); the first failure (by rank) is raised after all
        have answered, naming the rank."""
        targets = list(stubs)
        answers, self.sent = on_nodes(
            [(t.node, stubs[t]) for t in targets],
            step,
            lambda i: make(targets[i]),
            timeout,
            # an agent that stops (or whose host freezes) fails the round once its heartbeats stop,
            # not after the phase's timeout (hours for a dump): the other ranks are parked meanwhile
            lambda node: self.nodes.stopped_answering(node, f"agent on {node}", step),
        )
        for t, a in zip(targets, answers, strict=True):
            if isinstance(a, CkptdError):
                prefix = f"{t.label}: " if self.record.ranks else ""
                raise CkptdError(a.code, prefix + a.message, transient=a.transient) from None
        return dict(zip(targets, answers, strict=True))

    def _run(self, attempt: int = 1) -> pb.CheckpointInfo:
        record, job = self.record, self.record.name
        targets = record.targets()
        stubs = {t: self.nodes.live_stub(t.node, job) for t in targets}
        states = self._on_all(stubs, "get_job", lambda t: pb.AgentJobRequest(job=t.name), 10)
        for t, status in states.items():
            if status.state != JobState.RUNNING.pb:
                where = f" ({t.label})" if record.ranks else ""
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"job {job}{where} is {JobState.of(status.state)}, not running; nothing to checkpoint",
                )

        t0 = time.monotonic()
        job_dir = record.job_dir
        parent, parent_depth = self._parent()
        ckpt_id = self.catalog.next_id(job_dir)
        if record.shared_dir is not None:  # ids stay unique across both tiers
            try:
                ckpt_id = max(ckpt_id, self.catalog.next_id(record.shared_dir))
            except OSError as e:  # the shared tier's trouble is the upload's to report
                log.warning("job %s: cannot list the shared tier: %s", job, e)
        name = job_dir.checkpoint(ckpt_id).name
        tmp = self.catalog.create_tmp(job_dir, ckpt_id)
        record.in_flight = pb.CheckpointInfo(
            job=job, id=ckpt_id, name=name, path=str(tmp), created=now_rfc3339(), parent=parent,
            node=",".join(sorted({t.node for t in targets})),
        )  # fmt: skip
        dirs = {t: (tmp / f"rank-{t.rank.rank}" if t.rank else tmp) for t in targets}
        for d in dirs.values():
            d.mkdir(exist_ok=True)
        faults.point("reserve", "coordinator")
        timings: dict[str, float] = {}
        parked: dict[Target, AgentStub] = {}
        # each phase's time at the coordinator and inside the slowest agent:
        # what the protocol itself costs, apart from the ranks' own work.
        # Phases are back to back, so they add up to total_s
        phases: list[Phase] = []
        mark = [t0]

        def close(name: str, local_s: float = 0.0, sent: bool = False) -> None:
            now = time.monotonic()
            p = Phase(name=name, rpc_s=now - mark[0], local_s=local_s)
            if sent:  # where the phase's requests (_on_all) spent the protocol's time
                p.issue_s, p.wire_s, p.requests = self.sent.issue_s, self.sent.wire_s, self.sent.requests
                p.busy_s = self.sent.busy_s(mark[0], now)
            phases.append(p)
            mark[0] = now

        close("reserve")

        def phase(key: str, text: str, make: Callable[[Target], Any], timeout: float) -> dict[Target, Any]:
            self.set_operation(f"checkpoint {ckpt_id}: {text}")
            replies = self._on_all(stubs, key, make, timeout)
            local_s = max((float(r.local_s) for r in replies.values()), default=0.0)
            close(key, local_s, sent=True)
            timings[f"{key}_s" if key != "prepare" else "quiesce_s"] = phases[-1].rpc_s
            faults.point(key, "coordinator")
            return replies

        def request(t: Target) -> pb.ResumeRequest:
            return pb.ResumeRequest(job=t.name, checkpoint_id=ckpt_id)

        def prepare(t: Target) -> pb.PrepareRequest:
            return pb.PrepareRequest(
                job=t.name, checkpoint_id=ckpt_id, timeout_s=self.timeout_s, dir=str(dirs[t]), incremental=bool(parent)
            )

        try:
            # the job still runs: each rank's checks and early reads, once for all (agent ready)
            phase("ready", "getting ready", prepare, self.timeout_s + 30)
            t_pause, first = mark[0], len(phases)  # the stall's phases: phases[first:]
            parked = dict(stubs)  # an abort releases every rank, parked or not
            prep = phase("prepare", "quiescing", prepare, self.timeout_s + 30)
            if all(r.drained for r in prep.values()):
                # nothing unsent in any parked process: no step to send
                # (PrepareResponse.drained); the phase is recorded, empty
                close("drain")
                timings["drain_s"] = phases[-1].rpc_s
                faults.point("drain", "coordinator")
            else:
                phase("drain", "draining bytes in flight", request, 60)
            dumps = phase(
                "dump",
                "writing",
                lambda t: pb.DumpRequest(
                    job=t.name,
                    checkpoint_id=ckpt_id,
                    dir=str(dirs[t]),
                    parent=parent,
                    name=name,
                    part=f"rank-{t.rank.rank}" if t.rank else "",
                    # rank 0's pages are compared as they are written; the others' own,
                    # where their writers could not compare, after them (ckptd/image/dedup.py)
                    keep_cached=bool(record.spec.dedup and t.rank and t.rank.rank != 0),
                    dedup=dedup_role(record.spec.dedup, t),
                ),
                LONG_RPC_S,
            )
            if not self.then_stop:
                phase("resume", "resuming", request, 60)
                parked = {}
            else:
                close("resume")  # none: the ranks stay parked until stopped
            timings["stall_s"] = mark[0] - t_pause  # as seen from outside: an upper bound
            # the stall in which no rank was at its own work (Phase.busy_s)
            timings["protocol_s"] = max(0.0, timings["stall_s"] - sum(p.busy_s for p in phases[first:]))
            # the stall less the slowest rank's own time in each phase: as if
            # every rank had a core of its own (before 2026-11-29, protocol_s)
            timings["protocol_slowest_s"] = max(0.0, timings["stall_s"] - sum(p.local_s for p in phases[first:]))
            # with --dedup, ranks other than 0 store only what rank 0's images do not hold
            rank0 = next((t for t in targets if t.rank and t.rank.rank == 0), None)

            def finalize(t: Target) -> pb.FinalizeRequest:
                req = pb.FinalizeRequest(job=t.name, checkpoint_id=ckpt_id, dir=str(dirs[t]))
                if record.spec.dedup and rank0 is not None and t is not rank0:
                    req.dedup_with = str(dirs[rank0])
                    req.dedup_with_final = f"{name}/{dirs[rank0].name}"
                return req

            parts = phase("finalize", "checksums and fsync", finalize, LONG_RPC_S)
            self.set_operation(f"checkpoint {ckpt_id}: committing")
            rank_parts = {t: RankPart.from_json(json.loads(p.manifest_part_json)) for t, p in parts.items()}
            timings["total_s"] = time.monotonic() - t0  # the ranks' manifests: the round up to finalize
            try:
                manifest = self._manifest(
                    ckpt_id=ckpt_id,
                    targets=targets,
                    prep=prep,
                    dumps=dumps,
                    parts=rank_parts,
                    dirs=dirs,
                    timings=timings,
                    phases=phases,
                    attempts=attempt,
                )
                # the commit up to here (every rank's manifest); the job's own
                # manifest and the rename, one file each, cannot time themselves
                close("commit")
                timings["total_s"] = mark[0] - t0
                manifest.timings = dict(timings)
                manifest.phases = list(phases)
                # deduplicated images name this checkpoint's own rank 0: not a dependency
                depends = sorted({d for p in rank_parts.values() for d in p.depends_on} - {name})
                manifest.chain = Chain(
                    parent=parent if depends else "", depends_on=depends, depth=parent_depth + 1 if depends else 0
                )
                write_manifest(tmp, manifest.to_json())
            except OSError as e:  # the storage failed under the manifests: a storage error, not an internal one
                raise storage_error(e, job_dir.path) from e
            faults.point("commit", "coordinator")
            final = self.catalog.commit(tmp, job_dir, ckpt_id)
        except BaseException:
            record.in_flight = None
            if parked:
                self._abort(parked, ckpt_id)
            self.catalog.discard(tmp)
            raise
        record.in_flight = None
        record.restored_from = ""  # the shims track this one now
        if self.then_stop:
            self._stop(stubs, final.name)
        spec = record.spec
        if spec.keep_last or spec.keep_every:  # retention, still under the job's lock: no restart reads them
            removed = self.catalog.prune(job, job_dir, spec.keep_last, spec.keep_every)
            if removed:
                log.info("job %s: retention removed %s", job, ", ".join(removed))
        record.last_checkpoint_at = time.monotonic()
        info = info_from_manifest(job, final)
        log.info(
            "job %s: committed %s (%d bytes, stall %.3f s, total %.3f s)%s",
            job, final.name, info.size_bytes, timings["stall_s"], timings["total_s"],
            " and stopped" if self.then_stop else "",
        )  # fmt: skip
        return info

    def _parent(self) -> tuple[str, int]:
        """The checkpoint the next one builds on and its chain depth, or
        ("", 0) when the next checkpoint should be a full one: the newest
        committed one, or the one the job was restarted from since (an
        older one, `restart --from`), whose images its shims track.  Under
        the job's lock, which a prune also takes: it is not removed before
        this round has committed, and then the round depends on it."""
        record = self.record
        full_every = record.spec.full_every or DEFAULT_FULL_EVERY
        newest = self.catalog.newest(record.job_dir)
        if record.restored_from and newest is not None and newest[0] != record.restored_from:
            try:
                newest = record.restored_from, load_manifest(record.job_dir.path / record.restored_from)
            except CkptdError as e:  # gone since (removed by hand): a full one
                log.warning("job %s: %s", record.name, e.message)
                return "", 0
        if newest is None or newest[1] is None or full_every <= 1:
            return "", 0
        chain = newest[1].get("chain") or {}
        depth = chain.get("depth", 0) if isinstance(chain, dict) else 0
        if depth + 1 >= full_every:
            return "", 0
        return newest[0], int(depth)

    def _manifest(
        self,
        *,
        ckpt_id: int,
        targets: list[Target],
        prep: dict[Target, Any],
        dumps: dict[Target, Any],
        parts: dict[Target, RankPart],
        dirs: dict[Target, Path],
        timings: dict[str, float],
        phases: list[Phase],
        attempts: int,
    ) -> Manifest:
        """The checkpoint's manifest.  A multi-rank job's ranks' own manifests
        are written here, in parallel; they hold the round up to finalize."""
        record = self.record
        timings = dict(timings)
        phases = list(phases)

        def one(t: Target) -> Manifest:
            dump = dumps[t]
            return Manifest(
                job=t.name,
                id=ckpt_id,
                created=now_rfc3339(),
                node=t.node,
                protocol=PROTOCOL_VERSION,
                timings=timings,
                phases=phases,
                sizes=Sizes(
                    pages_bytes=sum(p.pages_bytes for p in dump.processes),
                    ref_bytes=sum(p.ref_bytes for p in dump.processes),
                    core_bytes=sum(p.core_bytes for p in dump.processes),
                    files_bytes=sum(p.files_bytes for p in dump.processes),
                    dedup_bytes=parts[t].dedup_bytes,
                ),
                spec={"argv": list(record.spec.argv), "cwd": record.spec.cwd, "env": dict(record.spec.env)},
                threads=prep[t].threads,
                output={"log_bytes": dump.log_bytes, "index_bytes": dump.index_bytes},
                part=parts[t],
                attempts=attempts,
            )

        if not record.ranks:
            return one(targets[0])
        # each rank's directory is a whole single-rank checkpoint of its own
        # (an agent restores it alone); the job's manifest lists them
        job = Manifest(
            job=record.name,
            id=ckpt_id,
            created=now_rfc3339(),
            node=",".join(sorted({t.node for t in targets})),
            protocol=PROTOCOL_VERSION,
            timings=timings,
            sizes=Sizes(),
            attempts=attempts,
        )

        def write(t: Target) -> tuple[Manifest, bytes]:
            m = one(t)
            return m, write_manifest(dirs[t], m.to_json())

        # each write waits on its own fsyncs: together, not one after another
        with ThreadPoolExecutor(max_workers=min(len(targets), COMMIT_WRITERS)) as pool:
            written = list(pool.map(write, targets))
        for t, (m, data) in zip(targets, written, strict=True):
            assert t.rank is not None
            sub = dirs[t].name
            job.ranks.append(RankEntry(rank=t.rank.rank, node=t.node, vip=t.rank.vip, dir=sub))
            job.files.extend(dict(f, path=f"{sub}/{f['path']}") for f in parts[t].files)
            entry = {"path": f"{sub}/manifest.json", "size": len(data), ALGORITHM: xxhash.xxh3_128_hexdigest(data)}
            job.files.append(entry)
            job.sizes.add(m.sizes)
            job.processes.extend(dataclasses.replace(p, rank=t.rank.rank) for p in parts[t].processes)
        return job

    def _abort(self, parked: dict[Target, AgentStub], ckpt_id: int) -> None:
        # every rank at once, and each node waited for (up to 60 s) even if its
        # heartbeats stopped: an agent that was stopped and goes on must find
        # its ranks released.  A failure is the agent's to log (its
        # coordinator-gone watch releases them)
        targets = list(parked)
        answers, _ = on_nodes(
            [(t.node, parked[t]) for t in targets],
            "abort",
            lambda i: pb.ResumeRequest(job=targets[i].name, checkpoint_id=ckpt_id),
            60,
        )
        for t, a in zip(parked, answers, strict=True):
            if isinstance(a, CkptdError):
                log.info("job %s: abort of checkpoint %d on %s: %s", self.record.name, ckpt_id, t.label, a.message)

    def _stop(self, stubs: dict[Target, AgentStub], name: str) -> None:
        reason = f"stopped after its final checkpoint {name}; `ckptctl restart {self.record.name}` resumes it"
        call_many(
            [
                (stub, "Stop", pb.StopRequest(job=t.name, reason=reason), 60, f"agent on {t.node}")
                for t, stub in stubs.items()
            ]
        )
