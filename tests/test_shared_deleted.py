"""MAP_SHARED mappings of a deleted file on disk (not tmpfs), shared by two
processes (issue 19; DMTCP's shared-memory1 and shared-memory2): the file's
contents, size and mode are saved, it is made again and removed again, and
both processes map that one file again, so that each still sees the other's
writes.  tests/workloads/shared_deleted.c checks it from inside at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip

STEPS = "40"  # 4 s: a checkpoint under load must not outlast the program


@pytest.fixture(scope="module")
def shared_deleted(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "shared_deleted")


def test_shared_mapping_of_a_deleted_file_held_open(ckptd: Ckptd, shared_deleted: str, tmp_path: Path) -> None:
    """Both processes also hold a descriptor of it: the contents are saved with the descriptor."""
    exact_round_trip(ckptd, "sd-held", [shared_deleted, STEPS, "held", str(tmp_path)])


def test_shared_mapping_of_a_deleted_file_only_mapped(ckptd: Ckptd, shared_deleted: str, tmp_path: Path) -> None:
    """Only the mappings hold it: the contents are read through /proc/self/map_files."""
    exact_round_trip(ckptd, "sd-mapped", [shared_deleted, STEPS, "mapped", str(tmp_path)])
