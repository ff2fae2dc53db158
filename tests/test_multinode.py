"""Multi-node jobs on nodes modelled as network namespaces on one bridge.

A real coordinator on a Unix socket, one real agent per node (each inside
its node's namespace, with its own IP), shared checkpoint storage (one
directory, the same path for every node).  Jobs are the data-parallel SGD
workload over plain TCP: its ranks talk across nodes through their virtual
IPs, and every result is compared byte for byte with a plain run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster
from conftest import CKPTCTL, CKPTD, PYTHON, WORKLOADS, run_plain

from ckptd.paths import Home

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces for nodes need root"),
    pytest.mark.skipif(shutil.which("nsenter") is None, reason="nsenter (util-linux) not installed"),
    pytest.mark.slow,
]

DP = str(WORKLOADS / "dp_sgd.py")


class MultiNode:
    """A coordinator and one agent per node, driven through the CLI.
    CKPTD_KEEP_TEST_DIRS=1 keeps its directory (logs, storage) after the test."""

    def __init__(self, names: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ckmn-"))  # short: Unix socket paths
        self.names = names
        self.cluster = Cluster(self.dir, names)
        self.home = self.dir / "home"
        self.storage = self.dir / "shared"  # every node's checkpoint storage, the same path
        self.sock = self.dir / "coord.sock"
        self.env = dict(os.environ, CKPTD_HOME=str(self.home), CKPTD_COORDINATOR=f"unix:{self.sock}")
        for var in ("LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
            self.env.pop(var, None)
        self.coordinator: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        self.cluster.setup_network()
        self.start_coordinator()
        for name in self.names:
            self.start_agent(name)
        self.wait_nodes(self.names)

    def start_coordinator(self) -> None:
        out = open(self.dir / "coordinator.out", "ab")  # noqa: SIM115 - the child keeps it
        self.coordinator = subprocess.Popen(
            [CKPTD, "coordinator", "--listen", f"unix:{self.sock}"],
            env=self.env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
        out.close()

    def start_agent(self, name: str) -> None:
        argv = [
            CKPTD, "agent",
            "--coordinator", f"unix:{self.sock}",
            "--node", name,
            "--ip", self.cluster.node_ip(name),
            "--listen", f"unix:{self.dir / ('agent-' + name + '.sock')}",
        ]  # fmt: skip
        self.cluster.start_agent(name, argv, self.env)

    def wait_nodes(self, alive: list[str], dead: tuple[str, ...] = (), timeout: float = 30) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            p = self.ctl("nodes", "--json", check=False)
            if p.returncode == 0:
                nodes = json.loads(p.stdout)
                state = {n["node"]: n.get("alive", False) for n in nodes}
                if all(state.get(n) for n in alive) and all(state.get(n) is False for n in dead):
                    return nodes
            time.sleep(0.3)
        raise AssertionError(f"nodes not as expected (alive {alive}, dead {dead}): {nodes} {p.stderr}")

    def ctl(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([CKPTCTL, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"ckptctl {' '.join(args)} failed ({p.returncode}): {p.stderr}")
        return p

    def launch(self, job: str, argv: list[str], *extra: str, cwd: str | None = None) -> None:
        p = subprocess.run(
            [CKPTD, "launch", "--detach", "--job", job, "--ckpt-dir", str(self.storage), *extra, "--", *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
        )
        assert p.returncode == 0, p.stderr

    def status(self, job: str) -> dict[str, Any]:
        return json.loads(self.ctl("status", job, "--json").stdout)

    def wait_state(self, job: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = self.status(job)
            if st.get("state") in states:
                return st
            time.sleep(0.3)
        ranks = [(r["rank"], r["node"], r["state"], r.get("message", "")) for r in st.get("ranks", [])]
        raise AssertionError(f"job {job} never became {states}: {st.get('state')} {ranks}\n{self.tails(job)}")

    def tails(self, job: str) -> str:
        """The end of every rank's output (stdout and stderr), for failure messages."""
        out = []
        for log in sorted((self.storage / job).glob("rank-*/output.log")):
            out.append(f"--- {log.parent.name}:\n" + log.read_bytes()[-1500:].decode(errors="replace"))
        return "\n".join(out)

    def rank_output(self, job: str, rank: int) -> bytes:
        from ckptd.agent.output import LogFollower

        log = self.storage / job / f"rank-{rank}" / "output.log"
        return b"".join(c.data for c in LogFollower(log, log.with_suffix(".idx")).poll())

    def wait_line(self, job: str, rank: int, text: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.rank_output(job, rank):
                return
            time.sleep(0.1)
        raise AssertionError(f"rank {rank} of {job} never printed {text!r}")

    def checkpoint(self, job: str, *extra: str) -> dict[str, Any]:
        return json.loads(self.ctl("checkpoint", job, "--json", *extra).stdout)

    def checkpoints(self, job: str) -> list[dict[str, Any]]:
        return json.loads(self.ctl("list", job, "--json").stdout)

    def teardown(self) -> None:
        subprocess.run(["pkill", "-9", "-f", f"{self.dir}/"], check=False)
        if self.coordinator is not None:
            self.coordinator.kill()
            self.coordinator.wait()
        self.cluster.teardown()
        Home(self.home).remove_run_dir()
        if not os.environ.get("CKPTD_KEEP_TEST_DIRS"):
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def three_nodes() -> Iterator[MultiNode]:
    m = MultiNode(["a", "b", "c"])
    try:
        m.start()
        yield m
    finally:
        m.teardown()


class PlainRanks:
    """The uninterrupted result: every rank as a plain process on loopback,
    started at once and run alongside the test; outputs() waits for it."""

    def __init__(self, nranks: int, args: list[str]) -> None:
        env = dict(os.environ, CKPTD_NRANKS=str(nranks), DP_PORT=str(29500 + os.getpid() % 400))
        self.procs = [
            subprocess.Popen(
                [PYTHON, DP, *args], env=dict(env, CKPTD_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for r in range(nranks)
        ]
        self._outs: list[bytes] | None = None

    def outputs(self) -> list[bytes]:
        if self._outs is None:
            self._outs = [p.communicate(timeout=300)[0] for p in self.procs]
            assert all(p.returncode == 0 for p in self.procs), [p.returncode for p in self.procs]
        return self._outs


plain_run = PlainRanks


def assert_identical(m: MultiNode, job: str, expected: PlainRanks) -> None:
    st = m.wait_state(job, ("exited", "failed", "lost", "killed"), timeout=240)
    assert st["state"] == "exited" and st.get("exit_code", 0) == 0, st
    for rank, want in enumerate(expected.outputs()):
        got = m.rank_output(job, rank)
        assert got == want, f"rank {rank} differs from the plain run:\n{got[-600:]!r}\n!=\n{want[-600:]!r}"


def test_two_ranks_restart_on_a_third_node(three_nodes: MultiNode) -> None:
    """Acceptance: 2 ranks on a and b; checkpoints in the middle of their
    all-reduces; node b dies (SIGKILL to everything on it); the job comes
    back with rank 1 on node c, a different node IP, and ends identical."""
    m = three_nodes
    args = ["--steps", "220", "--delay", "0.02"]
    expected = plain_run(2, args)
    m.launch("dp2", [PYTHON, DP, *args], "--nodes", "a,b")
    st = m.status("dp2")
    assert [(r["rank"], r["node"]) for r in st["ranks"]] == [(0, "a"), (1, "b")]
    assert st["ranks"][0]["vip"] != st["ranks"][1]["vip"]
    m.wait_line("dp2", 1, b"step   20")
    m.checkpoint("dp2")
    m.wait_line("dp2", 1, b"step   50")
    info = m.checkpoint("dp2")
    m.wait_line("dp2", 1, b"step   70")
    # killed at once: on a loaded machine the job could finish during the inspection below
    killed = m.cluster.kill_node("b")
    assert killed

    # one directory on shared storage: a whole checkpoint per rank, checksums verified
    shown = json.loads(m.ctl("inspect", info["path"], "--verify", "--json").stdout)
    assert shown["verified"] and sorted({p["rank"] for p in shown["processes"]}) == [0, 1]
    st = m.wait_state("dp2", ("lost", "failed"))
    out = m.ctl("restart", "dp2", "--on", "1=c", "--json")
    resp = json.loads(out.stdout)
    assert resp["checkpoint"]["name"] == info["name"]
    assert [(r["rank"], r["node"]) for r in resp["status"]["ranks"]] == [(0, "a"), (1, "c")]
    assert_identical(m, "dp2", expected)
    # the job's view of its addresses did not change: the restarted rank kept its virtual IP
    final = m.status("dp2")
    assert [r["vip"] for r in final["ranks"]] == [r["vip"] for r in st["ranks"]]
    nodes = {n["node"]: n for n in m.wait_nodes(["a", "c"], dead=("b",))}
    assert nodes["b"]["alive"] is False


def stdout_of(m: MultiNode, job: str, rank: int) -> bytes:
    from ckptd.agent.output import LogFollower

    log = m.storage / job / f"rank-{rank}" / "output.log"
    return b"".join(c.data for c in LogFollower(log, log.with_suffix(".idx")).poll() if c.stream == 1)


def test_torchrun_multinode_gloo(three_nodes: MultiNode, torch_path: str) -> None:
    """torchrun's own multi-node launch under ckptd: one torchrun agent per
    node (static rendezvous at rank 0's address), gloo all_reduce and
    broadcast between the nodes.  Checkpointed mid-training, node b killed,
    restarted with that rank on node c: the same output as a plain run."""
    m = three_nodes
    if torch_path:
        m.env["PYTHONPATH"] = torch_path
    script, steps = str(WORKLOADS / "ddp_gloo.py"), "400"
    # the reference runs alongside (its output is text; the ranks' logs are compared as bytes)
    plain = run_plain(
        [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29561", script, steps],
        env=m.env,
    )
    run = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    m.launch(
        "tr",
        [*run, "--node-rank", "{rank}", "--master-addr", "{master_addr}", "--master-port", "29500", script, steps],
        "--nodes", "a,b",
    )  # fmt: skip
    m.wait_line("tr", 0, b"step 60 ", timeout=120)
    m.checkpoint("tr")
    m.wait_line("tr", 0, b"step 150 ", timeout=120)
    m.checkpoint("tr")
    m.wait_line("tr", 0, b"step 200 ", timeout=120)
    m.cluster.kill_node("b")
    m.wait_state("tr", ("lost", "failed"))
    m.ctl("restart", "tr", "--on", "1=c")
    st = m.wait_state("tr", ("exited", "failed", "lost", "killed"), timeout=240)
    assert st["state"] == "exited", st
    expected = plain.stdout.encode()
    assert stdout_of(m, "tr", 0) == expected
    assert expected.splitlines()[-1].endswith(b"ranks agree True")


def test_four_ranks_auto_restart_after_node_death(three_nodes: MultiNode) -> None:
    """Acceptance: 4 ranks on 3 nodes with --auto-restart: node c dies and the
    coordinator brings the job back on its own; the result is identical."""
    m = three_nodes
    # long enough after step 60 that node c dies before the job ends: with 140
    # steps a slow round let the job finish first (exited 0, nothing to restart)
    args = ["--steps", "300", "--delay", "0.02", "--dim", "8192"]
    expected = plain_run(4, args)
    m.launch("dp4", [PYTHON, DP, *args], "--ranks", "4", "--nodes", "a,b,c", "--auto-restart")
    st = m.status("dp4")
    assert sorted(r["node"] for r in st["ranks"]) == ["a", "a", "b", "c"]
    m.wait_line("dp4", 3, b"step   30")
    taken = m.checkpoint("dp4")
    # each phase is one request per node (Agent.Steps), not one per rank: 3, not 4
    # (the drain only where some rank's all-reduce left unsent bytes as it was parked)
    sent = {p["name"]: p["requests"] for p in taken["phases"] if p["requests"]}
    sent.setdefault("drain", 3)
    assert sent == dict.fromkeys(["ready", "prepare", "drain", "dump", "resume", "finalize"], 3), taken["phases"]
    m.wait_line("dp4", 3, b"step   60")
    m.cluster.kill_node("c")
    assert b"step  299" not in m.rank_output("dp4", 3), "the job ended before node c died"
    # nobody calls restart: the coordinator notices the dead node and moves rank 2
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        st = m.status("dp4")
        if st.get("generation", 0) >= 1 and st["state"] in ("running", "exited"):
            break
        time.sleep(0.5)
    assert all(r["node"] != "c" for r in st["ranks"]), st
    assert_identical(m, "dp4", expected)


def test_preemption_then_stop_and_sigterm(three_nodes: MultiNode) -> None:
    """`ckptctl checkpoint --then-stop` commits a final checkpoint and stops
    the job; SIGTERM to `ckptd launch` does the same.  Each time the job
    resumes from there and ends identical."""
    m = three_nodes
    args = ["--steps", "120", "--delay", "0.02", "--dim", "4096"]
    expected = plain_run(2, args)
    m.launch("pre", [PYTHON, DP, *args], "--nodes", "a,b")
    m.wait_line("pre", 1, b"step   30")
    info = m.checkpoint("pre", "--then-stop")
    st = m.wait_state("pre", ("stopped",))
    assert info["name"] in st["message"]
    assert not st.get("pids")
    m.ctl("restart", "pre")
    m.wait_line("pre", 1, b"step   60")

    # SIGTERM to a foreground `ckptd launch` of another job: final checkpoint, then stop
    fg = subprocess.Popen(
        [CKPTD, "launch", "--job", "pre2", "--ckpt-dir", str(m.storage), "--nodes", "b,c", "--", PYTHON, DP, *args],
        env=m.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    m.wait_line("pre2", 1, b"step   40")
    fg.send_signal(signal.SIGTERM)
    _, err = fg.communicate(timeout=120)
    assert fg.returncode == 128 + signal.SIGTERM, err
    assert "stopped after ckpt-000001" in err
    assert m.status("pre2")["state"] == "stopped"
    m.ctl("restart", "pre2")
    assert_identical(m, "pre", expected)
    assert_identical(m, "pre2", expected)


def test_bad_input_keeps_job_and_checkpoints(three_nodes: MultiNode) -> None:
    """Every failure: a clear error, the job keeps running, and the last
    committed checkpoint stays the one a restart uses."""
    m = three_nodes
    # long enough that the job still runs at step 200, after the failed rounds, on a loaded machine
    args = ["--steps", "700", "--delay", "0.02", "--dim", "4096"]
    expected = plain_run(2, args)
    work = m.dir / "work"
    work.mkdir()

    # a node that does not exist, or does not answer
    p = subprocess.run(
        [CKPTD, "launch", "--detach", "--job", "x", "--nodes", "a,zz", "--", PYTHON, DP],
        env=m.env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 7, p.stderr
    assert "node zz is not answering" in p.stderr

    m.launch("bad", [PYTHON, DP, *args], "--nodes", "a,b", cwd=str(work))
    m.wait_line("bad", 1, b"step   20")
    good = m.checkpoint("bad")

    # two checkpoint requests at once: one wins, the other is refused. A round can end
    # before the other command has started (both then commit, one after the other): again
    for _ in range(5):
        procs = [
            subprocess.Popen([CKPTCTL, "checkpoint", "bad"], env=m.env, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        codes = sorted(p.wait(timeout=120) for p in procs)
        errs = "".join(p.stderr.read() for p in procs if p.stderr)
        if codes != [0, 0]:
            break
    assert codes == [0, 4], errs
    assert "already in progress" in errs

    # a rank that hangs in prepare: stopped with SIGSTOP, it never parks
    st = m.status("bad")
    rank1 = next(r for r in st["ranks"] if r["rank"] == 1)
    os.kill(rank1["pids"][0], signal.SIGSTOP)
    try:
        p = m.ctl("checkpoint", "bad", "--timeout", "2", check=False)
    finally:
        os.kill(rank1["pids"][0], signal.SIGCONT)
    assert p.returncode != 0
    assert "rank 1 on b" in p.stderr, p.stderr
    before = len(m.checkpoints("bad"))
    assert m.status("bad")["state"] == "running"

    # storage that disappears mid-write: the round's directory vanishes under it
    stop = threading.Event()

    def vanish() -> None:
        while not stop.is_set():
            for d in (m.storage / "bad").glob(".ckpt-*"):
                shutil.rmtree(d, ignore_errors=True)

    t = threading.Thread(target=vanish, daemon=True)
    t.start()
    try:
        p = m.ctl("checkpoint", "bad", check=False)
    finally:
        stop.set()
        t.join()
    assert p.returncode != 0, p.stdout
    assert "storage" in p.stderr or "No such file" in p.stderr, p.stderr
    assert len(m.checkpoints("bad")) == before
    assert m.status("bad")["state"] == "running"
    m.wait_line("bad", 1, b"step  200")

    # restart onto nodes that lack the job's files (its working directory)
    m.cluster.kill_node("b")
    m.wait_state("bad", ("lost", "failed"))
    kept = m.checkpoints("bad")
    # a node that is unreachable: a checkpoint says which, and changes nothing
    p = m.ctl("checkpoint", "bad", check=False)
    assert p.returncode in (4, 7), p.stderr
    assert "node b" in p.stderr or "on b" in p.stderr, p.stderr
    assert "not answering" in p.stderr or "unreachable" in p.stderr, p.stderr
    assert "coordinator is unreachable" not in p.stderr, p.stderr  # the coordinator answered: b did not
    assert m.checkpoints("bad") == kept
    shutil.move(str(work), str(m.dir / "elsewhere"))
    p = m.ctl("restart", "bad", "--on", "1=c", check=False)
    assert p.returncode == 4, p.stderr
    assert "working directory" in p.stderr and "does not exist" in p.stderr, p.stderr
    assert m.checkpoints("bad") == kept
    shutil.move(str(m.dir / "elsewhere"), str(work))
    p = m.ctl("restart", "bad", "--on", "1=c", "--lazy", check=False)  # lazy restore: single-node jobs only
    assert p.returncode == 2 and "single-node jobs only" in p.stderr, p.stderr
    resp = json.loads(m.ctl("restart", "bad", "--on", "1=c", "--json").stdout)
    assert resp["checkpoint"]["id"] >= good["id"]
    assert_identical(m, "bad", expected)


def test_coordinator_restart_mid_round(three_nodes: MultiNode) -> None:
    """The coordinator dies while a rank is being quiesced: the parked ranks
    are released by their agents, the half-written round is never
    committed, and a new coordinator takes over the job."""
    m = three_nodes
    # long enough that the job is still running at the final checkpoint on a loaded machine
    args = ["--steps", "300", "--delay", "0.02", "--dim", "4096"]
    expected = plain_run(2, args)
    m.launch("cr", [PYTHON, DP, *args], "--nodes", "a,b")
    m.wait_line("cr", 1, b"step   20")
    m.checkpoint("cr")
    st = m.status("cr")
    rank1 = next(r for r in st["ranks"] if r["rank"] == 1)
    os.kill(rank1["pids"][0], signal.SIGSTOP)  # rank 1 cannot park: the round hangs in prepare
    ck = subprocess.Popen([CKPTCTL, "checkpoint", "cr", "--timeout", "30"], env=m.env, stderr=subprocess.PIPE)
    time.sleep(2)
    assert m.coordinator is not None
    m.coordinator.kill()  # SIGKILL, mid-round
    m.coordinator.wait()
    ck.wait(timeout=30)
    assert ck.returncode != 0
    m.start_coordinator()
    m.wait_nodes(["a", "b", "c"])
    assert not list((m.storage / "cr").glob(".ckpt-*")), "a half-written round survived"
    assert [c["id"] for c in m.checkpoints("cr")] == [1]
    m.wait_state("cr", ("running",))
    # rank 1 goes on only now: with it running while the new coordinator
    # started, a loaded machine let the job end before it was adopted
    os.kill(rank1["pids"][0], signal.SIGCONT)
    m.wait_line("cr", 1, b"step   60")
    m.checkpoint("cr")  # the new coordinator drives a full round
    assert_identical(m, "cr", expected)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
