"""Storage faults under checkpoints, restarts and uploads (issue 20's
fault-injection matrix, the storage rows).  The checkpoint storage is a
faultfs (tests/faultfs.py): a FUSE passthrough whose calls fail with a
chosen errno, only for chosen calls on chosen paths, so that the fault
lands in one phase; the test checks where it landed (the faultfs logs each
call it failed).  Storage that disappears is every call failing with
ENOTCONN from a chosen call on, as a network filesystem whose server went.

Every cell checks the same promises: the command fails with a one-line
error naming the storage, the job runs on (a checkpoint) or nothing runs
(a restart), no checkpoint is committed, nothing is left in the storage
after the next daemon start, and once the storage is back the last good
checkpoint restores the job byte-identical to an uninterrupted run."""

from __future__ import annotations

import re
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faultfs
import faultmatrix
import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, Plain, run_plain
from test_bad_input import one_line_error

COUNTER = str(WORKLOADS / "counter.py")
TICKS = "200"  # 10 s: a cell kills the job 2 to 4 s in (more on a loaded machine)
# exit statuses (README): storage full or not writable, storage failed, image unreadable
STORAGE, UNAVAILABLE, CORRUPT = 6, 7, 5

NAMES = {"ENOSPC": "fills up", "EROFS": "turns read-only", "EIO": "returns EIO", "ENOTCONN": "disappears"}
EXITS = {"ENOSPC": (STORAGE,), "EROFS": (STORAGE,), "EIO": (UNAVAILABLE,), "ENOTCONN": (UNAVAILABLE,)}

CKPT_PROMISE = (
    "the checkpoint fails with a one-line storage error, the job runs on, nothing is committed, "
    "nothing is left after the next daemon start, and the last good checkpoint restores byte-identical"
)
RESTART_PROMISE = (
    "the restart fails with a one-line error naming the storage, no restored process runs, the log is "
    "untouched, and once the storage is back the same checkpoint restores byte-identical"
)
UPLOAD_PROMISE = (
    "the upload fails and says so, the stage copy stays, the job runs on, no partial copy is left on the "
    "shared tier after the next daemon start, and the next checkpoint uploads both"
)

