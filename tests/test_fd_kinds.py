"""Descriptor kinds that come back exactly, or are refused (issue 19).

tests/workloads/fd_kinds.c sets one kind up and checks it from inside at
every step, while the job is checkpointed, killed and restarted
(conftest.exact_round_trip): its output must be an uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "fd_kinds")


def _round_trip(c: Ckptd, exe: str, mode: str, tmp_path: Path) -> None:
    exact_round_trip(c, mode, [exe, "30", mode, str(tmp_path)])


def _refused(c: Ckptd, exe: str, mode: str, tmp_path: Path, *words: str) -> None:
    c.launch(mode, [exe, "100", mode, str(tmp_path)])
    c.wait_log(mode, r"^step 2 ok")
    assert_refused(c, mode, *words)


def test_deleted_files(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Open files whose names were removed, not on tmpfs: contents (a hole
    too), mode, offsets of two descriptions and of one a child shares, one
    inode for all of them, made again at the old path; one whose path a new
    file took is made beside it."""
    _round_trip(ckptd, exe, "deleted", tmp_path)


def test_deleted_working_directory_and_open_directory(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    _round_trip(ckptd, exe, "dirs", tmp_path)


def test_deleted_name_of_a_file_with_other_links_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """A copy would no longer share writes with the file's other name."""
    _refused(ckptd, exe, "hardlink", tmp_path, "other hard links")


def test_timerfd(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Clock, flags, interval, the time left (relative) and an expiration not read."""
    _round_trip(ckptd, exe, "timerfd", tmp_path)


def test_timerfd_cancel_on_set_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    _refused(ckptd, exe, "cancel", tmp_path, "TFD_TIMER_CANCEL_ON_SET")


def test_signalfd(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Masks and flags; a signal pending since before the checkpoint is still readable."""
    _round_trip(ckptd, exe, "signalfd", tmp_path)


def test_opath_symlink(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Symlinks opened with O_PATH|O_NOFOLLOW (one dangling): still the link, not what it points to."""
    _round_trip(ckptd, exe, "opath", tmp_path)


def test_pidfd(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """pidfds of a live child, of a zombie and of the process itself: the same
    processes (pids are kept), their flags; the child is killed and reaped through it."""
    _round_trip(ckptd, exe, "pidfd", tmp_path)


def test_pidfd_of_a_reaped_process_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    _refused(ckptd, exe, "reaped", tmp_path, "pidfd", "reaped")


def test_pidfd_shared_by_processes_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """The plan makes shared objects before the processes a pidfd names exist."""
    _refused(ckptd, exe, "sharedpidfd", tmp_path, "pidfd", "several processes share")


def test_inotify(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Watches added again by path with their masks and numbers (gaps where
    watches were removed), reporting again; the next watch gets the number
    it would have got."""
    _round_trip(ckptd, exe, "inotify", tmp_path)


def test_inotify_not_made_through_libc_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """The shim counts the numbers inotify_add_watch gave out; without that count the next one is unknown."""
    _refused(ckptd, exe, "rawinotify", tmp_path, "inotify", "next watch")


def test_inotify_shared_by_processes_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """Two instances, one per process, would each get every event."""
    _refused(ckptd, exe, "sharedinotify", tmp_path, "inotify", "several processes share")
