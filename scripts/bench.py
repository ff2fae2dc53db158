#!/usr/bin/env python3
"""ckptd benchmark: checkpoint and restart of one process at several resident
sizes, next to the raw sequential bandwidth of the same directory measured
in the same run.  Writes a Markdown table (stdout, and --out FILE).

    scripts/bench.py [--dir DIR] [--sizes 256,1024,4096] [--trees 8x256] [--out BENCHMARKS.md]
    scripts/bench.py --ranks 1,2,4 [--rank-mib 256] [--sizes ''] [--trees '']
    scripts/bench.py --ranks 1,32,64 --rank-mib 8 --nodes 16 --rank-repeats 5 --sizes "" --trees "" --incremental ""

Per size: raw write (write + fsync, through the page cache like ckptd) and
raw read (page cache dropped with POSIX_FADV_DONTNEED, then SETTLE_S); then the workload is
launched under ckptd and checkpointed (time from `ckptctl checkpoint` until
committed, including checksums and fsync), its pause is measured from its
own progress timestamps, it is killed with SIGKILL, its checkpoint files are
evicted from the page cache, the freed memory left to settle (SETTLE_S below),
and `ckptctl restart` is timed from the command's start to its return, the
job running (the CLI's start-up and its RPC, the verification of every
checksum, the restore; the coordinator's own figure, without the CLI, in
parentheses).  Checkpoint times are the coordinator's (request to commit).
Ratios compare ckptd's throughput on the image with the raw bandwidth, and
with a read of the same file into new memory (measured after the job).  --trees adds process trees (8x256: eight
processes of 256 MiB each), checkpointed and restarted as one job.  --ranks
adds multi-node jobs of 1, 2, 4 ranks (each rank its own network namespace
and virtual IP, all on this machine's agent; root), exchanging messages
over TCP all the time: checkpoint time and the pause against the number of
ranks.  DMTCP is measured too, for each of --sizes, when dmtcp_launch is on
PATH (scripts/bench_dmtcp.py), and its table gives ckptd's figures as
ratios to DMTCP's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.paths import Home

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_cli import tool  # noqa: E402  (next to this script)
from bench_dmtcp import bench_dmtcp, compress_table, dmtcp_table  # noqa: E402
from bench_encrypt import bench_encrypt, encrypt_table  # noqa: E402
from bench_move import bench_move, move_table  # noqa: E402
from bench_nodes import Nodes  # noqa: E402

WORKLOAD = HERE / "bench_workload.py"
RANK_WORKLOAD = HERE / "bench_rank_workload.py"
DP_WORKLOAD = HERE.parent / "tests" / "workloads" / "dp_sgd.py"  # data-parallel ranks with a replicated model
CHUNK = 8 << 20


def evict(path: Path) -> None:
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# Every read a ratio compares starts from the same state of memory: the
# file evicted, then SETTLE_S for the memory just freed (the killed job's,
# the evicted page cache) to go back to the host.  On a VM with free page
# reporting (virtio_balloon; this Firecracker VM) memory freed less than
# about 2 s before is still backed and fills at about 5 GB/s; later it is
# faulted in from the host at about 0.5 GB/s per core.  A read timed the
# moment the cache is dropped gets whatever part is still backed, which
# depends on how soon it starts, not on how it reads: the same 4 GiB
# ckptd restart took 5.2-5.5 s started at once and 9.2-9.4 s started 6 s
# later, alternating (BENCHMARKS.md, first section).
SETTLE_S = 6.0
settle_s = SETTLE_S  # --settle


def cold(*paths: Path) -> None:
    """paths evicted from the page cache, and the freed memory settled (SETTLE_S)."""
    for path in paths:
        evict(path)
    time.sleep(settle_s)


def raw_write(path: Path, size: int) -> float:
    buf = os.urandom(CHUNK)
    t = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, buf[: min(left, CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / (time.monotonic() - t)


def raw_read(path: Path) -> float:
    cold(path)
    buf = bytearray(CHUNK)
    t = time.monotonic()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while (k := f.readinto(buf)) > 0:
            n += k
    return n / (time.monotonic() - t)


class Ckptd:
    def __init__(self, home: Path) -> None:
        self.env = dict(os.environ, CKPTD_HOME=str(home))

    def run(self, *args: str) -> str:
        # the script beside this Python, as its venv runs it, not a wrapper
        # first on PATH: pyenv's shim adds 0.1 s, which a restart's time counts
        argv = [tool(args[0]), *args[1:]] if args[0] in ("ckptd", "ckptctl") else list(args)
        p = subprocess.run(argv, check=False, env=self.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {p.stderr.strip()}")
        return p.stdout

    def json(self, *args: str) -> dict:
        return json.loads(self.run(*args, "--json"))

    def json_list(self, *args: str) -> list[dict]:
        return json.loads(self.run(*args, "--json"))


def wait_line(log: Path, prefix: str, after: int = 0, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            lines = log.read_text().splitlines()[after:]
            for line in lines:
                if line.startswith(prefix):
                    return line
        time.sleep(0.05)
    tail = " | ".join(log.read_text(errors="replace").splitlines()[-3:]) if log.exists() else "(no log)"
    raise SystemExit(f"{prefix!r} never appeared in {log}; it ends: {tail}")


def gap_of(pid: int, log: Path) -> float:
    """The workload's longest pause since the last ask (SIGUSR1 to its first process)."""
    n = len(log.read_text().splitlines())
    os.kill(pid, signal.SIGUSR1)
    return float(wait_line(log, "max_gap_s", after=n).split()[1])


def gap(c: Ckptd, job: str, log: Path) -> float:
    first = [p["host_pid"] for p in c.json("ckptctl", "status", job)["processes"] if p["pid"] == 2]
    return gap_of(first[0], log)


MADV_HUGEPAGE = 14