# Where a fault lands in a checkpoint round (paths relative to the storage's root; the job is "j",
# the round's directory .ckpt-000002.tmp-XXXXXXXX): the call the faultfs fails first.
TMP = "/j/.ckpt-000002.tmp-????????"
CKPT_PHASES: dict[str, tuple[dict[str, Any], str]] = {
    # the coordinator's probe of the new directory, before the job is touched
    "reserve": ({"pattern": f"{TMP}/.probe"}, ".probe"),
    # the shim's own core.img, written while the job is parked
    "dump": ({"pattern": f"{TMP}/proc-*/core.img"}, "core.img"),
    # the forked writer's pages.img.part, after the job runs again
    "flush": ({"pattern": f"{TMP}/proc-*/pages.img.part", "calls": ["write", "create", "rename"]}, "pages.img.part"),
    # the agent's fsync of the images
    "finalize": ({"pattern": f"{TMP}/proc-*/pages.img", "calls": ["fsync"]}, "pages.img"),
    # the manifest, then the rename and the fsync of the job's directory that commit it
    "commit": ({"pattern": f"{TMP}/manifest.json"}, "manifest.json"),
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[faultfs.FaultFS]:
    faultfs.require()
    fs = faultfs.FaultFS(tmp_path / "real", tmp_path / "store", tmp_path / "faults.json")
    try:
        yield fs
    finally:
        fs.close()


def start(c: Ckptd, job: str, *launch: str, ticks: str = TICKS) -> Plain:
    """A counter with one good checkpoint at tick 5 (the reference runs meanwhile)."""
    plain = run_plain([PYTHON, COUNTER, ticks])
    c.launch(job, [PYTHON, COUNTER, ticks], *launch)
    c.wait_log(job, r"^tick 5$")
    assert c.checkpoint(job)["id"] == 1
    return plain


def leftovers(real: Path) -> list[str]:
    """What a failed round or upload may leave in a job's directory."""
    return sorted(p.name for p in real.glob("*/.ckpt-*"))


def ckpt_cells() -> list[Any]:
    out = []
    for phase in CKPT_PHASES:
        for err in ("ENOSPC", "EROFS", "EIO"):
            cell = faultmatrix.cell(f"storage {NAMES[err]} ({err})", phase, CKPT_PROMISE)
            out.append(pytest.param(err, phase, False, marks=cell, id=f"{err}-{phase}"))
    for phase in ("dump", "finalize"):
        cell = faultmatrix.cell("storage disappears (ENOTCONN)", phase, CKPT_PROMISE)
        out.append(pytest.param("ENOTCONN", phase, True, marks=cell, id=f"ENOTCONN-{phase}"))
    out.append(
        pytest.param(
            "EIO", "commit", False, id="EIO-commit-fsync",
            marks=faultmatrix.cell("storage returns EIO on the job directory's fsync", "commit", CKPT_PROMISE),
        )
    )  # fmt: skip
    return out


@pytest.mark.parametrize(("err", "phase", "spread"), ckpt_cells())
def test_checkpoint_on_failing_storage(  # noqa: PLR0917
    ckptd: Ckptd, store: faultfs.FaultFS, request: pytest.FixtureRequest, err: str, phase: str, spread: bool
) -> None:
    plain = start(ckptd, "j", "--ckpt-dir", str(store.mountpoint))
    pids = ckptd.status("j")["pids"]
    rule, landed = CKPT_PHASES[phase]
    if request.node.callspec.id.endswith("commit-fsync"):
        # the rename committed the directory; its name is durable only once the parent is fsynced
        rule, landed = {"pattern": "/j", "calls": ["fsyncdir"]}, "/j "
    store.set(err, **rule, spread=spread)
    p = ckptd.ctl("checkpoint", "j", check=False)
    injected = store.injected()
    assert injected and landed in injected[0], f"the fault landed elsewhere: {injected[:3]}"
    assert p.returncode in EXITS[err], (p.returncode, p.stderr, injected[:3])
    one_line_error(p, str(store.mountpoint))
    # the job runs on, the same processes
    st = ckptd.status("j")
    assert st["state"] == "running" and st["pids"] == pids, st
    store.set(None)  # the storage is back (the job's log is on it too)
    tick = int(re.findall(r"^tick (\d+)$", ckptd.log("j", "stdout"), re.M)[-1])
    ckptd.wait_log("j", rf"^(tick {tick + 2}|finished)$")
    if ckptd.status("j")["state"] == "running":  # (on a loaded machine it may have finished by now)
        ckptd.kill9("j")
    ckptd.crash_daemon()  # the next daemon sweeps what the failed round could not remove
    assert [c["name"] for c in ckptd.ctl_json("list", "j")] == ["ckpt-000001"]  # nothing committed
    assert leftovers(store.root) == []
    ckptd.ctl("restart", "j")  # the latest: the good one
    assert ckptd.wait("j") == 0
    assert ckptd.log("j", "stdout") == plain.stdout


# Where a fault lands in a restart from ckpt-000002: what the agent reads
# to verify (core.img, checksummed before anything is touched), what the
# restorers read to rebuild (pages.img: hashed by the agent while they read it).
C2 = "/j/ckpt-000002"
RESTART_CELLS = [
    ("EIO", "verify", {"ops": "read", "pattern": f"{C2}/proc-*/core.img"}, "core.img"),
    ("EIO", "rebuild", {"ops": "read", "pattern": f"{C2}/proc-*/pages.img", "calls": ["read"]}, "pages.img"),
    ("ENOTCONN", "verify", {"ops": "all", "pattern": f"{C2}/manifest.json", "spread": True}, "manifest.json"),
    ("ENOTCONN", "rebuild", {"ops": "read", "pattern": f"{C2}/proc-*/pages.img", "spread": True}, "pages.img"),
]


@pytest.mark.parametrize(
    ("err", "phase", "rule", "landed"),
    [
        pytest.param(
            *c, id=f"{c[0]}-{c[1]}",
            marks=[faultmatrix.cell(f"storage {NAMES[c[0]]} ({c[0]})", c[1], RESTART_PROMISE)]
        )
        for c in RESTART_CELLS
    ],
)  # fmt: skip
def test_restart_from_failing_storage(  # noqa: PLR0917
    ckptd: Ckptd, store: faultfs.FaultFS, err: str, phase: str, rule: dict[str, Any], landed: str
) -> None:
    plain = start(ckptd, "j", "--ckpt-dir", str(store.mountpoint))
    ckptd.wait_log("j", r"^tick 15$")
    assert ckptd.checkpoint("j")["id"] == 2
    ckptd.wait_log("j", r"^tick 25$")
    ckptd.kill9("j")
    log_before = (store.root / "j" / "output.log").read_bytes()
    # (a FUSE file's page cache is dropped at every open: the reads below reach the faultfs)

    store.set(err, **rule)
    p = ckptd.ctl("restart", "j", check=False)
    injected = store.injected()
    assert injected and landed in injected[0], f"the fault landed elsewhere: {injected[:3]}"
    assert p.returncode in (CORRUPT, UNAVAILABLE), (p.returncode, p.stderr, injected[:3])
    err_line = one_line_error(p)
    assert "ckpt-000002" in err_line or str(store.mountpoint) in err_line, err_line

    store.set(None)  # (status reads the job's directory too)
    st = ckptd.status("j")
    assert st["state"] == "failed" and st["pids"] == [], st  # nothing runs
    ckptd.crash_daemon()
    assert ckptd.status("j")["state"] in ("failed", "lost")  # (a job its daemon saw end is "lost" to the next)
    # the log as the crash left it (put back by the failed restart, or from its journal by the next daemon)
    assert (store.root / "j" / "output.log").read_bytes() == log_before
    ckptd.ctl("restart", "j")  # the same checkpoint, now readable
    assert ckptd.wait("j") == 0
    assert ckptd.log("j", "stdout") == plain.stdout


@pytest.mark.parametrize(
    "err",
    [
        pytest.param(e, marks=faultmatrix.cell(f"storage {NAMES[e]} ({e})", "upload", UPLOAD_PROMISE))
        for e in ("ENOSPC", "EROFS", "EIO", "ENOTCONN")
    ],
)
@pytest.mark.slow
def test_upload_to_failing_shared_storage(ckptd: Ckptd, store: faultfs.FaultFS, tmp_path: Path, err: str) -> None:
    stage = tmp_path / "stage"
    plain = start(ckptd, "j", "--stage-dir", str(stage), "--ckpt-dir", str(store.mountpoint), ticks="400")
    ckptd.ctl("checkpoint", "j", "--wait-shared")  # (ckpt-000002: the first one's upload is done)
    assert (store.root / "j" / "ckpt-000001").is_dir()
    rule: dict[str, Any] = {"pattern": "/j/.ckpt-000003.tmp-*/proc-*/*", "spread": err == "ENOTCONN"}
    store.set(err, **rule)
    p = ckptd.ctl("checkpoint", "j", "--wait-shared", check=False)
    injected = store.injected()
    assert injected and ".ckpt-000003.tmp-" in injected[0], injected[:3]
    assert p.returncode != 0
    one_line_error(p, str(store.mountpoint))
    assert ckptd.status("j")["state"] == "running"
    store.set(None)
    tiers = {c["name"]: c.get("tier", "") for c in ckptd.ctl_json("list", "j")}
    assert tiers["ckpt-000003"] != "local+shared" and (stage / "j" / "ckpt-000003").is_dir(), tiers

    info = ckptd.ctl_json("checkpoint", "j", "--wait-shared")  # uploads what is missing too
    assert info["tier"] == "local+shared", info
    tiers = {c["name"]: c.get("tier", "") for c in ckptd.ctl_json("list", "j")}
    assert set(tiers.values()) == {"local+shared"} and len(tiers) == 4, tiers
    ckptd.kill9("j")
    ckptd.crash_daemon()
    assert leftovers(store.root) == []
    shutil.rmtree(stage)  # the node's fast disk is gone with it: the restart fetches the shared copy
    ckptd.ctl("restart", "j")
    assert ckptd.wait("j") == 0
    assert ckptd.log("j", "stdout") == plain.stdout


# ---- the job's output while its storage fails ----

# lines of 100 bytes, one write(2) each (print may split off its "\n"): the
# relay's chunks are whole lines, and a chunk is lost whole or not at all
CHATTY = """
import os, sys, time
for i in range(int(sys.argv[1])):
    os.write(1, f"line {i:06d} {'x' * 87}\\n".encode())
    time.sleep(0.004)
"""
LOG_PROMISE = (
    "the job runs on; `ckptctl logs` shows exactly the lines written before the failure, then those written "
    "once the storage is back, whole; output.log and output.idx stay one another's image"
)


def log_and_index_agree(log: bytes, index: bytes) -> None:
    """Every record of the index follows the one before, and together they cover the log."""
    assert len(index) % 16 == 0, f"a cut record: {len(index)} index bytes"
    offset = 0
    for i in range(0, len(index), 16):
        at, length, _stream = struct.unpack("<QII", index[i : i + 16])
        assert at == offset, f"record {i // 16} at {at}, the log's bytes so far end at {offset}"
        offset += length
    assert offset == len(log), f"the index covers {offset} bytes, the log holds {len(log)}"


@pytest.mark.parametrize(
    ("err", "target"),
    [
        pytest.param(
            e, t, id=f"{e}-{t}",
            marks=faultmatrix.cell(f"storage {NAMES[e]} ({e}) under output.{t}", "any", LOG_PROMISE),
        )
        for e, t in (("ENOSPC", "log"), ("EIO", "log"), ("EIO", "idx"))
    ],
)  # fmt: skip
def test_output_on_failing_storage(ckptd: Ckptd, store: faultfs.FaultFS, tmp_path: Path, err: str, target: str) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    argv = [PYTHON, str(script), "800"]
    plain = run_plain(argv)
    ckptd.launch("j", argv, "--ckpt-dir", str(store.mountpoint))
    ckptd.wait_log("j", r"^line 000050 ")
    # a few lines in, a write cut short mid-line, then every write fails until the storage is back
    store.set(err, pattern=f"/j/output.{target}", after_bytes=1037 if target == "log" else 165)
    deadline = time.monotonic() + 30
    while len(store.injected()) < 3:
        assert time.monotonic() < deadline, "the fault never landed"
        time.sleep(0.02)
    store.set(None)
    assert ckptd.wait("j") == 0
    log = (store.root / "j" / "output.log").read_bytes()
    log_and_index_agree(log, (store.root / "j" / "output.idx").read_bytes())
    shown = ckptd.log("j", "stdout")
    assert shown == log.decode()
    # the plain run's lines, less one run of them: those written while the storage failed
    want, got = plain.stdout.splitlines(keepends=True), shown.splitlines(keepends=True)
    assert got[-1] == want[-1] and len(got) < len(want)
    first = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    assert got[first:] == want[len(want) - (len(got) - first) :], got[first - 1 : first + 2]
