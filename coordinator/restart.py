"""Restarting a job from a committed checkpoint, on its node or another."""

from __future__ import annotations

import logging
import time

from ckptd.errors import CkptdError, Code
from ckptd.rpc import call
from ckptd.v1 import ckptd_pb2 as pb

from .barrier import LONG_RPC_S
from .catalog import Catalog
from .jobs import JobRecord, JobRegistry
from .nodes import Node, NodeRegistry

log = logging.getLogger(__name__)

KILL_WAIT_S = 15.0
OP_WAIT_S = 60.0


def _choose_checkpoint(record: JobRecord, catalog: Catalog, from_id: int) -> pb.CheckpointInfo:
    checkpoints = [c for c in catalog.list(record.name, record.job_dir) if c.created != "corrupt" or from_id]
    if not checkpoints:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"job {record.name} has no checkpoint to restart from; "
            f"take one with `ckptctl checkpoint {record.name}` while it runs",
        )
    if from_id:
        for c in checkpoints:
            if c.id == from_id:
                return c
        raise CkptdError(
            Code.NOT_FOUND,
            f"job {record.name} has no checkpoint {from_id}; `ckptctl list {record.name}` shows them",
        )
    return checkpoints[-1]


def _stop_if_alive(record: JobRecord, nodes: NodeRegistry, force: bool) -> None:
    try:
        node = nodes.get(record.node)
    except CkptdError:
        return  # its node is gone, and the job with it
    if not node.alive or node.stub is None:
        return
    try:
        status = call(node.stub.GetJob, pb.AgentJobRequest(job=record.name), 10, f"agent on {node.name}")
    except CkptdError as e:
        if e.code is Code.NOT_FOUND:
            return
        raise
    if status.state not in ("starting", "running", "checkpointing", "restoring"):
        return
    if not force:
        pids = " ".join(str(p) for p in status.pids)
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"job {record.name} is still running on {node.name} (pids {pids}); stop it first or pass --force",
        )
    log.info("restart --force: killing job %s on %s", record.name, node.name)
    call(
        node.stub.SignalJob,
        pb.SignalRequest(job=record.name, signal=9),
        KILL_WAIT_S + 10,
        f"agent on {node.name}",
    )


def _choose_node(record: JobRecord, nodes: NodeRegistry, wanted: str) -> Node:
    if wanted:
        node = nodes.get(wanted)
        if not node.alive:
            raise CkptdError(Code.UNAVAILABLE, f"node {wanted} is not answering; choose another with --on")
        return node
    live = nodes.live()
    for n in live:
        if n.name == record.node:
            return n
    if not live:
        raise CkptdError(Code.UNAVAILABLE, "no live node to restart on; start an agent (`ckptd agent`)")
    return live[0]


def restart_job(
    record: JobRecord,
    registry: JobRegistry,
    nodes: NodeRegistry,
    catalog: Catalog,
    request: pb.RestartRequest,
) -> pb.RestartResponse:
    # a checkpoint in flight (a periodic one, say) ends quickly once the job
    # is dead: wait for it rather than refuse
    if not record.op_lock.acquire(timeout=OP_WAIT_S):
        raise CkptdError(
            Code.ABORTED, f"a checkpoint or restart of job {record.name} is still in progress after {OP_WAIT_S:.0f} s"
        )
    try:
        t0 = time.monotonic()
        checkpoint = _choose_checkpoint(record, catalog, request.from_id)
        _stop_if_alive(record, nodes, request.force)
        node = _choose_node(record, nodes, request.node)
        assert node.stub is not None
        with registry.lock:
            record.status.operation = f"restart from {checkpoint.name} on {node.name}"
        status = call(
            node.stub.Restore,
            pb.RestoreRequest(
                spec=record.spec,
                checkpoint_dir=checkpoint.path,
                allow_changed_files=request.allow_changed_files,
            ),
            LONG_RPC_S,
            f"agent on {node.name}",
        )
        registry.update(record, status, node.name)
        registry.save(record)
        return pb.RestartResponse(status=status, checkpoint=checkpoint, duration_s=time.monotonic() - t0)
    finally:
        with registry.lock:
            record.status.operation = ""
        record.op_lock.release()
