"""`ckptd.Client` (issue 16): a scheduler's or a notebook's view of ckptd,
driving a real daemon: launch, checkpoint, kill, restart, wait, logs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest
from conftest import PYTHON, Ckptd, run_plain

from ckptd import Client
from ckptd.client import exit_status
from ckptd.errors import CkptdError, Code
from ckptd.jobstate import JobState


@pytest.fixture
def client(ckptd: Ckptd, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    monkeypatch.setenv("CKPTD_HOME", str(ckptd.home))
    monkeypatch.setenv("CKPTD_IDLE_EXIT", "600")
    monkeypatch.delenv("CKPTD_COORDINATOR", raising=False)
    yield Client()


def test_launch_checkpoint_kill_restart_wait_logs(client: Client, ckptd: Ckptd, counter: Path) -> None:
    plain = run_plain([PYTHON, str(counter), "120"])  # the reference, run meanwhile
    st = client.launch([PYTHON, str(counter), "120"], job="cl", env=dict(ckptd.env))
    assert st.name == "cl" and JobState.of(st.state).live
    ckptd.wait_log("cl", r"^tick 20$")
    info = client.checkpoint("cl")
    assert info.id == 1 and Path(info.path).is_dir()
    assert [c.name for c in client.list("cl")] == ["ckpt-000001"]
    assert [j.name for j in client.jobs()] == ["cl"]
    ckptd.wait_log("cl", r"^tick 40$")
    for pid in client.status("cl").pids:
        os.kill(pid, 9)
    resp = client.restart("cl", force=True)
    assert resp.checkpoint.name == "ckpt-000001" and resp.status.generation == 1
    final = client.wait("cl", timeout=120)
    assert exit_status(final) == 0 and JobState.of(final.state) is JobState.EXITED
    assert client.logs_text("cl", stream="stdout") == plain.stdout
    assert b"".join(c.data for c in client.logs("cl", tail=2)) == b"tick 119\nfinished\n"


def test_errors_carry_their_code(client: Client) -> None:
    with pytest.raises(CkptdError) as e:
        client.status("nosuch")
    assert e.value.code is Code.NOT_FOUND and e.value.exit_code == 3
    with pytest.raises(CkptdError) as e:
        client.launch(["true"], job="../bad")
    assert e.value.code is Code.INVALID_ARGUMENT


def test_follow_logs_and_remove(client: Client, ckptd: Ckptd) -> None:
    client.launch(["sh", "-c", "sleep 0.5; for i in 1 2 3; do echo l$i; sleep 0.1; done; exit 4"], job="fl")
    out = b"".join(c.data for c in client.logs("fl", follow=True))
    assert out == b"l1\nl2\nl3\n"
    assert exit_status(client.wait("fl")) == 4
    client.remove("fl")
    assert client.jobs() == []


def test_no_daemon_started_when_told_not_to(ckptd: Ckptd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_HOME", str(ckptd.home))
    with pytest.raises(CkptdError) as e:
        Client(start_daemon=False).jobs()
    assert e.value.code is Code.UNAVAILABLE
    assert not ckptd.daemon_pids()


def test_a_unix_socket_is_reachable_only_while_something_listens(tmp_path: Path) -> None:
    """rpc.reachable, which every command asks before its first RPC: a plain
    connect for a Unix socket (no gRPC channel to close), true for a live
    gRPC server, false for a socket nobody listens on any more, a plain
    file and nothing at all."""
    import socket

    import grpc

    from ckptd.rpc import reachable

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    live = tmp_path / "live.sock"
    server.add_insecure_port(f"unix:{live}")
    server.start()
    try:
        assert reachable(f"unix:{live}")
        assert reachable(f"unix://{live}")
    finally:
        server.stop(None).wait()
    assert live.exists() is False or not reachable(f"unix:{live}")
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # bound, never listening: what a dead daemon leaves
    assert not reachable(f"unix:{stale}")
    plain = tmp_path / "plain"
    plain.write_text("not a socket")
    assert not reachable(f"unix:{plain}")
    assert not reachable(f"unix:{tmp_path / 'nothing'}")


def test_call_many_has_every_call_in_flight_at_once_on_one_thread(tmp_path: Path) -> None:
    """rpc.call_many, the coordinator's fan-out to its agents: every call is
    in flight at once (the servicer's 24 handlers meet at a barrier, which
    would break if any call waited for another), each answer or error comes
    back in the order asked, and a second round starts no thread (the
    synchronous API started one per channel per round)."""
    import threading

    import grpc

    from ckptd.rpc import agent_stub, call_many
    from ckptd.v1 import ckptd_pb2 as pb
    from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

    n = 24
    met = threading.Barrier(n, timeout=20)

    class Agent(pb_grpc.AgentServicer):
        def GetJob(self, request: pb.AgentJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
            met.wait()
            if request.job == "missing":
                context.abort(grpc.StatusCode.NOT_FOUND, "no job missing here")
            return pb.JobStatus(name=request.job)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=n))
    pb_grpc.add_AgentServicer_to_server(Agent(), server)
    addresses = []
    for i in range(4):  # several agents, several calls each
        sock = tmp_path / f"agent-{i}.sock"
        server.add_insecure_port(f"unix:{sock}")
        addresses.append(f"unix:{sock}")
    server.start()
    try:
        stubs = [agent_stub(a) for a in addresses]
        names = [f"job-{i}" if i != 7 else "missing" for i in range(n)]

        def round_() -> list[object]:
            met.reset()
            times: list[tuple[float, float]] = []
            calls = [(stubs[i % 4], "GetJob", pb.AgentJobRequest(job=names[i]), 30.0, f"agent {i}") for i in range(n)]
            out = call_many(calls, times=times)
            assert len(times) == n and all(0 < sent <= answered for sent, answered in times)
            return out

        first = round_()
        threads = threading.active_count()
        second = round_()
        assert threading.active_count() == threads
        for out in (first, second):
            for i, answer in enumerate(out):
                if i == 7:
                    assert isinstance(answer, CkptdError) and answer.code == Code.NOT_FOUND, answer
                    assert "no job missing here" in answer.message
                else:
                    assert isinstance(answer, pb.JobStatus) and answer.name == names[i], answer
    finally:
        server.stop(None).wait()


def test_call_many_gives_up_on_a_stopped_peer_while_an_earlier_call_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose agent stopped answering fails its call once `stopped`
    says so, whatever the calls before it in the order are doing (a long
    dump on another node, say): a round does not wait for the others to end
    before it notices.  `each` hears of every call as it ends, in the order
    they end, on the caller's thread."""
    import threading

    import grpc

    import ckptd.rpc
    from ckptd.rpc import agent_stub, call_many
    from ckptd.v1 import ckptd_pb2 as pb
    from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

    monkeypatch.setattr(ckptd.rpc, "STOPPED_POLL_S", 0.1)
    release = threading.Event()

    class Agent(pb_grpc.AgentServicer):
        def GetJob(self, request: pb.AgentJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
            release.wait(20)  # both calls hang: "slow" until released, "frozen" for good
            return pb.JobStatus(name=request.job)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AgentServicer_to_server(Agent(), server)
    sock = tmp_path / "agent.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        stub = agent_stub(f"unix:{sock}")
        calls = [(stub, "GetJob", pb.AgentJobRequest(job=name), 30.0, f"agent {name}") for name in ("slow", "frozen")]
        asked: list[int] = []
        ended: list[tuple[int, object]] = []
        caller = threading.get_ident()

        def stopped(i: int) -> str | None:
            asked.append(i)
            if i == 1 and len(asked) > 2:
                return "agent frozen stopped sending heartbeats"
            return None

        def each(i: int, answer: object, when: tuple[float, float]) -> None:
            assert threading.get_ident() == caller and 0 < when[0] <= when[1]
            ended.append((i, answer))
            if i == 1:
                release.set()  # only now may the first call end

        out = call_many(calls, stopped, each=each)
        assert [i for i, _ in ended] == [1, 0], ended
        assert isinstance(out[1], CkptdError) and out[1].code == Code.UNAVAILABLE, out[1]
        assert "stopped sending heartbeats" in out[1].message
        assert isinstance(out[0], pb.JobStatus) and out[0].name == "slow", out[0]
    finally:
        release.set()
        server.stop(None).wait()
