"""No refusal that waiting can fix (issue 19).

A state that passes by itself (a connection not yet accepted, descriptors in
flight, a process exiting) is marked transient from the shim's refusal to the
coordinator, which aborts the round (the job runs on, nothing committed) and
runs it again within the checkpoint's timeout: the user sees one success,
and the manifest says how many attempts it took.  A listener's backlog is
better saved than waited for: its connections are made again at restart.
A permanent refusal is never retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import faultmatrix
import pytest
from conftest import CKPTCTL, PYTHON, WORKLOADS, Ckptd, compile_workload, kill_restart_finish, run_plain
from test_bad_input import assert_refused

STEPS = "40"  # 4 s


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "transient")


def manifest(c: Ckptd, job: str) -> dict:
    info = c.ctl_json("list", job)[-1]
    return json.loads((Path(info["path"]) / "manifest.json").read_text())


def test_unix_listener_backlog_saved_exactly(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Two connections waiting in a Unix stream listener's backlog (one shut
    for writing, from a bound client) and one in a seqpacket listener's: the
    checkpoint takes them at once (refused before), and after the restart
    accept() returns them in the same order, each still talking to its client."""
    ref, live = tmp_path / "ref", tmp_path / "live"
    ref.mkdir()
    live.mkdir()
    plain = run_plain([exe, STEPS, "backlog", str(ref)])
    ckptd.launch("bl", [exe, STEPS, "backlog", str(live)])
    ckptd.wait_log("bl", r"^step 2 ok")
    ckptd.checkpoint("bl")
    assert "step 29 ok" not in ckptd.log("bl")  # taken while the connections still waited (accepted at 30)
    assert manifest(ckptd, "bl")["attempts"] == 1  # saved, not waited for
    ckptd.wait_log("bl", r"^step 4 ok")
    kill_restart_finish(ckptd, "bl", plain)


def test_tcp_listener_backlog_is_waited_for(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """A TCP connection not yet accepted refuses the round (a passing state):
    the coordinator tries again, and once the program has accepted it the
    checkpoint succeeds, one success for the user, its attempts in the
    manifest.  Before, the first refusal was the user's."""
    flag = tmp_path / "accept"
    ref_flag = tmp_path / "ref-accept"
    ref_flag.touch()
    plain = run_plain([exe, "60", "tcpbacklog", str(ref_flag)])
    c = ckptd
    c.launch("tb", [exe, "60", "tcpbacklog", str(flag)])
    c.wait_log("tb", r"^step 2 ok")
    attempt = subprocess.Popen(
        [CKPTCTL, "checkpoint", "tb", "--json"], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    operation = ""
    while "trying again" not in operation:  # (read once: the next attempt may start at any moment)
        assert time.monotonic() < deadline and attempt.poll() is None, attempt.communicate()
        time.sleep(0.05)
        operation = c.status("tb").get("operation", "")
    assert "not yet accepted" in operation, operation
    flag.touch()
    out, err = attempt.communicate(timeout=120)
    assert attempt.returncode == 0, err
    assert err.strip() == "" or "error" not in err.lower(), err
    assert json.loads(out)["id"] == 1
    assert manifest(c, "tb")["attempts"] >= 2
    assert "step 55 ok" not in c.log("tb")
    kill_restart_finish(c, "tb", plain)


@faultmatrix.cell(
    "SIGKILL a job process", "dump", "the round is tried again without it: one success, the restart identical"
)
def test_a_process_killed_during_its_dump_is_left_out_of_the_next_attempt(ckptd: Ckptd) -> None:
    """A child killed while the round writes its image (during the pause:
    CKPTD_CAPTURE=sync) fails that attempt, not the checkpoint: the next
    one saves the parent and the child's zombie.  Before, the user got
    "process N exited during DUMP"."""
    c = ckptd
    c.env["CKPTD_CAPTURE"] = "sync"
    argv = [PYTHON, str(WORKLOADS / "killed_child.py"), "200"]
    plain = run_plain(argv)
    c.launch("kc", argv)
    c.wait_log("kc", r"^child \d+")
    nspid = int(re.search(r"^child (\d+)", c.log("kc"), re.M).group(1))  # type: ignore[union-attr]

    def host_pid() -> int:
        for pid in c.status("kc")["pids"]:
            with open(f"/proc/{pid}/status") as f:
                if re.search(rf"^NSpid:.*\s{nspid}$", f.read(), re.M):
                    return int(pid)
        raise AssertionError("the child is not in the job")

    root = c.home / "checkpoints" / "kc"

    def dumping() -> bool:
        # its DUMP is under way: core.img written (the ready step made it empty), its pages next
        for core in root.glob(f".ckpt-*.tmp-*/proc-{nspid}/core.img"):
            with contextlib.suppress(OSError):  # an attempt that ended took its directory with it
                if core.stat().st_size:
                    return True
        return False

    victim = host_pid()
    attempt = subprocess.Popen(
        [CKPTCTL, "checkpoint", "kc", "--json"], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not dumping():
        assert time.monotonic() < deadline and attempt.poll() is None, attempt.communicate()
        time.sleep(0.002)
    os.kill(victim, signal.SIGKILL)
    _, err = attempt.communicate(timeout=120)
    assert attempt.returncode == 0, err
    m = manifest(c, "kc")
    assert m["attempts"] >= 2, m
    c.wait_log("kc", r"^step 60$")
    kill_restart_finish(c, "kc", plain)


def test_permanent_refusal_is_not_retried(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """A file lease cannot be restored, and waiting does not change that: one
    attempt, its own message, the job keeps running."""
    leased = tmp_path / "leased"
    leased.write_text("x")
    ckptd.launch("ls", [exe, "600", "lease", str(leased)])
    ckptd.wait_log("ls", r"^step 2 ok")
    t0 = time.monotonic()
    assert_refused(ckptd, "ls", "file lease", "release it")
    assert time.monotonic() - t0 < 5  # not the 10 s of retries
    log = (ckptd.home / "logs" / "daemon.log").read_text()
    assert "trying again" not in log, log[-2000:]
    assert ckptd.ctl_json("list", "ls") == []
    ckptd.ctl("kill", "ls")


@pytest.mark.slow
def test_pool_with_manager_proxies_checkpointed_20_times(ckptd: Ckptd, tmp_path: Path) -> None:
    """A multiprocessing.Pool whose tasks take Manager proxies (a new
    connection to the Manager per task) is checkpointed 20 times in a row
    with no refusal shown (8 of 12 were refused before: "a listening Unix
    socket has connections not yet accepted"), then killed and restarted,
    and ends as an uninterrupted run does."""
    argv = [PYTHON, str(WORKLOADS / "pool_manager.py"), "60"]
    ref_flag = tmp_path / "ref-go"
    ref_flag.touch()
    plain = run_plain([*argv, str(ref_flag)])
    flag = tmp_path / "go"
    ckptd.launch("pm", [*argv, str(flag)])
    ckptd.wait_log("pm", r"^step 3 ")
    attempts = []
    for _ in range(20):
        ckptd.checkpoint("pm")  # an AssertionError if one is refused
        attempts.append(manifest(ckptd, "pm").get("attempts", 1))
    assert len(ckptd.ctl_json("list", "pm")) == 20
    assert ckptd.status("pm")["state"] == "running"
    print("attempts per checkpoint:", attempts)
    ckptd.kill9("pm")
    ckptd.ctl("restart", "pm")
    flag.touch()
    assert ckptd.wait("pm") == 0, ckptd.log("pm")[-2000:]
    assert ckptd.log("pm", "stdout") == plain.stdout
