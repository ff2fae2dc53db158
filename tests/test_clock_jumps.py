"""Clocks that jump (issue 20's fault-injection matrix): the wall clock set
forward or back by hours, between checkpoints and during them.

Nothing here sets the machine's clock (the other tests, and the rest of
the machine, would see it jump), and CLOCK_REALTIME has no namespace:
instead the wall-clock time an agent recorded when it started a job
(runtime.json's `started`) is moved by hours, which is what a clock set
between that agent and the next one does to it against the process's
start time as psutil computes it (boot time from the wall clock, plus the
kernel's start ticks).  It used to be the pid-reuse check: a clock set
forward made the next daemon take the running job for gone ("lost").

What else could a jump fool reads no wall clock: --interval, node
liveness and every deadline run on time.monotonic(), "latest" and --keep
go by checkpoint ids (coordinator/policy.py, nodes.py, catalog.py)."""

from __future__ import annotations

import json
import time

import faultmatrix
import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, run_plain

COUNTER = str(WORKLOADS / "counter.py")

READOPT = (
    "the next daemon re-adopts the running job (same processes), checkpoints it, and the latest checkpoint "
    "restores byte-identical"
)


@pytest.mark.parametrize(
    "hours",
    [
        pytest.param(h, id=f"{h:+d}h", marks=faultmatrix.cell(f"clock set {way} 3 h", "any", READOPT))
        for h, way in ((3, "forward"), (-3, "back"))
    ],
)  # fmt: skip
@pytest.mark.slow
def test_a_running_job_is_re_adopted_after_the_clock_was_set(ckptd: Ckptd, hours: int) -> None:
    plain = run_plain([PYTHON, COUNTER, "300"])  # long enough to outlive a daemon's restart on a loaded machine
    ckptd.launch("clk", [PYTHON, COUNTER, "300"])
    ckptd.wait_log("clk", r"^tick 5$")
    pids = ckptd.status("clk")["pids"]
    (record,) = ckptd.home.rglob("runtime.json")
    inc = json.loads(record.read_text())
    # set forward: the process now seems to have started hours after the recorded time; back: before it
    inc["started"] -= hours * 3600
    record.write_text(json.dumps(inc))
    ckptd.crash_daemon()
    deadline = time.monotonic() + 15
    while not (st := ckptd.status("clk"))["pids"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the agent re-adopts its jobs right after it starts
    assert st["state"] == "running" and st["pids"] == pids, st
    assert ckptd.checkpoint("clk")["id"] == 1
    ckptd.kill9("clk")
    ckptd.ctl("restart", "clk")
    assert ckptd.wait("clk") == 0
    assert ckptd.log("clk", "stdout") == plain.stdout
