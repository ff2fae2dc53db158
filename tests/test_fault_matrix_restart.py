"""The fault-injection matrix, more restart cells (issue 20): hangs (SIGSTOP)
of ckptd-init, of the daemon and of the agent at the end of a restart's
phases, and storage that fails under a lazy restart's fill.

A hang is a process that stops answering without dying: nothing learns of
it from an exit.  Each hang cell checks: the restart returns within its
timeout, or, where the hung process is the one that must answer, waits
and lets nothing run on alone; no restored process runs before its
images verified (the job's log does not grow while they are parked);
once the hung process is killed, the next daemon start leaves nothing
behind; and the last good checkpoint restores byte-identical.  The cells
reuse test_fault_matrix_process's job, cell and split daemon.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faultfs
import faultmatrix
import psutil
import pytest
from conftest import CKPTCTL, Ckptd, compile_workload
from test_fault_matrix_process import JOB, Cell, Split

INIT_HUNG = (
    "the restart returns at once (the restorers do not wait on ckptd-init) with its images verified; "
    "once the stopped ckptd-init is killed the job goes with it, the next daemon leaves nothing behind; "
    "the last good checkpoint restores byte-identical"
)
DAEMON_HUNG = (
    "the restart waits while the daemon is stopped and nothing runs unverified; killed, the restart fails "
    "with one line, the next daemon fails the job (re-adopts it once released), puts its files back as the "
    "restart found them and leaves nothing behind; "
    "the last good checkpoint restores byte-identical"
)
AGENT_HUNG = (
    "the restart fails with one line once the agent misses its heartbeats, and nothing runs unverified; "
    "once the stopped agent is killed, the next agent fails the job (re-adopts it once released), puts its "
    "files back as the restart found them and leaves nothing behind; the last good checkpoint restores "
    "byte-identical"
)
HANG_S = 2.0  # how long a cell watches that nothing moves on its own while a process is stopped


@pytest.fixture(scope="module")
def fault_job(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "fault_job")


@pytest.fixture
def split(ckptd: Ckptd, tmp_path: Path) -> Iterator[Split]:
    s = Split(ckptd, tmp_path)
    try:
        yield s
    finally:
        s.stop()


def cells(fault: str, phases: tuple[str, ...], promise: str) -> list[Any]:
    return [pytest.param(p, marks=faultmatrix.cell(fault, p, promise), id=p.replace(" ", "-")) for p in phases]


def stopped(pids: list[int], timeout: float = 30) -> list[int]:
    """Those of pids the fault stopped, once it has."""
    deadline = time.monotonic() + timeout
    while True:
        out = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    out.append(pid)
        if out:
            return out
        assert time.monotonic() < deadline, f"none of {pids} stopped"
        time.sleep(0.05)


def restart(cell: Cell, spec: str, *args: str) -> subprocess.Popen[str]:
    """kill -9 the job (past its first wait), arm the fault, start a restart."""
    cell.runs_on()
    cell.c.kill9(JOB)
    cell.log_before = cell.c.log_file(JOB).stat().st_size  # the job's log as the restart finds it
    cell.arm(spec)
    return subprocess.Popen(
        [CKPTCTL, "restart", JOB, *args], env=cell.c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def one_line(p: subprocess.Popen[str], timeout: float) -> str:
    """The failed command's one-line error."""
    _, err = p.communicate(timeout=timeout)
    assert p.returncode != 0, err
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---- ckptd-init (its relay and reaper) ----


