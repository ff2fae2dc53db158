"""Nothing unverified runs (issue 20, first case): a restored process stays
parked until an agent says RESUME, and only an agent that saw every image
verify says it.  The daemon dies in the middle of a restart from a corrupt
image: the rebuilt processes wait (they used to release themselves after
10 s and run from the corrupt image), and the next daemon kills them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
from conftest import CKPTCTL, PYTHON, Ckptd, flip_byte, run_plain

# big enough that its checksum takes longer than noticing the restorer start
BIG = """
import sys, time
buf = bytearray(b"\\x5a") * (768 << 20)
for i in range(int(sys.argv[1])):
    buf[i << 20] = i & 0xFF
    print(f"tick {i} {sum(buf[j << 20] for j in range(i + 1))}", flush=True)
    time.sleep(0.05)
"""


def test_a_restart_cut_short_by_the_daemons_death_never_runs(ckptd: Ckptd, tmp_path: Path) -> None:
    script = tmp_path / "big.py"
    script.write_text(BIG)
    argv = [PYTHON, str(script), "200"]
    plain = run_plain(argv)
    ckptd.launch("cut", argv)
    ckptd.wait_log("cut", r"^tick 10 ")
    good = ckptd.checkpoint("cut")
    ckptd.wait_log("cut", r"^tick 20 ")
    ckptd.kill9("cut")
    before = ckptd.log_file("cut").stat().st_size  # the log as the restart finds it
    pages = Path(good["path"]) / "proc-2" / "pages.img"
    flip_byte(pages)

    restart = subprocess.Popen([CKPTCTL, "restart", "cut"], env=ckptd.env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ckptd.init_pids():  # ckptd-init --restore: the rebuild has begun, its checks with it
        assert time.monotonic() < deadline, "the restart never started"
        assert restart.poll() is None, restart.stderr.read() if restart.stderr else ""
        time.sleep(0.01)
    daemons = ckptd.daemon_pids()
    assert daemons
    for pid in daemons:
        os.kill(pid, signal.SIGKILL)
    restart.wait(timeout=60)
    # parked, unless the daemon's checks failed the image (and killed them)
    # before it died: on a loaded machine they can win the race
    rebuilt = [p for p in ckptd.init_pids() if psutil.pid_exists(p)]
    log = ckptd.log_file("cut")
    size = log.stat().st_size
    time.sleep(15)  # the shim used to release itself after 10 s
    assert log.stat().st_size == size, log.read_bytes()[size:][:500]

    # the next daemon finds the incarnation it never saw verified, and kills it
    ckptd.start_daemon()  # (status alone, with no daemon, reads the records: "lost")
    st = ckptd.status("cut")
    deadline = time.monotonic() + 60
    while st["state"] not in ("failed", "lost") and time.monotonic() < deadline:
        time.sleep(0.2)
        st = ckptd.status("cut")
    if rebuilt:
        while st["state"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.2)
            st = ckptd.status("cut")
        assert st["state"] == "failed", st
        assert "cut short by an agent restart" in st["message"], st["message"]
    else:  # the image failed its checks first: the processes went then
        assert st["state"] in ("failed", "lost"), st
    assert st["pids"] == []
    # the failed restart is undone: by the daemon that saw the checks fail, or
    # by the next one, which plays back the journal the dead one left
    assert log.stat().st_size == before
    for pid in rebuilt:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid

    flip_byte(pages)  # the same byte back: the checkpoint is good again
    ckptd.ctl("restart", "cut")
    assert ckptd.wait("cut") == 0
    assert ckptd.log("cut", "stdout") == plain.stdout
