"""Every checkpoint records its round's phases (reserve, ready, prepare,
drain, dump, resume, finalize, commit): each one's time at the coordinator, the
slowest rank's own time in it, and where the rest went (sending the
requests, one per node whatever its ranks, the worst round trip less its
rank's own time), in its manifest and in `ckptctl list --json`.
Back to back, they add up to the checkpoint's duration; prepare to resume
is its stall.  The drain is sent only to a job with unsent TCP bytes once
parked; without any it is recorded with no request."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from ckptd.coordinator.steps import Sent, on_agent_clock, step_answer
from conftest import PYTHON, WORKLOADS, Ckptd, checkpoint_stopped_at, run_plain

from ckptd.errors import CkptdError, Code
from ckptd.paths import Home, default_node
from ckptd.rpc import agent_stub, call
from ckptd.v1 import ckptd_pb2 as pb

PHASES = ["reserve", "ready", "prepare", "drain", "dump", "resume", "finalize", "commit"]
STALL = PHASES[2:6]  # ready runs before the pause: the job still runs
RANK_WORK = ["ready", "prepare", "drain", "dump", "resume", "finalize"]  # where the agents take part


def check_phases(info: dict[str, Any], nodes: int = 1, drained: bool = False) -> dict[str, dict[str, float]]:
    """Sane phases in a CheckpointInfo's JSON, from a job on nodes nodes; by
    name.  drained: the job had unsent TCP bytes when parked, and the agents
    were sent a drain step; else the drain has no request and no rank's time."""
    rank_work = RANK_WORK if drained else [n for n in RANK_WORK if n != "drain"]
    phases = info.get("phases")
    assert phases and [p["name"] for p in phases] == PHASES, info
    keys = ("rpc_s", "local_s", "issue_s", "wire_s", "requests", "busy_s")
    by = {p["name"]: {k: float(p.get(k, -1)) for k in keys} for p in phases}
    for name, p in by.items():
        assert all(p[k] >= 0 for k in keys), (name, p)  # every one recorded
        # one request per node in a phase the agents take part in, however many ranks it holds
        assert p["requests"] == (nodes if name in rank_work else 0), (name, p)
        # the protocol's own cost, split: the requests' sending and the worst
        # round trip less the rank's own time, both inside the phase
        assert p["issue_s"] <= p["rpc_s"] + 2e-6 and p["wire_s"] <= p["rpc_s"] + 2e-6, (name, p)
        if name not in rank_work:
            assert p["issue_s"] == 0 and p["wire_s"] == 0, (name, p)  # no RPC in it
        # an agent's own time is inside the coordinator's RPC (rounding: 1 µs)
        assert p["local_s"] <= p["rpc_s"] + 2e-6, (name, p)
        if name in rank_work:
            assert p["local_s"] > 0, (name, p)  # the agents answered with their own time
            # the time some rank was at work: at least the slowest rank's, inside the phase
            assert p["local_s"] - 2e-6 <= p["busy_s"] <= p["rpc_s"] + 2e-6, (name, p)
        else:
            assert p["local_s"] == 0 and p["busy_s"] == 0, (name, p)  # the coordinator's alone
    assert by["dump"]["local_s"] > 0.001, by  # writing the images takes a rank some time
    total = sum(p["rpc_s"] for p in by.values())
    assert abs(total - float(info["duration_s"])) < 1e-4, (total, info["duration_s"])
    stall = sum(by[n]["rpc_s"] for n in STALL)
    assert abs(stall - float(info["stall_s"])) < 1e-4, (stall, info["stall_s"])
    return by


def manifest(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "manifest.json").read_text())


def test_single_process_checkpoint_records_its_phases(ckptd: Ckptd, counter: Path) -> None:
    ckptd.launch("ph", [PYTHON, str(counter), "400"])
    ckptd.wait_log("ph", r"^tick 3$")
    taken = ckptd.checkpoint("ph")
    listed = {c["name"]: c for c in ckptd.ctl_json("list", "ph")}[taken["name"]]
    by = check_phases(listed)
    m = manifest(taken["path"])
    assert [p["name"] for p in m["phases"]] == PHASES
    assert m["timings"]["protocol_s"] >= 0
    # the stall no rank worked in is at most the stall less the slowest rank's time
    assert m["timings"]["protocol_s"] <= m["timings"]["protocol_slowest_s"] + 1e-5 <= m["timings"]["stall_s"] + 1e-5
    own = sum(p["busy_s"] for p in m["phases"] if p["name"] in STALL)
    assert abs(m["timings"]["stall_s"] - own - m["timings"]["protocol_s"]) < 1e-5, m
    assert abs(m["timings"]["dump_s"] - by["dump"]["rpc_s"]) < 1e-5
    ckptd.ctl("kill", "ph")


@pytest.mark.skipif(os.geteuid() != 0, reason="ranks live in network namespaces: root")
def test_two_ranks_record_the_slowest_ranks_time(ckptd: Ckptd, counter: Path) -> None:
    """Both ranks run on this machine's one agent: each phase is one request."""
    ckptd.launch("phr", [PYTHON, str(counter), "400"], "--ranks", "2")
    ckptd.wait_log("phr", r"^tick 3$")
    taken = ckptd.checkpoint("phr")
    listed = {c["name"]: c for c in ckptd.ctl_json("list", "phr")}[taken["name"]]
    by = check_phases(listed)
    # each rank's own manifest holds the round up to its finalize; the
    # slowest rank's dump time is the job's
    dumps = []
    for r in (0, 1):
        part = manifest(Path(taken["path"]) / f"rank-{r}")
        assert [p["name"] for p in part["phases"]] == PHASES[:-1], part["phases"]
        dumps.append(max(p["dump_s"] for p in part["processes"]))
    assert by["dump"]["local_s"] >= max(dumps) - 1e-6, (by["dump"], dumps)
    ckptd.ctl("kill", "phr")


