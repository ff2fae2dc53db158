"""The Coordinator gRPC service: jobs, nodes, the catalog, and the protocols."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from ckptd.errors import CkptdError, Code
from ckptd.paths import Home, JobDir
from ckptd.rpc import call, rpc_method
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

from .barrier import CheckpointRound
from .catalog import Catalog
from .jobs import RUNNING, TERMINAL, JobRecord, JobRegistry, check_name, new_job_name, now_rfc3339
from .nodes import HEARTBEAT_S, NodeRegistry
from .policy import IntervalScheduler
from .restart import restart_job

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, home: Home) -> None:
        self.home = home
        self.registry = JobRegistry(home.jobs_dir)
        self.nodes = NodeRegistry()
        self.catalog = Catalog()
        self.scheduler = IntervalScheduler(self.registry, self.checkpoint)
        for record in self.registry.all():
            self.catalog.remove_stale(record.job_dir)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def _set_operation(self, record: JobRecord) -> Callable[[str], None]:
        def set_op(text: str) -> None:
            with self.registry.lock:
                record.status.operation = text
                self.registry.changed.notify_all()

        return set_op

    def checkpoint(self, record: JobRecord, timeout_s: float = 0.0) -> pb.CheckpointInfo:
        return CheckpointRound(record, self.nodes, self.catalog, timeout_s, self._set_operation(record)).run()

    def status(self, record: JobRecord) -> pb.JobStatus:
        st = pb.JobStatus()
        with self.registry.lock:
            st.CopyFrom(record.status)
        st.name = record.name
        st.node = record.node
        st.spec.CopyFrom(record.spec)
        st.log_path = str(record.job_dir.log)
        checkpoints = self.catalog.list(record.name, record.job_dir)
        st.checkpoints = len(checkpoints)
        if checkpoints:
            st.last_checkpoint.CopyFrom(checkpoints[-1])
        if st.state in RUNNING:
            try:
                node = self.nodes.get(record.node)
            except CkptdError:
                node = None
            if node is None or not node.alive:
                st.state = "lost"
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
        return st


_LIVE_FIELDS = ("state", "message", "pids", "processes", "generation", "has_exit", "exit_code", "exit_signal")


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, on_shutdown: Callable[[], None]) -> None:
        self.c = coordinator
        self.on_shutdown = on_shutdown

    # ---- agents ----

    @rpc_method
    def RegisterNode(self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext) -> pb.RegisterNodeResponse:
        self.c.nodes.register(request.node, request.address)
        log.info("node %s registered at %s", request.node, request.address)
        return pb.RegisterNodeResponse(heartbeat_s=HEARTBEAT_S)

    @rpc_method
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.c.nodes.heartbeat(request.node, request.health)
        return pb.Empty()

    @rpc_method
    def ReportJobEvent(self, request: pb.JobEvent, context: grpc.ServicerContext) -> pb.Empty:
        try:
            record = self.c.registry.get(request.status.name)
        except CkptdError:
            return pb.Empty()  # not ours (or forgotten)
        if record.node and record.node != request.node and request.status.state not in RUNNING:
            return pb.Empty()  # stale news from a node the job has left
        self.c.registry.update(record, request.status, request.node)
        return pb.Empty()

    # ---- jobs ----

    @rpc_method
    def LaunchJob(self, request: pb.LaunchJobRequest, context: grpc.ServicerContext) -> pb.LaunchJobResponse:
        spec = pb.JobSpec()
        spec.CopyFrom(request.spec)
        spec.name = spec.name or new_job_name()
        check_name(spec.name)
        spec.ckpt_dir = str(Path(spec.ckpt_dir or self.c.home.default_ckpt_dir).resolve())
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
        JobDir.of(spec.ckpt_dir, spec.name).path.mkdir(parents=True, exist_ok=True)
        record = self.c.registry.add(spec, node.name)
        assert node.stub is not None
        try:
            status = call(node.stub.StartJob, pb.StartJobRequest(spec=spec), 60, f"agent on {node.name}")
        except CkptdError:
            self.c.registry.remove(spec.name)
            raise
        self.c.registry.update(record, status, node.name)
        return pb.LaunchJobResponse(status=self.c.status(record), agent_address=node.address)

    @rpc_method
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[self.c.status(r) for r in self.c.registry.all()])

    @rpc_method
    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        return self.c.status(self.c.registry.get(request.job))

    @rpc_method
    def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        record = self.c.registry.get(request.job)
        return pb.ListCheckpointsResponse(checkpoints=self.c.catalog.list(record.name, record.job_dir))

    @rpc_method
    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointInfo:
        return self.c.checkpoint(self.c.registry.get(request.job), request.timeout_s)

    @rpc_method
    def Restart(self, request: pb.RestartRequest, context: grpc.ServicerContext) -> pb.RestartResponse:
        record = self.c.registry.get(request.job)
        resp = restart_job(record, self.c.registry, self.c.nodes, self.c.catalog, request)
        resp.status.CopyFrom(self.c.status(record))
        return resp

    def _agent_for(self, record: JobRecord) -> pb_grpc.AgentStub:
        node = self.c.nodes.get(record.node)
        if not node.alive or node.stub is None:
            raise CkptdError(Code.UNAVAILABLE, f"node {node.name} of job {record.name} is not answering")
        return node.stub

    @rpc_method
    def KillJob(self, request: pb.KillJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record = self.c.registry.get(request.job)
        status = self.c.status(record)
        if status.state not in RUNNING:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {record.name} is not running ({status.state})")
        agent = self._agent_for(record)
        st = call(agent.SignalJob, pb.SignalRequest(job=record.name, signal=9), 30, "agent")
        self.c.registry.update(record, st, record.node)
        return self.c.status(record)

    @rpc_method
    def SignalJob(self, request: pb.SignalRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record = self.c.registry.get(request.job)
        agent = self._agent_for(record)
        call(agent.SignalJob, request, 30, "agent")
        return self.c.status(record)

    @rpc_method
    def WaitJob(self, request: pb.WaitJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        record = self.c.registry.get(request.job)
        deadline = time.monotonic() + max(0.0, min(request.timeout_s or 30.0, 300.0))
        while context.is_active():
            status = self.c.status(record)
            changed = (status.state, status.generation) != (request.known_state, request.known_generation)
            if status.state in TERMINAL or changed:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return status
            self.c.registry.wait_change(min(left, 1.0))
        return self.c.status(record)

    @rpc_method
    def ListNodes(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        return pb.ListNodesResponse(nodes=self.c.nodes.describe())

    @rpc_method
    def Shutdown(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        threading.Thread(target=self.on_shutdown, daemon=True).start()
        return pb.Empty()
