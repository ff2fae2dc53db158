"""Every checkpoint records its round's phases (reserve, prepare, drain,
dump, resume, finalize, commit): each one's time at the coordinator, the
slowest rank's own time in it, and where the rest went (sending the
requests, one per node whatever its ranks, the worst round trip less its
rank's own time), in its manifest and in `ckptctl list --json`.
Back to back, they add up to the checkpoint's duration; prepare to resume
is its stall."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from ckptd.coordinator.steps import step_answer
from conftest import PYTHON, Ckptd

from ckptd.errors import CkptdError, Code
from ckptd.paths import Home, default_node
from ckptd.rpc import agent_stub, call
from ckptd.v1 import ckptd_pb2 as pb

PHASES = ["reserve", "prepare", "drain", "dump", "resume", "finalize", "commit"]
STALL = PHASES[1:5]
RANK_WORK = ["prepare", "drain", "dump", "resume", "finalize"]  # where the agents take part


def check_phases(info: dict[str, Any], nodes: int = 1) -> dict[str, dict[str, float]]:
    """Sane phases in a CheckpointInfo's JSON, from a job on nodes nodes; by name."""
    phases = info.get("phases")
    assert phases and [p["name"] for p in phases] == PHASES, info
    keys = ("rpc_s", "local_s", "issue_s", "wire_s", "requests")
    by = {p["name"]: {k: float(p.get(k, -1)) for k in keys} for p in phases}
    for name, p in by.items():
        assert all(p[k] >= 0 for k in keys), (name, p)  # every one recorded
        # one request per node in a phase the agents take part in, however many ranks it holds
        assert p["requests"] == (nodes if name in RANK_WORK else 0), (name, p)
        # the protocol's own cost, split: the requests' sending and the worst
        # round trip less the rank's own time, both inside the phase
        assert p["issue_s"] <= p["rpc_s"] + 2e-6 and p["wire_s"] <= p["rpc_s"] + 2e-6, (name, p)
        if name not in RANK_WORK:
            assert p["issue_s"] == 0 and p["wire_s"] == 0, (name, p)  # no RPC in it
        # an agent's own time is inside the coordinator's RPC (rounding: 1 µs)
        assert p["local_s"] <= p["rpc_s"] + 2e-6, (name, p)
        if name in RANK_WORK:
            assert p["local_s"] > 0, (name, p)  # the agents answered with their own time
        else:
            assert p["local_s"] == 0, (name, p)  # the coordinator's alone
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
    assert m["timings"]["protocol_s"] <= m["timings"]["stall_s"]
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
