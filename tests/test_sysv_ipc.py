"""System V IPC comes back exactly (issue 19): shared memory segments with
their contents, attached by two processes (read-write, read-only, in part),
semaphore sets with their values and a waiter, message queues with messages
of several types in order and their size; every object under its old id, in
the job's own IPC namespace.  tests/workloads/sysv_ipc.c checks each from
inside at every step, through a checkpoint, kill -9 and restart."""

from __future__ import annotations

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused

STEPS = "30"


@pytest.fixture(scope="module")
def sysv_ipc(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "sysv_ipc")


def test_shared_memory(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-shm", [sysv_ipc, STEPS, "shm"])


def test_semaphores(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-sem", [sysv_ipc, STEPS, "sem"])


def test_message_queue(ckptd: Ckptd, sysv_ipc: str) -> None:
    exact_round_trip(ckptd, "sysv-msg", [sysv_ipc, STEPS, "msg"])


def test_removed_segment_still_attached_refused(ckptd: Ckptd, sysv_ipc: str) -> None:
    ckptd.launch("sysv-rmid", [sysv_ipc, "300", "rmid"])
    ckptd.wait_log("sysv-rmid", r"^step 2 ok")
    assert_refused(ckptd, "sysv-rmid", "System V shared memory", "IPC_RMID")
