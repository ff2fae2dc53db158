"""Exact or refused (issue 18): process trees.  Orphans, the sessions and
process groups whose leader has exited, double-forked daemons come back
with their pids, parents, groups and sessions (tests/workloads/tree_shapes.c
checks them from inside at every step).  What cannot come back exactly (a
stopped process, one without a vdso, processes sharing one descriptor
table) is refused, naming it, while the job runs on."""

from __future__ import annotations

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "tree_shapes")


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "exact_refused")


def shape_round_trip(c: Ckptd, exe: str, shape: str, nprocs: int, lost: int) -> None:
    out = exact_round_trip(c, shape, [exe, shape, "30"])
    assert out.startswith(f"shape {shape}: {nprocs} processes, {lost} exited leaders\n"), out[:200]


def test_orphan_in_its_own_session(ckptd: Ckptd, shapes: str) -> None:
    """sh -c '(setsid sleep 1000 &); exec sleep 1000': the orphan is forked
    by pid 2 with CLONE_PARENT (clone3 wants exit_signal 0 with it)."""
    shape_round_trip(ckptd, shapes, "setsid", 2, 0)


def test_orphan_leading_a_process_group(ckptd: Ckptd, shapes: str) -> None:
    shape_round_trip(ckptd, shapes, "pgleader", 3, 0)


def test_orphans_in_a_session_whose_leader_exited(ckptd: Ckptd, shapes: str) -> None:
    shape_round_trip(ckptd, shapes, "lostsession", 4, 1)


def test_orphans_in_a_process_group_whose_leader_exited(ckptd: Ckptd, shapes: str) -> None:
    shape_round_trip(ckptd, shapes, "lostgroup", 3, 1)


def test_orphan_in_the_session_of_an_orphan(ckptd: Ckptd, shapes: str) -> None:
    """The orphan leading the session forks the other (CLONE_PARENT too)."""
    shape_round_trip(ckptd, shapes, "nested", 3, 0)


def test_double_forked_daemon(ckptd: Ckptd, shapes: str) -> None:
    shape_round_trip(ckptd, shapes, "daemon", 2, 1)


def refusal(c: Ckptd, exe: str, mode: str, *words: str) -> None:
    c.launch(mode, [exe, mode, "600"])
    c.wait_log(mode, r"^step 2 ok")
    assert_refused(c, mode, *words)
    assert c.ctl_json("list", mode) == []
    c.wait_log(mode, r"^step 8 ok")  # it runs on, its state intact
    assert "BAD " not in c.log(mode)


def test_stopped_process_refused(ckptd: Ckptd, refused: str) -> None:
    refusal(ckptd, refused, "stopped", "(pid 4 in the job", "is stopped (SIGSTOP", "continue it first")


def test_process_without_vdso_refused(ckptd: Ckptd, refused: str) -> None:
    """The shim's own clock reads do not need the vdso either: the job runs."""
    refusal(ckptd, refused, "novdso", "pid 2 (exact_refused) has unmapped its [vdso]", "without the kernel's vdso")


def test_processes_sharing_a_descriptor_table_refused(ckptd: Ckptd, refused: str) -> None:
    refusal(ckptd, refused, "clonefiles", "(pid 4 in the job", "shares one descriptor table with", "CLONE_FILES")


def test_proc_of_own_grandchild_kept_open(ckptd: Ckptd, tmp_path_factory: pytest.TempPathFactory) -> None:
    """/proc/PID/status of the job's own grandchild (a pid no host process has):
    the restart neither checks nor opens the host's /proc/PID; the file is
    reopened in the job's pid namespace once the whole tree exists."""
    exact_round_trip(ckptd, "procchild", [compile_workload(tmp_path_factory, "proc_child"), "30"])