def raw_read_into_new_memory(path: Path) -> float:
    """Read the file, evicted, into memory the process has never touched (in
    huge pages, the fastest way measured here): what any restore must do
    at least, since it lands every byte in fresh pages.  On a VM that hands
    freed memory back to its host (Firecracker's free page reporting, say),
    getting that memory back costs more than reading the file."""
    cold(path)
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    t = time.monotonic()
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as mem, open(path, "rb", buffering=0) as f:
        anchor = ctypes.c_char.from_buffer(mem)
        libc.madvise(ctypes.addressof(anchor), size, MADV_HUGEPAGE)  # best effort
        del anchor
        view = memoryview(mem)
        n = 0
        while n < size and (k := f.readinto(view[n : n + CHUNK])) > 0:
            n += k
        view.release()
    return n / (time.monotonic() - t)


def raw_baseline(base: Path, size: int, name: str = "raw.bin") -> tuple[float, float]:
    """Raw sequential write and read bandwidth of `size` bytes in this
    directory.  The file stays for fresh_baseline."""
    raw = base / name
    return raw_write(raw, size), raw_read(raw)


def fresh_baseline(base: Path, name: str = "raw.bin", keep: bool = False) -> float:
    """The read of raw_baseline's file into new memory; removes the file
    (unless keep: Again reads it again).  Measured after the job:
    allocating and freeing that much memory right before it changes how the
    job's memory is backed (its pause measured ten times longer)."""
    raw = base / name
    fresh = raw_read_into_new_memory(raw)
    if not keep:
        raw.unlink()
    return fresh


def kill9(c: Ckptd, job: str) -> None:
    """SIGKILL every process of the job, as a node failure would, and wait
    until ckptd has seen it die."""
    for pid in c.json("ckptctl", "status", job)["pids"]:
        os.kill(pid, signal.SIGKILL)
    while c.json("ckptctl", "status", job)["state"] in ("running", "checkpointing"):
        time.sleep(0.05)


def restart_once(c: Ckptd, job: str, info: dict, alive: Callable[[], object]) -> tuple[float, float]:
    """SIGKILL the job, evict its checkpoint from the page cache, let the
    freed memory settle, time the restart and check the job runs (alive):
    the command's seconds (CLI start-up and its RPC included, as DMTCP's)
    and the coordinator's own (request to running)."""
    kill9(c, job)
    cold(Path(info["path"]))
    t = time.monotonic()
    own_s = float(c.json("ckptctl", "restart", job)["duration_s"])
    restart_s = time.monotonic() - t
    time.sleep(0.5)
    alive()
    return restart_s, own_s


def kill_and_restart(c: Ckptd, job: str, info: dict, alive: Callable[[], object], keep: bool = False) -> dict[str, Any]:
    """restart_once, then the job removed (unless keep: Again restarts it
    more times); the checkpoint's and the restart's figures."""
    restart_s, own_s = restart_once(c, job, info, alive)
    if not keep:
        c.run("ckptctl", "kill", job)
        shutil.rmtree(Path(info["path"]))
    image = int(info["size_bytes"])
    ckpt_s = float(info["duration_s"])  # request to commit, as the coordinator timed it
    return {
        "ckpt_s": ckpt_s,
        "stall_s": float(info["stall_s"]),
        "image": image,
        "restart_s": restart_s,
        "restart_own_s": own_s,  # the coordinator's own timing: request to running
        "restart_runs": [restart_s],
        "own_runs": [own_s],
        "write_bw": image / ckpt_s,
        "read_bw": image / restart_s,
    }


@dataclass
class Again:
    """A job kept after its row was measured, for --restarts: each round()
    restarts it once more and reads the raw file of the same size once more,
    and bench_dmtcp calls round() between its own restarts of the same
    workload, so ckptd's, DMTCP's and the raw reads alternate and see the
    same disk and host. DMTCP's restart of 1 GiB has measured 0.95-4.8 s
    on this VM from one run to the next: one restart of each says little."""

    c: Ckptd
    job: str
    info: dict[str, Any]
    alive: Callable[[], object]
    raw: Path
    row: dict[str, Any]

    def round(self) -> None:
        restart_s, own_s = restart_once(self.c, self.job, self.info, self.alive)
        self.row["restart_runs"].append(restart_s)
        self.row["own_runs"].append(own_s)
        self.row["raw_read_runs"].append(raw_read(self.raw))

    def finish(self, restarts: int) -> None:
        """Rounds alone up to restarts in all (no DMTCP to alternate with, or
        it failed), then close."""
        while len(self.row["restart_runs"]) < restarts:
            self.round()
        self.close()

    def close(self) -> None:
        """The job and its files removed; the row's figures become the medians of every round."""
        self.c.run("ckptctl", "kill", self.job)
        shutil.rmtree(Path(self.info["path"]))
        self.raw.unlink()
        r = self.row
        r["restart_s"] = statistics.median(r["restart_runs"])
        r["restart_own_s"] = statistics.median(r["own_runs"])
        r["raw_read"] = statistics.median(r["raw_read_runs"])
        r["read_bw"] = r["image"] / r["restart_s"]


