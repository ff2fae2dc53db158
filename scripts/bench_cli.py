"""How fast the read-only CLI commands answer with no daemon running
(issue 16: "well under 0.3 s"), as a ratio to a bare `python3 -c pass`
measured in the same run (the machine's load moves both alike).

    python3 scripts/bench_cli.py [--runs N]

Each command runs N times against an empty CKPTD_HOME with one recorded
job; the median wall time is printed with its ratio.  The tests check what
makes this fast (no daemon started, no gRPC or protobuf imported:
tests/test_day_two.py), not the timing itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else shutil.which(name) or name


COMMANDS = [
    ["ckptctl", "--help"],
    ["ckptd", "--help"],
    ["ckptctl", "jobs"],
    ["ckptctl", "status", "bench"],
    ["ckptctl", "list", "bench"],
]


def medians_s(argvs: list[list[str]], env: dict[str, str], runs: int) -> list[float]:
    """Each command's median wall time, the commands taking turns (a burst
    of load elsewhere then weighs on all of them alike)."""
    times: list[list[float]] = [[] for _ in argvs]
    for _ in range(runs):
        for argv, t in zip(argvs, times, strict=True):
            start = time.perf_counter()
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        home = Path(d)
        (home / "jobs").mkdir()
        record = {"spec": {"name": "bench", "argv": ["true"], "ckpt_dir": str(home / "checkpoints")}, "node": "n"}
        (home / "jobs" / "bench.json").write_text(json.dumps(record))
        env = dict(os.environ, CKPTD_HOME=str(home))
        env.pop("CKPTD_COORDINATOR", None)
        argvs = [[sys.executable, "-c", "pass"]] + [[tool(c[0]), *c[1:]] for c in COMMANDS]
        base, *rest = medians_s(argvs, env, args.runs)
        print(f"{'python3 -c pass':<28} {base * 1000:7.1f} ms   1.00x")
        for cmd, t in zip(COMMANDS, rest, strict=True):
            print(f"{' '.join(cmd):<28} {t * 1000:7.1f} ms  {t / base:5.2f}x")
        # (a ckptd from before this change started a daemon for `jobs`: stop it)
        subprocess.run([tool("ckptctl"), "shutdown"], env=env, capture_output=True, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
