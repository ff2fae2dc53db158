"""File descriptor state comes back exactly, or the checkpoint is refused (issue 18).

tests/workloads/exact_fds.c sets one kind of descriptor state up and checks
it from inside at every step, while the job is checkpointed, killed and
restarted (conftest.exact_round_trip).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "exact_fds")


def _round_trip(c: Ckptd, exe: str, mode: str, tmp_path: Path) -> None:
    exact_round_trip(c, mode, [exe, "30", mode, str(tmp_path)])


def test_status_flags_of_every_kind(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """F_GETFL (O_NONBLOCK, O_APPEND, O_DIRECT, O_NOATIME) and F_GETFD of
    pipes, packet-mode pipes, a FIFO, files, a directory, /dev/null, an
    eventfd, an epoll, Unix and TCP sockets and a memfd."""
    _round_trip(ckptd, exe, "flags", tmp_path)


def test_sigio_owner_and_signal(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """F_SETOWN (pid, process group), F_SETOWN_EX (thread) and F_SETSIG."""
    _round_trip(ckptd, exe, "owner", tmp_path)


def test_offset_shared_by_parent_and_child(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """open, then fork: both processes move one offset, after the restart too."""
    _round_trip(ckptd, exe, "offset", tmp_path)


def test_flock_held(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    _round_trip(ckptd, exe, "flock", tmp_path)


def test_posix_locks_held_by_their_process(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    _round_trip(ckptd, exe, "posix", tmp_path)


def test_ofd_locks_held(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    _round_trip(ckptd, exe, "ofd", tmp_path)


def test_lease_refused_without_a_stall(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    ckptd.launch("lease", [exe, "100", "lease", str(tmp_path)])
    ckptd.wait_log("lease", r"^step 2 ok")
    assert_refused(ckptd, "lease", "lease", "leased")


def test_packet_pipe_with_messages_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Refilled by one write, two queued messages would read back as one."""
    ckptd.launch("packet", [exe, "100", "packet", str(tmp_path)])
    ckptd.wait_log("packet", r"^step 2 ok")
    assert_refused(ckptd, "packet", "packet-mode pipe", "6 bytes", "message boundaries")
