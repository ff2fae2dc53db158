#!/usr/bin/env python3
"""ckptd in one minute: launch, checkpoint, kill -9, restart, identical result.

Runs scripts/demo_train.py once plainly as the reference, then under ckptd:
two checkpoints while it trains, SIGKILL of every process of the job (what a
node failure does), `ckptctl restart`, and a byte-for-byte comparison of the
output and the files the job wrote.  Uses a private CKPTD_HOME, so it leaves
nothing running.  Exit status 0 when the results are identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "demo_train.py"
STEPS = "60"


def step(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"\n== {text}", flush=True)


def run(env: dict[str, str], *args: str, echo: bool = True) -> str:
    print("$", " ".join(args), flush=True)
    p = subprocess.run(args, check=False, env=env, capture_output=True, text=True)
    if echo:
        sys.stdout.write(p.stdout)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"demo failed: {' '.join(args)} exited {p.returncode}")
    return p.stdout


def wait_for(log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.1)
    raise SystemExit(f"demo failed: {text!r} never appeared in {log}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ckptd-demo-") as tmp:
        t = Path(tmp)
        ref, out = t / "reference", t / "run"
        ref.mkdir()
        out.mkdir()
        env = dict(os.environ, CKPTD_HOME=str(t / "home"))

        step("1. the reference: the job run plainly, uninterrupted")
        plain = subprocess.run(
            [sys.executable, str(TRAIN), str(ref), STEPS], check=False, capture_output=True, text=True
        )
        if plain.returncode != 0:
            print(plain.stderr.strip().splitlines()[-1] if plain.stderr.strip() else f"status {plain.returncode}")
            print("the demo's job could not run; it trains a numpy model: pip install '.[demo]'")
            return 1
        expected = plain.stdout
        print(f"{len(expected.splitlines())} lines of output, {expected.splitlines()[-1]}")

        step("2. the same job under ckptd (nothing in it knows)")
        job = "demo"
        run(env, "ckptd", "launch", "--detach", "--job", job, "--", sys.executable, str(TRAIN), str(out), STEPS)
        log = t / "home" / "checkpoints" / job / "output.log"
        wait_for(log, "step  15")
        step("3. two checkpoints while it trains")
        run(env, "ckptctl", "checkpoint", job)
        wait_for(log, "step  30")
        run(env, "ckptctl", "checkpoint", job)
        wait_for(log, "step  40")

        step("4. a node failure: SIGKILL every process of the job")
        status = json.loads(run(env, "ckptctl", "status", job, "--json", echo=False))
        for pid in status["pids"]:
            os.kill(pid, signal.SIGKILL)
            print(f"kill -9 {pid}")
        time.sleep(1)
        run(env, "ckptctl", "status", job)

        step("5. restart from the last checkpoint and wait for the job to finish")
        run(env, "ckptctl", "restart", job)
        run(env, "ckptctl", "wait", job)
        run(env, "ckptctl", "list", job)

        step("6. compare with the reference")
        got = subprocess.run(["ckptctl", "logs", job], env=env, capture_output=True, text=True, check=True).stdout
        same = {
            "stdout": got == expected,
            "losses.txt": (out / "losses.txt").read_bytes() == (ref / "losses.txt").read_bytes(),
            "weights.npy": (out / "weights.npy").read_bytes() == (ref / "weights.npy").read_bytes(),
        }
        for what, ok in same.items():
            print(f"{what:12s} {'identical' if ok else 'DIFFERENT'}")
        subprocess.run(["ckptctl", "shutdown"], check=False, env=env, capture_output=True)
        if all(same.values()):
            print("\nckptd demo: killed mid-run, restarted, byte-for-byte identical result.")
            return 0
        print("\nckptd demo: results differ", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
