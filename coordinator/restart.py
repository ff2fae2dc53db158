"""Restarting a job from a committed checkpoint, on its node or another."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ckptd.errors import CkptdError, Code
from ckptd.image.manifest import load_manifest
from ckptd.jobstate import JobState
from ckptd.rpc import call
from ckptd.v1 import ckptd_pb2 as pb

from .barrier import LONG_RPC_S
from .catalog import Catalog
from .jobs import JobRecord, JobRegistry
from .nodes import Node, NodeRegistry
from .ranks import RankRecord, agent_job_name, aggregate, apply_placement, each_rank, on_every_rank, rank_spec
from .steps import on_nodes
from .tiering import TransferBoard, fetch_chain

log = logging.getLogger(__name__)

KILL_WAIT_S = 15.0
OP_WAIT_S = 60.0


def _choose_checkpoint(record: JobRecord, catalog: Catalog, from_id: int) -> pb.CheckpointInfo:
    checkpoints = [c for c in catalog.list_job(record) if c.created != "corrupt" or from_id]
    if not checkpoints:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"job {record.name} has no checkpoint to restart from; "
            f"take one with `ckptctl checkpoint {record.name}` while it runs",
        )
    names = {c.name for c in checkpoints}

    def missing(c: pb.CheckpointInfo) -> list[str]:
        return [d for d in c.depends_on if d not in names]

    if from_id:
        for c in checkpoints:
            if c.id == from_id:
                if missing(c):
                    raise CkptdError(
                        Code.DATA_LOSS,
                        f"checkpoint {c.name} of job {record.name} builds on {', '.join(missing(c))}, which "
                        f"{'is' if len(missing(c)) == 1 else 'are'} missing (deleted by hand?); restart from "
                        f"another with --from (`ckptctl list {record.name}` shows them)",
                    )
                return c
        raise CkptdError(
            Code.NOT_FOUND,
            f"job {record.name} has no checkpoint {from_id}; `ckptctl list {record.name}` shows them",
        )
    for c in reversed(checkpoints):
        if not missing(c):
            return c
        log.warning("job %s: skipping %s: it builds on missing %s", record.name, c.name, ", ".join(missing(c)))
    raise CkptdError(
        Code.DATA_LOSS,
        f"every checkpoint of job {record.name} builds on one that is missing (deleted by hand?); "
        "nothing to restart from",
    )


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
    if not JobState.of(status.state).live:
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
    *,
    board: TransferBoard,
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
        checkpoint = fetch_chain(record, catalog, checkpoint, board)  # with a shared tier, what the stage lacks
        # whole and authentic before anything is stopped or touched (the agent checks it all again)
        load_manifest(Path(checkpoint.path))
        if record.ranks:
            if request.lazy:
                raise CkptdError(
                    Code.INVALID_ARGUMENT,
                    f"job {record.name} has {len(record.ranks)} ranks; --lazy restarts single-node jobs only",
                )
            status = _restart_ranks(record, registry, nodes, checkpoint, request)
            record.restored_from = checkpoint.name
            return pb.RestartResponse(status=status, checkpoint=checkpoint, duration_s=time.monotonic() - t0)
        if not request.node and request.placement:
            request.node = request.placement[0]
        _stop_if_alive(record, nodes, request.force)
        node = _choose_node(record, nodes, request.node)
        assert node.stub is not None
        with registry.lock:
            record.status.operation = f"restart from {checkpoint.name} on {node.name}"
        status = nodes.call_while_alive(  # an agent that hangs fails the restart, not after hours
            node,
            node.stub.Restore,
            pb.RestoreRequest(
                spec=record.spec,
                checkpoint_dir=checkpoint.path,
                allow_changed_files=request.allow_changed_files,
                lazy=request.lazy,
            ),
            LONG_RPC_S,
            what=f"agent on {node.name}",
            doing=f"during the restart of job {record.name}",
        )
        registry.update(record, status, node.name)
        registry.save(record)
        record.restored_from = checkpoint.name
        return pb.RestartResponse(status=status, checkpoint=checkpoint, duration_s=time.monotonic() - t0)
    finally:
        with registry.lock:
            record.status.operation = ""
        record.op_lock.release()


def _stop_ranks(record: JobRecord, nodes: NodeRegistry, force: bool) -> set[str]:
    """A job whose ranks all run is only restarted with force; one that lost a
    rank cannot go on, and its surviving ranks are stopped first."""

    def now(r: RankRecord) -> pb.JobStatus:
        return nodes.rank_status(agent_job_name(record.name, r.rank), r.node, r.status)

    live = {r.rank: st for r, st in zip(record.ranks, each_rank(now, record.ranks), strict=True)}
    view = [RankRecord(r.rank, r.node, r.vip, live[r.rank]) for r in record.ranks]
    job = aggregate(record.name, view)
    unreachable = {r.node for r in view if r.status.state == JobState.LOST.pb and r.status.message}
    running = [r for r in view if JobState.of(r.status.state).live]
    if not running:
        return unreachable
    if JobState.of(job.state).live and not force:
        where = ", ".join(f"rank {r.rank} on {r.node}" for r in running)
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"job {record.name} is still running ({where}); stop it first or pass --force",
        )

    def stop(r: RankRecord) -> None:
        node = nodes.get(r.node)
        assert node.stub is not None
        log.info("restart: stopping rank %d of job %s on %s", r.rank, record.name, r.node)
        call(
            node.stub.SignalJob,
            pb.SignalRequest(job=agent_job_name(record.name, r.rank), signal=9),
            KILL_WAIT_S + 10,
            f"agent on {r.node}",
        )

    each_rank(stop, running)
    return unreachable


def _restart_ranks(
    record: JobRecord,
    registry: JobRegistry,
    nodes: NodeRegistry,
    checkpoint: pb.CheckpointInfo,
    request: pb.RestartRequest,
) -> pb.JobStatus:
    """Every rank from the same checkpoint: rebuilt on its node with its link
    down and its processes parked; once all are rebuilt, links up and run."""
    manifest = load_manifest(Path(checkpoint.path))
    saved = {int(r["rank"]): r for r in manifest.get("ranks", [])}
    if sorted(saved) != [r.rank for r in record.ranks]:
        raise CkptdError(
            Code.DATA_LOSS,
            f"{checkpoint.name} holds ranks {sorted(saved)}, but job {record.name} has {len(record.ranks)}",
        )
    unreachable = _stop_ranks(record, nodes, request.force)
    placement = list(request.placement) + ([request.node] if request.node else [])
    live = [n.name for n in nodes.live() if n.name not in unreachable]
    busy: dict[str, int] = {}
    for other in registry.all():
        if other is not record:
            for t in other.targets():
                busy[t.node] = busy.get(t.node, 0) + 1
    where = apply_placement(record.ranks, placement, live, busy)
    ranks = [
        RankRecord(
            r.rank,
            where[r.rank],
            r.vip,
            pb.JobStatus(name=agent_job_name(record.name, r.rank), state=JobState.RESTORING.pb),
        )
        for r in record.ranks
    ]
    ips = nodes.ips()
    with registry.lock:
        # from now on the agents' reports about these ranks come from the new nodes
        record.ranks = ranks
        record.node = ranks[0].node
        record.status.operation = f"restart from {checkpoint.name} on " + ", ".join(f"{r.rank}={r.node}" for r in ranks)

    def restore(r: RankRecord) -> pb.JobStatus:
        stub = nodes.live_stub(r.node, record.name)
        try:
            return nodes.call_while_alive(  # an agent that hangs fails the restart, not after hours
                nodes.get(r.node),
                stub.Restore,
                pb.RestoreRequest(
                    spec=rank_spec(record.spec, ranks, r, ips),
                    checkpoint_dir=str(Path(checkpoint.path) / saved[r.rank]["dir"]),
                    allow_changed_files=request.allow_changed_files,
                    hold=True,
                ),
                LONG_RPC_S,
                what=f"agent on {r.node}",
                doing=f"during the restart of job {record.name}",
            )
        except CkptdError as e:
            raise CkptdError(e.code, f"rank {r.rank} on {r.node}: {e.message}") from None

    def release(rs: list[RankRecord], step: str) -> None:
        """step resume (run) or abort (end) on held ranks, one request per node (steps.on_nodes)."""
        answers, _ = on_nodes(
            [(r.node, nodes.live_stub(r.node, record.name)) for r in rs],
            step,
            lambda i: pb.ResumeRequest(job=agent_job_name(record.name, rs[i].rank)),
            60,
        )
        for r, a in zip(rs, answers, strict=True):
            if isinstance(a, CkptdError):
                raise CkptdError(a.code, f"rank {r.rank} on {r.node}: {a.message}") from None

    on_every_rank(ranks, restore, lambda r: release([r], "abort"))
    # every rank is rebuilt: links up and run, all together
    release(ranks, "resume")
    statuses = each_rank(lambda r: nodes.rank_status(agent_job_name(record.name, r.rank), r.node, r.status), ranks)
    for r, st in zip(ranks, statuses, strict=True):
        registry.update(record, st, r.node, r)
    registry.save(record)
    log.info(
        "job %s restarted from %s: %s", record.name, checkpoint.name, ", ".join(f"{r.rank}={r.node}" for r in ranks)
    )
    return record.status
