"""The fault-injection matrix, process faults (issue 20): SIGKILL and SIGSTOP of
the job, the shim's writer, ckptd-init, the agent, the coordinator and the
daemon at the end of each phase of a checkpoint, a restart and an upload.

Faults are injected at fault points (ckptd/faults.py): CKPTD_FAULT=@FILE in
the daemon's and the job's environment, and FILE armed with WHO:PHASE:SIGNAL
when the test wants it; the fault fires once, exactly at that phase's end.
No cell races a log line.

Every cell runs tests/workloads/fault_job.c (two processes, a pipe, 24 MiB
it rewrites and checks at every step), checkpointed good at step 3 while it
waits for a file at step 4; then the fault; then the recovery a person
would do (start the daemon again, SIGCONT what was stopped); then the
promises: the job is alive when it should be, nothing is committed that
does not restore, nothing is left behind (temporary directories, sockets,
processes), and a restart from the latest committed checkpoint ends with
the output of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faultmatrix
import psutil
import pytest
from conftest import CKPTCTL, CKPTD, Ckptd, compile_workload, run_plain

JOB = "fj"

KILLED = "the round is not committed; the next daemon removes what it left and re-adopts the job, which runs on"
STOPPED = "the caller's call times out; once the daemon runs again the round ends and nothing is left"
AGENT_STOPPED = (
    "the round fails once the agent's heartbeats stop, not at the phase's timeout (hours for a dump); once the agent"
    " runs again it releases the job and nothing is left"
)
JOB_KILLED = "the round fails (or commits a checkpoint that restores); the job is failed, not left parked"
WRITER = "the round fails within the dump timeout; the job runs on; the writer is gone"
LAST_GOOD = "; the last good checkpoint restores byte-identical"


@pytest.fixture(scope="module")
def fault_job(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "fault_job")


def fault_env(c: Ckptd, tmp: Path) -> Path:
    """The environment of every ckptd process and job of a cell: the fault file, short timeouts."""
    c.env["CKPTD_FAULT"] = f"@{tmp / 'fault'}"
    c.env["CKPTD_DUMP_TIMEOUT_S"] = "8"  # a stopped writer fails the round in seconds
    c.env["CKPTD_RELEASE_TIMEOUT_S"] = "4"  # and a stopped process its release
    return tmp / "fault"


class Cell:
    """One job under one daemon, armed for one fault."""

    def __init__(self, c: Ckptd, tmp: Path, exe: str, *extra: str) -> None:
        self.c, self.tmp = c, tmp
        self.armed = fault_env(c, tmp)
        self.go = tmp / "go"
        ready = tmp / "plain-go"
        ready.touch()
        Path(f"{ready}2").touch()
        self.plain = run_plain([exe, str(ready)])
        c.launch(JOB, [exe, str(self.go)], *extra)
        c.wait_log(JOB, r"^step 3 ok")
        self.good = c.checkpoint(JOB)
        self.job_dir = Path(c.status(JOB)["log_path"]).parent
        self.log_before = -1  # set by _restart_with

    def arm(self, spec: str) -> None:
        self.armed.write_text(spec)

    def fired(self) -> bool:
        return not self.armed.exists()

    def attempt(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A ckptctl command that may fail (its daemon may die under it)."""
        return self.c.ctl(*args, check=False, timeout=timeout)

    def wait_daemon_gone(self) -> None:
        deadline = time.monotonic() + 90
        while self.c.daemon_pids():
            assert time.monotonic() < deadline, "the daemon did not die"
            time.sleep(0.05)

    def ids(self) -> list[int]:
        return [int(c["id"]) for c in self.c.ctl_json("list", JOB)]

    def nothing_left(self, job_dir: Path | None = None) -> None:
        """No temporary checkpoint directory, no socket nobody serves."""
        left = sorted(p.name for p in (job_dir or self.job_dir).glob(".ckpt-*"))
        assert not left, f"left behind: {left}"
        from ckptd.paths import Home

        for sock in Home(self.c.home).run_dir.glob("*.sock"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                try:
                    s.connect(str(sock))
                except OSError as e:
                    raise AssertionError(f"stale socket {sock.name} left behind: {e}") from None

    def writers(self) -> list[int]:
        out = []
        for p in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error):
                if p.info["name"] == "ckptd-writer" and any(str(self.tmp) in a for a in p.parent().cmdline()):
                    out.append(p.pid)
        return out

    def state(self) -> str:
        return str(self.c.status(JOB)["state"])

    def wait_state(self, *states: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st = self.c.status(JOB)
        while st["state"] not in states:
            assert time.monotonic() < deadline, f"job is {st['state']} ({st.get('message')}), not {states}"
            time.sleep(0.1)
            st = self.c.status(JOB)
        return st

    def runs_on(self) -> None:
        """The job is running, not parked: it gets past its first wait."""
        assert self.wait_state("running")["state"] == "running"
        self.go.touch()
        self.c.wait_log(JOB, r"^step 6 ok", timeout=30)

    def restores_identical(self) -> None:
        """kill -9 (if alive), restart from the latest committed checkpoint: the
        job ends with an uninterrupted run's output, and leaves nothing."""
        self.go.touch()
        if self.state() in ("running", "checkpointing"):
            self.c.kill9(JOB)
        self.c.ctl("restart", JOB)
        Path(f"{self.go}2").touch()
        rc = self.c.wait(JOB)
        out = self.c.log(JOB)
        assert rc == 0 and "BAD" not in out, out[-2000:]
        assert self.c.log(JOB, "stdout") == self.plain.stdout
        deadline = time.monotonic() + 10
        while self.c.init_pids() or self.writers():
            assert time.monotonic() < deadline, f"processes left: {self.c.init_pids()} {self.writers()}"
            time.sleep(0.1)
        self.nothing_left()


def cells(fault: str, phases: tuple[str, ...], promise: str, slow: tuple[str, ...] = ()) -> list[Any]:
    return [
        pytest.param(
            phase,
            marks=[faultmatrix.cell(fault, phase, promise)] + ([pytest.mark.slow] if phase in slow else []),
            id=phase,
        )
        for phase in phases
    ]


# ---- the daemon (coordinator and agent in one process) ----

CHECKPOINT = ("reserve", "ready", "prepare", "drain", "dump", "flush", "finalize", "commit", "resume")


@pytest.mark.parametrize("phase", cells("SIGKILL daemon", CHECKPOINT, KILLED + LAST_GOOD, slow=CHECKPOINT[1:-1]))
def test_daemon_killed_during_a_checkpoint(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    cell.arm(f"daemon:{phase}:KILL")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired() and p.returncode != 0, p.stderr
    cell.wait_daemon_gone()
    ckptd.start_daemon()
    cell.nothing_left()
    assert cell.ids() == [1]
    cell.runs_on()
    cell.restores_identical()


@pytest.mark.parametrize(
    "phase", cells("SIGSTOP daemon", CHECKPOINT, STOPPED + LAST_GOOD, slow=CHECKPOINT[:3] + CHECKPOINT[4:])
)
def test_daemon_hung_during_a_checkpoint(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    daemon = ckptd.daemon_pids()
    cell.arm(f"daemon:{phase}:STOP")
    p = subprocess.Popen([CKPTCTL, "checkpoint", JOB], env=ckptd.env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (cell.fired() and all(psutil.Process(d).status() == psutil.STATUS_STOPPED for d in daemon)):
        assert time.monotonic() < deadline and p.poll() is None, "the daemon never stopped"
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):  # a hang: nothing answers, nothing moves on alone
        p.wait(timeout=1)
    for d in daemon:
        os.kill(d, signal.SIGCONT)
    assert p.wait(timeout=60) == 0, p.stderr.read() if p.stderr else ""  # the round ends: here, committed
    p.stderr and p.stderr.close()
    cell.nothing_left()
    assert cell.ids() == [1, 2]
    cell.runs_on()
    cell.restores_identical()


# ---- the job's own processes ----

AGENT_CHECKPOINT = ("ready", "prepare", "drain", "dump", "flush", "finalize", "resume")


@pytest.mark.parametrize(
    "phase", cells("SIGKILL job", AGENT_CHECKPOINT, JOB_KILLED + LAST_GOOD, slow=AGENT_CHECKPOINT[1:])
)
def test_job_killed_during_a_checkpoint(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    cell.arm(f"job:{phase}:KILL")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired()
    # parked when it died: the round cannot finish; running again: its images may be whole
    assert p.returncode != 0 or phase in ("resume", "flush", "finalize"), p.stdout
    assert cell.wait_state("failed")["pids"] == []
    cell.nothing_left()
    assert cell.ids() == ([1, 2] if p.returncode == 0 else [1])
    cell.restores_identical()


@pytest.mark.parametrize(
    "phase",
    cells(
        "SIGSTOP job",
        AGENT_CHECKPOINT,
        "the round fails or commits, within its timeouts; after SIGCONT the job runs on" + LAST_GOOD,
        slow=AGENT_CHECKPOINT[1:],
    ),
)
def test_job_stopped_during_a_checkpoint(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    cell.arm(f"job:{phase}:STOP")
    pids = ckptd.status(JOB)["pids"]
    p = cell.attempt("checkpoint", JOB, timeout=150)
    assert cell.fired()
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    cell.nothing_left()
    assert cell.ids() == ([1, 2] if p.returncode == 0 else [1]), p.stderr
    cell.runs_on()
    cell.restores_identical()


# ---- the shim's forked writer ----


@pytest.mark.parametrize("phase", cells("SIGKILL writer", ("dump", "flush"), WRITER + LAST_GOOD))
def test_writer_killed(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job, "--full-every", "1")  # an incremental image is staged: no writer
    cell.arm(f"writer:{phase}:KILL")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired()
    # the round that lost its writer is discarded; the checkpoint's next try may commit
    log = (ckptd.home / "logs" / "daemon.log").read_text()
    assert "the writer of pages.img was killed" in log, (p.returncode, p.stdout, p.stderr)
    cell.nothing_left()
    assert cell.ids() == ([1, 2] if p.returncode == 0 else [1]) and not cell.writers()
    cell.runs_on()
    cell.restores_identical()


@pytest.mark.parametrize(
    "phase", cells("SIGSTOP writer", ("dump", "flush"), WRITER + LAST_GOOD, slow=("dump", "flush"))
)
def test_writer_hung(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job, "--full-every", "1")
    cell.arm(f"writer:{phase}:STOP")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired()
    # the round whose writer hung is discarded and the writer killed; the next try may commit
    assert "did not answer FLUSH" in (ckptd.home / "logs" / "daemon.log").read_text()
    cell.nothing_left()
    assert cell.ids() == ([1, 2] if p.returncode == 0 else [1])
    cell.runs_on()
    deadline = time.monotonic() + 10
    while cell.writers():
        assert time.monotonic() < deadline, "the stopped writer is still there"
        time.sleep(0.1)
    cell.restores_identical()


# ---- a restart: the daemon, ckptd-init, the restored job ----

UNVERIFIED = (
    "no restored process runs before its images verified; the next daemon fails the job and puts its files back"
    " as they were before the restart; a new restart ends identical"
)


def _restart_with(cell: Cell, spec: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A restart with the fault armed; cell.log_before: the job's log as the restart found it."""
    cell.runs_on()
    cell.c.kill9(JOB)
    cell.log_before = cell.c.log_file(JOB).stat().st_size
    cell.arm(spec)
    p = cell.attempt("restart", JOB, *args)
    assert cell.fired(), p.stderr
    return p


@pytest.mark.parametrize(
    "phase", cells("SIGKILL daemon", ("verify", "rebuild", "release"), UNVERIFIED, slow=("verify", "release"))
)
def test_daemon_killed_during_a_restart(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    p = _restart_with(cell, f"daemon:{phase}:KILL")
    assert p.returncode != 0
    cell.wait_daemon_gone()
    ckptd.start_daemon()
    if phase == "release":  # every image verified and the processes released: it runs on
        st = cell.wait_state("running", "failed")
    else:  # the next daemon plays back the restart's journal: the log as the restart found it
        st = cell.wait_state("failed", "lost")
        assert ckptd.log_file(JOB).stat().st_size == cell.log_before
    assert st["state"] in ("running", "failed", "lost")
    cell.nothing_left()
    cell.restores_identical()


@pytest.mark.parametrize(
    "phase",
    cells(
        "SIGKILL ckptd-init",
        ("rebuild", "release"),
        "the restart fails or the job fails; the job's files are as they were; a new restart ends identical",
    ),
)
def test_init_killed_during_a_restart(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    _restart_with(cell, f"init:{phase}:KILL")
    cell.wait_state("failed")
    if phase == "rebuild":  # nothing of the job ran: its files are as the restart found them
        assert ckptd.log_file(JOB).stat().st_size == cell.log_before
    cell.nothing_left()
    cell.restores_identical()


@pytest.mark.parametrize(
    "phase",
    cells(
        "SIGKILL job",
        ("rebuild", "release"),
        "the restart fails or the job fails; a new restart ends identical",
        slow=("rebuild",),
    ),
)
def test_job_killed_during_a_restart(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    _restart_with(cell, f"job:{phase}:KILL")
    cell.wait_state("failed")
    cell.nothing_left()
    cell.restores_identical()


@pytest.mark.parametrize(
    "who",
    [
        pytest.param(
            w,
            marks=faultmatrix.cell(
                f"SIGKILL {w}", "lazy fill", "the filling job dies; the next restart ends identical"
            ),
            id=w,
        )
        for w in ("daemon", "ckptd-init")
    ],
)
def test_killed_during_a_lazy_fill(ckptd: Ckptd, tmp_path: Path, fault_job: str, who: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    spec = "daemon" if who == "daemon" else "init"
    ckptd.env["CKPTD_LAZY_FILL_DELAY_MS"] = "50"
    _restart_with(cell, f"{spec}:lazy fill:KILL", "--lazy")
    if who == "daemon":
        cell.wait_daemon_gone()
        ckptd.start_daemon()
    cell.wait_state("failed", "running")
    cell.nothing_left()
    cell.restores_identical()


# ---- an upload to the shared tier ----


@pytest.mark.parametrize(
    "phase",
    cells(
        "SIGKILL daemon",
        ("upload",),
        "the shared tier gets no half copy; the next daemon uploads it again; the job runs on" + LAST_GOOD,
    ),
)
def test_daemon_killed_during_an_upload(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    stage, shared = tmp_path / "stage", tmp_path / "shared"
    cell = Cell(ckptd, tmp_path, fault_job, "--stage-dir", str(stage), "--ckpt-dir", str(shared))
    cell.job_dir = stage / JOB
    # the fault is for the second checkpoint's upload: armed while the
    # first one's still ran, it killed the daemon before the checkpoint
    # below, whose command then started a new one (a command 0.2 s faster)
    deadline = time.monotonic() + 60
    while not (shared / JOB / "ckpt-000001").is_dir():
        assert time.monotonic() < deadline, "the first checkpoint never reached the shared tier"
        time.sleep(0.05)
    cell.arm("daemon:upload:KILL")
    cell.attempt("checkpoint", JOB)  # committed on the stage; its upload kills the daemon
    cell.wait_daemon_gone()
    assert cell.fired()
    ckptd.start_daemon()
    deadline = time.monotonic() + 60
    while not (shared / JOB / "ckpt-000002").is_dir():
        assert time.monotonic() < deadline, "the upload was not done again"
        time.sleep(0.2)
    cell.nothing_left(shared / JOB)
    cell.runs_on()
    cell.restores_identical()


# ---- states after a re-adoption are exact ----


def _readopted(ckptd: Ckptd, tmp_path: Path, fault_job: str) -> Cell:
    cell = Cell(ckptd, tmp_path, fault_job)
    for pid in ckptd.daemon_pids():
        os.kill(pid, signal.SIGKILL)
    cell.wait_daemon_gone()
    ckptd.start_daemon()
    assert "re-adopted" in cell.wait_state("running")["message"]
    return cell


def test_kill_after_a_readoption_says_killed(ckptd: Ckptd, tmp_path: Path, fault_job: str) -> None:
    """`ckptctl kill` of a re-adopted job printed a stale `running`."""
    cell = _readopted(ckptd, tmp_path, fault_job)
    p = ckptd.ctl("kill", JOB)
    assert "running" not in p.stdout and "killed" in p.stdout, p.stdout
    assert cell.state() == "killed"


def test_restart_right_after_killing_a_readopted_job(ckptd: Ckptd, tmp_path: Path, fault_job: str) -> None:
    """A restart right after `kill` failed with `still running on vm (pids )`."""
    from ckptd.v1 import ckptd_pb2 as pb

    cell = _readopted(ckptd, tmp_path, fault_job)
    # back to back, as a script's two commands would be on a fast machine (the CLI's start-up hid it)
    ckptd._rpc("KillJob", pb.KillJobRequest(job=JOB), 60, "kill")
    ckptd._rpc("Restart", pb.RestartRequest(job=JOB), 120, "restart")
    cell.go.touch()
    Path(f"{cell.go}2").touch()
    assert ckptd.wait(JOB) == 0
    assert ckptd.log(JOB, "stdout") == cell.plain.stdout
    cell.nothing_left()


# ---- multi-node mode: a coordinator and an agent, each its own process ----


def _serves(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


class Split:
    """`ckptd coordinator` and `ckptd agent` as two processes (the daemon's two halves)."""

    def __init__(self, c: Ckptd, tmp: Path) -> None:
        self.c, self.tmp = c, tmp
        self.sock = tmp / "coord.sock"
        c.env["CKPTD_COORDINATOR"] = f"unix:{self.sock}"
        fault_env(c, tmp)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.start("coordinator")
        self.start("agent")

    def start(self, who: str) -> None:
        argv = (
            [CKPTD, "coordinator", "--listen", f"unix:{self.sock}"]
            if who == "coordinator"
            else [CKPTD, "agent", "--coordinator", f"unix:{self.sock}",
                  "--listen", f"unix:{self.tmp / 'agent.sock'}"]
        )  # fmt: skip
        with open(self.tmp / f"{who}.log", "ab") as out:
            self.procs[who] = subprocess.Popen(argv, env=self.c.env, stdout=out, stderr=out, start_new_session=True)
        if who == "agent":  # served (a killed one's heartbeat may still make its node look alive)
            deadline = time.monotonic() + 30
            while not _serves(self.tmp / "agent.sock"):
                assert time.monotonic() < deadline and self.procs[who].poll() is None, "the agent did not start"
                time.sleep(0.1)
        if who == "agent" or "agent" in self.procs:
            self.wait_node()

    def wait_node(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            p = self.c.ctl("nodes", "--json", check=False)
            if p.returncode == 0 and any(n.get("alive") for n in json.loads(p.stdout)):
                return
            assert time.monotonic() < deadline, f"no live node: {p.stdout} {p.stderr}"
            time.sleep(0.2)

    def died(self, who: str) -> None:
        assert self.procs[who].wait(timeout=60) is not None

    def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


@pytest.fixture
def split(ckptd: Ckptd, tmp_path: Path) -> Iterator[Split]:
    s = Split(ckptd, tmp_path)
    try:
        yield s
    finally:
        s.stop()


COORDINATOR = ("reserve", "ready", "prepare", "drain", "dump", "finalize", "commit", "resume")
COORDINATOR_KILLED = (
    "the round is not committed; the agent releases the parked job; the next coordinator removes what it left"
)


@pytest.mark.parametrize(
    "phase", cells("SIGKILL coordinator", COORDINATOR, COORDINATOR_KILLED + LAST_GOOD, slow=COORDINATOR[:-1])
)
def test_coordinator_killed_during_a_checkpoint(
    ckptd: Ckptd, split: Split, tmp_path: Path, fault_job: str, phase: str
) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    cell.arm(f"coordinator:{phase}:KILL")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired() and p.returncode != 0, p.stdout
    split.died("coordinator")
    split.start("coordinator")
    cell.nothing_left()
    assert cell.ids() == [1]
    cell.runs_on()
    cell.restores_identical()


AGENT_KILLED = "the round is not committed; the job runs on; the next agent re-adopts it"


@pytest.mark.parametrize(
    "phase", cells("SIGKILL agent", AGENT_CHECKPOINT, AGENT_KILLED + LAST_GOOD, slow=AGENT_CHECKPOINT[1:])
)
def test_agent_killed_during_a_checkpoint(
    ckptd: Ckptd, split: Split, tmp_path: Path, fault_job: str, phase: str
) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    cell.arm(f"agent:{phase}:KILL")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired() and p.returncode != 0, p.stdout
    split.died("agent")
    split.start("agent")
    cell.nothing_left()
    assert cell.ids() == [1]
    cell.runs_on()
    cell.restores_identical()


@pytest.mark.parametrize(
    "phase", cells("SIGKILL agent", ("verify", "rebuild", "release"), UNVERIFIED, slow=("verify", "release"))
)
def test_agent_killed_during_a_restart(ckptd: Ckptd, split: Split, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    p = _restart_with(cell, f"agent:{phase}:KILL")
    assert p.returncode != 0
    split.died("agent")
    split.start("agent")
    if phase == "release":
        cell.wait_state("running", "failed")
    else:  # the next agent plays back the restart's journal: the log as the restart found it
        cell.wait_state("failed", "lost")
        assert ckptd.log_file(JOB).stat().st_size == cell.log_before
    cell.nothing_left()
    cell.restores_identical()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            f"{who}:{phase}",
            marks=[
                faultmatrix.cell(f"SIGSTOP {who}", phase, (AGENT_STOPPED if who == "agent" else STOPPED) + LAST_GOOD),
                pytest.mark.slow,
            ],
            id=f"{who}-{phase}",
        )
        for who in ("coordinator", "agent")
        for phase in ("prepare", "dump")
    ],
)
def test_half_hung_during_a_checkpoint(ckptd: Ckptd, split: Split, tmp_path: Path, fault_job: str, case: str) -> None:
    who, phase = case.split(":")
    cell = Cell(ckptd, tmp_path, fault_job)
    cell.arm(f"{who}:{phase}:STOP")
    p = subprocess.Popen([CKPTCTL, "checkpoint", JOB], env=ckptd.env, stderr=subprocess.PIPE, text=True)
    pid = split.procs[who].pid
    deadline = time.monotonic() + 30
    while not (cell.fired() and psutil.Process(pid).status() == psutil.STATUS_STOPPED):
        assert time.monotonic() < deadline and p.poll() is None, "it never stopped"
        time.sleep(0.05)
    time.sleep(8)  # longer than the agent's wait for a heartbeat answer, and than DEAD_AFTER_S
    os.kill(pid, signal.SIGCONT)
    _, err = p.communicate(timeout=120)
    rc = p.returncode
    if who == "agent":  # its heartbeats stopped: the round failed then, not at the phase's timeout (hours)
        assert rc != 0 and "stopped answering" in err, err
    cell.nothing_left()
    assert cell.ids() == ([1, 2] if rc == 0 else [1])
    cell.runs_on()
    cell.restores_identical()
