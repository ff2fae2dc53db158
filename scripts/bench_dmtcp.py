"""DMTCP on the benchmark's workload, for the comparison column of
scripts/bench.py (used only when dmtcp_launch is on PATH).

The same process (bench_workload.py, MIB MiB resident) runs under
dmtcp_launch with its own coordinator on a free port; `dmtcp_command
--bcheckpoint` is timed (DMTCP's gzip off, as ckptd writes uncompressed;
on, set beside ckptd's --compress zstd, in compress_table),
the pause is measured from inside exactly as for ckptd (SIGUSR1: the
longest gap in the workload's own progress), the process is killed with
SIGKILL, the image evicted from the page cache and the freed memory left
to settle (bench.py's SETTLE_S, as for ckptd), and `dmtcp_restart` is
timed until the workload answers again.

The options are passed as environment variables, which DMTCP 2.x and 3.x
both read (their flag names differ between versions).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import statistics
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


def _tail(log: Path, n: int = 6) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return " | ".join(lines[-n:])


def _clients(env: dict[str, str], running: bool = True) -> dict[int, int]:
    """DMTCP's clients as the coordinator lists them: virtual pid -> real pid
    (a restarted process keeps its virtual pid, not its real one).  running:
    only those back to running (a restarting one is listed before its memory
    and signal handlers are back: a SIGUSR1 then kills it)."""
    argv = ["dmtcp_command", "--list"]
    out = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=30).stdout
    found = re.findall(r"\[(\d+):(\d+)\]@[^\n]*?(WorkerState::\w+)", out)
    return {int(v): int(r) for v, r, state in found if not running or state == "WorkerState::RUNNING"}


def _kill_clients(env: dict[str, str], kill: bool = True) -> None:
    """SIGKILL every process the coordinator lists (kill; by their real
    pids: a tree's processes are not our children), and wait until it lists
    none."""
    if kill:
        for real in _clients(env, running=False).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(real, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _clients(env, running=False) and time.monotonic() < deadline:
        time.sleep(0.1)


def _gaps(pids: dict[int, Path], watch: subprocess.Popen[bytes], timeout: float = 120) -> float:
    """SIGUSR1 to each process (real pid -> the log it prints to; several
    may share one); the longest pause any of them reports.  Fails at once,
    with the log's end, if `watch` (what started them) died: DMTCP says why
    in the log."""
    want: dict[Path, int] = {}
    for log in pids.values():
        want[log] = want.get(log, 0) + 1
    seen = {log: len(log.read_text().splitlines()) for log in want}
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    worst = 0.0
    deadline = time.monotonic() + timeout
    for log, n in want.items():
        while True:
            found = [ln for ln in log.read_text().splitlines()[seen[log] :] if ln.startswith("max_gap_s")]
            if len(found) >= n:
                worst = max([worst, *(float(ln.split()[1]) for ln in found)])
                break
            if watch.poll() is not None and watch.returncode != 0:
                raise RuntimeError(f"{watch.args[0]} exited with {watch.returncode}: {_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n - len(found)} process(es) never reported their pause in {log}: {_tail(log)}")
            time.sleep(0.05)
    return worst


def bench_dmtcp(
    base: Path,
    mib: int,
    workload: Path,
    *,
    cold: Callable[..., None],
    wait_line: Callable[[Path, str], str],
    procs: int = 1,
    ranks: int = 0,
    gzip: bool = False,
    fill: str = "",
    restarts: int = 1,
    between: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """bench.py's own helpers come in: evict files from the page cache and
    let the freed memory settle (cold), wait for a line of a log.  procs > 1:
    a tree of that many processes (bench_workload.py forks them); ranks > 0:
    that many ranks of bench_rank_workload.py (workload), each its own
    dmtcp_launch, talking over loopback TCP, checkpointed and restarted
    together.  gzip: DMTCP compresses its images (DMTCP_GZIP=1), to set
    beside `ckptd launch --compress zstd`; fill: the workload's BENCH_FILL.
    restarts > 1: the job killed and restarted from the same images that
    many times in all, between() called before each restart after the first
    (bench.py's Again.round: ckptd's restart of the same workload), and
    restart_s the median."""
    what = f"{ranks}r" if ranks else f"{procs}x"
    work = base / f"dmtcp-{what}{mib}{'-gzip' if gzip else ''}{'-' + fill if fill else ''}"
    ckpt = work / "ckpt"
    ckpt.mkdir(parents=True)
    port = str(_free_port())
    env = dict(
        os.environ,
        DMTCP_COORD_PORT=port,
        DMTCP_PORT=port,  # DMTCP 2.x
        DMTCP_CHECKPOINT_DIR=str(ckpt),
        DMTCP_TMPDIR=str(work),
        DMTCP_GZIP="1" if gzip else "0",
    )
    if fill:
        env["BENCH_FILL"] = fill
    for var in ("LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
        env.pop(var, None)
    quiet: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # no --exit-on-last: the coordinator must outlive the job's SIGKILL, or
    # `dmtcp_restart --join` finds none and exits ("Coordinator not found"):
    # the restarted workload never answered, and the column stayed empty
    coord = subprocess.Popen(["dmtcp_coordinator"], env=env, cwd=work, **quiet)
    running: list[subprocess.Popen[bytes]] = [coord]
    try:
        time.sleep(0.5)
        logs: list[Path] = []
        jobs: list[subprocess.Popen[bytes]] = []
        for r in range(max(ranks, 1)):
            log = work / (f"rank-{r}.log" if ranks else "output.log")
            argv = [sys.executable, str(workload), str(mib)] + ([] if ranks else [str(procs)])
            renv = (
                dict(env, CKPTD_RANK=str(r), CKPTD_NRANKS=str(ranks), CKPTD_MASTER_ADDR="127.0.0.1") if ranks else env
            )
            with open(log, "wb") as out:
                job = subprocess.Popen(["dmtcp_launch", "--join", *argv], env=renv, cwd=work, stdout=out,
                                       stderr=subprocess.STDOUT)  # fmt: skip
            jobs.append(job)
            running.append(job)
            logs.append(log)
        for log in logs:
            wait_line(log, "ready")
        # dmtcp_launch execs the workload: its pid is the process's real one;
        # DMTCP gives it a virtual pid (40000 on), which a restart keeps while
        # the real one changes.  A tree's first process answers for all
        mine = {job.pid: log for job, log in zip(jobs, logs, strict=True)}
        first = {virt: mine[real] for virt, real in _clients(env).items() if real in mine}
        if len(first) != len(mine):
            raise RuntimeError(f"the DMTCP coordinator lists {len(first)} of the job's {len(mine)} first processes")
        time.sleep(1.0)
        _gaps(mine, jobs[0])
        t0 = time.monotonic()
        subprocess.run(["dmtcp_command", "--bcheckpoint"], env=env, check=True, capture_output=True, timeout=600)
        ckpt_s = time.monotonic() - t0
        paused = _gaps(mine, jobs[0])
        images = sorted(ckpt.glob("ckpt_*.dmtcp"))
        if len(images) != procs * max(ranks, 1):
            raise RuntimeError(f"DMTCP wrote {len(images)} ckpt_*.dmtcp in {ckpt}, not {procs * max(ranks, 1)}")
        image = sum(img.stat().st_size for img in images)
        for job in jobs:
            job.send_signal(signal.SIGKILL)
            job.wait()
        _kill_clients(env, kill=procs > 1)  # a tree's other processes (the first ones are reaped: their pids are free)
        # dmtcp_restart gives the restored processes its own stdout and
        # stderr: a job's log goes on in its log, ranks all print to one
        restart_log = logs[0] if not ranks else work / "restart.log"
        runs: list[float] = []
        restarted: subprocess.Popen[bytes] | None = None
        for k in range(restarts):
            if k:
                if between is not None:
                    between()
                _kill_clients(env)  # the restarted job, every process
                if restarted is not None:
                    restarted.wait()
            cold(*images)
            t0 = time.monotonic()
            with open(restart_log, "ab") as out:
                restarted = subprocess.Popen(["dmtcp_restart", "--join", *map(str, images)],
                                             env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
            running.append(restarted)
            # running again once every first process answers (the answer's own latency is milliseconds)
            while True:
                real = _clients(env)
                if all(v in real for v in first):
                    break
                if restarted.poll() is not None or time.monotonic() > t0 + 600:
                    raise RuntimeError(f"dmtcp_restart did not bring the job back: {_tail(restart_log)}")
                time.sleep(0.02)
            runs.append(time.monotonic() - t0)  # before the answer is asked for: none of its latency counts
            _gaps({real[v]: restart_log for v in first}, restarted)
        restart_s = statistics.median(runs)
        return {"mib": mib, "procs": procs, "ranks": ranks, "image": image, "ckpt_s": ckpt_s, "paused_s": paused,
                "restart_s": restart_s, "restart_runs": runs, "gzip": gzip, "fill": fill}  # fmt: skip
    finally:
        subprocess.run(["dmtcp_command", "--quit"], env=env, check=False, capture_output=True, timeout=30)
        for p in running:
            if p.poll() is None:
                p.kill()
                p.wait()


def _key(r: dict[str, Any]) -> tuple[int, int, int]:
    """What a row measured: (MiB per process, processes in the tree, ranks)."""
    ranks = int(r.get("ranks", 0))
    return int(r["mib"]), 1 if ranks else int(r.get("procs", 1)), ranks


def dmtcp_table(ckptd_rows: list[dict[str, Any]], dmtcp_rows: list[dict[str, Any]]) -> str:
    """ckptd's figures beside DMTCP's for the same workloads, with ratios
    (ckptd/DMTCP: below 1, ckptd takes less)."""
    head = (
        "| workload | checkpoint s ckptd / DMTCP | ratio | paused s ckptd / DMTCP | ratio "
        "| image MiB ckptd / DMTCP | ratio "
        "| restart s ckptd / DMTCP (from the command, CLI included; median of --restarts) | ratio |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    ours = {_key(r): r for r in ckptd_rows}
    for d in dmtcp_rows:
        mib, procs, ranks = _key(d)
        what = f"{ranks} ranks x {mib} MiB" if ranks else (f"{procs} x {mib} MiB" if procs > 1 else f"{mib} MiB")
        c = ours.get(_key(d))
        cells = [what]
        for k, fmt in (("ckpt_s", ".2f"), ("paused_s", ".3f"), ("image", ".0f"), ("restart_s", ".2f")):
            scale = 2**20 if k == "image" else 1
            if c:
                cells += [f"{c[k] / scale:{fmt}} / {d[k] / scale:{fmt}}", f"{c[k] / d[k]:.2f}"]
            else:
                cells += [f"- / {d[k] / scale:{fmt}}", "-"]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body + _restart_runs(ours, dmtcp_rows)


def _restart_runs(ours: dict[tuple[int, int, int], dict[str, Any]], dmtcp_rows: list[dict[str, Any]]) -> str:
    """Every restart of a workload restarted more than once (--restarts), in
    the order run, ckptd's and DMTCP's alternating; the table above gives
    their medians."""
    text = ""
    for d in dmtcp_rows:
        c = ours.get(_key(d))
        if not c or len(d.get("restart_runs", [])) < 2:
            continue
        pairs = list(zip(c["restart_runs"], d["restart_runs"], strict=False))
        faster = sum(1 for a, b in pairs if a < b)
        mib, procs, _ = _key(d)
        what = f"{procs} x {mib} MiB" if procs > 1 else f"{mib} MiB"
        each = ", ".join(f"{a:.2f} / {b:.2f}" for a, b in pairs)
        text += f"- {what}: restarts in the order run, ckptd / DMTCP: {each}; "
        text += f"ckptd faster in {faster} of {len(pairs)}\n"
    return "\n" + text if text else ""


def compress_table(tier_rows: list[dict[str, Any]], gzip_rows: list[dict[str, Any]]) -> str:
    """ckptd's --compress zstd (compressed on the way to the shared tier,
    after the pause) beside DMTCP's gzip (compressed as it writes, the job
    stopped), same workload, same run.  Stored bytes are over the resident
    memory, for both; restarts are from the command, CLI included, with
    the images evicted (ckptd's from the shared tier, its stage deleted)."""
    head = (
        "| resident | memory holds | stored/resident ckptd zstd / DMTCP gzip | ratio "
        "| paused s ckptd / DMTCP | ckptd: stage commit s + upload s | DMTCP: checkpoint s "
        "| restart s ckptd / DMTCP | ratio |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = ""
    ours = {(int(r["mib"]), r["fill"]): r for r in tier_rows if r["codec"] == "zstd"}
    for d in gzip_rows:
        c = ours.get((int(d["mib"]), d["fill"]))
        if c is None:
            continue
        resident = int(d["mib"]) << 20
        mine, theirs = c["shared_bytes"] / resident, d["image"] / resident
        cells = [
            f"{d['mib']} MiB",
            {"weights": "float32 N(0,1)", "pattern": "integer pattern"}.get(d["fill"], d["fill"]),
            f"{mine:.2f} / {theirs:.2f}",
            f"{mine / theirs:.2f}",
            f"{c['paused_s']:.3f} / {d['paused_s']:.3f}",
            f"{c['stage_s']:.2f} + {c['upload_s']:.2f}",
            f"{d['ckpt_s']:.2f}",
            f"{c['restart_cmd_s']:.2f} / {d['restart_s']:.2f}",
            f"{c['restart_cmd_s'] / d['restart_s']:.2f}",
        ]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body
