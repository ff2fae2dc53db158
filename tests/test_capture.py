"""Copy-on-write capture: the job runs again as soon as its state is
captured, while a forked writer puts its pages on disk (native/shim/
writeout.c).  The image must still be one instant of the job, and a writer
that fails must cost the checkpoint, never the job or an earlier one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import CKPTCTL, PYTHON, WORKLOADS, Ckptd, checkpoint_stopped_at

ABORTED = 4  # ckptd/errors.py


def snapshot(steps: int, mib: int, pause: float = 0.01) -> list[str]:
    return [PYTHON, str(WORKLOADS / "snapshot.py"), str(steps), str(mib), str(pause)]


def expected(steps: int, mib: int) -> str:
    lines = [f"step {s} ok" for s in range(1, steps + 1)]
    return "\n".join([*lines, f"done {steps * (mib << 17)}"]) + "\n"


def writers(c: Ckptd, exited: bool = False) -> list[psutil.Process]:
    """This installation's page writers still running (and, with exited, those that exited but are not yet reaped).

    Only this test's: the suite runs tests side by side, and another test's writer is not ours to kill.
    """
    out = []
    for p in psutil.process_iter(["name", "status", "environ"]):
        env = p.info["environ"] or {}
        # a zombie's environment cannot be read: its parent's can
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            if not exited:
                continue
            with contextlib.suppress(psutil.Error):
                env = p.parent().environ() if p.parent() else {}
        ours = str(c.home) in (env.get("CKPTD_HOME", ""), env.get("CKPTD_SHIM_SOCKET", ""))
        if p.info["name"] == "ckptd-writer" and ours:
            out.append(p)
    return out


@pytest.mark.parametrize("capture", ["cow", "sync"])
def test_image_is_one_instant_while_the_job_rewrites_its_memory(ckptd: Ckptd, capture: str) -> None:
    """The job rewrites all 256 MiB every few milliseconds, also while its
    pages are being written: after kill -9 and a restart, every page holds
    the value of the same step (cow: the default; sync: CKPTD_CAPTURE=sync,
    also the fallback where the kernel refuses the fork)."""
    c = ckptd
    if capture == "sync":
        c.env["CKPTD_CAPTURE"] = "sync"  # the job's environment is the launching CLI's
    steps, mib = 90, 256
    c.launch("snap", snapshot(steps, mib))
    c.wait_log("snap", r"^step 10 ")
    first = c.checkpoint("snap")
    c.wait_log("snap", r"^step 30 ")
    second = c.checkpoint("snap")
    assert second["parent"] == first["name"]  # an incremental one on a copy-on-write snapshot too
    assert not writers(c)  # reaped once its pages were written
    c.kill9("snap")
    c.ctl("restart", "snap")
    assert c.wait("snap") == 0
    assert c.log("snap", "stdout") == expected(steps, mib)


@pytest.mark.parametrize("phase", ["dump", "resume"])
def test_the_writer_writes_nothing_until_the_round_has_resumed(ckptd: Ckptd, tmp_path: Path, phase: str) -> None:
    """The daemon is stopped at the end of the dump (the job parked) or of
    the resume (the job running, finalize not begun): the process's writer
    has forked but written nothing. On a node with more ranks than cores,
    a writer that started there would take a core from the ranks still
    dumping or resuming, and lengthen every rank's pause. Once the daemon
    goes on, finalize lets the writer write, the checkpoint commits, and
    the job restarts from it to the plain output."""
    c = ckptd
    fault = tmp_path / "fault"
    c.env["CKPTD_FAULT"] = f"@{fault}"  # read by the daemon, which the first command starts
    steps, mib = 60, 64
    c.launch("gate", snapshot(steps, mib, 0.02))
    c.wait_log("gate", r"^step 3 ")
    log = c.log_file("gate")  # read directly: no command is answered while the daemon is stopped
    with checkpoint_stopped_at(c, fault, "gate", phase) as taken:
        (writer,) = writers(c, exited=True)
        assert writer.status() != psutil.STATUS_ZOMBIE, f"the writer finished before the daemon went on ({phase})"
        log_before = log.read_bytes()
        time.sleep(1.0)  # a 64 MiB image takes a small part of that to write
        with open(f"/proc/{writer.pid}/io") as f:
            wchar = int(next(line for line in f if line.startswith("wchar:")).split()[1])
        assert wchar == 0, f"the writer wrote {wchar} bytes before finalize ({phase})"
        if phase == "dump":
            assert log.read_bytes() == log_before  # the job is parked
        else:
            assert log.read_bytes() != log_before  # the job runs: only its writer waits
    info = taken.info
    assert not writers(c)  # it wrote, and FLUSH reaped it
    c.kill9("gate")
    c.ctl("restart", "gate", "--from", str(info["id"]))
    assert c.wait("gate") == 0
    assert c.log("gate", "stdout") == expected(steps, mib)


FORK_LATER = """
import os, sys, time
forked = False
for i in range(3000):
    if not forked and os.path.exists(sys.argv[1]):
        forked = True
        if os.fork() == 0:
            while True:
                time.sleep(0.02)
    print("step", i, flush=True)
    time.sleep(0.02)
