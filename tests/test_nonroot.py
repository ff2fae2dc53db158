"""The same round trip without root: ckptd puts the job in a user namespace
of its own (mapping only the caller's uid), which is what lets it own the
job's pid namespace and recreate its thread ids."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, ckptd_at, compile_workload, reachable_by_others, run_plain

pytestmark = pytest.mark.serial  # it opens /root and the pytest base directory to another user

NOBODY = (65534, 65534)


@pytest.fixture
def unprivileged(tmp_path: Path) -> Iterator[Ckptd]:
    if os.getuid() != 0:
        home = tmp_path / "home"
        home.mkdir()
        with ckptd_at(home) as c:
            yield c
        return
    base = tmp_path / "nobody"
    base.mkdir()
    for d in (tmp_path, base):
        d.chmod(0o755)
    os.chown(base, *NOBODY)
    home = base / "home"
    home.mkdir()
    os.chown(home, *NOBODY)
    with reachable_by_others(Path(PYTHON), home), ckptd_at(home, user=NOBODY) as c:
        c.env["HOME"] = str(base)
        yield c


def test_round_trip_without_root(unprivileged: Ckptd, ctimer: str, tmp_path: Path) -> None:
    c = unprivileged
    os.chmod(ctimer, 0o755)
    plain = run_plain([ctimer, "250"])
    c.launch("nr", [ctimer, "250"], cwd="/")
    c.wait_log("nr", r"^round 40 ")
    c.checkpoint("nr")
    c.wait_log("nr", r"^round 90 ")
    c.checkpoint("nr")
    c.wait_log("nr", r"^round 120 ")
    c.kill9("nr")
    c.ctl("restart", "nr", "--from", "1")
    c.wait_log("nr", r"^round 60 ")
    c.kill9("nr")
    c.ctl("restart", "nr")
    assert c.wait("nr") == 0
    assert c.log("nr") == plain.stdout


def test_python_numpy_without_root(unprivileged: Ckptd, tmp_path: Path) -> None:
    c = unprivileged
    out = c.home.parent / "out"
    out.mkdir()
    if os.getuid() == 0:
        os.chown(out, *NOBODY)
    ref = tmp_path / "ref"
    ref.mkdir()
    plain = run_plain([PYTHON, str(WORKLOADS / "numpy_train.py"), str(ref), "40", "64"])
    c.launch("nrp", [PYTHON, str(WORKLOADS / "numpy_train.py"), str(out), "40", "64"], cwd="/")
    c.wait_log("nrp", r"^step 8 ")
    c.checkpoint("nrp")
    c.wait_log("nrp", r"^step 16 ")
    c.kill9("nrp")
    c.ctl("restart", "nrp")
    assert c.wait("nrp") == 0
    assert c.log("nrp") == plain.stdout
    assert (out / "losses.txt").read_bytes() == (ref / "losses.txt").read_bytes()


def test_process_tree_without_root(unprivileged: Ckptd, tmp_path: Path) -> None:
    """A tree with a FIFO, a memfd, its own sessions and groups, signals and
    zombies, restored by a user who cannot see beyond its own namespaces."""
    c = unprivileged
    live = c.home.parent / "life"
    live.mkdir()
    if os.getuid() == 0:
        os.chown(live, *NOBODY)
    ref = tmp_path / "ref"
    ref.mkdir()
    argv = [PYTHON, str(WORKLOADS / "lifecycle.py"), "500"]
    plain = run_plain([*argv, str(ref)])
    c.launch("nrt", [*argv, str(live)], cwd="/")
    c.wait_log("nrt", r"^round 100 ")
    assert c.checkpoint("nrt")["processes"] >= 3
    c.wait_log("nrt", r"^round 200 ")
    c.kill9("nrt")
    c.ctl("restart", "nrt")
    assert c.wait("nrt") == 0
    assert c.log("nrt", "stdout") == plain.stdout


def test_tcp_between_processes_without_root(unprivileged: Ckptd) -> None:
    """Without CAP_NET_ADMIN there is no repair mode and no clearing of the
    killed job's TIME_WAIT sockets: listeners that ask for SO_REUSEADDR (as
    servers do) come back on their ports, and connections whose old
    addresses are still taken come back on a new client port."""
    c = unprivileged
    argv = [PYTHON, str(WORKLOADS / "tcp_ipc.py"), "600", "--reuse"]
    plain = run_plain(argv)
    c.launch("nrtcp", argv, cwd="/")
    c.wait_log("nrtcp", r"^round 100 ")
    c.checkpoint("nrtcp")
    c.wait_log("nrtcp", r"^round 200 ")
    c.kill9("nrtcp")
    c.ctl("restart", "nrtcp")
    c.wait_log("nrtcp", r"^round 300 ")
    c.kill9("nrtcp")
    c.ctl("restart", "nrtcp")
    assert c.wait("nrtcp") == 0
    assert c.log("nrtcp", "stdout") == plain.stdout


def _renice(pid: int, nice: int) -> None:
    """Every thread of pid (a daemon whose next restorer inherits it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


@pytest.mark.skipif(os.getuid() != 0, reason="renices the user's daemon, which only root may lower again")
def test_a_nice_value_the_job_cannot_have_again_refuses_the_restart(
    unprivileged: Ckptd, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A job's threads set their own nice values (3 and 7, above the node's
    0: no privilege needed).  Restarted where the node gives the job 10, an
    unprivileged job cannot lower them again: the restart refuses, one line
    naming the nice value, nothing runs, and the checkpoint is kept; back at
    the node's 0 the same checkpoint restarts, and the run ends as an
    uninterrupted one."""
    c = unprivileged
    exe = compile_workload(tmp_path_factory, "proc_attrs")
    os.chmod(exe, 0o755)
    argv = [exe, "40", "attrs", "nice"]
    plain = run_plain(argv)
    c.launch("nice", argv, cwd="/")
    c.wait_log("nice", r"^step 3 ok")
    c.checkpoint("nice")
    c.wait_log("nice", r"^step 6 ok")
    c.kill9("nice")
    log = c.log("nice")
    (daemon,) = c.daemon_pids()
    _renice(daemon, 10)
    try:
        r = c.ctl("restart", "nice", check=False)
        assert r.returncode != 0 and "nice value" in r.stderr and "CAP_SYS_NICE" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert c.status("nice")["state"] not in ("running", "checkpointing")
        assert c.log("nice") == log  # nothing ran
    finally:
        _renice(daemon, 0)
    assert [ck["id"] for ck in c.ctl_json("list", "nice")] == [1]
    c.ctl("restart", "nice")
    assert c.wait("nice") == 0
    assert c.log("nice", "stdout") == plain.stdout
