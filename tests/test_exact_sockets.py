"""Sockets and odd descriptors come back exactly, or the checkpoint is refused
(issue 18, "Exact or refused").

tests/workloads/exact_sockets.c sets the state up and checks it from inside
at every step (state_check.h); conftest.exact_round_trip checkpoints it,
kills it and restarts it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import PYTHON, Ckptd, compile_workload, exact_round_trip, run_plain
from test_bad_input import assert_refused, one_line_error

STEPS = "50"  # 5 s: a checkpoint under load must not outlast the program


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "exact_sockets")


def test_epoll_registrations(ckptd: Ckptd, exe: str) -> None:
    """One file through two descriptors, a registration whose descriptor number
    was closed and given to another registered file, EPOLLET, EPOLLONESHOT
    armed and disabled, EPOLLEXCLUSIVE and a nested epoll: epoll_wait reports
    the same events with the same data after the restart."""
    exact_round_trip(ckptd, "ep", [exe, STEPS, "epoll"])


def test_epoll_set_shared_with_a_child_is_refused(ckptd: Ckptd, exe: str) -> None:
    """Each process gets its own epoll set back: one shared through fork is refused."""
    ckptd.launch("epf", [exe, "600", "epollfork"])
    ckptd.wait_log("epf", r"^step 2 ok")
    assert_refused(ckptd, "epf", "epoll descriptor", "shared with the parent process", "inherited through fork")


def test_two_reuseport_listeners_on_one_port(ckptd: Ckptd, exe: str) -> None:
    exact_round_trip(ckptd, "rp", [exe, STEPS, "reuseport"])


def test_socket_options(ckptd: Ckptd, exe: str) -> None:
    """SO_LINGER, keepalive timers, TCP_USER_TIMEOUT, TCP_CONGESTION, SO_PRIORITY,
    IP_TOS, SO_RCVLOWAT, SO_RCVTIMEO and SO_SNDTIMEO on a TCP listener, both
    ends of a connection and a Unix socket pair, read back with getsockopt."""
    exact_round_trip(ckptd, "so", [exe, STEPS, "sockopts"])


def test_o_path_descriptors(ckptd: Ckptd, exe: str) -> None:
    exact_round_trip(ckptd, "op", [exe, STEPS, "opath"])


def test_removed_open_directory(ckptd: Ckptd, exe: str) -> None:
    """Made again, opened and removed again (issue 19; it was refused before)."""
    exact_round_trip(ckptd, "rd", [exe, STEPS, "rmdir"])


def test_restorer_failing_in_a_child_fails_the_restart_at_once(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """A restorer that fails in a process other than the first (here: the
    directory it had open is gone) fails the restart at once: the others,
    parked, wait for it, and the agent waited for its deadline, a minute."""
    data = tmp_path / "input"
    data.mkdir()
    ckptd.launch("child", ["/bin/sh", "-c", f"{exe} 600 dir {data}; true"])
    ckptd.wait_log("child", r"^step 2 ok")
    ckptd.checkpoint("child")
    ckptd.kill9("child")
    data.rmdir()
    started = time.monotonic()
    p = ckptd.ctl("restart", "child", check=False)
    assert p.returncode != 0
    one_line_error(p, "cannot reopen a directory", str(data))
    assert time.monotonic() - started < 20


UNCONNECTED = """
import os, socket, sys, time
path = sys.argv[2]
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # made, not connected yet
for i in range(int(sys.argv[1])):
    assert client.type == socket.SOCK_STREAM
    print(f"step {i} ok", flush=True)
    time.sleep(0.1)
if os.path.exists(path):
    os.unlink(path)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(1)
client.connect(path)  # the restored socket is still a fresh, connectable one
peer, _ = server.accept()
client.sendall(b"hello")
print(peer.recv(5).decode(), flush=True)
"""


def test_unconnected_unix_stream_socket(ckptd: Ckptd, tmp_path: Path) -> None:
    """A Unix stream socket between socket() and connect() has no queue to
    read (recvmsg says EINVAL): it used to fail the checkpoint."""
    script = tmp_path / "unconnected.py"
    script.write_text(UNCONNECTED)
    plain = run_plain([PYTHON, str(script), "40", str(tmp_path / "ref.sock")])
    ckptd.launch("unc", [PYTHON, str(script), "40", str(tmp_path / "job.sock")])
    ckptd.wait_log("unc", r"^step 3 ok")
    ckptd.checkpoint("unc")
    ckptd.wait_log("unc", r"^step 6 ok")
    ckptd.kill9("unc")
    ckptd.ctl("restart", "unc")
    assert ckptd.wait("unc") == 0, ckptd.log("unc")[-2000:]
    assert ckptd.log("unc", "stdout") == plain.stdout
    assert plain.stdout.endswith("hello\n")
