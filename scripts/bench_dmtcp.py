"""DMTCP on the benchmark's workload, for the comparison column of
scripts/bench.py (used only when dmtcp_launch is on PATH).

The same process (bench_workload.py, MIB MiB resident) runs under
dmtcp_launch with its own coordinator on a free port; `dmtcp_command
--bcheckpoint` is timed (DMTCP's gzip off, as ckptd writes uncompressed),
the pause is measured from inside exactly as for ckptd (SIGUSR1: the
longest gap in the workload's own progress), the process is killed with
SIGKILL, the image evicted from the page cache, and `dmtcp_restart` is
timed until the workload answers again.

The options are passed as environment variables, which DMTCP 2.x and 3.x
both read (their flag names differ between versions).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_dmtcp(
    base: Path,
    mib: int,
    workload: Path,
    *,
    evict: Callable[[Path], None],
    wait_line: Callable[[Path, str], str],
    gap_of: Callable[[int, Path], float],
) -> dict[str, Any]:
    """bench.py's own helpers come in: evict a file from the page cache,
    wait for a line of the log, ask the workload for its longest pause."""
    work = base / f"dmtcp-{mib}"
    ckpt = work / "ckpt"
    ckpt.mkdir(parents=True)
    port = str(_free_port())
    env = dict(
        os.environ,
        DMTCP_COORD_PORT=port,
        DMTCP_PORT=port,  # DMTCP 2.x
        DMTCP_CHECKPOINT_DIR=str(ckpt),
        DMTCP_TMPDIR=str(work),
        DMTCP_GZIP="0",
    )
    for var in ("LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
        env.pop(var, None)
    log = work / "output.log"
    quiet: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    coord = subprocess.Popen(["dmtcp_coordinator", "--exit-on-last"], env=env, cwd=work, **quiet)
    procs: list[subprocess.Popen[bytes]] = [coord]
    try:
        time.sleep(0.5)
        with open(log, "wb") as out:
            job = subprocess.Popen(["dmtcp_launch", "--join", sys.executable, str(workload), str(mib)],
                                   env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(job)
        wait_line(log, "ready")
        time.sleep(1.0)
        gap_of(job.pid, log)
        t0 = time.monotonic()
        subprocess.run(["dmtcp_command", "--bcheckpoint"], env=env, check=True, capture_output=True, timeout=600)
        ckpt_s = time.monotonic() - t0
        paused = gap_of(job.pid, log)
        images = sorted(ckpt.glob("ckpt_*.dmtcp"))
        if not images:
            raise RuntimeError(f"DMTCP wrote no ckpt_*.dmtcp in {ckpt}")
        image = sum(img.stat().st_size for img in images)
        job.send_signal(signal.SIGKILL)
        job.wait()
        for img in images:
            evict(img)
        t0 = time.monotonic()
        with open(log, "ab") as out:
            restarted = subprocess.Popen(["dmtcp_restart", "--join", *map(str, images)],
                                         env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(restarted)
        # running again once it answers; the answer's own latency is milliseconds
        gap_of(restarted.pid, log)
        restart_s = time.monotonic() - t0
        return {"mib": mib, "image": image, "ckpt_s": ckpt_s, "paused_s": paused, "restart_s": restart_s}
    finally:
        subprocess.run(["dmtcp_command", "--quit"], env=env, check=False, capture_output=True, timeout=30)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def dmtcp_table(ckptd_rows: list[dict[str, Any]], dmtcp_rows: list[dict[str, Any]]) -> str:
    """ckptd's figures next to DMTCP's for the same sizes, as ratios."""
    head = (
        "| resident | DMTCP checkpoint s | ckptd/DMTCP checkpoint time | DMTCP paused s | ckptd/DMTCP pause "
        "| DMTCP image MiB | DMTCP restart s | ckptd/DMTCP restart time |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    ours = {r["mib"]: r for r in ckptd_rows if r.get("procs", 1) == 1}
    for d in dmtcp_rows:
        c = ours.get(d["mib"])
        cells = [
            f"{d['mib']} MiB",
            f"{d['ckpt_s']:.2f}",
            f"{c['ckpt_s'] / d['ckpt_s']:.2f}" if c else "-",
            f"{d['paused_s']:.3f}",
            f"{c['paused_s'] / d['paused_s']:.2f}" if c else "-",
            f"{d['image'] / 2**20:.0f}",
            f"{d['restart_s']:.2f}",
            f"{c['restart_s'] / d['restart_s']:.2f}" if c else "-",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body