def bench_size(base: Path, mib: int, procs: int = 1, keep: bool = False) -> tuple[dict[str, Any], Again | None]:
    """The row of one process (procs > 1: a tree) of mib MiB each; with keep,
    also the Again that restarts it more times (--restarts)."""
    raw = base / f"raw-{procs}x{mib}.bin"  # kept for Again's rounds
    w, r = raw_baseline(base, (mib << 20) * procs, raw.name)

    c = Ckptd(base / "home")
    job = f"bench-{procs}x{mib}"
    ckpt_dir = base / "ckpt"
    c.run(
        "ckptd",
        "launch",
        "--detach",
        "--job",
        job,
        "--ckpt-dir",
        str(ckpt_dir),
        "--",
        sys.executable,
        str(WORKLOAD),
        str(mib),
        str(procs),
    )
    log = ckpt_dir / job / "output.log"
    wait_line(log, "ready")
    time.sleep(1.0)
    gap(c, job, log)  # reset the workload's gap counter
    info = c.json("ckptctl", "checkpoint", job)
    paused = gap(c, job, log)

    def alive() -> float:
        return gap(c, job, log)

    row = kill_and_restart(c, job, info, alive, keep=keep)
    fresh = fresh_baseline(base, raw.name, keep=keep)
    # this disk's write speed drifts by a third within minutes: the baseline is
    # the mean of a raw write before and one after ckptd's checkpoint
    after = base / "raw-after.bin"
    w_after = raw_write(after, (mib << 20) * procs)
    after.unlink()
    row.update({"mib": mib, "procs": procs, "raw_write": (w + w_after) / 2, "raw_write_before": w,
                "raw_write_after": w_after, "raw_read": r, "raw_read_runs": [r], "raw_fresh": fresh,
                "paused_s": paused})  # fmt: skip
    return row, (Again(c, job, info, alive, raw, row) if keep else None)


def bench_lazy(base: Path, mib: int) -> dict[str, Any]:
    """`restart --lazy` of a process of mib MiB, checkpoint evicted: how soon
    the job runs again, and how soon all of its memory is back (the
    agent's log), next to an ordinary restart of the same checkpoint."""
    w, r = raw_baseline(base, mib << 20)
    c = Ckptd(base / "home")
    job = f"bench-lazy-{mib}"
    ckpt_dir = base / "ckpt"
    c.run("ckptd", "launch", "--detach", "--job", job, "--ckpt-dir", str(ckpt_dir), "--",
          sys.executable, str(WORKLOAD), str(mib))  # fmt: skip
    log = ckpt_dir / job / "output.log"
    wait_line(log, "ready")
    info = c.json("ckptctl", "checkpoint", job)
    image = int(info["size_bytes"])
    kill9(c, job)
    evict(Path(info["path"]))
    eager_s = float(c.json("ckptctl", "restart", job)["duration_s"])
    gap(c, job, log)
    kill9(c, job)
    evict(Path(info["path"]))
    daemon_log = base / "home" / "logs" / "daemon.log"
    seen = daemon_log.read_text().count("lazy restore filled in")
    lazy_s = float(c.json("ckptctl", "restart", job, "--lazy")["duration_s"])
    gap(c, job, log)  # it runs
    deadline = time.monotonic() + 600
    while (text := daemon_log.read_text()).count("lazy restore filled in") == seen and time.monotonic() < deadline:
        time.sleep(0.05)
    fill_s = float(text.rsplit("lazy restore filled in", 1)[1].split()[0])
    c.run("ckptctl", "kill", job)
    shutil.rmtree(Path(info["path"]))
    return {"mib": mib, "raw_write": w, "raw_read": r, "image": image, "eager_s": eager_s, "lazy_s": lazy_s,
            "fill_s": fill_s}  # fmt: skip


def lazy_table(rows: list[dict[str, Any]]) -> str:
    out = (
        "| MiB | raw read GB/s | restart s | restart/raw read | restart --lazy: runs after s "
        "| memory all back after s | lazy fill/raw read |\n|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        cells = [
            str(r["mib"]),
            gb(r["raw_read"]),
            f"{r['eager_s']:.2f}",
            f"{r['image'] / r['eager_s'] / r['raw_read']:.2f}",
            f"{r['lazy_s']:.3f}",
            f"{r['lazy_s'] + r['fill_s']:.2f}",
            f"{r['image'] / (r['lazy_s'] + r['fill_s']) / r['raw_read']:.2f}",
        ]
        out += "| " + " | ".join(cells) + " |\n"
    return out


def phase_split(info: dict[str, Any]) -> dict[str, float]:
    """A checkpoint's stall split by its phases (ckptctl's "phases"): the
    time some rank was at its own work (busy_s: the union of the ranks'
    steps) and the protocol's (the rest of the stall: RPCs, fan-out, time
    in which no rank worked).  Also the older split, as if every rank had a
    core of its own: the stall less the slowest rank's time in each phase."""
    by = {p["name"]: p for p in info.get("phases", [])}
    stall_phases = [by[n] for n in ("prepare", "drain", "dump", "resume") if n in by]
    stall = sum(float(p["rpc_s"]) for p in stall_phases)
    own = sum(float(p.get("local_s", 0)) for p in stall_phases)
    busy = sum(float(p.get("busy_s", 0)) for p in stall_phases)
    return {
        "stall_s": stall,
        "protocol_s": stall - busy,
        "protocol_slowest_s": stall - own,
        # the protocol's cost phase by phase, and where it goes (Phase.issue_s, wire_s)
        "protocol_by_phase": [float(p["rpc_s"]) - float(p.get("busy_s", 0)) for p in stall_phases],
        "busy_by_phase": [float(p.get("busy_s", 0)) for p in stall_phases],
        "busy_s": busy,
        "own_by_phase": [float(p.get("local_s", 0)) for p in stall_phases],
        "issue_s": sum(float(p.get("issue_s", 0)) for p in stall_phases),
        "wire_s": sum(float(p.get("wire_s", 0)) for p in stall_phases),
        "own_s": own,
        "dump_own_s": float(by.get("dump", {}).get("local_s", 0)),
        "commit_s": float(by.get("commit", {}).get("rpc_s", 0)),
        "finalize_s": float(by.get("finalize", {}).get("rpc_s", 0)),
    }


