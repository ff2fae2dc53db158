"""A checkpoint, and a restart, are invisible to blocking calls (issue 18).

tests/workloads/eintr.c makes poll, poll(-1), epoll_wait, epoll_pwait,
nanosleep, select, pselect, ppoll, sigtimedwait, sleep, usleep,
clock_nanosleep (relative and absolute), sigsuspend, a futex wait through
syscall() and a recv under SO_RCVTIMEO, one thread each, and never retries:
any EINTR or early return prints FAIL and exits 1.  The quiesce signal
interrupts every one of them; the shim's wrappers (native/shim/eintr.c)
resume them with the time that was left.
"""

from __future__ import annotations

import re

import pytest
from conftest import Ckptd, compile_workload, run_plain

ROUNDS = 45  # about one second each (the sleep(1) thread)


@pytest.fixture(scope="module")
def eintr_exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "eintr")


def _round(c: Ckptd, job: str) -> int:
    rounds = re.findall(r"^round (\d+) ok", c.log(job, "stdout"), re.M)
    return int(rounds[-1]) if rounds else -1


def _no_fail(c: Ckptd, job: str) -> None:
    out = c.log(job)
    assert "FAIL" not in out, out[-2000:]


def test_blocking_calls_see_no_checkpoint_and_no_restart(ckptd: Ckptd, eintr_exe: str) -> None:
    argv = [eintr_exe, str(ROUNDS)]
    plain = run_plain(argv)
    ckptd.launch("ei", argv)
    ckptd.wait_log("ei", r"^round 1 ok")
    for _ in range(20):  # in a row, while every thread is blocked in its call
        ckptd.checkpoint("ei")
        assert ckptd.status("ei")["state"] == "running"
    _no_fail(ckptd, "ei")
    at = _round(ckptd, "ei")
    assert at < ROUNDS - 8, f"the job ran too far ahead of the checkpoints (round {at})"
    ckptd.wait_log("ei", rf"^round {at + 2} ok")
    ckptd.kill9("ei")
    ckptd.ctl("restart", "ei")
    ckptd.wait_log("ei", rf"^round {at + 4} ok")
    for _ in range(3):
        ckptd.checkpoint("ei")
    assert ckptd.wait("ei") == 0, ckptd.log("ei")[-2000:]
    _no_fail(ckptd, "ei")
    assert ckptd.log("ei", "stdout") == plain.stdout
    # the same call made as a raw system call (not resumed) did see EINTR:
    # the checkpoints really interrupted blocking calls
    m = re.search(r"^control: (\d+) interrupted$", ckptd.log("ei", "stderr"), re.M)
    assert m, ckptd.log("ei", "stderr")
    assert int(m.group(1)) >= 10, m.group(0)
    assert "control: 0 interrupted" in plain.result().stderr


def test_recv_under_so_rcvtimeo_sees_no_checkpoint(ckptd: Ckptd, eintr_exe: str) -> None:
    """recv under SO_RCVTIMEO, with all the other calls, across checkpoints."""
    argv = [eintr_exe, "10"]
    plain = run_plain(argv)
    ckptd.launch("rcv", argv)
    ckptd.wait_log("rcv", r"^round 1 ok")
    for _ in range(6):
        ckptd.checkpoint("rcv")
    assert ckptd.wait("rcv") == 0, ckptd.log("rcv")[-2000:]
    _no_fail(ckptd, "rcv")
    assert " recv\n" in plain.stdout
    assert ckptd.log("rcv", "stdout") == plain.stdout


def test_the_programs_own_signal_in_the_same_instant_still_ends_the_call(ckptd: Ckptd, eintr_exe: str) -> None:
    """ckptd's quiesce signal alone does not end a ppoll (it times out after
    its full time); the program's SIGUSR1 delivered in the same instant
    does, with EINTR, as without ckptd (the shim counts the program's own
    handlers)."""
    ckptd.launch("same", [eintr_exe, "--same-instant"])
    assert ckptd.wait("same") == 0, ckptd.log("same")[-2000:]
    assert ckptd.log("same", "stdout") == (
        "ckptd's signal alone: ppoll timed out\nwith SIGUSR1 in the same instant: EINTR\n"
    )
