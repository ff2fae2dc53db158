"""The Coordinator gRPC service: jobs, nodes, the catalog, and the protocols."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from ckptd.auth import Identity, Policy, Role
from ckptd.errors import STORAGE_ERRNOS, CkptdError, Code
from ckptd.image.transfer import CODECS
from ckptd.jobstate import RESTARTABLE, JobState
from ckptd.metrics import Metrics
from ckptd.paths import Home
from ckptd.rpc import call, rpc_method
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

from .barrier import CheckpointRound
from .catalog import Catalog
from .jobs import (
    JobRecord,
    JobRegistry,
    check_checkpoint_timeout,
    check_spec,
    new_job_name,
    now_rfc3339,
)
from .nodes import HEARTBEAT_S, NodeRegistry
from .policy import AutoRestarter, IntervalScheduler
from .ranks import (
    MAX_RANKS,
    RankRecord,
    agent_job_name,
    aggregate,
    each_rank,
    free_slot,
    on_every_rank,
    rank_spec,
    spread,
    vip,
)
from .restart import restart_job
from .tiering import Uploader, prune_shared

log = logging.getLogger(__name__)

UPLOAD_WAIT_S = 6 * 3600.0  # checkpoint --wait-shared: as long as the CLI waits


def check_tiers(spec: pb.JobSpec) -> None:
    if spec.compress not in CODECS:
        raise CkptdError(
            Code.INVALID_ARGUMENT, f"unknown compression {spec.compress!r}; use one of: zstd, auto (or leave it off)"
        )
    if not spec.shared_dir:
        if spec.compress:
            raise CkptdError(
                Code.INVALID_ARGUMENT,
                "compression applies to the shared tier: add --stage-dir FAST_DIR (checkpoints commit there "
                "first and are uploaded, compressed, to --ckpt-dir)",
            )
        return
    spec.shared_dir = str(Path(spec.shared_dir).resolve())
    if spec.shared_dir == spec.ckpt_dir:
        raise CkptdError(Code.INVALID_ARGUMENT, "--stage-dir and --ckpt-dir are the same directory; tiering needs two")


class Coordinator:
    def __init__(self, home: Home) -> None:
        self.home = home
        self.registry = JobRegistry(home.jobs_dir)
        self.nodes = NodeRegistry()
        self.catalog = Catalog()
        self.instance = secrets.token_hex(8)  # agents notice a restarted coordinator by it
        self.scheduler = IntervalScheduler(self.registry, self.checkpoint)
        self.auto_restarter = AutoRestarter(self)
        self.uploader = Uploader(self.catalog)
        self.metrics = Metrics()  # served by `--metrics` (ckptd/daemon.py)
        self.metrics.gauges.jobs = lambda: [JobState.of(r.status.state) for r in self.registry.all()]
        self.metrics.gauges.nodes = self._nodes_up
        for record in self.registry.all():
            # a round that a previous coordinator left half done is never committed
            self.catalog.remove_stale(record.job_dir)
            if record.shared_dir is not None:
                self.catalog.remove_stale(record.shared_dir)

    def _nodes_up(self) -> list[tuple[str, bool]]:
        with self.nodes.lock:
            return [(n.name, n.alive) for n in self.nodes.nodes.values()]

    def start(self) -> None:
        self.scheduler.start()
        self.auto_restarter.start()
        self.uploader.start()
        for record in self.registry.all():  # uploads a previous coordinator left undone
            self.uploader.submit(record)

    def stop(self) -> None:
        self.scheduler.stop()
        self.auto_restarter.stop()
        self.uploader.stop()

    def _set_operation(self, record: JobRecord) -> Callable[[str], None]:
        def set_op(text: str) -> None:
            with self.registry.lock:
                record.status.operation = text
                self.registry.changed.notify_all()

        return set_op

    def checkpoint(
        self, record: JobRecord, timeout_s: float = 0.0, then_stop: bool = False, wait_shared: bool = False
    ) -> pb.CheckpointInfo:
        # every checkpoint (ckptctl, the interval scheduler, a preemption) is decided here: counted here
        try:
            info = CheckpointRound(
                record, self.nodes, self.catalog, timeout_s, self._set_operation(record), then_stop=then_stop
            ).run()
        except BaseException as e:
            self.metrics.checkpoint_failed(record.name, e)
            raise
        self.metrics.checkpoint(record.name, info.duration_s, info.stall_s, info.size_bytes, info.dedup_bytes)
        if then_stop:
            self.registry.save(record)
        if record.shared_dir is None:
            return info
        self.uploader.submit(record)
        # a preempted node may not come back: its last checkpoint must reach the shared tier
        if wait_shared or then_stop:
            self.uploader.wait(record, info.name, UPLOAD_WAIT_S)
        for c in self.catalog.list_job(record):
            if c.name == info.name:
                return c
        return info

    def restart(self, record: JobRecord, request: pb.RestartRequest) -> pb.RestartResponse:
        try:  # every restart (ckptctl, the auto-restarter) is decided here: counted here
            resp = restart_job(record, self.registry, self.nodes, self.catalog, request, board=self.uploader.board)
        except BaseException as e:
            self.metrics.restart(record.name, e)
            raise
        self.metrics.restart(record.name)
        resp.status.CopyFrom(self.status(record))
        return resp

    def final_stop(self, record: JobRecord, why: str) -> None:
        """A final checkpoint, then the job stops (a dead launcher, the
        embedded daemon's SIGTERM under Slurm); killed if no checkpoint can
        be taken.  A checkpoint already in flight (the launcher's own) is
        waited for: the retries see the job stopped."""
        log.warning("job %s: %s: a final checkpoint, then the job stops", record.name, why)
        for attempt in range(5):
            if not JobState.of(self.status(record).state).live:
                return  # the launcher's own final checkpoint (or the job's end) got there first
            try:
                info = self.checkpoint(record, then_stop=True)
                log.info("job %s stopped after %s; `ckptd launch --resume` resumes it", record.name, info.name)
                return
            except CkptdError as e:
                log.warning("job %s: final checkpoint %d failed: %s", record.name, attempt + 1, e.message)
                time.sleep(2.0)  # a checkpoint in progress, a job still restoring
        if JobState.of(self.status(record).state).live:
            log.warning("job %s: no final checkpoint could be taken: killing it", record.name)
            for t in record.targets():
                try:
                    stub = self.nodes.live_stub(t.node, record.name)
                    st = call(stub.SignalJob, pb.SignalRequest(job=t.name, signal=9), 30, f"agent on {t.node}")
                    self.registry.update(record, st, t.node, t.rank)
                except CkptdError as e:
                    log.warning("job %s: cannot kill it on %s: %s", record.name, t.node, e.message)

    def _rank_status(self, rank: RankRecord) -> pb.JobStatus:
        with self.registry.lock:
            last = pb.JobStatus()
            last.CopyFrom(rank.status)
        try:
            return self.nodes.rank_status(last.name, rank.node, last)
        except CkptdError:
            return last

    def _multi_status(self, record: JobRecord) -> pb.JobStatus:
        ranks = record.ranks
        live = each_rank(self._rank_status, ranks)
        view = [RankRecord(r.rank, r.node, r.vip, st) for r, st in zip(ranks, live, strict=True)]
        st = aggregate(record.name, view)
        with self.registry.lock:
            st.operation = record.status.operation
            if not st.operation:
                st.ClearField("progress")
            if JobState.of(record.status.state).ended and not JobState.of(st.state).ended:
                st.state, st.message = record.status.state, record.status.message
        return st

    def status(self, record: JobRecord) -> pb.JobStatus:
        if record.ranks:
            st = self._multi_status(record)
            st.spec.CopyFrom(record.spec)
            st.log_path = str(record.job_dir.path / "rank-0" / "output.log")
            checkpoints = self.catalog.list_job(record)
            st.checkpoints = len(checkpoints)
            if checkpoints:
                st.last_checkpoint.CopyFrom(checkpoints[-1])
            return self._with_transfer(record, st)
        st = pb.JobStatus()
        with self.registry.lock:
            st.CopyFrom(record.status)
        st.name = record.name
        st.node = record.node
        st.spec.CopyFrom(record.spec)
        st.log_path = str(record.job_dir.log)
        try:
            checkpoints = self.catalog.list_job(record)
        except OSError as e:  # the job's state is known without its storage: say what is not
            if e.errno not in STORAGE_ERRNOS:
                raise
            checkpoints = []
            st.message = "; ".join(m for m in (st.message, f"checkpoint storage unreadable: {e.strerror}") if m)
        st.checkpoints = len(checkpoints)
        if checkpoints:
            st.last_checkpoint.CopyFrom(checkpoints[-1])
        if JobState.of(st.state).live:
            try:
                node = self.nodes.get(record.node)
            except CkptdError:
                node = None
            if node is None or not node.alive:
                st.state = JobState.LOST.pb
                st.message = f"node {record.node} is not answering"
                st.ClearField("pids")
                st.ClearField("processes")
            elif node.stub is not None:
                # live processes come from the agent, not from its last report
                with contextlib.suppress(CkptdError):
                    live = call(node.stub.GetJob, pb.AgentJobRequest(job=record.name), 5, f"agent on {node.name}")
                    operation = st.operation or live.operation
                    for field in _LIVE_FIELDS:
                        st.ClearField(field)
                        if field in ("pids", "processes"):
                            getattr(st, field).extend(getattr(live, field))
                        else:
                            setattr(st, field, getattr(live, field))
                    st.operation = operation
                    if operation and live.HasField("progress"):
                        st.progress.CopyFrom(live.progress)
        return self._with_transfer(record, st)

    def _with_transfer(self, record: JobRecord, st: pb.JobStatus) -> pb.JobStatus:
        """An upload or a restart's fetch shows as the job's operation while
        nothing else is going on."""
        transfer = self.uploader.board.get(record.name)
        if transfer is not None and not st.operation:
            st.operation = transfer[0]
            st.progress.CopyFrom(transfer[1])
        return st


_LIVE_FIELDS = ("state", "message", "pids", "processes", "generation", "has_exit", "exit_code", "exit_signal")


def shown(st: pb.JobStatus, who: Identity, show_env: bool = False) -> pb.JobStatus:
    """A status as a caller sees it: the environment (tokens, keys) only when
    asked for, and only its owner's own."""
    if not (show_env and (who.local or st.spec.owner == who.name)):
        st.spec.ClearField("env")
    return st


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """Every method first asks the policy who calls (ckptd/auth.py): nodes
    may only speak for themselves, users only act on their own jobs."""

    def __init__(self, coordinator: Coordinator, on_shutdown: Callable[[], None], policy: Policy) -> None:
        self.c = coordinator
        self.on_shutdown = on_shutdown
        self.policy = policy

    def _node(self, context: grpc.ServicerContext, node: str) -> None:
        who = self.policy.require(context, Role.NODE, "a node's registration, heartbeat or report")
        if not who.local and who.name != node:
            raise CkptdError(Code.PERMISSION_DENIED, f"the certificate of node {who.name} cannot speak for node {node}")

    def _job(self, context: grpc.ServicerContext, job: str) -> tuple[JobRecord, Identity]:
        """The job a user asks about, if it is theirs (or they are an admin)."""
        who = self.policy.require(context, Role.USER, "acting on a job")
        record = self.c.registry.get(job)
        self.policy.require_owner(context, record.spec.owner, record.name)
        return record, who

    # ---- agents ----

    @rpc_method
    def RegisterNode(self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext) -> pb.RegisterNodeResponse:
        self._node(context, request.node)
        self.c.nodes.register(request.node, request.address, request.ip, request.health)
        log.info("node %s registered at %s (ip %s)", request.node, request.address, request.ip or "-")
        return pb.RegisterNodeResponse(heartbeat_s=HEARTBEAT_S, instance=self.c.instance)

    @rpc_method
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._node(context, request.node)
        self.c.nodes.heartbeat(request.node, request.health)
        return pb.Empty()

    @rpc_method
    def ReportJobEvent(self, request: pb.JobEvent, context: grpc.ServicerContext) -> pb.Empty:
        self._node(context, request.node)
        found = self.c.registry.find(request.status.name)
        if found is None:
            return pb.Empty()  # not ours (or forgotten)
        record, rank = found
        node = rank.node if rank is not None else record.node
        if node and node != request.node and not JobState.of(request.status.state).live:
            return pb.Empty()  # stale news from a node the job (or rank) has left
        if rank is not None and node != request.node:
            return pb.Empty()  # a rank the coordinator has placed elsewhere
        self.c.registry.update(record, request.status, request.node, rank)
        if (request.launcher_gone or request.sigterm) and (rank is None or rank.rank == 0):  # the launcher's rank
            st = self.c.status(record)  # the incarnation the launcher followed, still live: not a later restart
            if JobState.of(st.state).live and st.generation == request.status.generation:
                why = "its launcher is gone" if request.launcher_gone else "a process of the job got SIGTERM"
                threading.Thread(target=self.c.final_stop, args=(record, why), daemon=True).start()
        return pb.Empty()

    # ---- jobs ----

    @rpc_method
    def LaunchJob(self, request: pb.LaunchJobRequest, context: grpc.ServicerContext) -> pb.LaunchJobResponse:
        who = self.policy.require(context, Role.USER, "launching a job")
        spec = pb.JobSpec()
        spec.CopyFrom(request.spec)
        spec.owner = who.name  # never the client's word
        if request.as_user:
            if not who.admin:
                raise CkptdError(Code.PERMISSION_DENIED, f"--as-user is for admins; {who.name} is not one")
            spec.owner = request.as_user
        spec.name = spec.name or new_job_name()
        check_spec(spec)
        if request.replace_ended:
            self._replace_ended(context, spec.name)
        spec.ckpt_dir = str(Path(spec.ckpt_dir or self.c.home.default_ckpt_dir).resolve())
        check_tiers(spec)
        spec.created = spec.created or now_rfc3339()
        if request.node:
            node = self.c.nodes.get(request.node)
            if not node.alive:
                raise CkptdError(Code.UNAVAILABLE, f"node {request.node} is not answering")
        else:
            live = self.c.nodes.live()
            if not live:
                raise CkptdError(Code.UNAVAILABLE, "no agent is running; start one with `ckptd agent`")
            node = min(live, key=lambda n: sum(1 for r in self.c.registry.all() if r.node == n.name))
        if spec.nranks or spec.nodes:
            resp = self._launch_ranks(spec)
            shown(resp.status, who)
            return resp
        record = self.c.registry.add(spec, node.name)
        assert node.stub is not None
        try:
            self._refuse_kept_checkpoints(record)
            status = call(node.stub.StartJob, pb.StartJobRequest(spec=spec), 60, f"agent on {node.name}")
        except CkptdError:
            self.c.registry.remove(spec.name)
            raise
        self.c.registry.update(record, status, node.name)
        return pb.LaunchJobResponse(
            status=shown(self.c.status(record), who), agent_address=node.address, agent_job=spec.name
        )

    def _refuse_kept_checkpoints(self, record: JobRecord) -> None:
        """A fresh job whose checkpoint directory already holds checkpoints:
        those of an earlier job of this name, kept by `ckptctl rm
        --keep-checkpoints`.  The new job would list them as its own, resume
        from them, build its incremental images on them: refused."""
        kept = self.c.catalog.list_job(record)
        if kept:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"job {record.name}: {record.job_dir.path} holds {len(kept)} checkpoint(s) of an earlier job "
                f"{record.name} (kept by `ckptctl rm --keep-checkpoints`); move them away, or launch it under "
                "another name or --ckpt-dir",
            )

    def _launch_ranks(self, spec: pb.JobSpec) -> pb.LaunchJobResponse:
        """A multi-node job: its ranks spread over the chosen (or live) nodes."""
        live = [n.name for n in self.c.nodes.live()]
        nodes = [n for entry in spec.nodes for n in entry.split(",") if n]
        for n in nodes:
            if n not in live:
                raise CkptdError(Code.UNAVAILABLE, f"node {n} is not answering; `ckptctl nodes` lists the live ones")
        nodes = nodes or sorted(live)
        if not nodes:
            raise CkptdError(Code.UNAVAILABLE, "no agent is running; start one with `ckptd agent`")
        spec.nranks = spec.nranks or len(nodes)
        if spec.nranks > MAX_RANKS:
            raise CkptdError(Code.INVALID_ARGUMENT, f"at most {MAX_RANKS} ranks per job")
        slot = free_slot(self.c.registry.used_vip_slots(), str(self.c.home.root))
        ranks = [RankRecord(r, n, vip(slot, r)) for r, n in enumerate(spread(spec.nranks, nodes))]
        record = self.c.registry.add(spec, ranks[0].node, ranks, slot)
        ips = self.c.nodes.ips()

        def start(rank: RankRecord) -> pb.JobStatus:
            stub = self.c.nodes.live_stub(rank.node, spec.name)
            return call(
                stub.StartJob,
                pb.StartJobRequest(spec=rank_spec(spec, ranks, rank, ips)),
                60,
                f"agent on {rank.node}",
            )

        def kill(rank: RankRecord) -> object:
            stub = self.c.nodes.live_stub(rank.node, spec.name)
            return call(
                stub.SignalJob, pb.SignalRequest(job=agent_job_name(spec.name, rank.rank), signal=9), 30, "agent"
            )

        try:
            started = on_every_rank(ranks, start, kill)
        except CkptdError:
            self.c.registry.remove(spec.name)
            raise
        for r, st in zip(ranks, started, strict=True):
            self.c.registry.update(record, st, r.node, r)
        node0 = self.c.nodes.get(ranks[0].node)
        log.info("job %s: %d ranks on %s", spec.name, len(ranks), ", ".join(r.node for r in ranks))
        return pb.LaunchJobResponse(
            status=self.c.status(record), agent_address=node0.address, agent_job=f"{spec.name}@0"
        )

    @rpc_method
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        who = self.policy.require(context, Role.USER, "listing jobs")
        mine = [r for r in self.c.registry.all() if who.owns(r.spec.owner)]
        return pb.ListJobsResponse(jobs=[shown(self.c.status(r), who, request.show_env) for r in mine])

    @rpc_method
    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record, who = self._job(context, request.job)
        return shown(self.c.status(record), who, request.show_env)

    @rpc_method
    def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        record, _ = self._job(context, request.job)
        in_flight = record.in_flight
        return pb.ListCheckpointsResponse(
            checkpoints=self.c.catalog.list_job(record),
            in_progress=[in_flight] if in_flight is not None else [],
        )

    @rpc_method
    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointInfo:
        record, _ = self._job(context, request.job)
        check_checkpoint_timeout(request.timeout_s)
        if request.wait_shared and record.shared_dir is None:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"job {record.name} has no shared tier to wait for (launch it with --stage-dir to have one)",
            )
        return self.c.checkpoint(record, request.timeout_s, request.then_stop, request.wait_shared)

    @rpc_method
    def Restart(self, request: pb.RestartRequest, context: grpc.ServicerContext) -> pb.RestartResponse:
        record, who = self._job(context, request.job)
        resp = self.c.restart(record, request)
        shown(resp.status, who)
        return resp

    @rpc_method
    def KillJob(self, request: pb.KillJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record, who = self._job(context, request.job)
        status = self.c.status(record)
        state = JobState.of(status.state)
        if not state.live and state not in RESTARTABLE:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {record.name} is not running ({state})")
        errors = []
        for t in record.targets():
            try:
                stub = self.c.nodes.live_stub(t.node, record.name)
                st = call(stub.SignalJob, pb.SignalRequest(job=t.name, signal=9), 30, f"agent on {t.node}")
                self.c.registry.update(record, st, t.node, t.rank)
            except CkptdError as e:
                if e.code is not Code.NOT_FOUND:
                    errors.append(e)
        if errors and not record.ranks:
            raise errors[0]
        return shown(self.c.status(record), who)

    @rpc_method
    def RemoveJob(self, request: pb.RemoveJobRequest, context: grpc.ServicerContext) -> pb.RemoveJobResponse:
        """`ckptctl rm`: the job's record and, unless keep_checkpoints, its
        checkpoints (stage and shared tier); its log and every file it wrote
        stay.  A live job is refused: it would run on unmanaged."""
        record, _ = self._job(context, request.job)
        if not record.op_lock.acquire(blocking=False):
            raise CkptdError(
                Code.ABORTED, f"a checkpoint or restart of job {record.name} is in progress; remove it when it is done"
            )
        try:
            state = JobState.of(self.c.status(record).state)
            if state.live:
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"job {record.name} is {state}: stop it first (`ckptctl kill {record.name}`)",
                )
            removed: list[str] = []
            if not request.keep_checkpoints:
                for d in (record.job_dir, record.shared_dir):
                    if d is not None:
                        removed += self.c.catalog.remove_all(d)
            self.c.registry.remove(record.name)
        finally:
            record.op_lock.release()
        log.info("job %s removed (checkpoints removed: %s)", record.name, ", ".join(removed) or "none")
        return pb.RemoveJobResponse(removed=removed)

    @rpc_method
    def Prune(self, request: pb.PruneRequest, context: grpc.ServicerContext) -> pb.ListCheckpointsResponse:
        record, _ = self._job(context, request.job)
        if not request.keep_last and not request.keep_every:
            raise CkptdError(Code.INVALID_ARGUMENT, "say what to keep: --keep N and/or --keep-every K")
        if not record.op_lock.acquire(blocking=False):
            raise CkptdError(
                Code.ABORTED, f"a checkpoint or restart of job {record.name} is in progress; prune when it is done"
            )
        try:
            removed = self.c.catalog.prune(record.name, record.job_dir, request.keep_last, request.keep_every)
            removed += prune_shared(record, self.c.catalog, request.keep_last, request.keep_every)
        finally:
            record.op_lock.release()
        log.info("job %s: pruned %s", record.name, ", ".join(removed) or "nothing")
        return pb.ListCheckpointsResponse(checkpoints=self.c.catalog.list_job(record))

    @rpc_method
    def SignalJob(self, request: pb.SignalRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record, who = self._job(context, request.job)
        for t in record.targets():
            stub = self.c.nodes.live_stub(t.node, record.name)
            call(stub.SignalJob, pb.SignalRequest(job=t.name, signal=request.signal), 30, f"agent on {t.node}")
        return shown(self.c.status(record), who)

    @rpc_method
    def WaitJob(self, request: pb.WaitJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record, who = self._job(context, request.job)
        deadline = time.monotonic() + max(0.0, min(request.timeout_s or 30.0, 300.0))
        while context.is_active():
            status = self.c.status(record)
            changed = (status.state, status.generation) != (request.known_state, request.known_generation)
            if JobState.of(status.state).ended or changed:
                return shown(status, who)
            left = deadline - time.monotonic()
            if left <= 0:
                return shown(status, who)
            self.c.registry.wait_change(min(left, 1.0))
        return shown(self.c.status(record), who)

    def _replace_ended(self, context: grpc.ServicerContext, name: str) -> None:
        """launch --resume found no checkpoint: an ended job of this name
        (stopped or failed before its first checkpoint) gives way to a fresh one."""
        try:
            record = self.c.registry.get(name)
        except CkptdError as e:
            if e.code is Code.NOT_FOUND:
                return
            raise
        self.policy.require_owner(context, record.spec.owner, record.name)
        state = JobState.of(self.c.status(record).state)
        if state.live:
            raise CkptdError(
                Code.FAILED_PRECONDITION, f"job {name} is {state}: it cannot be launched again while it runs"
            )
        if self.c.catalog.list_job(record):
            raise CkptdError(
                Code.FAILED_PRECONDITION, f"job {name} has a checkpoint now: `ckptd launch --resume` restarts from it"
            )
        log.info("job %s (%s, no checkpoint) replaced by a fresh launch", name, state)
        self.c.registry.remove(name)

    @rpc_method
    def ListNodes(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        self.policy.caller(context)  # any authenticated identity
        return pb.ListNodesResponse(nodes=self.c.nodes.describe())

    @rpc_method
    def Shutdown(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        who = self.policy.caller(context)
        if not who.admin:
            raise CkptdError(Code.PERMISSION_DENIED, f"only an admin may shut the coordinator down, not {who}")
        threading.Thread(target=self.on_shutdown, daemon=True).start()
        return pb.Empty()