def test_unsent_tcp_bytes_are_drained_and_come_back_once(ckptd: Ckptd) -> None:
    """A process whose loopback connection has a full window holds unsent
    bytes in its send queue while parked: the round sends its drain step
    (SETTLE, which finds them stuck), the dump saves them, and after a
    kill -9 and a restart each of them arrives exactly once."""
    argv = [PYTHON, str(WORKLOADS / "tcp_full.py"), "100"]
    plain = run_plain(argv)
    ckptd.launch("full", argv)
    ckptd.wait_log("full", r"^tick 5$")
    taken = ckptd.checkpoint("full")
    check_phases(taken, drained=True)
    ckptd.kill9("full")
    ckptd.ctl("restart", "full")
    assert ckptd.wait("full") == 0
    assert plain.stdout.splitlines()[-1] == "every byte once True", plain.stdout
    assert ckptd.log("full", "stdout") == plain.stdout


def test_a_nodes_steps_answer_in_order_each_with_its_own_error(ckptd: Ckptd, counter: Path) -> None:
    """Agent.Steps over the agent's own socket: each step answers in its
    place; one that fails carries its own error, and the others answer as
    if it had not been sent; a step the agent does not know says why."""
    ckptd.launch("st", [PYTHON, str(counter), "400"])
    ckptd.wait_log("st", r"^tick 3$")
    agent = agent_stub(f"unix:{Home(ckptd.home).agent_socket(default_node())}")
    steps = [
        pb.RankStep(get_job=pb.AgentJobRequest(job="st")),
        pb.RankStep(resume=pb.ResumeRequest(job="nosuch")),
        pb.RankStep(),  # what a newer coordinator's unknown step looks like here
        pb.RankStep(get_job=pb.AgentJobRequest(job="st")),
    ]
    replies = call(agent.Steps, pb.StepsRequest(steps=steps), 30, "agent").replies
    assert [r.WhichOneof("reply") for r in replies] == ["get_job", "error", "error", "get_job"], replies
    assert replies[0].get_job.state == replies[3].get_job.state == pb.JOB_STATE_RUNNING
    # as the coordinator reads them
    running = step_answer(replies[0], "get_job", "here")
    assert isinstance(running, pb.JobStatus) and running.name == "st"
    missing = step_answer(replies[1], "resume", "here")
    assert isinstance(missing, CkptdError) and missing.code is Code.NOT_FOUND, missing
    assert "nosuch" in missing.message and not missing.transient
    unknown = step_answer(replies[2], "drain", "here")
    assert isinstance(unknown, CkptdError) and unknown.code is Code.INVALID_ARGUMENT, unknown
    assert "one version on every node" in unknown.message and "\n" not in unknown.message
    mixed = step_answer(replies[0], "resume", "here")  # an answer to another step than asked
    assert isinstance(mixed, CkptdError) and "another version" in mixed.message, mixed
    # nothing was done to the job: it checkpoints as before
    taken = ckptd.checkpoint("st")
    check_phases(taken)
    ckptd.ctl("kill", "st")


def test_a_pause_in_which_no_rank_works_is_the_protocols(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    """The daemon stops itself for a second at the end of the rank's dump,
    after the rank's own work and before its answer: the phase is that much
    longer, the time some rank was at work is not, and the checkpoint puts
    the second in the protocol's own cost."""
    fault = tmp_path / "fault"
    ckptd.env["CKPTD_FAULT"] = f"@{fault}"  # read by the daemon, which the first command starts
    ckptd.launch("idle", [PYTHON, str(counter), "400"])
    ckptd.wait_log("idle", r"^tick 3$")
    with checkpoint_stopped_at(ckptd, fault, "idle", "dump") as stopped:
        time.sleep(1.0)
    taken = stopped.info
    by = check_phases(taken)
    assert by["dump"]["rpc_s"] - by["dump"]["busy_s"] >= 0.95, by["dump"]
    assert by["dump"]["busy_s"] < 0.5, by["dump"]  # a counter's dump is short
    t = manifest(taken["path"])["timings"]
    assert t["protocol_s"] >= 0.95 and t["protocol_slowest_s"] >= 0.95, t
    ckptd.ctl("kill", "idle")


def test_steps_on_another_nodes_clock_are_read_inside_their_round_trip() -> None:
    """Where each step's work lies on the coordinator's clock (on_agent_clock):
    a node sharing its clock is read as it is; one whose clock is far off
    is moved to within the round trip; the time at work is the union."""
    same = pb.StepsReply(received=10.2, answered=10.8)
    assert on_agent_clock(same, 10.0, 11.0) == 0.0
    far = pb.StepsReply(received=1000.5, answered=1000.9)  # 990.5 s ahead, 0.1 s on the wire each way
    skew = on_agent_clock(far, 10.0, 11.0)
    assert far.received - skew >= 10.0 and far.answered - skew <= 11.0, skew
    behind = pb.StepsReply(received=5.1, answered=5.3)
    skew = on_agent_clock(behind, 10.0, 11.0)
    assert behind.received - skew >= 10.0 and behind.answered - skew <= 11.0, skew
    sent = Sent(work=[(1.0, 2.0), (1.5, 3.0), (5.0, 6.0), (-1.0, 0.5)])
    assert abs(sent.busy_s(0.0, 5.5) - 3.0) < 1e-9  # 0-0.5, 1-3 and 5-5.5
    assert sent.busy_s(3.0, 5.0) == 0.0
