"""`ckptd launch --dedup`: two data-parallel ranks holding the same 64 MiB
model store it once per checkpoint (in rank 0's images); rank 1's images
refer to rank 0's pages, the files hold no copy, and restarts from a full
and from an incremental checkpoint give the uninterrupted run's output."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import CKPTD, PYTHON, WORKLOADS, Ckptd

DP = str(WORKLOADS / "dp_sgd.py")
ARGS = ["--steps", "300", "--delay", "0.02", "--dim", "4096", "--model-mib", "64"]
MODEL = 64 << 20


def plain_run(nranks: int) -> list[str]:
    env = dict(os.environ, CKPTD_NRANKS=str(nranks), DP_PORT=str(29100 + os.getpid() % 400))
    procs = [
        subprocess.Popen([PYTHON, DP, *ARGS], env=dict(env, CKPTD_RANK=str(r)), stdout=subprocess.PIPE, text=True)
        for r in range(nranks)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return outs


def allocated(directory: Path) -> int:
    """Bytes the files under directory take on disk (holes excluded)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def rank_log(c: Ckptd, job: str, rank: int) -> str:
    return (Path(c.status(job)["log_path"]).parent.parent / f"rank-{rank}" / "output.log").read_text()


def test_identical_ranks_store_their_model_once(ckptd: Ckptd) -> None:
    c = ckptd
    expected = plain_run(2)
    bad = c.run(CKPTD, "launch", "--detach", "--job", "x", "--dedup", "--", "true", check=False)
    assert bad.returncode == 2 and "--dedup stores pages once across the ranks" in bad.stderr, bad.stderr

    c.launch("dp", [PYTHON, DP, *ARGS], "--ranks", "2", "--dedup")
    c.wait_log("dp", r"^rank 0 step   30 ")
    first = c.checkpoint("dp")
    c.wait_log("dp", r"^rank 0 step   60 ")
    second = c.checkpoint("dp")
    listed = {i["name"]: i for i in c.ctl_json("list", "dp")}
    full, inc = listed[first["name"]], listed[second["name"]]

    # rank 1's writer compared with rank 0's pages as both wrote, and left the model out
    # (native/shim/writeout_dedup.c), rather than writing it and punching it out after
    log = (c.home / "logs" / "daemon.log").read_text()
    assert re.search(r"job dp@1: dedup: \d+ MiB stored once \(1 of 1 processes by their writers\)", log), log[-3000:]
    # the model is stored once: rank 1's part holds little besides its own interpreter
    assert int(full.get("dedup_bytes", 0)) > MODEL * 0.95, full
    assert full["parent"] == "" and full["depends_on"] == []  # its own rank 0 is no dependency
    rank0, rank1 = Path(first["path"]) / "rank-0", Path(first["path"]) / "rank-1"
    assert allocated(rank0) > MODEL
    assert allocated(rank1) < MODEL * 0.5, (allocated(rank0), allocated(rank1))
    assert int(full["size_bytes"]) < int(full["logical_bytes"]) - MODEL * 0.95

    # the incremental one builds on the first; what changed in the model is stored once too
    assert inc["parent"] == first["name"], inc
    assert int(inc["size_bytes"]) < int(full["size_bytes"]) * 0.5, inc

    c.wait_log("dp", r"^rank 0 step   90 ")
    c.kill9("dp")
    c.ctl("restart", "dp")  # from the incremental one: rank 1's pages come from three files
    assert c.wait("dp") == 0
    assert [rank_log(c, "dp", r) for r in (0, 1)] == expected

    c.ctl("restart", "dp", "--from", str(first["id"]))  # from the full one
    assert c.wait("dp") == 0
    assert [rank_log(c, "dp", r) for r in (0, 1)] == expected


@pytest.mark.parametrize("phase", ["dump", "flush"])
def test_a_writer_killed_during_a_dedup_checkpoint_loses_nothing(ckptd: Ckptd, tmp_path: Path, phase: str) -> None:
    """The first writer to start (rank 0's, whose pages rank 1's writer is
    comparing with as they come, or rank 1's) is killed at its start or
    just before it names pages.img: the round is discarded, the checkpoint
    before it is kept and restores the uninterrupted run's output, and the
    job runs on and checkpoints again."""
    c = ckptd
    expected = plain_run(2)
    fault = tmp_path / "fault"
    c.env["CKPTD_FAULT"] = f"@{fault}"  # fired once, by whoever unlinks it
    c.env["CKPTD_DUMP_TIMEOUT_S"] = "20"
    c.launch("dpk", [PYTHON, DP, *ARGS], "--ranks", "2", "--dedup", "--full-every", "1")
    c.wait_log("dpk", r"^rank 0 step   30 ")
    good = c.checkpoint("dpk")
    fault.write_text(f"writer:{phase}:KILL")
    p = c.ctl("checkpoint", "dpk", check=False, timeout=150)
    assert not fault.exists(), "the fault did not fire"
    assert "the writer of pages.img was killed" in (c.home / "logs" / "daemon.log").read_text(), p.stderr
    ids = [int(i["id"]) for i in c.ctl_json("list", "dpk")]
    assert ids == ([good["id"], good["id"] + 1] if p.returncode == 0 else [good["id"]]), (ids, p.stderr)
    assert not list(Path(good["path"]).parent.glob(".ckpt-*"))  # nothing half-written left
    c.wait_log("dpk", r"^rank 0 step   60 ")
    again = c.checkpoint("dpk")  # the job ran on
    assert again["id"] > good["id"]
    c.kill9("dpk")
    c.ctl("restart", "dpk", "--from", str(good["id"]))
    assert c.wait("dpk") == 0
    assert [rank_log(c, "dpk", r) for r in (0, 1)] == expected
