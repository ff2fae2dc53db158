"""Lazy restore (`ckptctl restart --lazy`): the job runs before its memory is
back; a pager fills it on demand and in the background.  The workload
discards, moves and forks its memory while the fill runs (slowed down for
the test), and the output must still be byte for byte the plain run's."""

from __future__ import annotations

import re
import time
from pathlib import Path

from conftest import PYTHON, WORKLOADS, Ckptd, flip_byte, run_plain

# 0.1 s a step: the two checkpoints below (each a CLI start, some 0.3 s)
# land well before the fork at step 19, so that the restarted job has steps
# to take during the fill before its fork waits for the fill's end
LAZY = [PYTHON, str(WORKLOADS / "lazy_memory.py"), "60", "48", "0.1"]


def pager_reports(c: Ckptd, job: str) -> list[str]:
    return [p.read_text() for p in sorted(Path(c.home).glob(f"agents/*/jobs/{job}/lazy-*.out"))]


def test_lazy_restart_output_identical_while_the_job_moves_its_memory(ckptd: Ckptd) -> None:
    c = ckptd
    c.env["CKPTD_LAZY_FILL_DELAY_MS"] = "30"  # 48 MiB in about 1.4 s: the steps up to the fork at step 19 land mid-fill
    plain = run_plain(LAZY).stdout
    c.launch("lz", LAZY)
    c.wait_log("lz", r"^step 2 ")
    c.checkpoint("lz")
    c.wait_log("lz", r"^step 4 ")
    first = c.checkpoint("lz")  # an incremental: the pager reads both images
    assert first["parent"]
    c.kill9("lz")
    out = c.ctl("restart", "lz", "--lazy").stdout
    assert "restarted from" in out
    # a checkpoint during the fill waits for it, then is an ordinary one
    c.wait_log("lz", r"^step 16 ")
    second = c.checkpoint("lz")
    assert second["name"] != first["name"]
    reports = pager_reports(c, "lz")
    assert len(reports) == 1, reports
    stats = dict(kv.split("=") for kv in reports[0].split())
    assert int(stats["filled"]) >= 16 << 20  # the buffer came back through the pager (less what it discarded first)
    assert int(stats["events"]) >= 4  # the job discarded and moved memory during the fill
    # and the restart from the checkpoint taken after a lazy restart
    c.kill9("lz")
    c.ctl("restart", "lz")
    assert c.wait("lz") == 0
    assert c.log("lz", "stdout") == plain
    assert re.search(r"^child of step 19: ", plain, re.M) and "done " in plain


def test_lazy_fill_outlives_an_agent_restart(ckptd: Ckptd) -> None:
    """The agent that started the pager stops mid-fill, so nobody will say
    LAZY_DONE: the shim sees the end of the fill for itself.  The next
    agent's checkpoint is retried until then, the job's fork
    goes on after it, and that checkpoint restores to the plain output."""
    c = ckptd
    # a slow fill (4 MiB/s in the background) and a slow job (whose faults
    # also fill: about 4 MiB/s): 48 MiB take some 6 s
    c.env["CKPTD_LAZY_FILL_DELAY_MS"] = "250"
    slow = [PYTHON, str(WORKLOADS / "lazy_memory.py"), "40", "48", "0.3"]
    plain = run_plain(slow).stdout
    c.launch("ag", slow)
    c.wait_log("ag", r"^step 3 ")
    c.checkpoint("ag")
    c.kill9("ag")
    c.ctl("restart", "ag", "--lazy")
    c.ctl("shutdown")  # the job and its pager run on
    refused = []
    deadline = time.monotonic() + 90
    while True:
        p = c.ctl("checkpoint", "ag", "--json", check=False)  # starts the next daemon, which re-adopts the job
        if p.returncode == 0:
            break
        if "still being filled after a lazy restart" in p.stderr:
            refused.append(p.stderr)
        else:  # the child of step 19 exiting during its dump discards that round
            assert "exited during" in p.stderr, p.stderr
        assert time.monotonic() < deadline, refused
        time.sleep(0.5)
    # the fill was still running when the new agent asked: the coordinator
    # tried again by itself (a refusal reaches the user only past its retries)
    retried = "memory is still being filled after a lazy restart" in (c.home / "logs" / "daemon.log").read_text()
    assert refused or retried
    c.wait_log("ag", r"^child of step 19: ")  # fork() went on without LAZY_DONE
    c.kill9("ag")
    c.ctl("restart", "ag")  # from the checkpoint taken by the new agent
    assert c.wait("ag") == 0
    assert c.log("ag", "stdout") == plain


def test_lazy_restart_from_a_corrupt_image_is_killed_and_its_log_put_back(ckptd: Ckptd) -> None:
    """--lazy runs the job before the images' checksums are known: a
    mismatch found meanwhile kills it and puts its files back, and the
    earlier checkpoint still restarts it."""
    c = ckptd
    plain = run_plain(LAZY)
    c.launch("bad", LAZY)
    c.wait_log("bad", r"^step 2 ")
    c.checkpoint("bad")
    c.wait_log("bad", r"^step 6 ")
    second = c.checkpoint("bad")
    c.kill9("bad")
    log_before = c.log_file("bad").read_bytes()
    flip_byte(Path(second["path"]) / "proc-2" / "pages.img")
    c.ctl("restart", "bad", "--lazy")  # starts: the check runs while the job does
    deadline = time.monotonic() + 60
    while (st := c.status("bad"))["state"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert st["state"] == "failed", st
    assert "lazy restart" in st["message"] and "checksum" in st["message"], st["message"]
    assert c.log_file("bad").read_bytes() == log_before  # what the bad run printed is gone
    c.ctl("restart", "bad", "--from", "1")
    assert c.wait("bad") == 0
    assert c.log("bad", "stdout") == plain.stdout


def test_lazy_restart_of_a_small_job_and_without_a_checkpoint(ckptd: Ckptd, counter: Path) -> None:
    """A job with nothing large enough to fill lazily restarts as usual
    (no pager), and --lazy with no checkpoint is the usual clear error."""
    c = ckptd
    plain = run_plain([PYTHON, str(counter), "60"])
    c.launch("small", [PYTHON, str(counter), "60"])
    c.wait_log("small", r"^tick 5$")
    c.checkpoint("small")
    c.kill9("small")
    c.ctl("restart", "small", "--lazy")
    c.checkpoint("small")  # nothing to wait for
    assert pager_reports(c, "small") == []
    assert c.wait("small") == 0
    assert c.log("small", "stdout") == plain.stdout

    c.launch("none", [PYTHON, str(counter), "400"])
    c.wait_log("none", r"^tick 2$")
    c.kill9("none")
    r = c.ctl("restart", "none", "--lazy", check=False)
    assert r.returncode == 4 and "no checkpoint to restart from" in r.stderr, r.stderr
    assert c.status("none")["state"] == "failed"
