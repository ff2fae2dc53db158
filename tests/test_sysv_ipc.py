"""System V IPC comes back exactly (issue 19): shared memory segments with
their contents, attached by two processes (read-write, read-only, in part),
semaphore sets with their values, a waiter and the SEM_UNDO adjustments of
several processes, message queues with messages
of several types in order and their size; every object under its old id, in
the job's own IPC namespace.  tests/workloads/sysv_ipc.c checks each from
inside at every step, through a checkpoint, kill -9 and restart."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import test_nonroot
from conftest import Ckptd, checkpoint_stopped_at, compile_workload, exact_round_trip, kill_restart_finish, run_plain
from test_bad_input import assert_refused
from test_capture import writers

STEPS = "30"
unprivileged = test_nonroot.unprivileged  # the fixture: a ckptd run as nobody


@pytest.fixture(scope="module")
def sysv_ipc(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "sysv_ipc")


def test_shared_memory(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-shm", [sysv_ipc, STEPS, "shm"])


def test_the_writers_hold_no_attachment_while_the_job_runs_on(ckptd: Ckptd, sysv_ipc: str, tmp_path: Path) -> None:
    """The daemon is stopped at the end of the resume: the job runs again
    while its processes' page writers wait for finalize.  A writer is a fork
    of its process, but inherits none of its shared mappings: the segments'
    attachment counts (shm_nattch), which the job checks every step, stay
    what they were, and the restart ends as the plain run does."""
    fault = tmp_path / "fault"
    ckptd.env["CKPTD_FAULT"] = f"@{fault}"  # read by the daemon, which the first command starts
    argv = [sysv_ipc, "60", "shm"]
    plain = run_plain(argv)
    ckptd.launch("sysv-w", argv)
    ckptd.wait_log("sysv-w", r"^step 3 ok")
    log = ckptd.log_file("sysv-w")  # read directly: no command is answered while the daemon is stopped
    with checkpoint_stopped_at(ckptd, fault, "sysv-w", "resume"):
        assert writers(ckptd), "no page writer waits for finalize: nothing is tested"
        seen = log.read_text().count(" ok\n")
        deadline = time.monotonic() + 30
        while log.read_text().count(" ok\n") < seen + 3:  # three checks of nattch with the writers there
            assert time.monotonic() < deadline and "BAD" not in log.read_text(), log.read_text()[-500:]
            time.sleep(0.05)
        assert writers(ckptd) and "BAD" not in log.read_text(), log.read_text()[-500:]
    kill_restart_finish(ckptd, "sysv-w", plain)


def test_semaphores(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-sem", [sysv_ipc, STEPS, "sem"])


def test_message_queue(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-msg", [sysv_ipc, STEPS, "msg"])


def test_segment_removed_while_attached(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-rmid", [sysv_ipc, STEPS, "rmid"])


def test_sem_undo(ckptd: Ckptd, sysv_ipc: str) -> None:
    """SEM_UNDO adjustments of three processes come back: the kernel undoes each child's at its exit."""
    exact_round_trip(ckptd, "sysv-undo", [sysv_ipc, STEPS, "undo"])


def test_sem_undo_cleared_by_another_refused(ckptd: Ckptd, sysv_ipc: str) -> None:
    """A SETVAL clears every process's adjustment on the set; the child's shim cannot see it."""
    ckptd.launch("sysv-setval", [sysv_ipc, "300", "setval"])
    ckptd.wait_log("sysv-setval", r"^step 2 ok")
    assert_refused(ckptd, "sysv-setval", "SEM_UNDO", "semaphore set")


def test_sem_undo_then_exec_refused(ckptd: Ckptd, sysv_ipc: str) -> None:
    """The kernel keeps the adjustments over an exec; the shim's record of them is lost with the old program."""
    ckptd.launch("sysv-exec", [sysv_ipc, "300", "exec"])
    ckptd.wait_log("sysv-exec", r"^step 2 ok")
    assert_refused(ckptd, "sysv-exec", "SEM_UNDO", "exec")


@pytest.mark.serial  # the unprivileged fixture opens directories to another user
def test_shared_memory_without_root_refused(unprivileged: Ckptd, sysv_ipc: str) -> None:
    """A job in a user namespace shares the host's IPC namespace: its segments are not its own to save."""
    os.chmod(sysv_ipc, 0o755)
    unprivileged.launch("sysv-nr", [sysv_ipc, "300", "rmid"], cwd="/")  # removed at exit: nothing left behind
    unprivileged.wait_log("sysv-nr", r"^step 2 ok")
    assert_refused(unprivileged, "sysv-nr", "System V shared memory", "own IPC namespace")


@pytest.mark.parametrize("kind", ["shm", "sem", "msg"])
def test_an_empty_namespace_is_told_from_one_holding_an_object(kind: str) -> None:
    """The dump saves a job's IPC objects only when its namespace holds any
    (sysv_ipc.holds_objects, asked without starting a child): one object of
    any kind must count, and the asking thread leaves the agent's own
    namespace alone."""
    import ctypes

    from ckptd.agent import sysv_ipc

    if os.geteuid() != 0:
        pytest.skip("a new IPC namespace needs root")
    libc = ctypes.CDLL(None, use_errno=True)
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # a process in an IPC namespace of its own: empty, then one object
        try:
            assert libc.unshare(sysv_ipc.CLONE_NEWIPC) == 0
            os.write(ready[1], b"e")
            os.read(go[0], 1)
            made = {
                "shm": lambda: libc.shmget(0, 4096, 0o1600),
                "sem": lambda: libc.semget(0, 2, 0o1600),
                "msg": lambda: libc.msgget(0, 0o1600),
            }[kind]()
            os.write(ready[1], b"o" if made >= 0 else b"!")
            os.read(go[0], 1)
        finally:
            os._exit(0)
    own = os.stat("/proc/self/ns/ipc").st_ino
    try:
        assert os.read(ready[0], 1) == b"e"
        assert sysv_ipc.own_namespace(pid)
        assert not sysv_ipc.holds_objects(pid)
        os.write(go[1], b"x")
        assert os.read(ready[0], 1) == b"o", f"the child could not make a {kind} object"
        assert sysv_ipc.holds_objects(pid)
        assert os.stat("/proc/self/ns/ipc").st_ino == own
    finally:
        os.write(go[1], b"x")
        os.waitpid(pid, 0)


def test_a_namespace_that_cannot_be_joined_is_not_taken_for_an_empty_one(tmp_path: Path) -> None:
    """holds_objects answers True when it cannot tell (the saving child would
    run), and the saving child ends with one line naming the process and why
    (save() passes its last line on)."""
    import subprocess
    import sys

    from ckptd.agent import sysv_ipc

    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names nobody now
    assert sysv_ipc.holds_objects(child.pid)
    r = subprocess.run(
        [sys.executable, "-m", "ckptd.agent.sysv_ipc", str(child.pid), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",  # as save() runs it: not this source tree's ckptd/
    )
    assert r.returncode == 1
    assert r.stderr.strip() == f"cannot join the IPC namespace of process {child.pid}: No such file or directory"
    assert list(tmp_path.iterdir()) == []
