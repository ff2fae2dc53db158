"""Restart on another node (bench.py --move SIZES): is it as fast as a
restart on the node the job ran on?

One process of MIB MiB is launched on the first of two namespace nodes
(bench_nodes.py: a coordinator, one agent per node, every node's
checkpoints in one shared directory), checkpointed, killed with SIGKILL,
its checkpoint evicted and the freed memory settled (bench.py's `cold`),
and restarted on the same node; killed, evicted and settled again, and
restarted with `--on` the second node.  Both restarts are timed from the
command, CLI included, and set beside the raw read of the same number of
bytes from the same directory, measured in the same run.  The two nodes
share this machine's disk and page cache: what is measured is ckptd's
path on a node that never ran the job (its agent, its namespace, no local
state), not a network filesystem.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def bench_move(
    base: Path,
    mib: int,
    *,
    nodes: Any,
    ckptd: Any,
    workload: Path,
    wait_line: Callable[..., str],
    cold: Callable[..., None],
    raw_read: Callable[[Path], float],
    raw_write: Callable[[Path, int], float],
    kill9: Callable[[Any, str], None],
) -> dict[str, Any]:
    first, other = nodes.names[0], nodes.names[1]
    raw = base / "move-raw.bin"
    raw_write(raw, mib << 20)
    c = ckptd(base / "home")
    c.env = dict(nodes.env)
    job = f"move-{mib}"
    ckpt_dir = base / "ckpt"
    c.run("ckptd", "launch", "--detach", "--job", job, "--node", first, "--ckpt-dir", str(ckpt_dir), "--",
          sys.executable, str(workload), str(mib))  # fmt: skip
    log = ckpt_dir / job / "output.log"
    wait_line(log, "ready")
    time.sleep(1.0)
    info = c.json("ckptctl", "checkpoint", job)
    image = int(info["size_bytes"])

    def restart(*on: str) -> tuple[float, str]:
        kill9(c, job)
        cold(Path(info["path"]))
        t = time.monotonic()
        resp = c.json("ckptctl", "restart", job, *on)
        took = time.monotonic() - t
        # alive: the first process answers (the workload prints its longest pause)
        n = len(log.read_text().splitlines())
        first_pid = next(p["host_pid"] for p in resp["status"]["processes"] if p["pid"] == 2)
        os.kill(first_pid, signal.SIGUSR1)
        wait_line(log, "max_gap_s", after=n)
        return took, str(resp["status"].get("node", ""))

    try:
        here_s, here = restart()
        moved_s, moved = restart("--on", other)
    finally:
        c.run("ckptctl", "kill", job)
    for node, want in ((here, first), (moved, other)):
        if node != want:
            raise SystemExit(f"a restart meant for {want} ran the job on {node!r}")
    read = raw_read(raw)
    raw.unlink()
    shutil.rmtree(ckpt_dir / job, ignore_errors=True)
    return {"mib": mib, "image": image, "raw_read": read, "here_s": here_s, "moved_s": moved_s}


def move_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| resident | image MiB | raw read GB/s | restart on its node s | restart/raw | restart --on another node s "
        "| restart/raw | other node / its node |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    for r in rows:
        want = r["image"] / r["raw_read"]  # seconds the raw read takes for the image's bytes
        cells = [
            f"{r['mib']} MiB",
            f"{r['image'] / 2**20:.0f}",
            f"{r['raw_read'] / 1e9:.2f}",
            f"{r['here_s']:.2f}",
            f"{want / r['here_s']:.2f}",
            f"{r['moved_s']:.2f}",
            f"{want / r['moved_s']:.2f}",
            f"{r['moved_s'] / r['here_s']:.2f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body
