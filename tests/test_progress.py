"""Observability of a checkpoint in flight: `ckptctl list` shows the round
being written (and no restart can use it), `ckptctl status` shows how many
bytes it has written and hashed, `ckptctl status --watch` follows it to its
end; then a kill -9 and a restart give the uninterrupted run's output."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from conftest import CKPTCTL, PYTHON, WORKLOADS, Ckptd, run_plain

from ckptd.daemon import coordinator_address
from ckptd.paths import Home
from ckptd.rpc import call, coordinator_stub
from ckptd.v1 import ckptd_pb2 as pb

MIB = 256
BIG = [PYTHON, str(WORKLOADS / "dirty_pages.py"), "300", str(MIB)]


def wait_until(what: str, predicate: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"no {what} after {timeout} s")


def test_checkpoint_in_flight_is_listed_and_shows_its_bytes(ckptd: Ckptd) -> None:
    c = ckptd
    plain = run_plain(BIG)
    c.launch("obs", BIG, "--full-every", "1")  # every checkpoint full: its size is known in advance
    c.wait_log("obs", r"^step 20 ")
    first = c.checkpoint("obs")
    stub = coordinator_stub(coordinator_address(Home(c.home), start=False))

    def status() -> pb.JobStatus:
        return call(stub.GetJob, pb.GetJobRequest(job="obs"), 10, "coordinator")

    # a frozen process cannot be paused: the round waits in its first phase
    # (a stopped one would be refused at once: nothing would resume it)
    pid = c.status("obs")["pids"][0]
    freezer = Path(f"/sys/fs/cgroup/freezer/ckptd-test-{os.getpid()}")
    freezer.mkdir()
    (freezer / "cgroup.procs").write_text(str(pid))
    (freezer / "freezer.state").write_text("FROZEN")
    try:
        ck = subprocess.Popen(
            [CKPTCTL, "checkpoint", "obs", "--json", "--timeout", "60"],
            env=c.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def listing_in_progress() -> str:
            out = c.ctl("list", "obs").stdout
            return out if "in progress" in out else ""

        listing = wait_until("checkpoint in progress", listing_in_progress)
        row = next(line for line in listing.splitlines() if "in progress" in line)
        assert row.split()[:2] == ["2", "ckpt-000002"], row
        # what scripts read stays the committed checkpoints only, and a restart cannot pick it
        assert [i["id"] for i in c.ctl_json("list", "obs")] == [first["id"]]
        # the ready step first (its early maps read gives the frozen process 2 s), then the pause
        wait_until("quiescing", lambda: status().operation == "checkpoint 2: quiescing")
        watch = subprocess.Popen(
            [CKPTCTL, "status", "obs", "--watch"], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        (freezer / "freezer.state").write_text("THAWED")
        Path("/sys/fs/cgroup/freezer/cgroup.procs").write_text(str(pid))
        freezer.rmdir()

    # the bytes written, then hashed, as the round goes
    seen: list[pb.Progress] = []
    while ck.poll() is None:
        st = status()
        if st.operation and st.HasField("progress"):
            seen.append(st.progress)
        time.sleep(0.02)
    out, err = ck.communicate()
    assert ck.returncode == 0, err
    info = json.loads(out)
    assert info["id"] == 2
    phases = {p.what for p in seen}
    assert phases & {"writing", "checksums"}, seen
    for p in seen:
        assert p.total >= p.done, p
    writing = [p for p in seen if p.what == "writing"]
    # a full image of a process holding MIB MiB: the expected total is about that
    assert all(p.total >= MIB << 20 for p in writing), writing
    assert any(p.done > 0 for p in seen), seen

    watched, werr = watch.communicate(timeout=60)
    assert watch.returncode == 0, werr
    assert "checkpoint: ckpt-000002" in watched, watched  # it waited for the round to end
    assert "in progress" not in c.ctl("list", "obs").stdout
    assert not status().HasField("progress")  # nothing in flight

    c.kill9("obs")
    c.ctl("restart", "obs")
    assert c.wait("obs") == 0
    assert c.log("obs", "stdout") == plain.stdout
