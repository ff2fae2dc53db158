"""The same round trip without root: ckptd puts the job in a user namespace
of its own (mapping only the caller's uid), which is what lets it own the
job's pid namespace and recreate its thread ids."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, ckptd_at, run_plain

pytestmark = pytest.mark.serial  # it opens /root and the pytest base directory to another user

NOBODY = (65534, 65534)


@contextlib.contextmanager
def reachable_by_others(*paths: Path) -> Iterator[None]:
    """The interpreter may live under a 0700 home (/root/.pyenv), the test's
    files under pytest's 0700 temporary root: let other users traverse those
    directories (not list them) for the duration of the test."""
    blocked = []
    for path in paths:
        for parent in path.resolve().parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH and (parent, mode) not in blocked:
                blocked.append((parent, mode))
                parent.chmod(mode | stat.S_IXOTH)
    try:
        yield
    finally:
        for parent, mode in blocked:
            parent.chmod(mode)


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
