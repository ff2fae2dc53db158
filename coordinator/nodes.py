"""Nodes and their agents: registration, heartbeats and liveness."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from ckptd.errors import CkptdError, Code
from ckptd.jobstate import FINAL, JobState
from ckptd.rpc import AgentStub, agent_stub, call
from ckptd.v1 import ckptd_pb2 as pb

HEARTBEAT_S = 2.0
DEAD_AFTER_S = 3 * HEARTBEAT_S


@dataclass
class Node:
    name: str
    address: str
    last_seen: float
    health: pb.NodeHealth = field(default_factory=pb.NodeHealth)
    stub: AgentStub | None = None
    ip: str = ""  # its address between nodes (agent --ip)

    @property
    def alive(self) -> bool:
        return time.monotonic() - self.last_seen < DEAD_AFTER_S


class NodeRegistry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nodes: dict[str, Node] = {}
        # agents served by this very process (ckptd/daemon.py run_local): one that hangs hangs us
        # too, so a late heartbeat from one is load, not a hang (call_while_alive)
        self.in_process: set[str] = set()

    def call_while_alive(self, node: Node, method: Any, request: Any, timeout: float, *, what: str, doing: str) -> Any:
        """A unary call to node's agent that fails once the node stops sending
        heartbeats (an agent stopped, or its host frozen: nothing answers, and
        without this the caller waits out timeout, hours for a restore)."""
        future = method.future(request, timeout=timeout)
        while True:
            try:
                return future.result(timeout=HEARTBEAT_S)
            except grpc.FutureTimeoutError:
                why = self.stopped_answering(node.name, what, doing)
                if why is None:
                    continue
                future.cancel()
                raise CkptdError(Code.UNAVAILABLE, why) from None
            except grpc.RpcError as e:
                raise CkptdError.from_rpc(e, what) from None

    def stopped_answering(self, name: str, what: str, doing: str) -> str | None:
        """Why a call to node name's agent must not be waited for any longer
        (it sends no heartbeats: stopped, or its host frozen), or None.  An
        agent served by this very process never counts: its late heartbeat is
        this process's own load."""
        node = self.nodes.get(name)
        if node is None or node.alive or node.address in self.in_process:
            return None
        return (
            f"{what} stopped answering {doing} (no heartbeat for {time.monotonic() - node.last_seen:.0f} s); "
            "`ckptctl nodes` shows when it is back, `ckptctl status` where the job stands then"
        )

    def register(self, name: str, address: str, ip: str = "", health: pb.NodeHealth | None = None) -> None:
        with self.lock:
            node = self.nodes.get(name)
            if node is None or node.address != address:
                node = Node(name=name, address=address, last_seen=time.monotonic(), stub=agent_stub(address))
                self.nodes[name] = node
            node.ip = ip
            node.last_seen = time.monotonic()
            if health is not None and health.node:
                node.health = health

    def ips(self) -> dict[str, str]:
        with self.lock:
            return {n.name: n.ip for n in self.nodes.values()}

    def live_stub(self, name: str, job: str) -> AgentStub:
        """The agent of a node that must answer now, or a clear error."""
        node = self.get(name)
        if not node.alive or node.stub is None:
            raise CkptdError(
                Code.UNAVAILABLE,
                f"node {name} of job {job} is not answering "
                f"(no heartbeat for {time.monotonic() - node.last_seen:.0f} s); "
                f"`ckptctl nodes` shows the nodes, `ckptctl restart {job} --on NODE` moves the job",
            )
        return node.stub

    def heartbeat(self, name: str, health: pb.NodeHealth) -> None:
        with self.lock:
            node = self.nodes.get(name)
            if node is None:
                raise CkptdError(Code.NOT_FOUND, f"node {name} is not registered")
            node.last_seen = time.monotonic()
            node.health = health

    def get(self, name: str) -> Node:
        with self.lock:
            node = self.nodes.get(name)
        if node is None:
            raise CkptdError(
                Code.UNAVAILABLE, f"node {name} has no agent registered; start `ckptd agent --node {name}`"
            )
        return node

    def live(self) -> list[Node]:
        with self.lock:
            return [n for n in self.nodes.values() if n.alive]

    def describe(self) -> list[pb.NodeHealth]:
        out = []
        with self.lock:
            nodes = list(self.nodes.values())
        for n in sorted(nodes, key=lambda n: n.name):
            h = pb.NodeHealth()
            h.CopyFrom(n.health)
            h.node = n.name
            h.address = n.address
            h.ip = n.ip
            h.alive = n.alive
            h.last_seen_s = time.monotonic() - n.last_seen
            out.append(h)
        return out

    def rank_status(self, name: str, node_name: str, last: pb.JobStatus) -> pb.JobStatus:
        """A rank's state now: its last report if that was final, else what its
        agent says; "lost" when the node does not answer or no longer has it."""
        if JobState.of(last.state) in FINAL:
            return last
        try:
            node = self.get(node_name)
        except CkptdError:
            node = None
        if node is None or not node.alive or node.stub is None:
            return pb.JobStatus(name=name, state=JobState.LOST.pb, message=f"node {node_name} is not answering")
        try:
            return call(node.stub.GetJob, pb.AgentJobRequest(job=name), 10, f"agent on {node_name}")
        except CkptdError as e:
            if e.code in (Code.NOT_FOUND, Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                # an agent that does not answer is as good as dead (its heartbeats stop soon after)
                return pb.JobStatus(name=name, state=JobState.LOST.pb, message=f"node {node_name}: {e.message}")
            raise
