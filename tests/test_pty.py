"""Pseudo-terminals saved and restored exactly, or refused (issue 19).

tests/workloads/pty.c opens a pair (/dev/ptmx and /dev/pts/N) and checks
it from inside at every step while the job is checkpointed, killed and
restarted (conftest.exact_round_trip): the same /dev/pts number, termios,
window size, lock and packet mode, master and slave still talking, the
controlling terminal of a session and its foreground group.
"""

from __future__ import annotations

import os

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused
from test_nonroot import unprivileged  # noqa: F401  (a fixture: the unprivileged test's)


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "pty")


def test_pty_pair_with_bytes_in_flight(ckptd: Ckptd, exe: str) -> None:
    """Master in the parent (packet mode), slave in a child that answers
    upper-cased; the answer (output-processed: "X\\r\\n") waits in the
    master's buffer at the checkpoint and is read after the restart."""
    exact_round_trip(ckptd, "ptypair", [exe, "30", "pair"])


def test_pty_controlling_terminal(ckptd: Ckptd, exe: str) -> None:
    """A child's session has the slave as its controlling terminal and a
    grandchild's group in front; the grandchild inherits the terminal."""
    exact_round_trip(ckptd, "ptyctty", [exe, "30", "ctty"])


def test_pty_slave_without_master_refused(ckptd: Ckptd, exe: str) -> None:
    """A slave whose master was closed: the pair cannot be made again."""
    ckptd.launch("ptynomaster", [exe, "100", "nomaster"])
    ckptd.wait_log("ptynomaster", r"^step 2 ok")
    assert_refused(ckptd, "ptynomaster", "/dev/pts/", "master", "held by no process of the job")


def test_pty_locked_again_with_its_slave_open_refused(ckptd: Ckptd, exe: str) -> None:
    """The restart could not open the slave of a locked pair."""
    ckptd.launch("ptyrelock", [exe, "100", "relock"])
    ckptd.wait_log("ptyrelock", r"^step 2 ok")
    assert_refused(ckptd, "ptyrelock", "/dev/pts/0", "locked again", "unlockpt")


def test_pty_on_another_devpts_instance_refused(ckptd: Ckptd, exe: str) -> None:
    """The job unmounted its own instance and opened a pair on the host's:
    its number could not be had again."""
    ckptd.launch("ptyhost", [exe, "100", "hostpts"])
    ckptd.wait_log("ptyhost", r"^step 2 ok")
    assert_refused(ckptd, "ptyhost", "/dev/pts/", "outside the job's own devpts instance")


@pytest.mark.serial  # the unprivileged fixture opens /root and pytest's base directory to another user
def test_pty_pair_without_root(request: pytest.FixtureRequest, exe: str) -> None:
    """In a user namespace: ckptd-init mounts the job's devpts instance there too."""
    c: Ckptd = request.getfixturevalue("unprivileged")
    os.chmod(exe, 0o755)
    exact_round_trip(c, "ptynr", [exe, "60", "pair"])  # a slower start: the CLI runs as another user
