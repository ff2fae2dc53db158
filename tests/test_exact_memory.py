"""Memory comes back exactly (issue 18, "Exact or refused"): every page of
mappings reshaped by mremap and mprotect, memfd contents, names, modes and
seals, madvise advice, membarrier registrations, and the maximum
protection of shared file mappings.  tests/workloads/exact_memory.c checks
each from inside at every step, through a checkpoint, kill -9 and restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip, kill_restart_finish, run_plain

STEPS = "60"


@pytest.fixture(scope="module")
def exact_memory(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "exact_memory")


def incremental_round_trip(c: Ckptd, job: str, argv: list[str], tmp: Path, track: str = "uffd") -> None:
    """A checkpoint, then the program changes its memory (when it finds the
    trigger file, which it removes), a second checkpoint, an incremental
    image (track: how the shim finds the pages written since the first,
    track.c), kill -9, restart from it.  The program changes its memory
    again after the restart (step 45)."""
    plain = run_plain(argv)
    trigger = tmp / "trigger"
    c.env["CKPTD_TRACK"] = track  # the job inherits the launcher's environment
    c.launch(job, [*argv, str(trigger)], "--full-every", "16")
    c.wait_log(job, r"^step 3 ok")
    first = c.checkpoint(job)
    trigger.touch()
    deadline = time.monotonic() + 30
    while trigger.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not trigger.exists(), "the program did not change its memory"
    second = c.checkpoint(job)
    listed = {i["name"]: i for i in c.ctl_json("list", job)}
    assert listed[second["name"]]["parent"] == first["name"]  # incremental
    kill_restart_finish(c, job, plain)


def test_reshaped_mappings(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "reshape", [exact_memory, STEPS, "reshape"])


@pytest.mark.parametrize("track", ["uffd", "hash"])
def test_reshaped_mappings_incremental(ckptd: Ckptd, exact_memory: str, tmp_path: Path, track: str) -> None:
    incremental_round_trip(ckptd, "reshape-inc", [exact_memory, STEPS, "reshape"], tmp_path, track)


def test_memfd_contents(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "memfd", [exact_memory, STEPS, "memfd"])


def test_memfd_contents_incremental(ckptd: Ckptd, exact_memory: str, tmp_path: Path) -> None:
    incremental_round_trip(ckptd, "memfd-inc", [exact_memory, STEPS, "memfd"], tmp_path)


def test_memfd_name_mode_and_seals(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "memfd-meta", [exact_memory, STEPS, "memfd_meta"])


def test_madvise_advice(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "madvise", [exact_memory, STEPS, "madvise"])


def test_membarrier_registrations(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "membarrier", [exact_memory, STEPS, "membarrier"])


def test_mprotect_after_restart(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "mprotect", [exact_memory, STEPS, "mprotect"])
