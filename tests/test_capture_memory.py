"""Memory safety of the capture (issue 20): a checkpoint of a job that
rewrites all its memory, in a memory cgroup with room for 1.6 times the job
(and, as under Slurm, the daemon that `ckptd launch` starts lands there
too).  A copy-on-write capture could need the job's memory once more, so
the agent has the processes write their pages during the pause instead
(agent/capture_budget.py), and says so in the checkpoint's record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CKPTD, PYTHON, WORKLOADS, Ckptd

pytestmark = pytest.mark.serial  # it makes memory cgroups and fills most of a gigabyte

JOB_MIB = 300
V1 = Path("/sys/fs/cgroup/memory")


def oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


@pytest.fixture
def memory_cgroup(ckptd: Ckptd) -> Iterator[Path]:
    if not (V1 / "memory.limit_in_bytes").exists():
        pytest.fail("this test needs the cgroup v1 memory controller at /sys/fs/cgroup/memory (the machine's own)")
    cg = V1 / f"ckptd-test-{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(int(JOB_MIB * 1.6) << 20))
        yield cg
    finally:
        ckptd.cleanup()  # the daemon and the job leave the cgroup
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                cg.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_checkpoints_of_a_job_near_its_memory_limit_do_not_oom(ckptd: Ckptd, memory_cgroup: Path) -> None:
    c, cg = ckptd, memory_cgroup
    argv = [PYTHON, str(WORKLOADS / "rewrite_memory.py"), str(JOB_MIB), "1000000"]
    procs = str(cg / "cgroup.procs")
    subprocess.run(
        [CKPTD, "launch", "--detach", "--job", "mem", "--", *argv],
        env=c.env,
        check=True,
        timeout=120,
        preexec_fn=lambda: Path(procs).write_text(str(os.getpid())),
    )
    c.wait_log("mem", r"^pass 3$")
    assert c.daemon_pids() and all(str(p) in Path(procs).read_text().split() for p in c.daemon_pids())
    for _ in range(3):
        info = c.checkpoint("mem")
        assert c.status("mem")["state"] == "running"
        manifest = json.loads((Path(info["path"]) / "manifest.json").read_text())
        proc = manifest["processes"][0]
        assert proc["capture"] == "pause", proc
        assert "a copy-on-write capture could need" in proc["capture_why"], proc
        assert f"memory cgroup /{cg.name}" in proc["capture_why"], proc
    assert oom_kills(cg) == 0
    log = (c.home / "logs" / "daemon.log").read_text()
    assert "written during the pause: a copy-on-write capture could need" in log
