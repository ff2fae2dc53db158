"""The Agent gRPC service: what the coordinator and `ckptd launch` call on a node."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import grpc

from ckptd import limits
from ckptd.auth import Policy, Role
from ckptd.errors import CkptdError, Code
from ckptd.jobstate import LIVE
from ckptd.rpc import answer_error, rpc_method
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

from .node import AgentNode
from .output import LogFollower
from .runtime import JobRuntime

log = logging.getLogger(__name__)


class AgentService(pb_grpc.AgentServicer):
    """Only the coordinator drives a node (ckptd/auth.py); a job's owner may
    also read its status and output and signal it (`ckptd launch` follows
    its job here)."""

    def __init__(self, node: AgentNode, policy: Policy) -> None:
        self.node = node
        self.policy = policy
        # a Steps request's steps run side by side, as many as a job has ranks
        # (a round's steps on one node may wait for each other: --dedup);
        # threads are started as needed and kept
        self._pool = ThreadPoolExecutor(max_workers=limits.MAX_RANKS, thread_name_prefix="ckptd-step")

    def _coordinator(self, context: grpc.ServicerContext) -> None:
        self.policy.require(context, Role.COORDINATOR, "driving a node")

    def _own(self, context: grpc.ServicerContext, name: str) -> JobRuntime:
        job = self.node.get(name)
        self.policy.require_owner(context, job.spec.owner, name)
        return job

    def _shown(self, context: grpc.ServicerContext, st: pb.JobStatus) -> pb.JobStatus:
        """A user sees no environment here (the coordinator shows it to its owner with --show-env)."""
        if not self.policy.caller(context).has(Role.COORDINATOR):
            st.spec.ClearField("env")
        return st

    @rpc_method
    def StartJob(self, request: pb.StartJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        self._coordinator(context)
        return self.node.start_job(request.spec).status()

    @rpc_method
    def GetJob(self, request: pb.AgentJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        return self._shown(context, self.node.job_status(self._own(context, request.job)))

    @rpc_method
    def ListJobs(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.AgentJobList:
        self._coordinator(context)
        return pb.AgentJobList(jobs=self.node.statuses())

    @rpc_method
    def FollowOutput(self, request: pb.FollowOutputRequest, context: grpc.ServicerContext) -> Iterator[pb.OutputChunk]:
        job = self._own(context, request.job)
        follower = LogFollower(job.job_dir.log, job.job_dir.index, request.offset)
        generation = job.generation

        def running() -> bool:
            # a launch follows one incarnation; `logs -f` follows restarts too
            if not context.is_active():
                return False
            if not request.follow:
                return False
            return job.state in LIVE and (request.across_restarts or job.generation == generation)

        ended = False

        def dropped() -> None:  # the RPC is over: a guarding launcher that went away mid-stream (kill -9)?
            if not ended and job.state in LIVE and job.generation == generation:
                self.node.launcher_gone(job)  # the job must not run on unmanaged

        # the launcher's SIGTERM policy, for the SIGTERMs its job's processes hold (native/shim/sigterm.c)
        release = job.term_policy(request.hold_sigterm) if request.guard else (lambda: None)
        if request.guard:
            context.add_callback(dropped)
            context.add_callback(release)
        try:
            for chunk in follower.follow(running):
                yield pb.OutputChunk(stream=chunk.stream, data=chunk.data, offset=chunk.offset)
        finally:
            release()
        ended = True
        yield pb.OutputChunk(end=True, status=self._shown(context, job.status()), offset=follower.offset)

    @rpc_method
    def SignalJob(self, request: pb.SignalRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        job = self._own(context, request.job)
        if request.signal == 9:
            job.kill()
            job.wait_ended(10)
        else:
            job.signal(request.signal)
        return self._shown(context, job.status())

    # ---- the barrier protocol ----
    # Each phase of a round (and a restart's release of its held ranks) is a
    # step, sent in one Steps request with the node's other targets' steps
    # (coordinator/steps.py).

    def _get_job(self, request: pb.AgentJobRequest) -> pb.JobStatus:
        return self.node.job_status(self.node.get(request.job))

    def _ready(self, request: pb.PrepareRequest) -> pb.PhaseResponse:
        t0 = time.monotonic()
        job = self.node.get(request.job)
        self.node.checkpointer.ready(
            job, request.checkpoint_id, request.timeout_s or 10.0, request.dir, check_space=not request.incremental
        )
        local_s = time.monotonic() - t0
        job.fault("ready")
        return pb.PhaseResponse(local_s=local_s)

    def _prepare(self, request: pb.PrepareRequest) -> pb.PrepareResponse:
        t0 = time.monotonic()
        job = self.node.get(request.job)
        reply = self.node.checkpointer.prepare(
            job, request.checkpoint_id, request.timeout_s or 10.0, request.dir, check_space=not request.incremental
        )
        reply.local_s = time.monotonic() - t0
        job.fault("prepare")
        if reply.drained:  # and the drain with it: no drain step will come for this rank
            job.fault("drain")
        return reply

    def _drain(self, request: pb.ResumeRequest) -> pb.PhaseResponse:
        t0 = time.monotonic()
        job = self.node.get(request.job)
        self.node.checkpointer.drain(job)
        local_s = time.monotonic() - t0
        job.fault("drain")
        return pb.PhaseResponse(local_s=local_s)

    def _dump(self, request: pb.DumpRequest) -> pb.DumpResponse:
        t0 = time.monotonic()
        job = self.node.get(request.job)
        reply = self.node.checkpointer.dump(job, request)
        reply.local_s = time.monotonic() - t0
        job.fault("dump")
        return reply

    def _resume(self, request: pb.ResumeRequest) -> pb.PhaseResponse:
        t0 = time.monotonic()
        job = self.node.get(request.job)
        if not self.node.release(job):  # a rank held after its restore, or a checkpoint's pause
            self.node.checkpointer.resume(job)
            job.fault("resume")
        return pb.PhaseResponse(local_s=time.monotonic() - t0)

    def _abort(self, request: pb.ResumeRequest) -> pb.Empty:
        try:
            job = self.node.get(request.job)
        except CkptdError:
            return pb.Empty()
        if job.name in self.node.held:  # a held restore that will not go on: it must not run alone
            self.node.held.pop(job.name, None)
            job.kill(requested=False)  # failed, like the restart: a new one can be tried
            job.wait_ended(10)
            return pb.Empty()
        self.node.checkpointer.abort(job, request.checkpoint_id)
        return pb.Empty()

    def _finalize(self, request: pb.FinalizeRequest) -> pb.FinalizeResponse:
        t0 = time.monotonic()
        job = self.node.get(request.job)
        part = self.node.manifest_part(job, request)
        local_s = time.monotonic() - t0
        job.fault("finalize")
        return pb.FinalizeResponse(manifest_part_json=json.dumps(part.to_json()), local_s=local_s)

    # RankStep's and StepReply's field names
    _STEPS: ClassVar[dict[str, Callable[[AgentService, Any], Any]]] = {
        "get_job": _get_job,
        "ready": _ready,
        "prepare": _prepare,
        "drain": _drain,
        "dump": _dump,
        "resume": _resume,
        "finalize": _finalize,
        "abort": _abort,
    }

    @rpc_method
    def Steps(self, request: pb.StepsRequest, context: grpc.ServicerContext) -> pb.StepsReply:
        """Every step at once: the first on this RPC's own thread (a node
        with one rank hands nothing over), the others on the step pool."""
        received = time.monotonic()
        self._coordinator(context)
        steps = list(request.steps)
        later = [self._pool.submit(self._step, step) for step in steps[1:]]
        replies = [self._step(step) for step in steps[:1]]
        replies += [f.result() for f in later]
        return pb.StepsReply(replies=replies, received=received, answered=time.monotonic())

    def _step(self, step: pb.RankStep) -> pb.StepReply:
        kind = step.WhichOneof("step")
        began = time.monotonic()
        try:
            if kind is None:  # a field this agent does not know
                raise CkptdError(
                    Code.INVALID_ARGUMENT,
                    f"node {self.node.node} was sent a step it does not know: its agent and the coordinator "
                    "are different versions of ckptd; run one version on every node",
                )
            return pb.StepReply(**{kind: self._STEPS[kind](self, getattr(step, kind))}, began=began)
        except Exception as e:
            err = answer_error(kind or "Steps", e)
            return pb.StepReply(error=pb.StepError(code=err.code.name, message=err.message, transient=err.transient))

    @rpc_method
    def Stop(self, request: pb.StopRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        """End a job for good after its final checkpoint (preemption)."""
        self._coordinator(context)
        job = self.node.get(request.job)
        self.node.checkpointer.forget(job)
        self.node.held.pop(job.name, None)
        job.kill(request.reason or "stopped")
        job.wait_ended(10)
        return job.status()

    @rpc_method
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        self._coordinator(context)
        checkpoint = Path(request.checkpoint_dir)
        if not checkpoint.is_dir():
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"node {self.node.node} cannot see {checkpoint}: checkpoint storage must be shared by every node",
            )
        return self.node.restore(
            request.spec, checkpoint, request.allow_changed_files, request.hold, request.lazy
        ).status()

    @rpc_method
    def Health(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.NodeHealth:
        self._coordinator(context)
        return self.node.health()
