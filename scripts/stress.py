#!/usr/bin/env python3
"""Kill -9 at random moments: for each round and workload, launch the job
under ckptd, checkpoint it at a random moment, SIGKILL every process a
random moment later, restart it, and compare its final stdout with a plain
run's.  Prints one line per run and a summary; exits 1 if any run differed.

    scripts/stress.py [--rounds 6] [--workloads mp_pool,tcp_ipc,unix_ipc,dp_sgd,dirty_pages]
                      [--checkpoints K] [--seed N]

With --checkpoints K, K checkpoints are taken at random moments before the
kill, so the restart restores from a chain of K-1 incremental checkpoints
on a full one.

The workloads are the process-tree ones in tests/workloads (multiprocessing,
loopback TCP, Unix sockets) and dp_sgd as a multi-node job of 2 ranks (each
in its own network namespace on this machine, TCP between them; needs
root), every rank's output compared; each takes about 5 s per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent.parent / "tests" / "workloads"
ARGS = {
    "mp_pool": ["300"],
    "tcp_ipc": ["400"],
    "unix_ipc": ["400", "{dir}/job.sock"],
    "dp_sgd": ["--steps", "250", "--dim", "16384"],
    "dirty_pages": ["300", "32"],
}
RANKS = {"dp_sgd": 2}  # launched as a multi-node job of this many ranks


def plain(name: str, d: Path) -> list[str]:
    """Each rank's stdout from a run without ckptd."""
    argv = [sys.executable, str(WORKLOADS / f"{name}.py"), *(a.format(dir=d) for a in ARGS[name])]
    n = RANKS.get(name, 0)
    if not n:
        return [subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout]
    env = dict(os.environ, CKPTD_NRANKS=str(n), DP_PORT=str(29700 + os.getpid() % 200))
    procs = [
        subprocess.Popen(argv, env=dict(env, CKPTD_RANK=str(r)), stdout=subprocess.PIPE, text=True) for r in range(n)
    ]
    return [p.communicate(timeout=300)[0] for p in procs]


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=300, check=False)


def one_run(
    base: Path, name: str, job: str, rng: random.Random, expected: list[str], *, checkpoints: int = 1
) -> tuple[bool, str]:
    env = dict(os.environ, CKPTD_HOME=str(base / "home"))
    d = base / job
    d.mkdir()
    argv = [sys.executable, str(WORKLOADS / f"{name}.py"), *(a.format(dir=d) for a in ARGS[name])]
    ranks = ["--ranks", str(RANKS[name])] if name in RANKS else []
    run(env, "ckptd", "launch", "--detach", "--job", job, *ranks, "--", *argv)
    for k in range(checkpoints):
        time.sleep(rng.uniform(0.3, 2.0) if k == 0 else rng.uniform(0.1, 0.8))
        for _ in range(5):  # a refusal that says "retry" (a connection being made, say) is retried, as a user would
            p = run(env, "ckptctl", "checkpoint", job)
            if p.returncode == 0 or "retry" not in p.stderr:
                break
            time.sleep(0.2)
        if p.returncode != 0 and k and ("exited" in p.stderr or "no live process" in p.stderr):
            break  # the job ended before this one: the chain so far is what the restart uses
        if p.returncode != 0:
            return False, f"checkpoint {k + 1} failed: {p.stderr.strip()}"
    time.sleep(rng.uniform(0.0, 0.6))
    status = json.loads(run(env, "ckptctl", "status", job, "--json").stdout)
    for pid in status["pids"]:
        with contextlib.suppress(ProcessLookupError):  # a process of the tree that just ended
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.3)
    p = run(env, "ckptctl", "restart", job)
    if p.returncode != 0:
        return False, f"restart failed: {p.stderr.strip()}"
    rc = run(env, "ckptctl", "wait", job, "--timeout", "120").returncode
    for rank, want in enumerate(expected):
        got = run(env, "ckptctl", "logs", job, "--stream", "stdout", "--rank", str(rank)).stdout
        if got != want:
            return False, f"output differs (exit {rc})" + (f" for rank {rank}" if len(expected) > 1 else "")
    return True, "identical"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workloads", default=",".join(ARGS))
    ap.add_argument("--checkpoints", type=int, default=1, help="checkpoints before the kill (a chain)")
    ap.add_argument("--seed", type=int, default=None, help="for repeatable moments")
    args = ap.parse_args()
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in ARGS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(ARGS)}")
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="ckptd-stress-"))
    failures = 0
    try:
        expected = {}
        for name in names:
            ref = base / f"ref-{name}"
            ref.mkdir()
            expected[name] = plain(name, ref)
        for i in range(args.rounds):
            for name in names:
                job = f"{name.replace('_', '-')}-{i}"
                ok, why = one_run(base, name, job, rng, expected[name], checkpoints=args.checkpoints)
                failures += not ok
                print(f"round {i} {name}: {why}", flush=True)
    finally:
        subprocess.run(
            ["ckptctl", "shutdown"],
            env=dict(os.environ, CKPTD_HOME=str(base / "home")),
            capture_output=True,
            check=False,
        )
        shutil.rmtree(base, ignore_errors=True)
    total = args.rounds * len(names)
    print(f"{total - failures} identical, {failures} differed or failed, of {total} runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
