#!/usr/bin/env python3
"""DMTCP's own test programs under ckptd: launch, checkpoint, kill -9, restart, still alive.

Issue 19 measured ckptd against the programs of DMTCP's test/ directory that run on their own (the
simple TestSpecs of its test/autotest.py; shared-fd2, forkexec, presuspend, nocheckpoint and the
syscall-tester variants need DMTCP itself, frisbee needs three jobs that find each other by port).
For each program: `ckptd launch` it (from the DMTCP tree, as autotest runs them), wait --before
seconds, `ckptctl checkpoint`, SIGKILL every process of the job, `ckptctl restart`, and check it is
still running (or exited 0) --after seconds later.  One line per program, then the count; exit 1
unless every program passed.

    scripts/dmtcp_programs.py --dmtcp-src DIR [--only a,b] [--before 2] [--after 4]

DIR is a DMTCP source tree whose test programs are built (`./configure && make -j2 && make tests`;
keep it outside this repository).  Each program gets its own CKPTD_HOME under a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (name, argv relative to the DMTCP tree): the simple TestSpecs of DMTCP's test/autotest.py.
PROGRAMS: list[tuple[str, list[str]]] = [
    (name, [f"./test/{name}"])
    for name in (  # noqa: SIM905 (one line per row of names reads better than a list literal)
        "dmtcp1 dmtcp2 dmtcp3 dmtcp4 dmtcp5 zeropages alarm sched_test gettid file1 file2 file3 stat mmap1 mremap "
        "mmap-noreserve gettimeofday sigchild rlimit-restore poll environ realpath pthread1 pthread2 pthread4 "
        "pthread5 pthread6 mutex1 mutex2 mutex3 mutex4 timer1 clock dlopen1 shared-fd1 stale-fd rlimit-nofile "
        "procfd1 epoll1 client-server seqpacket shared-memory1 shared-memory2 shared-memory3 sysv-shm1 sysv-shm2 "
        "sysv-sem sysv-msg pty1 pty2"
    ).split()
] + [
    ("vfork1", ["./test/vfork1", "ls | wc"]),
    ("vfork2", ["./test/vfork1", "while true; do date; sleep 1; done"]),
]


def ctl(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ckptctl", *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)


def status(env: dict[str, str], job: str) -> dict[str, object]:
    p = ctl(env, "status", job, "--json")
    return json.loads(p.stdout) if p.returncode == 0 else {"state": "unknown", "pids": []}


def last_line(p: subprocess.CompletedProcess[str]) -> str:
    text = (p.stderr or p.stdout).strip().splitlines()
    return text[-1] if text else f"exit {p.returncode}"


def one(src: Path, name: str, argv: list[str], scratch: Path, *, before: float, after: float) -> str:
    """'ok' or the reason it failed."""
    home = scratch / name
    env = dict(os.environ, CKPTD_HOME=str(home))
    for var in ("CKPTD_COORDINATOR", "LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
        env.pop(var, None)
    try:
        p = subprocess.run(
            ["ckptd", "launch", "--detach", "--job", name, "--", *argv],
            env=env,
            cwd=src,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if p.returncode != 0:
            return f"launch: {last_line(p)}"
        time.sleep(before)
        p = ctl(env, "checkpoint", name)
        if p.returncode != 0:
            return f"checkpoint: {last_line(p)}"
        pids = [int(x) for x in status(env, name).get("pids", [])]  # type: ignore[union-attr]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while status(env, name)["state"] in ("running", "checkpointing") and time.monotonic() < deadline:
            time.sleep(0.1)
        p = ctl(env, "restart", name)
        if p.returncode != 0:
            return f"restart: {last_line(p)}"
        time.sleep(after)
        st = status(env, name)
        if st["state"] == "running" or (st["state"] == "exited" and st.get("exit_code", 0) == 0):
            return "ok"
        log = ctl(env, "logs", name, "--tail", "3").stdout.strip().replace("\n", " | ")
        return f"after restart: {st['state']} {st.get('message', '')} {log}".strip()
    except subprocess.TimeoutExpired as e:
        return f"timed out: {' '.join(str(a) for a in e.cmd[:3])}"
    finally:
        with contextlib.suppress(Exception):
            ctl(env, "kill", name, timeout=30)
        with contextlib.suppress(Exception):
            ctl(env, "shutdown", timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dmtcp-src", required=True, type=Path, help="a DMTCP source tree with its tests built")
    ap.add_argument("--only", default="", help="comma-separated program names")
    ap.add_argument("--before", type=float, default=2.0, help="seconds between launch and checkpoint")
    ap.add_argument("--after", type=float, default=4.0, help="seconds the restarted job must live")
    args = ap.parse_args()
    if not shutil.which("ckptd") or not shutil.which("ckptctl"):
        sys.exit("dmtcp_programs: ckptd and ckptctl are not on PATH: pip install . first")
    wanted = set(filter(None, args.only.split(",")))
    programs = [(n, a) for n, a in PROGRAMS if not wanted or n in wanted]
    missing = [n for n, a in programs if not (args.dmtcp_src / a[0]).exists()]
    if missing:
        sys.exit(f"dmtcp_programs: not built in {args.dmtcp_src}/test: {', '.join(missing)} (run `make tests` there)")
    passed = 0
    with tempfile.TemporaryDirectory(prefix="ckptd-dmtcp-") as scratch:
        for name, argv in programs:
            result = one(args.dmtcp_src, name, argv, Path(scratch), before=args.before, after=args.after)
            passed += result == "ok"
            print(f"{name:16} {result}", flush=True)
    print(f"{passed} of {len(programs)} passed")
    return 0 if passed == len(programs) else 1


if __name__ == "__main__":
    sys.exit(main())