def daemons_cpu(nodes: Nodes | None) -> tuple[float, float]:
    """CPU seconds (user and system, every thread) the namespace nodes'
    coordinator and all their agents have used so far: what the protocol
    costs in work, which the cores' load does not stretch as it does time."""
    if nodes is None or nodes.coordinator is None:
        return 0.0, 0.0

    def cpu(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    return cpu(nodes.coordinator.pid), sum(cpu(a.pid) for a in nodes.cluster.agents.values())


def bench_ranks(base: Path, nranks: int, mib: int, nodes: Nodes | None = None, rep: int = 0) -> dict[str, float]:
    """A job of nranks ranks of mib MiB each: checkpoint, pause, restart;
    with nodes, spread over its namespace nodes (one agent each); rep: the
    how-manieth job of that many ranks (--rank-repeats)."""
    w, r = raw_baseline(base, (mib << 20) * nranks)
    c = Ckptd(base / "home")
    if nodes is not None:
        c.env = dict(nodes.env)
    job = f"ranks-{nranks}x{mib}" + (f"-{rep}" if rep else "")
    ckpt_dir = base / "ckpt"
    c.run("ckptd", "launch", "--detach", "--job", job, "--ckpt-dir", str(ckpt_dir), "--ranks", str(nranks),
          "--", sys.executable, str(RANK_WORKLOAD), str(mib))  # fmt: skip
    logs = [ckpt_dir / job / f"rank-{k}" / "output.log" for k in range(nranks)]
    for log in logs:
        wait_line(log, "ready")
    time.sleep(1.0)

    def gaps() -> float:
        counts = [len(log.read_text().splitlines()) for log in logs]
        for p in c.json("ckptctl", "status", job)["processes"]:
            if p["pid"] == 2:
                os.kill(p["host_pid"], signal.SIGUSR1)
        return max(float(wait_line(log, "max_gap_s", after=n).split()[1]) for log, n in zip(logs, counts, strict=True))

    gaps()  # reset the counters
    cpu0 = daemons_cpu(nodes)
    info = c.json("ckptctl", "checkpoint", job)
    cpu1 = daemons_cpu(nodes)
    paused = gaps()
    split = phase_split(info)
    row = kill_and_restart(c, job, info, gaps)  # every rank alive and talking after the restart
    fresh = fresh_baseline(base)
    return {
        "mib": mib, "procs": nranks, "ranks": nranks, "nodes": len(nodes.names) if nodes else 1,
        "raw_write": w, "raw_read": r, "raw_fresh": fresh, "paused_s": paused, **row, **split,
        "coordinator_cpu_s": cpu1[0] - cpu0[0], "agents_cpu_s": cpu1[1] - cpu0[1],
    }  # fmt: skip


def ranks_table(rows: list[dict[str, Any]]) -> str:
    """ranks -> what the barrier itself costs, beside the stall and the restart."""
    head = (
        "| ranks | nodes | MiB per rank | protocol s (stall in which no rank worked) "
        "| of it: prepare / drain / dump / resume | issuing requests s | worst round trip less own s "
        "| ranks at work s (union of their steps) | stall less slowest rank's own s "
        "| ranks' own s (slowest, per phase) "
        "| of it: prepare / drain / dump / resume | stall s | paused s (from inside) "
        "| finalize s | commit s | checkpoint s | CPU s of the round: coordinator / agents "
        "| restart s (command; ckptd's own) |\n" + "|---:" * 18 + "|\n"
    )
    body = ""
    for r in rows:
        cells = [
            str(int(r["ranks"])),
            str(int(r["nodes"])),
            str(r["mib"]),
            f"{r['protocol_s']:.3f}",
            " / ".join(f"{x:.3f}" for x in r["protocol_by_phase"]),
            f"{r['issue_s']:.3f}",
            f"{r['wire_s']:.3f}",
            f"{r['busy_s']:.3f}",
            f"{r['protocol_slowest_s']:.3f}",
            f"{r['own_s']:.3f}",
            " / ".join(f"{x:.3f}" for x in r["own_by_phase"]),
            f"{r['stall_s']:.3f}",
            f"{r['paused_s']:.3f}",
            f"{r['finalize_s']:.3f}",
            f"{r['commit_s']:.3f}",
            f"{r['ckpt_s']:.2f}",
            f"{r['coordinator_cpu_s']:.2f} / {r['agents_cpu_s']:.2f}",
            f"{r['restart_s']:.2f}; {r['restart_own_s']:.2f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def bench_incremental(base: Path, mib: int, pct: float, rounds: int, track: str) -> dict[str, Any]:
    """One process of mib MiB: a full checkpoint, then `rounds` incremental
    ones, each after pct% of its pages were rewritten; the pause of each
    from inside; then a restart from the last (a chain of `rounds`).  track:
    how the shim finds the changed pages (CKPTD_TRACK: uffd or hash)."""
    w, r = raw_baseline(base, mib << 20)
    c = Ckptd(base / "home")
    c.env["CKPTD_TRACK"] = track  # the job inherits the launcher's environment
    job = f"incr-{mib}-{track}"
    ckpt_dir = base / "ckpt"
    c.run("ckptd", "launch", "--detach", "--job", job, "--ckpt-dir", str(ckpt_dir), "--full-every", "100",
          "--", sys.executable, str(WORKLOAD), str(mib), "1", str(pct))  # fmt: skip
    log = ckpt_dir / job / "output.log"
    wait_line(log, "ready")
    time.sleep(1.0)
    gap(c, job, log)
    full = c.json("ckptctl", "checkpoint", job)
    full_paused = gap(c, job, log)
    incs, paused = [], []
    for _ in range(rounds):
        n = len(log.read_text().splitlines())
        pid = next(p["host_pid"] for p in c.json("ckptctl", "status", job)["processes"] if p["pid"] == 2)
        os.kill(pid, signal.SIGUSR2)
        wait_line(log, "dirtied", after=n)
        gap(c, job, log)
        incs.append(c.json("ckptctl", "checkpoint", job))
        paused.append(gap(c, job, log))
    listed = {i["name"]: i for i in c.json_list("ckptctl", "list", job)}
    last = listed[incs[-1]["name"]]
    kill9(c, job)
    evict(ckpt_dir / job)
    restart_s = float(c.json("ckptctl", "restart", job)["duration_s"])
    time.sleep(0.5)
    gap(c, job, log)  # alive
    # the first checkpoint after the restart, after the same share of pages
    # changed: on the checkpoint restored from (ADOPT), as the others were
    n = len(log.read_text().splitlines())
    pid = next(p["host_pid"] for p in c.json("ckptctl", "status", job)["processes"] if p["pid"] == 2)
    os.kill(pid, signal.SIGUSR2)
    wait_line(log, "dirtied", after=n)
    after = c.json("ckptctl", "checkpoint", job)
    c.run("ckptctl", "kill", job)
    fresh = fresh_baseline(base)
    return {
        "mib": mib,
        "track": track,
        "pct": pct,
        "rounds": rounds,
        "raw_write": w,
        "raw_read": r,
        "raw_fresh": fresh,
        "full_bytes": int(full["size_bytes"]),
        "full_s": float(full["duration_s"]),
        "full_paused_s": full_paused,
        "inc_bytes": max(int(i["size_bytes"]) for i in incs),
        "inc_s": max(float(i["duration_s"]) for i in incs),
        "inc_paused_s": max(paused),
        "logical_bytes": int(last["logical_bytes"]),
        "restart_s": restart_s,
        "after_bytes": int(after["size_bytes"]),
        "after_s": float(after["duration_s"]),
    }


def bench_tiering(base: Path, mib: int, codec: str, fill: str) -> dict[str, Any]:
    """One process of mib MiB (fill: its memory's content, see
    bench_workload.py) launched with --stage-dir and --ckpt-dir (both in
    this directory here: what is measured is the copy and the compressor,
    not a second disk), codec: --compress.  A checkpoint with --wait-shared,
    then a restart after the stage is deleted: a fetch (read, decompress,
    write to the stage) and a rebuild, next to a raw read plus a raw write."""
    w, r = raw_baseline(base, mib << 20)
    c = Ckptd(base / "home")
    c.env["BENCH_FILL"] = fill
    job = f"tier-{mib}-{codec}-{fill}"
    stage, shared = base / "stage", base / "shared"
    c.run("ckptd", "launch", "--detach", "--job", job, "--stage-dir", str(stage), "--ckpt-dir", str(shared),
          "--compress", codec, "--full-every", "1", "--", sys.executable, str(WORKLOAD), str(mib))  # fmt: skip
    log = stage / job / "output.log"
    wait_line(log, "ready")
    time.sleep(1.0)
    gap(c, job, log)
    info = c.json("ckptctl", "checkpoint", job, "--wait-shared")
    paused = gap(c, job, log)
    if codec == "auto":  # its first upload measures the shared tier uncompressed: time the second
        info = c.json("ckptctl", "checkpoint", job, "--wait-shared")
        paused = max(paused, gap(c, job, log))
    kill9(c, job)
    shutil.rmtree(stage / job / info["name"])  # the stage is lost with its node
    cold(shared / job)
    t = time.monotonic()
    restart_s = float(c.json("ckptctl", "restart", job)["duration_s"])
    restart_cmd_s = time.monotonic() - t  # from the command, CLI included (compress_table, beside DMTCP)
    time.sleep(0.5)
    gap(c, job, log)  # alive
    c.run("ckptctl", "kill", job)
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(shared, ignore_errors=True)
    raw = base / "raw.bin"
    raw.unlink()
    return {
        "mib": mib,
        "codec": codec,
        "fill": fill,
        "raw_write": w,
        "raw_read": r,
        "image": int(info["size_bytes"]),
        "stage_s": float(info["duration_s"]),
        "paused_s": paused,
        "upload_s": float(info["upload_s"]),
        "shared_bytes": int(info["shared_bytes"]),
        "restart_s": restart_s,
        "restart_cmd_s": restart_cmd_s,
    }


def tiering_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| resident | memory holds | --compress | stage commit s | paused s | upload s | upload/raw write "
        "| shared/stage bytes | restart from shared s | restart/(raw read + raw write) |\n"
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    for r in rows:
        cells = [
            f"{r['mib']} MiB",
            {"weights": "float32 N(0,1)", "pattern": "integer pattern"}.get(r["fill"], r["fill"]),
            r["codec"],
            f"{r['stage_s']:.2f}",
            f"{r['paused_s']:.3f}",
            f"{r['upload_s']:.2f}",
            f"{r['image'] / r['upload_s'] / r['raw_write']:.2f}",
            f"{r['shared_bytes'] / r['image']:.2f}",
            f"{r['restart_s']:.2f}",
            f"{(r['image'] / r['raw_read'] + r['image'] / r['raw_write']) / r['restart_s']:.2f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def allocated(directory: Path) -> int:
    """Bytes the files under directory take on disk (holes excluded)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def bench_dedup(base: Path, mib: int, dedup: bool) -> dict[str, Any]:
    """Two data-parallel ranks each holding the same mib MiB model: one
    checkpoint, with or without --dedup; what it stores on disk."""
    c = Ckptd(base / "home")
    job = f"dedup-{mib}-{int(dedup)}"
    ckpt_dir = base / "ckpt"
    extra = ["--dedup"] if dedup else []
    c.run("ckptd", "launch", "--detach", "--job", job, "--ckpt-dir", str(ckpt_dir), "--ranks", "2", *extra,
          "--", sys.executable, str(DP_WORKLOAD), "--steps", "100000", "--dim", "4096", "--delay", "0.05",
          "--model-mib", str(mib))  # fmt: skip
    logs = [ckpt_dir / job / f"rank-{k}" / "output.log" for k in range(2)]
    for log in logs:
        wait_line(log, f"rank {logs.index(log)} step   10")
    info = c.json("ckptctl", "checkpoint", job)
    listed = {i["name"]: i for i in c.json_list("ckptctl", "list", job)}[info["name"]]
    on_disk = allocated(Path(info["path"]))
    c.run("ckptctl", "kill", job)
    return {
        "mib": mib,
        "dedup": dedup,
        "logical": int(listed["logical_bytes"]),
        "stored": int(listed["size_bytes"]),
        "on_disk": on_disk,
        "ckpt_s": float(info["duration_s"]),
        "paused_s": float(info["stall_s"]),
    }


def dedup_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model per rank | --dedup | logical MiB | on disk MiB | on disk / one model | checkpoint s | paused s |\n"
        "|---:|---|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    for r in rows:
        cells = [
            f"{r['mib']} MiB",
            "yes" if r["dedup"] else "no",
            f"{r['logical'] / 2**20:.0f}",
            f"{r['on_disk'] / 2**20:.0f}",
            f"{r['on_disk'] / (r['mib'] << 20):.2f}",
            f"{r['ckpt_s']:.2f}",
            f"{r['paused_s']:.3f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def rank_medians_table(rows: list[dict[str, Any]]) -> str:
    """Per rank count: the medians of its jobs' stall, protocol and pause
    (min-max), and each median against the fewest ranks' median."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(int(r["ranks"]), []).append(r)
    keys = ("stall_s", "protocol_s", "paused_s")
    med = {n: {k: statistics.median(float(r[k]) for r in rs) for k in keys} for n, rs in by.items()}
    first = med[min(by)]
    out = (
        "| ranks | jobs | stall s | stall / fewest ranks' | protocol s | protocol / fewest ranks' "
        "| paused s (from inside) |\n" + "|---:" * 7 + "|\n"
    )
    for n in sorted(by):
        rs, m = by[n], med[n]

        def cell(k: str, rs: list[dict[str, Any]] = rs, m: dict[str, float] = m) -> str:
            vals = [float(r[k]) for r in rs]
            return f"{m[k]:.3f} ({min(vals):.3f}-{max(vals):.3f})"

        ratio = {k: m[k] / first[k] if first[k] > 0 else float("nan") for k in keys}
        out += (
            f"| {n} | {len(rs)} | {cell('stall_s')} | {ratio['stall_s']:.1f}x | {cell('protocol_s')} "
            f"| {ratio['protocol_s']:.1f}x | {cell('paused_s')} |\n"
        )
    return out


def incremental_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| resident | changed pages found by | dirtied | full: image MiB | full: s | full: ckpt/raw write "
        "| incremental: image MiB "
        "| incremental/full | incremental: s | paused s (full) | paused s (incremental) "
        "| restart s (chain) | restart/raw read | restart/read into new memory "
        "| first after the restart: image MiB | its s |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    for r in rows:
        cells = [
            f"{r['mib']} MiB",
            {"uffd": "write protection (userfaultfd)", "hash": "page hashes"}.get(r["track"], r["track"]),
            f"{r['pct']:g}%",
            f"{r['full_bytes'] / 2**20:.0f}",
            f"{r['full_s']:.2f}",
            f"{r['full_bytes'] / r['full_s'] / r['raw_write']:.2f}",
            f"{r['inc_bytes'] / 2**20:.1f}",
            f"{r['inc_bytes'] / r['full_bytes']:.4f}",
            f"{r['inc_s']:.2f}",
            f"{r['full_paused_s']:.3f}",
            f"{r['inc_paused_s']:.3f}",
            f"{r['restart_s']:.2f} ({int(r['rounds'])} incrementals)",
            f"{r['logical_bytes'] / r['restart_s'] / r['raw_read']:.2f}",
            f"{r['logical_bytes'] / r['restart_s'] / r['raw_fresh']:.2f}",
            f"{r['after_bytes'] / 2**20:.1f}",
            f"{r['after_s']:.2f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def table(rows: list[dict[str, float]], where: Path) -> str:
    head = (
        "| resident | checkpoint s | paused s (from inside) | image MiB | ckpt GB/s "
        "| raw write GB/s (before/after) | ckpt/raw "
        "| restart s (ckptd's own), median of --restarts | restart GB/s | raw read GB/s (median) | restart/raw "
        "| read into new memory GB/s "
        "| restart/that |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    for r in rows:
        if r.get("ranks"):
            what = f"{int(r['ranks'])} rank{'s' if r['ranks'] > 1 else ''} x {r['mib']} MiB"
        else:
            what = f"{r['mib']} MiB" if r["procs"] == 1 else f"{r['procs']} x {r['mib']} MiB"
        cells = [
            what,
            f"{r['ckpt_s']:.2f}",
            f"{r['paused_s']:.3f}",
            f"{r['image'] / 2**20:.0f}",
            gb(r["write_bw"]),
            gb(r["raw_write"])
            + (f" ({gb(r['raw_write_before'])}/{gb(r['raw_write_after'])})" if "raw_write_after" in r else ""),
            f"{r['write_bw'] / r['raw_write']:.2f}",
            f"{r['restart_s']:.2f} ({r['restart_own_s']:.2f})",
            gb(r["read_bw"]),
            gb(r["raw_read"]),
            f"{r['read_bw'] / r['raw_read']:.2f}",
            gb(r["raw_fresh"]),
            f"{r['read_bw'] / r['raw_fresh']:.2f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    machine = f"{platform.node()}, Linux {platform.release()}, {os.cpu_count()} cores, directory {where}"
    settled = f"every read {settle_s:g} s after its file was evicted (--settle)"
    return f"Measured {time.strftime('%Y-%m-%d')} on {machine}; {settled}.\n\n{head}{body}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir", help="directory to measure and store checkpoints in (default: a temporary one under /var/tmp)"
    )
    ap.add_argument("--sizes", default="256,1024,4096", help="resident sizes in MiB, comma-separated ('' for none)")
    ap.add_argument("--trees", default="8x256", help="process trees, PROCSxMIB, comma-separated ('' for none)")
    ap.add_argument("--ranks", default="", help="multi-node jobs of these rank counts, e.g. 1,2,4 (root)")
    ap.add_argument("--rank-mib", type=int, default=256, help="resident MiB per rank (default 256)")
    ap.add_argument(
        "--rank-repeats", type=int, default=1,
        help="fresh jobs per rank count, the counts taking turns; with more than one, a table of the medians "
        "and of their ratios to the fewest ranks' (one checkpoint of one job says little on a shared VM)",
    )  # fmt: skip
    ap.add_argument(
        "--nodes", type=int, default=0,
        help="spread --ranks over this many namespace nodes, one agent each (0: all on this machine's agent)",
    )  # fmt: skip
    ap.add_argument(
        "--incremental", default="4096",
        help="incremental checkpoints of a process of this many MiB ('' for none)",
    )  # fmt: skip
    ap.add_argument("--dirty", type=float, default=1.0, help="percent of its pages rewritten between checkpoints")
    ap.add_argument("--rounds", type=int, default=3, help="incremental checkpoints after the full one")
    ap.add_argument(
        "--track", default="uffd,hash",
        help="ways of finding the changed pages to measure, comma-separated: uffd, hash (CKPTD_TRACK)",
    )  # fmt: skip
    ap.add_argument(
        "--dedup", default="",
        help="two data-parallel ranks with a replicated model of this many MiB, checkpointed without and "
        "with --dedup (root; '' for none)",
    )  # fmt: skip
    ap.add_argument(
        "--tiering", default="",
        help="tiering (--stage-dir): a process of this many MiB, uploaded with each of --codecs ('' for none)",
    )  # fmt: skip
    ap.add_argument("--codecs", default="off,zstd,auto", help="--compress values to measure with --tiering")
    ap.add_argument(
        "--fills", default="pattern,weights",
        help="what the tiering process's memory holds: pattern (integers), weights (float32 N(0,1))",
    )  # fmt: skip
    ap.add_argument(
        "--lazy", default="",
        help="restart --lazy of a process of this many MiB, next to a plain restart ('' for none)",
    )  # fmt: skip
    ap.add_argument(
        "--encrypt", default="",
        help="checkpoints of processes of these many MiB with launch --encrypt next to plain ones, "
        "--encrypt-rounds each, in the same run ('' for none)",
    )  # fmt: skip
    ap.add_argument(
        "--move", default="",
        help="restart of a process of these many MiB on its node and --on another (two namespace nodes; root)",
    )  # fmt: skip
    ap.add_argument("--encrypt-rounds", type=int, default=3, help="checkpoints of each kind with --encrypt")
    ap.add_argument(
        "--settle", type=float, default=SETTLE_S,
        help=f"seconds between evicting a file and reading it back (default {SETTLE_S:g}; see SETTLE_S)",
    )  # fmt: skip
    ap.add_argument(
        "--restarts", type=int, default=1,
        help="settled restarts of each of --sizes and --trees, alternating with DMTCP's and with raw reads; "
        "the tables give medians, and every restart in the order run (default 1)",
    )  # fmt: skip
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()
    if importlib.util.find_spec("numpy") is None:  # the workloads' memory (bench_workload.py)
        raise SystemExit(f"the benchmark's workloads need numpy, which {sys.executable} lacks: pip install '.[demo]'")
    global settle_s
    settle_s = args.settle
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=args.dir or "/var/tmp"))
    rows = []
    rank_rows: list[dict[str, Any]] = []
    inc_rows: list[dict[str, Any]] = []
    dedup_rows: list[dict[str, Any]] = []
    tier_rows: list[dict[str, Any]] = []
    lazy_rows: list[dict[str, Any]] = []
    dmtcp_rows: list[dict[str, Any]] = []
    gzip_rows: list[dict[str, Any]] = []
    enc_rows: list[dict[str, Any]] = []
    move_rows: list[dict[str, Any]] = []
    agains: dict[tuple[int, int, int], Again | None] = {}  # (MiB, processes, ranks): --restarts
    try:
        for mib in (int(s) for s in filter(None, args.encrypt.split(","))):
            print(f"benchmarking --encrypt with {mib} MiB ...", file=sys.stderr, flush=True)
            enc_rows.append(
                bench_encrypt(base, mib, args.encrypt_rounds, ckptd=Ckptd, workload=WORKLOAD, wait_line=wait_line)
            )
        if args.move:
            with Nodes(base, 2) as pair:
                for mib in (int(s) for s in filter(None, args.move.split(","))):
                    print(f"benchmarking restart --on another node of {mib} MiB ...", file=sys.stderr, flush=True)
                    move_rows.append(bench_move(base, mib, nodes=pair, ckptd=Ckptd, workload=WORKLOAD,
                                                wait_line=wait_line, cold=cold, raw_read=raw_read,
                                                raw_write=raw_write, kill9=kill9))  # fmt: skip
        for mib in (int(s) for s in filter(None, args.lazy.split(","))):
            print(f"benchmarking restart --lazy of {mib} MiB ...", file=sys.stderr, flush=True)
            lazy_rows.append(bench_lazy(base, mib))
        for mib in (int(s) for s in filter(None, args.tiering.split(","))):
            for fill in filter(None, args.fills.split(",")):
                for codec in filter(None, args.codecs.split(",")):
                    print(f"benchmarking tiering of {mib} MiB ({fill}, {codec}) ...", file=sys.stderr, flush=True)
                    tier_rows.append(bench_tiering(base, mib, codec, fill))
        for mib in (int(s) for s in filter(None, args.incremental.split(","))):
            print(f"benchmarking incremental checkpoints of {mib} MiB ({args.track}) ...", file=sys.stderr, flush=True)
            for track in filter(None, args.track.split(",")):
                inc_rows.append(bench_incremental(base, mib, args.dirty, args.rounds, track))
        keep = args.restarts > 1
        for mib in (int(s) for s in filter(None, args.sizes.split(","))):
            print(f"benchmarking {mib} MiB ...", file=sys.stderr, flush=True)
            row, again = bench_size(base, mib, keep=keep)
            rows.append(row)
            agains[(mib, 1, 0)] = again
        for tree in filter(None, args.trees.split(",")):
            procs, mib = (int(x) for x in tree.split("x"))
            print(f"benchmarking {procs} processes of {mib} MiB ...", file=sys.stderr, flush=True)
            row, again = bench_size(base, mib, procs, keep=keep)
            rows.append(row)
            agains[(mib, procs, 0)] = again
        rank_counts = [int(x) for x in filter(None, args.ranks.split(","))]
        with Nodes(base, args.nodes) if args.nodes and rank_counts else contextlib.nullcontext() as nodes:
            for rep in range(args.rank_repeats):
                for n in rank_counts:
                    print(f"benchmarking {n} rank(s) of {args.rank_mib} MiB ({rep + 1}) ...", file=sys.stderr,
                          flush=True)  # fmt: skip
                    rank_rows.append(bench_ranks(base, n, args.rank_mib, nodes, rep))
        rows += rank_rows
        for mib in (int(x) for x in filter(None, args.dedup.split(","))):
            for on in (False, True):
                print(f"benchmarking 2 ranks of {mib} MiB, dedup {on} ...", file=sys.stderr, flush=True)
                dedup_rows.append(bench_dedup(base, mib, on))
        if shutil.which("dmtcp_launch"):
            # the same workloads under DMTCP: every size, every tree, and
            # 2 ranks when --ranks has them (DMTCP's ranks share loopback)
            workloads = [(int(m), 1, 0) for m in filter(None, args.sizes.split(","))]
            workloads += [(int(t.split("x")[1]), int(t.split("x")[0]), 0) for t in filter(None, args.trees.split(","))]
            workloads += [(args.rank_mib, 1, 2)] if 2 in rank_counts else []
            for mib, procs, nranks in workloads:
                print(f"benchmarking DMTCP with {procs} x {mib} MiB, {nranks} ranks ...", file=sys.stderr, flush=True)
                again = agains.pop((mib, procs, nranks), None)
                try:
                    dmtcp_rows.append(
                        bench_dmtcp(base, mib, RANK_WORKLOAD if nranks else WORKLOAD, cold=cold,
                                    wait_line=wait_line, procs=procs, ranks=nranks,
                                    restarts=args.restarts if again else 1, between=again.round if again else None)
                    )  # fmt: skip
                except (RuntimeError, OSError, subprocess.SubprocessError, SystemExit) as e:
                    print(f"DMTCP with {procs} x {mib} MiB, {nranks} ranks failed: {e}", file=sys.stderr)
                if again:
                    again.finish(args.restarts)
            # --compress zstd beside DMTCP's gzip: the same process, the same fill
            for mib, fill in dict.fromkeys((int(r["mib"]), r["fill"]) for r in tier_rows if r["codec"] == "zstd"):
                print(f"benchmarking DMTCP with gzip, {mib} MiB ({fill}) ...", file=sys.stderr, flush=True)
                try:
                    gzip_rows.append(bench_dmtcp(base, mib, WORKLOAD, cold=cold, wait_line=wait_line, gzip=True,
                                                 fill=fill))  # fmt: skip
                except (RuntimeError, OSError, subprocess.SubprocessError, SystemExit) as e:
                    print(f"DMTCP with gzip, {mib} MiB ({fill}) failed: {e}", file=sys.stderr)
        else:
            print("DMTCP not installed: no comparison", file=sys.stderr)
        for again in filter(None, agains.values()):  # no DMTCP to alternate with
            again.finish(args.restarts)
    finally:
        subprocess.run(
            ["ckptctl", "shutdown"],
            check=False,
            env=dict(os.environ, CKPTD_HOME=str(base / "home")),
            capture_output=True,
        )
        Home(base / "home").remove_run_dir()
        shutil.rmtree(base, ignore_errors=True)
    text = table(rows, Path(args.dir or "/var/tmp")) if rows else ""
    if rank_rows:
        text += "\nThe barrier's own cost against the number of ranks (a full checkpoint each):\n\n" + ranks_table(
            rank_rows
        )
        if args.rank_repeats > 1:
            text += (
                f"\nThe same, by the medians of {args.rank_repeats} fresh jobs per rank count (min-max), "
                "and their ratios to the fewest ranks' medians:\n\n" + rank_medians_table(rank_rows)
            )
    if inc_rows:
        text += "\nIncremental checkpoints:\n\n" + incremental_table(inc_rows)
    if dedup_rows:
        text += "\nTwo data-parallel ranks with the same model:\n\n" + dedup_table(dedup_rows)
    if dmtcp_rows:
        text += "\nckptd beside DMTCP on the same workloads, same run (ratio ckptd/DMTCP):\n\n" + dmtcp_table(
            rows, dmtcp_rows
        )
    if enc_rows:
        text += "\nEncryption at rest (launch --encrypt) against plain checkpoints, same run:\n\n" + encrypt_table(
            enc_rows
        )
    if move_rows:
        text += "\nRestart on the job's node and --on another node (two namespace nodes, one disk):\n\n" + move_table(
            move_rows
        )
    if lazy_rows:
        text += "\nLazy restore (checkpoint evicted before each restart):\n\n" + lazy_table(lazy_rows)
    if tier_rows:
        text += "\nTiering (stage and shared tier in the same directory):\n\n" + tiering_table(tier_rows)
    if gzip_rows:
        text += "\n--compress zstd beside DMTCP's gzip, same run (ratio ckptd/DMTCP):\n\n" + compress_table(
            tier_rows, gzip_rows
        )
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
