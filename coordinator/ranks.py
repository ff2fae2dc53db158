"""Multi-node jobs: ranks, their placement on nodes, and their addresses.

A job launched with --ranks or --nodes is N process trees ("ranks").  Each
rank runs in its own network namespace with a virtual IP that belongs to
the rank, not to the node: 10.213.S.(R+1) for rank R of the job in address
slot S.  The agents route every rank's /32 to the node that hosts it, so a
rank restarted on another node keeps its address, and its peers' TCP
connections to it are rebuilt unchanged (ARCHITECTURE.md, "Multi-node").

A classic job (no --ranks) has no RankRecord: one tree, the node's network.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ckptd import limits
from ckptd.errors import CkptdError, Code
from ckptd.jobstate import ENDED, JobState
from ckptd.v1 import ckptd_pb2 as pb

VIP_PREFIX = "10.213"
MAX_RANKS = limits.MAX_RANKS
MAX_SLOTS = 255


@dataclass
class RankRecord:
    rank: int
    node: str
    vip: str
    status: pb.JobStatus = field(default_factory=pb.JobStatus)


@dataclass(frozen=True, eq=False)  # hashed by identity: a key for one round's replies
class Target:
    """One agent-side job the coordinator drives: a rank, or a classic job."""

    name: str  # the job's name on the agent ("<job>@<rank>" for a rank)
    node: str
    rank: RankRecord | None

    @property
    def label(self) -> str:
        return f"rank {self.rank.rank} on {self.node}" if self.rank else f"node {self.node}"


T = TypeVar("T")
R = TypeVar("R")
# ranks a coordinator works on at once (a thread each): a round's or a
# restart's per-rank calls go out together rather than one after another
RANK_FAN_OUT = 64


def each_rank(do: Callable[[R], T], items: list[R]) -> list[T]:
    """do(item) for every item at once (at most RANK_FAN_OUT at a time), in
    order; the first exception is raised once all have ended."""
    if len(items) <= 1:
        return [do(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(len(items), RANK_FAN_OUT)) as pool:
        return list(pool.map(do, items))


def on_every_rank(
    ranks: list[RankRecord], do: Callable[[RankRecord], T], undo: Callable[[RankRecord], object]
) -> list[T]:
    """do(rank) on every rank at once.  All or none: if any fails, undo the
    ranks where it succeeded (no rank may run without the others) and raise
    the first error."""
    with ThreadPoolExecutor(max_workers=min(len(ranks), RANK_FAN_OUT)) as pool:
        futures = [pool.submit(do, r) for r in ranks]
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            for r, f in zip(ranks, futures, strict=True):
                if f.exception() is None:
                    with contextlib.suppress(CkptdError):
                        undo(r)
            raise errors[0]
    return [f.result() for f in futures]


def agent_job_name(job: str, rank: int) -> str:
    return f"{job}@{rank}"


def split_agent_job_name(name: str) -> tuple[str, int | None]:
    job, sep, rank = name.rpartition("@")
    if sep and rank.isdigit():
        return job, int(rank)
    return name, None


def vip(slot: int, rank: int) -> str:
    return f"{VIP_PREFIX}.{slot}.{rank + 1}"


def free_slot(used: set[int], home: str = "") -> int:
    """The first slot this coordinator does not use, looking from a place
    its home picks: two coordinators on one machine (two users' homes, the
    tests' parallel workers) rarely hand out the same addresses, whose
    routes would then send one job's packets to the other's ranks."""
    start = zlib.crc32(home.encode()) % MAX_SLOTS if home else 0
    for k in range(MAX_SLOTS):
        slot = 1 + (start + k) % MAX_SLOTS
        if slot not in used:
            return slot
    raise CkptdError(Code.RESOURCE_EXHAUSTED, f"all {MAX_SLOTS} address slots are taken; remove finished jobs")


def spread(nranks: int, nodes: list[str]) -> list[str]:
    """Rank r on nodes[r % len(nodes)]."""
    return [nodes[r % len(nodes)] for r in range(nranks)]


def rank_spec(spec: pb.JobSpec, ranks: list[RankRecord], rank: RankRecord, node_ips: dict[str, str]) -> pb.JobSpec:
    """The spec one agent runs: the job's, named for the rank, with the
    whole job's current placement."""
    out = pb.JobSpec()
    out.CopyFrom(spec)
    out.name = agent_job_name(spec.name, rank.rank)
    out.rank.job = spec.name
    out.rank.rank = rank.rank
    out.rank.vip = rank.vip
    out.rank.hostname = f"{spec.name}-{rank.rank}"[:63]
    for r in ranks:
        out.rank.ranks.append(pb.RankAddress(rank=r.rank, vip=r.vip, node=r.node, node_ip=node_ips.get(r.node, "")))
    out.env["CKPTD_RANK"] = str(rank.rank)
    out.env["CKPTD_NRANKS"] = str(len(ranks))
    out.env["CKPTD_RANK_ADDRS"] = ",".join(r.vip for r in ranks)
    out.env["CKPTD_MASTER_ADDR"] = ranks[0].vip
    return out


def apply_placement(
    ranks: list[RankRecord], placement: list[str], live: list[str], busy: dict[str, int]
) -> dict[int, str]:
    """Where each rank goes on a restart.  `placement` entries are NODE (the
    ranks are spread over these) or RANK=NODE.  Ranks not named stay on
    their node while it is live, else go to the least busy live node."""
    chosen: dict[int, str] = {}
    spread_over: list[str] = []
    by_rank = {r.rank: r for r in ranks}
    for entry in placement:
        for raw in entry.split(","):
            part = raw.strip()
            if not part:
                continue
            if "=" in part:
                rank_text, _, node_name = part.partition("=")
                if not rank_text.strip().isdigit() or int(rank_text) not in by_rank:
                    raise CkptdError(
                        Code.INVALID_ARGUMENT,
                        f"--on {part}: the job has ranks 0 to {len(ranks) - 1}; use RANK=NODE or NODE",
                    )
                chosen[int(rank_text)] = node_name.strip()
            else:
                spread_over.append(part)
    for node in [*chosen.values(), *spread_over]:
        if node not in live:
            raise CkptdError(Code.UNAVAILABLE, f"node {node} is not answering; `ckptctl nodes` lists the live ones")
    if spread_over:
        unnamed = [r for r in ranks if r.rank not in chosen]
        for rr, target in zip(unnamed, spread(len(unnamed), spread_over), strict=True):
            chosen[rr.rank] = target
    if not live:
        raise CkptdError(Code.UNAVAILABLE, "no live node to restart on; start an agent (`ckptd agent`)")
    load = dict(busy)
    for node in chosen.values():
        load[node] = load.get(node, 0) + 1
    for rec in ranks:
        if rec.rank in chosen:
            continue
        if rec.node in live:
            chosen[rec.rank] = rec.node
        else:
            chosen[rec.rank] = min(live, key=lambda n: (load.get(n, 0), n))
        load[chosen[rec.rank]] = load.get(chosen[rec.rank], 0) + 1
    return chosen


def aggregate(job: str, ranks: list[RankRecord]) -> pb.JobStatus:
    """One state for the whole job from its ranks' states."""
    st = pb.JobStatus(name=job)
    states = [JobState.of(r.status.state) for r in ranks]
    for r in ranks:
        st.ranks.append(
            pb.RankStatus(
                rank=r.rank,
                node=r.node,
                vip=r.vip,
                state=JobState.of(r.status.state).pb,
                message=r.status.message,
                pids=list(r.status.pids),
            )
        )
        st.pids.extend(r.status.pids)
        st.processes.extend(r.status.processes)
        if r.status.HasField("progress"):  # the job's transfer is every rank's together
            st.progress.done += r.status.progress.done
            st.progress.total += r.status.progress.total
            st.progress.what = st.progress.what or r.status.progress.what
    st.generation = max((r.status.generation for r in ranks), default=0)
    st.node = ranks[0].node if ranks else ""

    def first(state: JobState) -> RankRecord:
        return next(r for r, s in zip(ranks, states, strict=True) if s is state)

    if all(s is JobState.EXITED for s in states):
        st.state = JobState.EXITED.pb
        failed = [r for r in ranks if r.status.exit_code or r.status.exit_signal]
        last = failed[0] if failed else ranks[0]
        st.has_exit, st.exit_code, st.exit_signal = True, last.status.exit_code, last.status.exit_signal
        st.message = last.status.message
    elif all(s is JobState.STOPPED for s in states):
        st.state, st.message = JobState.STOPPED.pb, ranks[0].status.message
    elif all(s in ENDED for s in states):
        st.state, st.message = JobState.KILLED.pb, "killed by `ckptctl kill`"
    elif JobState.LOST in states:
        r = first(JobState.LOST)
        st.state = JobState.LOST.pb
        st.message = f"rank {r.rank} on node {r.node}: {r.status.message or 'not answering'}"
    elif JobState.FAILED in states:
        r = first(JobState.FAILED)
        st.state = JobState.FAILED.pb
        st.message = f"rank {r.rank} on node {r.node}: {r.status.message}"
    elif any(s in ENDED for s in states):
        # some ranks ended and others did not: the job cannot go on as it is
        r, ended = next((r, s) for r, s in zip(ranks, states, strict=True) if s in ENDED)
        if all(s.live for s in states if s is not JobState.EXITED) and ended is JobState.EXITED:
            st.state = JobState.RUNNING.pb  # ranks finishing one after another
            st.message = f"rank {r.rank} exited; waiting for the others"
        else:
            st.state = JobState.FAILED.pb
            st.message = f"rank {r.rank} on node {r.node} is {ended}: {r.status.message}"
    else:
        for state in (JobState.RESTORING, JobState.CHECKPOINTING, JobState.STARTING, JobState.RUNNING):
            if state in states:
                st.state = state.pb
                break
        st.message = next((r.status.message for r in ranks if r.status.message), "")
    return st