"""


def test_a_child_forked_before_finalize_holds_nothing_of_its_parents_writer(ckptd: Ckptd, tmp_path: Path) -> None:
    """The job forks while its writer waits for finalize (the daemon
    stopped at the end of the resume). The child does not keep the gate's
    write end, which would hold the writer back until the child exits,
    and it forgets its parent's writer (its next QUIESCE would kill that
    pid). The checkpoint commits, and the next one saves both processes."""
    c = ckptd
    fault = tmp_path / "fault"
    c.env["CKPTD_FAULT"] = f"@{fault}"
    flag = tmp_path / "fork"
    script = tmp_path / "fork_later.py"
    script.write_text(FORK_LATER)
    c.launch("fl", [PYTHON, str(script), str(flag)])
    c.wait_log("fl", r"^step 3$")
    (parent,) = (p["host_pid"] for p in c.status("fl")["processes"])
    with checkpoint_stopped_at(c, fault, "fl", "resume"):
        (writer,) = writers(c, exited=True)
        gate = os.readlink(f"/proc/{writer.pid}/fd/2")
        assert gate.startswith("pipe:"), gate
        flag.touch()
        deadline = time.monotonic() + 30
        while not (forked := [k for k in psutil.Process(parent).children() if k.name() != "ckptd-writer"]):
            assert time.monotonic() < deadline, "the job did not fork"
            time.sleep(0.05)
        held = {os.readlink(f"/proc/{forked[0].pid}/fd/{fd}") for fd in os.listdir(f"/proc/{forked[0].pid}/fd")}
        assert gate not in held
    second = c.checkpoint("fl")
    assert len(json.loads((Path(second["path"]) / "manifest.json").read_text())["processes"]) == 2
    c.ctl("kill", "fl")


def test_a_job_that_closed_its_stdin_checkpoints_and_restarts(ckptd: Ckptd) -> None:
    """A job that closed descriptor 0 (as daemons do): the dump's own
    descriptors then start at 0, and the writer, which keeps its files as
    0, 1 and 2, must not close one while it moves another. The checkpoint
    commits and restarts to the plain output."""
    c = ckptd
    steps, mib = 40, 32
    closed = f"import os, runpy, sys; os.close(0); sys.argv = {snapshot(steps, mib)[1:]!r}; runpy.run_path(sys.argv[0])"
    c.launch("nostdin", [PYTHON, "-c", closed])
    c.wait_log("nostdin", r"^step 3 ")
    info = c.checkpoint("nostdin")
    c.kill9("nostdin")
    c.ctl("restart", "nostdin", "--from", str(info["id"]))
    assert c.wait("nostdin") == 0
    assert c.log("nostdin", "stdout") == expected(steps, mib)


def test_writer_killed_mid_write_costs_only_that_checkpoint(ckptd: Ckptd) -> None:
    """The writer of a big image is SIGKILLed while it writes: that
    checkpoint fails with a clear error, the job runs on, the earlier
    checkpoint stays and restarts to the same output."""
    c = ckptd
    steps, mib = 70, 768
    c.launch("wk", snapshot(steps, mib, 0.02), "--full-every", "1")
    c.wait_log("wk", r"^step 3 ")
    first = c.checkpoint("wk")
    committed = [first["id"]]
    aborted = False
    for attempt in range(4):  # the writer may finish before it is seen: try again
        c.wait_log("wk", rf"^step {6 + 3 * attempt} ")
        p = subprocess.Popen(
            [CKPTCTL, "checkpoint", "wk"],
            env=c.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:
            for w in writers(c):
                with contextlib.suppress(psutil.NoSuchProcess):  # it may end meanwhile
                    w.send_signal(signal.SIGKILL)
            time.sleep(0.002)
        _out, err = p.communicate(timeout=120)
        if p.returncode == ABORTED:
            aborted = True
            break
        # missed: it had written everything already (a killed zombie, or after its rename)
        assert p.returncode == 0, err
        committed.append(c.ctl_json("list", "wk")[-1]["id"])
    assert aborted, "the writer was never killed while it wrote"
    assert "writer of pages.img was killed" in err and "discarded" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert c.status("wk")["state"] == "running"
    assert [i["id"] for i in c.ctl_json("list", "wk")] == committed  # nothing half-written listed
    job_dir = c.home / "checkpoints" / "wk"
    assert not [n for n in os.listdir(job_dir) if ".tmp-" in n]
    assert not writers(c)
    c.kill9("wk")
    c.ctl("restart", "wk", "--from", str(first["id"]))
    assert c.wait("wk") == 0
    assert c.log("wk", "stdout") == expected(steps, mib)


def test_a_process_that_exits_while_its_pages_are_written_keeps_the_checkpoint(ckptd: Ckptd) -> None:
    """A child exits on its own while its writer is still writing, so while
    the agent waits for it (FLUSH): the writer finishes its image anyway,
    the checkpoint commits with both processes, and the job restarts from
    it to the plain output (the restored child exits again)."""
    c = ckptd
    steps = 100
    c.launch("ex", [PYTHON, str(WORKLOADS / "exit_mid_checkpoint.py"), str(steps)])
    c.wait_log("ex", r"^child ready")
    info = c.checkpoint("ex")
    manifest = json.loads((Path(info["path"]) / "manifest.json").read_text())
    assert len(manifest["processes"]) == 2
    deadline = time.monotonic() + 30
    while len(c.status("ex")["pids"]) > 1:  # the child is gone: it exited during the round
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c.kill9("ex")
    c.ctl("restart", "ex")
    (c.home / "release").touch()  # the parent waits for it after its steps: alive for the kill above
    assert c.wait("ex") == 0
    out = "".join(f"step {s}\n" for s in range(1, steps + 1)) + f"child exited {((768 << 17) - 1) % 7}\n"
    assert c.log("ex", "stdout") == out
