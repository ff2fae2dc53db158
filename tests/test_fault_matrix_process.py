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
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import faultmatrix
import psutil
import pytest
from conftest import CKPTCTL, Ckptd, compile_workload, run_plain

JOB = "fj"

KILLED = "the round is not committed; the next daemon removes what it left and re-adopts the job, which runs on"
STOPPED = "the caller's call times out; once the daemon runs again the round ends and nothing is left"
JOB_KILLED = "the round fails (or commits a checkpoint that restores); the job is failed, not left parked"
WRITER = "the round fails within the dump timeout; the job runs on; the writer is gone"
LAST_GOOD = "; the last good checkpoint restores byte-identical"


@pytest.fixture(scope="module")
def fault_job(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "fault_job")


class Cell:
    """One job under one daemon, armed for one fault."""

    def __init__(self, c: Ckptd, tmp: Path, exe: str, *extra: str) -> None:
        self.c, self.tmp = c, tmp
        self.armed = tmp / "fault"
        c.env["CKPTD_FAULT"] = f"@{self.armed}"
        c.env["CKPTD_DUMP_TIMEOUT_S"] = "8"  # a stopped writer fails the round in seconds
        self.go = tmp / "go"
        ready = tmp / "plain-go"
        ready.touch()
        Path(f"{ready}2").touch()
        self.plain = run_plain([exe, str(ready)])
        c.launch(JOB, [exe, str(self.go)], *extra)
        c.wait_log(JOB, r"^step 3 ok")
        self.good = c.checkpoint(JOB)
        self.job_dir = Path(c.status(JOB)["log_path"]).parent

    def arm(self, spec: str) -> None:
        self.armed.write_text(spec)

    def fired(self) -> bool:
        return not self.armed.exists()

    def attempt(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A ckptctl command that may fail (its daemon may die under it)."""
        return self.c.ctl(*args, check=False, timeout=timeout)

    def wait_daemon_gone(self) -> None:
        deadline = time.monotonic() + 30
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

CHECKPOINT = ("reserve", "prepare", "drain", "dump", "flush", "finalize", "commit", "resume")


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

AGENT_CHECKPOINT = ("prepare", "drain", "dump", "flush", "finalize", "resume")


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
    assert "the writer of pages.img was killed" in (ckptd.home / "logs" / "daemon.log").read_text()
    cell.nothing_left()
    assert cell.ids() == ([1, 2] if p.returncode == 0 else [1]) and not cell.writers()
    cell.runs_on()
    cell.restores_identical()


HUNG_WRITER = (
    "FLUSH timed out on the agent's side, but the shim's checkpoint thread still waits for the stopped writer "
    "(no DISCARD after a failed finalize): the writer is left, and the process answers nothing more"
)


@pytest.mark.xfail(reason=HUNG_WRITER, strict=True)
@pytest.mark.parametrize(
    "phase", cells("SIGSTOP writer", ("dump", "flush"), WRITER + LAST_GOOD, slow=("dump", "flush"))
)
def test_writer_hung(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job, "--full-every", "1")
    cell.arm(f"writer:{phase}:STOP")
    p = cell.attempt("checkpoint", JOB)
    assert cell.fired() and p.returncode != 0, p.stdout
    cell.nothing_left()
    assert cell.ids() == [1]
    cell.runs_on()
    deadline = time.monotonic() + 10
    while cell.writers():
        assert time.monotonic() < deadline, "the stopped writer is still there"
        time.sleep(0.1)
    cell.restores_identical()


# ---- a restart: the daemon, ckptd-init, the restored job ----

UNVERIFIED = (
    "no restored process runs before its images verified; the next daemon fails the job; a new restart ends identical"
)


def _restart_with(cell: Cell, spec: str, *args: str) -> subprocess.CompletedProcess[str]:
    cell.runs_on()
    cell.c.kill9(JOB)
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
    size = ckptd.log_file(JOB).stat().st_size
    ckptd.start_daemon()
    if phase == "release":  # every image verified and the processes released: it runs on
        st = cell.wait_state("running", "failed")
    else:
        st = cell.wait_state("failed", "lost")
        assert ckptd.log_file(JOB).stat().st_size == size  # not one more line
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
    cell = _readopted(ckptd, tmp_path, fault_job)
    ckptd.ctl("kill", JOB)
    ckptd.ctl("restart", JOB)
    cell.go.touch()
    Path(f"{cell.go}2").touch()
    assert ckptd.wait(JOB) == 0
    assert ckptd.log(JOB, "stdout") == cell.plain.stdout
    cell.nothing_left()
