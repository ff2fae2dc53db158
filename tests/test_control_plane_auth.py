"""The TCP control plane: mutual TLS and per-user authorization.

A real coordinator and two real agents (nodes n1, n2) listen on loopback TCP
with certificates from a CA made by `ckptd certs`; the CLIs and raw gRPC
clients connect as various callers. Every refused call must fail with one
line on stderr and change nothing: the victim job keeps running with the
same processes and checkpoints, no file appears, the daemons stay up.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import CKPTCTL, CKPTD, PYTHON, WORKLOADS
from test_bad_input import one_line_error

from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc


def _listening(log: Path, what: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    rx = re.compile(rf"{what} listening on ([^\s,]+)")
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            m = rx.search(log.read_text())
            if m:
                return m.group(1)
        time.sleep(0.1)
    raise AssertionError(f"{what} did not start: {log.read_text() if log.exists() else 'no log'}")


class TlsCluster:
    """A CA, a coordinator and agents n1, n2 over TLS on loopback, and certificates for several callers."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.certs = tmp / "certs"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.base_env = dict(os.environ, CKPTD_HOME=str(self.home))
        for var in ("CKPTD_COORDINATOR", "CKPTD_TLS_DIR", "LD_PRELOAD"):
            self.base_env.pop(var, None)
        self.address = ""
        self.agents: dict[str, str] = {}

    def certs_cmd(self, *args: str) -> None:
        subprocess.run([CKPTD, "certs", *args], check=True, capture_output=True, env=self.base_env)

    def make_certs(self) -> None:
        ca, other = str(self.certs / "ca"), str(self.certs / "other-ca")
        self.certs_cmd("ca", "--dir", ca)
        self.certs_cmd("issue", "--ca", ca, "--out", str(self.certs / "coordinator"), "--coordinator", "coord")
        for node in ("n1", "n2"):
            self.certs_cmd("issue", "--ca", ca, "--out", str(self.certs / node), "--node", node)
        for user in ("root", "nobody"):
            self.certs_cmd("issue", "--ca", ca, "--out", str(self.certs / user), "--user", user)
        # a stranger's CA, and a client of it that trusts our CA (ca.pem is public)
        self.certs_cmd("ca", "--dir", other)
        self.certs_cmd("issue", "--ca", other, "--out", str(self.certs / "foreign"), "--user", "root")
        mixed = self.certs / "foreign-trusting-ours"
        shutil.copytree(self.certs / "foreign", mixed)
        shutil.copy(self.certs / "ca" / "ca.pem", mixed / "ca.pem")

    def daemon(self, name: str, *argv: str) -> None:
        log = open(self.tmp / f"{name}.out", "ab")  # noqa: SIM115 - the child keeps it
        env = dict(self.base_env, CKPTD_NODE=name)
        self.procs.append(
            subprocess.Popen([CKPTD, *argv], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()

    def start(self) -> None:
        self.make_certs()
        self.daemon("coordinator", "coordinator", "--listen", "127.0.0.1:0", "--tls", str(self.certs / "coordinator"))
        self.address = _listening(self.home / "logs" / "coordinator.log", "coordinator")
        for node in ("n1", "n2"):
            self.daemon(
                node, "agent", "--coordinator", self.address, "--node", node,
                "--listen", "127.0.0.1:0", "--tls", str(self.certs / node),
            )  # fmt: skip
            self.agents[node] = _listening(self.home / "logs" / f"agent-{node}.log", f"agent for node {node}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            p = self.ctl("root", "nodes", check=False)
            if p.stdout.count(" alive ") == 2:
                return
            time.sleep(0.2)
        raise AssertionError(f"nodes did not register: {p.stdout} {p.stderr}")

    def env(self, who: str | None) -> dict[str, str]:
        env = dict(self.base_env, CKPTD_COORDINATOR=self.address)
        if who is not None:
            env["CKPTD_TLS_DIR"] = str(self.certs / who)
        return env

    def run(
        self, who: str | None, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(list(argv), env=self.env(who), capture_output=True, text=True, timeout=120)
        if check and p.returncode != 0:
            raise AssertionError(f"{who}: {argv} failed with {p.returncode}: {p.stderr}")
        return p

    def ctl(self, who: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(who, CKPTCTL, *args, check=check)

    def channel(self, who: str, address: str) -> grpc.Channel:
        d = self.certs / who
        creds = grpc.ssl_channel_credentials(
            (d / "ca.pem").read_bytes(), (d / "key.pem").read_bytes(), (d / "cert.pem").read_bytes()
        )
        return grpc.secure_channel(address, creds)

    def teardown(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        subprocess.run(["pkill", "-9", "-f", f"ckptd-init.*{self.home}"], check=False)


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[TlsCluster]:
    c = TlsCluster(tmp_path)
    try:
        c.start()
        yield c
    finally:
        c.teardown()


def status(c: TlsCluster, job: str) -> dict[str, Any]:
    import json

    return json.loads(c.ctl("root", "status", job, "--json").stdout)  # type: ignore[no-any-return]


def refused(p: subprocess.CompletedProcess[str]) -> str:
    """The one-line error of a command that failed."""
    assert p.returncode != 0, p.stdout
    return one_line_error(p)


def test_tcp_listeners_refuse_to_run_without_tls(tmp_path: Path) -> None:
    env = dict(os.environ, CKPTD_HOME=str(tmp_path / "home"))
    env.pop("CKPTD_TLS_DIR", None)
    for argv in (
        ["coordinator", "--listen", "127.0.0.1:0"],
        ["agent", "--coordinator", "127.0.0.1:1", "--node", "n1", "--listen", "127.0.0.1:0"],
        ["agent", "--coordinator", "unix:/nonexistent", "--node", "n1", "--listen", "0.0.0.0:0"],
    ):
        p = subprocess.run([CKPTD, *argv], env=env, capture_output=True, text=True, timeout=60)
        line = refused(p)
        assert "refusing to listen on" in line and "without TLS" in line and "--tls" in line, line
        assert p.returncode == 4


def test_a_daemon_needs_a_certificate_of_its_own_role(tls: TlsCluster) -> None:
    """A node's certificate cannot serve as the coordinator, nor n2's as n1's agent."""
    p = tls.run(None, CKPTD, "coordinator", "--listen", "127.0.0.1:0", "--tls", str(tls.certs / "n1"), check=False)
    assert "is a node certificate for 'n1', not a coordinator one" in refused(p)
    p = tls.run(
        None, CKPTD, "agent", "--coordinator", tls.address, "--node", "n1",
        "--listen", "127.0.0.1:0", "--tls", str(tls.certs / "n2"), check=False,
    )  # fmt: skip
    assert "is a node certificate for 'n2', not a node n1 one" in refused(p)


STRANGERS = ("no certificate", "foreign", "foreign-trusting-ours", "nobody")


def test_strangers_cannot_drive_another_users_job(tls: TlsCluster, tmp_path: Path) -> None:
    victim = ["ckptd", "launch", "--detach", "--job", "victim", "--node", "n1", "--",
              PYTHON, str(WORKLOADS / "counter.py"), "100000"]  # fmt: skip
    tls.run("root", CKPTD, *victim[1:])
    tls.ctl("root", "checkpoint", "victim")
    before = status(tls, "victim")
    assert before["state"] == "running" and before["checkpoints"] == 1
    log_before = Path(before["log_path"]).stat().st_size
    pwned = tmp_path / "pwned"

    for who in STRANGERS:
        cert = None if who == "no certificate" else who
        attempts = [
            (CKPTD, "launch", "--job", f"evil-{who.split()[0]}", "--node", "n1", "--", "touch", str(pwned)),
            (CKPTCTL, "status", "victim"),
            (CKPTCTL, "logs", "victim"),
            (CKPTCTL, "checkpoint", "victim"),
            (CKPTCTL, "restart", "victim", "--force"),
            (CKPTCTL, "kill", "victim"),
            (CKPTCTL, "prune", "victim", "--keep", "1"),
            (CKPTCTL, "list", "victim"),
            (CKPTCTL, "shutdown"),
        ]
        if who == "nobody":  # a valid user: may launch its own jobs, so only the others' are checked
            attempts = attempts[1:]
        for argv in attempts:
            p = tls.run(cert, *argv, check=False)
            line = refused(p)
            if who == "nobody":
                assert "belongs to another user" in line or "only an admin" in line, (argv, line)
            elif cert is None:
                assert "needs a client certificate" in line, (argv, line)
            else:
                assert "certificate" in line, (argv, line)
        jobs = tls.ctl(cert, "jobs", check=False)
        if who == "nobody":
            assert jobs.returncode == 0 and "victim" not in jobs.stdout, jobs.stdout
        else:
            refused(jobs)

    # a plaintext client, and a TLS client without a certificate, are refused by the server itself
    ca = (tls.certs / "ca" / "ca.pem").read_bytes()
    for ch in (grpc.insecure_channel(tls.address), grpc.secure_channel(tls.address, grpc.ssl_channel_credentials(ca))):
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CoordinatorStub(ch).Shutdown(pb.Empty(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()

    after = status(tls, "victim")
    assert after["state"] == "running" and after["pids"] == before["pids"], after
    assert after["checkpoints"] == 1 and after["generation"] == before["generation"]
    assert Path(after["log_path"]).stat().st_size >= log_before
    assert not pwned.exists()
    assert "evil" not in tls.ctl("root", "jobs").stdout
    tls.ctl("root", "kill", "victim")


def test_agents_obey_only_the_coordinator(tls: TlsCluster) -> None:
    tls.run("root", CKPTD, "launch", "--detach", "--job", "mine", "--node", "n1", "--",
            PYTHON, str(WORKLOADS / "counter.py"), "100000")  # fmt: skip
    before = status(tls, "mine")
    n1 = tls.agents["n1"]
    spec = pb.JobSpec(name="evil", argv=["touch", "/tmp/evil"], ckpt_dir=str(tls.tmp), owner="root")
    for who in ("root", "nobody", "n2"):
        agent = pb_grpc.AgentStub(tls.channel(who, n1))
        calls = [
            (agent.StartJob, pb.StartJobRequest(spec=spec)),
            (agent.Restore, pb.RestoreRequest(spec=spec, checkpoint_dir=str(tls.tmp))),
            (agent.Stop, pb.StopRequest(job="mine")),
            (
                agent.Steps,  # a checkpoint round's steps
                pb.StepsRequest(
                    steps=[pb.RankStep(prepare=pb.PrepareRequest(job="mine", checkpoint_id=9, dir=str(tls.tmp)))]
                ),
            ),
            (agent.ListJobs, pb.Empty()),
        ]
        if who != "root":  # the owner (and an admin) may follow and signal their job where it runs
            calls.append((agent.SignalJob, pb.SignalRequest(job="mine", signal=9)))
            calls.append((agent.GetJob, pb.AgentJobRequest(job="mine")))
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as e:
                method(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (who, method, e.value.details())
        if who != "root":
            with pytest.raises(grpc.RpcError) as e:
                next(iter(agent.FollowOutput(pb.FollowOutputRequest(job="mine"), timeout=10)))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # the owner reads its own job's output where it runs, as `ckptd launch` does
    owner = pb_grpc.AgentStub(tls.channel("root", n1))
    first = next(iter(owner.FollowOutput(pb.FollowOutputRequest(job="mine"), timeout=10)))
    assert first.data.startswith(b"tick 0") or first.end
    assert not Path("/tmp/evil").exists()
    after = status(tls, "mine")
    assert after["state"] == "running" and after["pids"] == before["pids"]
    tls.ctl("root", "kill", "mine")


def test_only_a_node_certificate_registers_its_node(tls: TlsCluster) -> None:
    real = tls.agents["n1"]
    for who in ("root", "nobody", "n2", "coordinator"):
        stub = pb_grpc.CoordinatorStub(tls.channel(who, tls.address))
        for method, request in (
            (stub.RegisterNode, pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1")),
            (stub.Heartbeat, pb.HeartbeatRequest(node="n1")),
            (stub.ReportJobEvent, pb.JobEvent(node="n1", status=pb.JobStatus(name="x", state=pb.JOB_STATE_FAILED))),
        ):
            with pytest.raises(grpc.RpcError) as e:
                method(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (who, method)
    nodes = tls.ctl("root", "nodes").stdout
    assert re.search(rf"^n1\s+alive.*{re.escape(real)}", nodes, re.M), nodes
    assert "127.0.0.1:1 " not in nodes


def test_a_users_job_runs_as_that_user_on_a_root_agent(tls: TlsCluster, tmp_path: Path) -> None:
    """nobody's certificate launches over TLS; the root agent runs the job as nobody, and root's
    certificate (an admin) sees it while nobody still cannot see root's."""
    import pwd

    from conftest import reachable_by_others

    nobody = pwd.getpwnam("nobody")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    ckpts.chmod(0o1777)  # a scratch directory every user may write, as /tmp (sticky)
    with reachable_by_others(Path(PYTHON), ckpts):
        tls.run(
            "nobody", CKPTD, "launch", "--detach", "--job", "theirs", "--node", "n2", "--ckpt-dir", str(ckpts),
            "--", PYTHON, str(WORKLOADS / "counter.py"), "100000",
        )  # fmt: skip
        tls.run("root", CKPTD, "launch", "--detach", "--job", "roots", "--node", "n1", "--",
                PYTHON, str(WORKLOADS / "counter.py"), "100000")  # fmt: skip
        import json

        mine = json.loads(tls.ctl("nobody", "status", "theirs", "--json").stdout)
        assert mine["state"] == "running" and mine["spec"]["owner"] == "nobody" and mine["pids"]
        for pid in mine["pids"]:
            uid_line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
            assert uid_line.split()[1:] == [str(nobody.pw_uid)] * 4, (pid, uid_line)
        assert tls.ctl("nobody", "checkpoint", "theirs").returncode == 0
        listed = tls.ctl("nobody", "jobs").stdout
        assert "theirs" in listed and "roots" not in listed
        admin = tls.ctl("root", "jobs").stdout
        assert "theirs" in admin and "roots" in admin
        tls.ctl("nobody", "kill", "theirs")
        tls.ctl("root", "kill", "roots")
