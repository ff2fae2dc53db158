"""One step on many targets, one request per node (Agent.Steps).

A checkpoint round's phases (coordinator/barrier.py) and a restart's release
of its held ranks (coordinator/restart.py) go to the agents as one
StepsRequest per node, holding a RankStep for each of the node's targets:
the requests grow with the nodes, not the ranks.  Every node's request is in
flight at once (rpc.call_many); the agent runs its steps side by side and
answers each in order, with its reply or its error (agent/server.py Steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.rpc import AgentStub, call_many
from ckptd.v1 import ckptd_pb2 as pb


@dataclass
class Sent:
    """Where a step's requests spent the time the agents did not (Phase)."""

    requests: int = 0  # one per node
    issue_s: float = 0.0  # putting every node's request in flight (the coordinator's serial part)
    wire_s: float = 0.0  # the worst round trip less its slowest step's own time (transport, an agent's queue)
    # each step's own work, (began, ended) on the coordinator's clock (busy_s)
    work: list[tuple[float, float]] = field(default_factory=list)

    def busy_s(self, start: float, end: float) -> float:
        """The time in [start, end] in which at least one step was at work:
        the union of the steps' spans.  Ranks that share cores take turns,
        and their own work then adds up; the rest of the phase is the
        protocol's (Phase.busy_s)."""
        total, reach = 0.0, start
        for began, ended in sorted(self.work):
            a, b = max(began, reach), min(ended, end)
            if b > a:
                total += b - a
                reach = b
        return total


def on_agent_clock(reply: pb.StepsReply, out: float, back: float) -> float:
    """What to take from the agent's CLOCK_MONOTONIC to read it on ours.
    Every offset that keeps the request's arrival after it went out and
    the reply's going out before it came back is possible; the one nearest
    0 is taken, so that nodes sharing a clock (this machine's namespace
    nodes) read it as it is, and other nodes are off by no more than the
    round trip's time on the wire."""
    lo, hi = reply.answered - back, reply.received - out
    if lo > hi:  # clocks that run at different rates: the middle
        return (lo + hi) / 2
    return min(max(0.0, lo), hi)


def on_nodes(
    targets: Sequence[tuple[str, AgentStub]],
    step: str,
    make: Callable[[int], Any],
    timeout: float,
    stopped: Callable[[str], str | None] | None = None,
) -> tuple[list[Any], Sent]:
    """targets: (node, its agent's stub) per target; make(i): target i's
    request; step: RankStep's field.  Each target's reply, or the
    CkptdError it failed with, in the order given.  stopped(node), as for
    call_many: why a node that has not answered must not be waited for any
    longer, or None.

    As flat in the number of nodes as one thread can make it: each node's
    request is built and sent before the next node's is built, and each
    node's answer is read as it comes, so that only the first request's
    building and the last answer's reading lie outside the agents' work."""
    by_node: dict[str, list[int]] = {}
    for i, (node, _) in enumerate(targets):
        by_node.setdefault(node, []).append(i)
    nodes = list(by_node)

    def requests() -> Iterator[tuple[AgentStub, str, Any, float, str]]:
        for node in nodes:
            steps = [pb.RankStep(**{step: make(i)}) for i in by_node[node]]
            yield targets[by_node[node][0]][1], "Steps", pb.StepsRequest(steps=steps), timeout, f"agent on {node}"

    start = time.monotonic()
    answers: list[Any] = [None] * len(targets)
    sent = Sent(requests=len(nodes))
    last_out = [start]

    def answered(k: int, reply: Any, when: tuple[float, float]) -> None:
        node, (out, back) = nodes[k], when
        last_out[0] = max(last_out[0], out)
        indices = by_node[node]
        failed = reply if isinstance(reply, CkptdError) else None
        if failed is None and len(reply.replies) != len(indices):
            failed = CkptdError(
                Code.INTERNAL,
                f"agent on {node} answered {len(reply.replies)} of {len(indices)} steps: it runs another "
                "version of ckptd than the coordinator; run one version on every node",
            )
        if failed is not None:
            for i in indices:
                answers[i] = failed
            return
        own = 0.0
        skew = on_agent_clock(reply, out, back)
        for i, r in zip(indices, reply.replies, strict=True):
            answers[i] = step_answer(r, step, node)
            if not isinstance(answers[i], CkptdError):
                took = float(getattr(answers[i], "local_s", 0.0))
                own = max(own, took)
                # an agent from before the stamps: as if its steps had ended with the reply
                began = r.began - skew if reply.received else back - took
                sent.work.append((began, began + took))
        sent.wire_s = max(sent.wire_s, back - out - own)

    call_many(requests(), (lambda k: stopped(nodes[k])) if stopped else None, each=answered)
    sent.issue_s = last_out[0] - start  # when the last request went out
    return answers, sent


def step_answer(reply: pb.StepReply, step: str, node: str) -> Any:
    """A step's reply (StepReply's field step), or the CkptdError it failed with."""
    kind = reply.WhichOneof("reply")
    if kind == "error":
        e = reply.error
        return CkptdError(Code.__members__.get(e.code, Code.INTERNAL), e.message, transient=e.transient)
    if kind != step:
        return CkptdError(
            Code.INTERNAL,
            f"agent on {node} answered {step} with {kind or 'nothing'}: it runs another version of ckptd than "
            "the coordinator; run one version on every node",
        )
    return getattr(reply, kind)
