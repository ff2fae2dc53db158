#!/usr/bin/env python3
"""A soak: one job checkpointed --interval 1 with --keep 3 until N
checkpoints (default 1,000) are committed, killed with SIGKILL at random
moments in between and restarted from its latest checkpoint.  Reports, and
exits 1 unless every line says "held":

- every restart byte-identical: after each restart, once the job has gone
  on, its stdout is a prefix of a plain run's (tests/workloads/dirty_pages.py
  is deterministic whatever its delay, so the plain run is a fast one);
- no growth in the daemon's or the job's memory (RSS) and descriptors
  beyond the bound printed (the median of the last tenth of the samples
  against the first tenth's);
- disk use bounded by retention (the largest the job's checkpoint
  directory got, against three full images and the chain they need);
- the time per checkpoint flat: the median of the last hundred against the
  first hundred (from the daemon's "committed" log lines).

    scripts/soak.py [--checkpoints 1000] [--mib 64] [--kill-every 90] [--seed 1]

It takes about 1.2 s per checkpoint on a quiet machine: some 20 minutes
for 1,000.  Not a test: a benchmark-style run whose figures go in
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

WORKLOADS = Path(__file__).resolve().parent.parent / "tests" / "workloads"
COMMITTED = re.compile(r"committed ckpt-(\d+) \((\d+) bytes, stall ([\d.]+) s, total ([\d.]+) s\)")
DELAY = "0.05"
MEM_SLACK = 32 << 20  # what a process's RSS may move by without being growth
FD_SLACK = 4
FULL_EVERY = 16  # coordinator/barrier.py DEFAULT_FULL_EVERY


def tool(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=300, check=False)
    if check and p.returncode != 0:
        raise SystemExit(f"soak: {' '.join(args[:3])} failed: {p.stderr.strip()}")
    return p


def usage(pids: list[int]) -> tuple[int, int]:
    """Resident bytes and open descriptors of these processes together."""
    rss = fds = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            rss += p.memory_info().rss
            fds += p.num_fds()
    return rss, fds


def daemon_pids(home: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            if "ckptd.cli.ckptd_main" in " ".join(p.info["cmdline"] or []) and (p.info["environ"] or {}).get(
                "CKPTD_HOME"
            ) == str(home):
                out.append(p.pid)
    return out


def du(path: Path) -> int:
    total = 0
    for d, _, files in os.walk(path):  # directories come and go meanwhile: skipped
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
    return total


def tenth(xs: list[int], last: bool) -> float:
    k = max(1, len(xs) // 10)
    return statistics.median(xs[-k:] if last else xs[:k])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=1000)
    ap.add_argument("--mib", type=int, default=64, help="the job's buffer")
    ap.add_argument("--steps", type=int, default=60000, help="the job's length (0.05 s a step)")
    ap.add_argument("--kill-every", type=float, default=90.0, help="mean seconds between two SIGKILLs")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="ckptd-soak-"))
    home = base / "home"
    env = dict(os.environ, CKPTD_HOME=str(home), CKPTD_IDLE_EXIT="3600")
    argv = [sys.executable, str(WORKLOADS / "dirty_pages.py"), str(args.steps), str(args.mib), "1"]
    print(f"soak: plain run of {args.steps} steps ...", flush=True)
    expected = subprocess.run([*argv, "0"], capture_output=True, text=True, check=True).stdout
    ok = True
    try:
        tool(env, "ckptd", "launch", "--detach", "--job", "soak", "--interval", "1", "--keep", "3", "--", *argv, DELAY)
        log = home / "logs" / "daemon.log"
        samples: dict[str, list[int]] = {"daemon_rss": [], "daemon_fds": [], "job_rss": [], "job_fds": []}
        disk_max = restarts = identical = 0
        next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
        t0 = time.monotonic()
        committed: dict[int, tuple[float, float]] = {}
        sizes: dict[int, int] = {}
        disk: list[int] = []
        while len(committed) < args.checkpoints:
            time.sleep(2)
            for m in COMMITTED.finditer(log.read_text()):
                committed[int(m[1])] = (float(m[3]), float(m[4]))
                sizes[int(m[1])] = int(m[2])
            status = json.loads(tool(env, "ckptctl", "status", "soak", "--json").stdout)
            if status["state"] not in ("running", "checkpointing", "restoring"):
                raise SystemExit(f"soak: the job is {status['state']}: {status.get('message', '')}")
            d_rss, d_fds = usage(daemon_pids(home))
            j_rss, j_fds = usage(status["pids"])
            for k, v in (("daemon_rss", d_rss), ("daemon_fds", d_fds), ("job_rss", j_rss), ("job_fds", j_fds)):
                samples[k].append(v)
            disk.append(du(home / "checkpoints" / "soak"))
            disk_max = max(disk_max, disk[-1])
            if time.monotonic() >= next_kill and status["state"] == "running" and committed:
                for pid in status["pids"]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                while json.loads(tool(env, "ckptctl", "status", "soak", "--json").stdout)["state"] == "running":
                    time.sleep(0.1)
                tool(env, "ckptctl", "restart", "soak")
                restarts += 1
                time.sleep(3)  # the job goes on past its checkpoint
                out = tool(env, "ckptctl", "logs", "soak", "--stream", "stdout").stdout
                same = expected.startswith(out) and out.count("\n") > 0
                identical += same
                ok &= same
                print(
                    f"restart {restarts} after {len(committed)} checkpoints: "
                    f"{out.count(chr(10))} lines, {'identical' if same else 'DIFFERS'}",
                    flush=True,
                )
                next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
            if len(samples["job_rss"]) % 30 == 0:
                print(
                    f"{time.monotonic() - t0:6.0f} s: {len(committed)} checkpoints, daemon {d_rss >> 20} MiB "
                    f"{d_fds} fds, job {j_rss >> 20} MiB {j_fds} fds, disk {disk_max >> 20} MiB",
                    flush=True,
                )
        elapsed = time.monotonic() - t0
        out = tool(env, "ckptctl", "logs", "soak", "--stream", "stdout").stdout
        ok &= expected.startswith(out)
        ids = sorted(committed)
        first, last = [committed[i] for i in ids[:100]], [committed[i] for i in ids[-100:]]
        ratio_total = statistics.median(t for _, t in last) / statistics.median(t for _, t in first)
        ratio_stall = statistics.median(s for s, _ in last) / statistics.median(s for s, _ in first)
        # what --keep 3 may hold at worst: the kept ones span two chains
        # (a full image and up to DEFAULT_FULL_EVERY - 1 incrementals each),
        # and one more full image is being written
        full = max(sizes.values())
        incremental = max((b for b in sizes.values() if b < full // 2), default=full)
        disk_bound = 2 * (full + (FULL_EVERY - 1) * incremental) + full
        rows = [
            ("restarts byte-identical", f"{identical} of {restarts}", identical == restarts and restarts > 0),
            ("final output a prefix of the plain run's", f"{out.count(chr(10))} lines", expected.startswith(out)),
        ]
        for what, slack, unit in (("rss", MEM_SLACK, 1 << 20), ("fds", FD_SLACK, 1)):
            for who in ("daemon", "job"):
                xs = samples[f"{who}_{what}"]
                a, b = tenth(xs, False), tenth(xs, True)
                rows.append(
                    (
                        f"{who} {what}: first tenth -> last tenth (bound +{slack // unit})",
                        f"{a / unit:.0f} -> {b / unit:.0f}",
                        b <= a + slack,
                    )
                )
        rows.append(
            (
                f"disk use, against what --keep 3 may hold ({disk_bound >> 20} MiB)",
                f"at most {disk_max >> 20} MiB",
                disk_max <= disk_bound,
            )
        )
        half = max(disk[: len(disk) // 2], default=0)
        rows.append(
            (
                "disk use, last tenth's most against the first half's (bound 1.1 times)",
                f"{max(disk[-max(1, len(disk) // 10) :]) >> 20} MiB against {half >> 20} MiB",
                max(disk[-max(1, len(disk) // 10) :]) <= half * 1.1,
            )
        )
        for what, ratio in (("checkpoint time", ratio_total), ("pause", ratio_stall)):
            rows.append((f"{what}, last 100 / first 100 (medians, bound 1.5)", f"{ratio:.2f}", ratio <= 1.5))
        print(f"\n{len(committed)} checkpoints in {elapsed:.0f} s, {restarts} kill -9 and restart")
        for what, value, held in rows:
            ok &= held
            print(f"  {'held  ' if held else 'FAILED'} {what}: {value}")
    finally:
        tool(env, "ckptctl", "shutdown", check=False)
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