@pytest.mark.parametrize("phase", cells("SIGSTOP ckptd-init", ("rebuild", "release", "lazy fill"), INIT_HUNG))
def test_init_hung_during_a_restart(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    ckptd.env["CKPTD_LAZY_FILL_DELAY_MS"] = "20"
    cell = Cell(ckptd, tmp_path, fault_job)
    p = restart(cell, f"init:{phase}:STOP", *(["--lazy"] if phase == "lazy fill" else []))
    out, err = p.communicate(timeout=30)  # nothing in a restart waits on ckptd-init once it has started
    assert p.returncode == 0 and "restarted from ckpt-000001" in out, err
    assert cell.fired()
    hung = stopped(ckptd.init_pids())
    assert cell.state() == "running"
    kill(hung)  # the reaper was pid 1 of the job's namespace: the job goes with it
    ckptd.crash_daemon()
    assert cell.wait_state("failed", "lost")["pids"] == []
    cell.nothing_left()
    cell.restores_identical()


# ---- the daemon (coordinator and agent in one process) ----


@pytest.mark.parametrize("phase", cells("SIGSTOP daemon", ("verify", "rebuild", "release"), DAEMON_HUNG))
def test_daemon_hung_during_a_restart(ckptd: Ckptd, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    daemon = ckptd.daemon_pids()
    p = restart(cell, f"daemon:{phase}:STOP")
    hung = stopped(daemon)
    size = ckptd.log_file(JOB).stat().st_size
    time.sleep(HANG_S)
    assert p.poll() is None  # nothing answers, and
    if phase != "release":  # the rebuilt processes stay parked: not one more line
        assert ckptd.log_file(JOB).stat().st_size == size
    kill(hung)
    err = one_line(p, 30)
    assert "coordinator" in err or "daemon" in err, err
    cell.wait_daemon_gone()  # (a loaded machine can take a moment: the next one must not find it still there)
    ckptd.start_daemon()
    if phase == "release":
        cell.wait_state("running", "failed")
    else:  # the next one plays back the failed restart's journal: the log as the restart found it
        cell.wait_state("failed", "lost")
        assert ckptd.log_file(JOB).stat().st_size == cell.log_before
    cell.nothing_left()
    cell.restores_identical()


# ---- the agent, its own process (the coordinator answers) ----


@pytest.mark.slow  # the node's 3 missed heartbeats (6 s) are the point
@pytest.mark.parametrize("phase", cells("SIGSTOP agent", ("verify", "rebuild", "release"), AGENT_HUNG))
def test_agent_hung_during_a_restart(ckptd: Ckptd, split: Split, tmp_path: Path, fault_job: str, phase: str) -> None:
    cell = Cell(ckptd, tmp_path, fault_job)
    agent = split.procs["agent"].pid
    p = restart(cell, f"agent:{phase}:STOP")
    stopped([agent])
    size = ckptd.log_file(JOB).stat().st_size
    t0 = time.monotonic()
    err = one_line(p, 60)  # once the node missed its heartbeats (6 s), not after the call's hours
    assert time.monotonic() - t0 < 30 and "stopped answering during the restart" in err, err
    if phase != "release":
        assert ckptd.log_file(JOB).stat().st_size == size
    kill([agent])
    split.died("agent")
    split.start("agent")
    if phase == "release":
        cell.wait_state("running", "failed")
    else:  # the next one plays back the failed restart's journal: the log as the restart found it
        cell.wait_state("failed", "lost")
        assert ckptd.log_file(JOB).stat().st_size == cell.log_before
    cell.nothing_left()
    cell.restores_identical()


# ---- storage that fails under a lazy restart's fill ----

LAZY_STORAGE = (
    "the lazily restored job dies (never runs on with pages missing), its status names the cause; "
    "once the storage is back a new restart ends identical"
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[faultfs.FaultFS]:
    faultfs.require()
    fs = faultfs.FaultFS(tmp_path / "real", tmp_path / "store", tmp_path / "faults.json")
    try:
        yield fs
    finally:
        fs.close()


PAGES = f"/{JOB}/ckpt-000001/proc-*/pages.img"  # the memory images a lazy fill reads, on the faultfs


def lazily_restarted(ckptd: Ckptd, store: faultfs.FaultFS, tmp_path: Path, fault_job: str) -> Cell:
    """The fault job on store, past its checkpoint, killed and restarted --lazy (slowly filled)."""
    ckptd.env["CKPTD_LAZY_FILL_DELAY_MS"] = "100"  # 24 MiB in some 20 s: a fault lands mid-fill
    cell = Cell(ckptd, tmp_path, fault_job, "--ckpt-dir", str(store.mountpoint))
    cell.runs_on()
    ckptd.kill9(JOB)
    ckptd.ctl("restart", JOB, "--lazy")
    return cell


def mapping(root: Path) -> list[int]:
    """The processes that map a file under root (a lazy restore's pagers map its images)."""
    pids = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            if str(root) + "/" in maps.read_text():
                pids.append(int(maps.parent.name))
    return pids


@pytest.mark.parametrize(
    "err",
    [
        pytest.param(e, marks=faultmatrix.cell(f"storage {what} ({e})", "lazy fill", LAZY_STORAGE), id=e)
        for e, what in (("EIO", "returns EIO"), ("ENOTCONN", "disappears"))
    ],
)
def test_storage_fails_during_a_lazy_fill(
    ckptd: Ckptd, store: faultfs.FaultFS, tmp_path: Path, fault_job: str, err: str
) -> None:
    cell = lazily_restarted(ckptd, store, tmp_path, fault_job)
    images = sorted((store.mountpoint / JOB / "ckpt-000001").glob("proc-*/pages.img"))
    store.set(err, ops="read", pattern=PAGES, calls=["read"], spread=err == "ENOTCONN")
    # an open drops a FUSE file's cached pages: every later read reaches the faultfs
    for img in images:
        try:
            img.open("rb").close()
        except OSError as e:  # the fill read first: the fault landed, and ENOTCONN took the filesystem
            assert e.errno == getattr(errno, err) and store.injected(), e
            break
    deadline = time.monotonic() + 30
    while not store.injected():
        assert time.monotonic() < deadline, "the fill read nothing"
        time.sleep(0.05)
    if err == "ENOTCONN":
        # storage back only once every pager has gone: a pager that failed
        # reads the byte again to name the error, and must see it fail too
        while mapping(store.mountpoint):
            assert time.monotonic() < deadline, f"pagers still map the images: {mapping(store.mountpoint)}"
            time.sleep(0.05)
        store.set(None)  # (the job's status is read from its directory, on the same storage)
    st = cell.wait_state("failed")
    errno_text = {"EIO": "(errno 5)", "ENOTCONN": "(errno 107)"}[err]
    assert "cannot read the memory image" in st["message"] and errno_text in st["message"], st["message"]
    assert st["pids"] == []
    store.set(None)
    assert "BAD" not in ckptd.log(JOB)
    cell.nothing_left()
    cell.restores_identical()


BLIP = 10


@faultmatrix.cell(
    "storage returns EIO for a moment (10 reads)",
    "lazy fill",
    "the pager reads the page's byte again, finds the storage back and copies the page again: "
    "the job runs on and ends identical",
)
def test_storage_that_fails_for_a_moment_under_a_lazy_fill(
    ckptd: Ckptd, store: faultfs.FaultFS, tmp_path: Path, fault_job: str
) -> None:
    cell = lazily_restarted(ckptd, store, tmp_path, fault_job)
    # ten reads fail, then the storage is back: more than the kernel's own retries of a page-in absorb
    store.set("EIO", ops="read", pattern=PAGES, calls=["read"], times=BLIP)
    for img in sorted((store.mountpoint / JOB / "ckpt-000001").glob("proc-*/pages.img")):
        with contextlib.suppress(OSError):  # (the fill may read first and take the one fault)
            img.open("rb").close()  # an open drops a FUSE file's cached pages: later reads reach the faultfs
    deadline = time.monotonic() + 30
    while not store.injected():
        assert time.monotonic() < deadline, "the fill read nothing"
        time.sleep(0.05)
    Path(f"{cell.go}2").touch()
    st = cell.wait_state("exited", "failed", timeout=120)
    assert st["state"] == "exited", st.get("message")
    out = ckptd.log(JOB)
    assert ckptd.wait(JOB) == 0 and "BAD" not in out, out[-2000:]
    assert ckptd.log(JOB, "stdout") == cell.plain.stdout
    # more than the kernel's own second try of a page-in absorbs (the pager before this one failed at 8)
    assert len(store.injected()) > 2, store.injected()
    cell.nothing_left()
