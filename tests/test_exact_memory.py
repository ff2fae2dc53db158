"""Memory comes back exactly (issue 18, "Exact or refused"): every page of
mappings reshaped by mremap and mprotect, memfd contents, names, modes and
seals, madvise advice, membarrier registrations, and the maximum
protection of shared file mappings.  tests/workloads/exact_memory.c checks
each from inside at every step, through a checkpoint, kill -9 and restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import (
    PYTHON,
    Ckptd,
    checkpoint_stopped_at,
    compile_workload,
    exact_round_trip,
    kill_restart_finish,
    run_plain,
    trigger_and_wait,
)

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


# advises its mapping once the trigger file appears; prints the mapping's
# VmFlags (from its own smaps) at every tick
ADVISED_LATE = r"""
import ctypes, mmap, os, sys, time
trigger, ticks = sys.argv[1], int(sys.argv[2])
m = mmap.mmap(-1, 1 << 20)
m[:4] = b"data"
start = f"{ctypes.addressof(ctypes.c_char.from_buffer(m)):x}-"

def flags():
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    vm = next(line for line in lines[at + 1 :] if line.startswith("VmFlags:"))
    return " ".join(sorted(x for x in vm.split()[1:] if x in ("dd", "lo", "rr")))

for i in range(ticks):
    if os.path.exists(trigger):
        m.madvise(mmap.MADV_DONTDUMP)
        m.madvise(mmap.MADV_RANDOM)
        assert ctypes.CDLL(None, use_errno=True).mlock(ctypes.c_void_p(int(start[:-1], 16)), 1 << 20) == 0
        os.unlink(trigger)
        print("advised", flush=True)
    print(f"tick {i} [{flags()}]", flush=True)
    time.sleep(0.05)
print("done", flush=True)
"""


def test_advice_given_after_the_early_maps_read(ckptd: Ckptd, tmp_path: Path) -> None:
    """Each process reads its memory map (smaps) early, in the round's ready
    step, while the job still runs: advice given to a whole mapping after
    that read (madvise, mlock: VmFlags dd, rr, lo) changes no line the dump compares
    with the early copy.  The daemon is stopped after the ready step, the
    program advises its mapping meanwhile, and the checkpoint goes on: the
    dump must read the maps again (the shim counts madvise calls), or the
    restored mapping comes back without its advice and lock."""
    c = ckptd
    fault, trigger = tmp_path / "fault", tmp_path / "trigger"
    c.env["CKPTD_FAULT"] = f"@{fault}"  # read by the daemon, which the first command starts
    c.launch("advise", [PYTHON, "-c", ADVISED_LATE, str(trigger), "160"])
    c.wait_log("advise", r"^tick 3 \[\]$")
    with checkpoint_stopped_at(c, fault, "advise", "ready") as taken:
        trigger_and_wait(trigger, c.log_file("advise"), b"advised", "the program never advised its mapping")
    c.kill9("advise")
    c.ctl("restart", "advise", "--from", str(taken.info["id"]))
    assert c.wait("advise") == 0
    lines = c.log("advise").splitlines()
    after = lines[lines.index("advised") + 1 :]
    assert after[-1] == "done" and len(after) > 100, lines
    # every tick after the advice, before the checkpoint and after the restart, has it
    assert all(line.endswith("[dd lo rr]") for line in after[:-1]), [x for x in after[:-1] if "[dd lo rr]" not in x]


def test_membarrier_registrations(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "membarrier", [exact_memory, STEPS, "membarrier"])


def test_mprotect_after_restart(ckptd: Ckptd, exact_memory: str) -> None:
    exact_round_trip(ckptd, "mprotect", [exact_memory, STEPS, "mprotect"])
