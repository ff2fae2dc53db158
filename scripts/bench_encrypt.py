"""The cost of `ckptd launch --encrypt` (bench.py --encrypt SIZES).

Two jobs of the same size run side by side, one launched with --encrypt and
one without, both with --full-every 1 (every checkpoint a full one); each
round checkpoints both, in alternating order so that the disk's drift
falls on both alike, and removes the checkpoints again.  Reported: the
median checkpoint time of each (request to commit, as the coordinator
times it), and the encrypted checkpoint's speed relative to the plain one
(plain time / encrypted time; the goal is at least 0.9).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.native import native_path


def cipher_speed() -> str:
    """What one core does here: ckptd-crypt speed (CTR, GHASH, both)."""
    p = subprocess.run([str(native_path("ckptd-crypt")), "speed", "1024"], capture_output=True, text=True, check=False)
    return p.stdout.strip() or p.stderr.strip()


def bench_encrypt(
    base: Path, mib: int, rounds: int, *, ckptd: Any, workload: Path, wait_line: Callable[..., str]
) -> dict:
    key = base / "bench.key"
    if not key.exists():
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    c = ckptd(base / "home")
    ckpt_dir = base / "ckpt"
    jobs = {"plain": f"plain-{mib}", "encrypted": f"enc-{mib}"}
    for kind, job in jobs.items():
        extra = ["--encrypt-key", str(key)] if kind == "encrypted" else []
        c.run("ckptd", "launch", "--detach", "--job", job, "--ckpt-dir", str(ckpt_dir), "--full-every", "1", *extra,
              "--", sys.executable, str(workload), str(mib), "1")  # fmt: skip
        wait_line(ckpt_dir / job / "output.log", "ready")
    time.sleep(1.0)
    times: dict[str, list[float]] = {k: [] for k in jobs}
    paused: dict[str, list[float]] = {k: [] for k in jobs}
    for r in range(rounds):
        for kind in list(jobs) if r % 2 == 0 else list(reversed(jobs)):
            info = c.json("ckptctl", "checkpoint", jobs[kind])
            times[kind].append(float(info["duration_s"]))
            paused[kind].append(float(info["stall_s"]))
            shutil.rmtree(Path(info["path"]))  # room for the next; none is incremental
    for job in jobs.values():
        c.run("ckptctl", "kill", job)
    plain, enc = statistics.median(times["plain"]), statistics.median(times["encrypted"])
    return {
        "mib": mib,
        "rounds": rounds,
        "plain_s": plain,
        "enc_s": enc,
        "plain_all": times["plain"],
        "enc_all": times["encrypted"],
        "plain_paused": statistics.median(paused["plain"]),
        "enc_paused": statistics.median(paused["encrypted"]),
        "ratio": plain / enc,
    }


def encrypt_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| resident | plain checkpoint s (median; all) | encrypted checkpoint s (median; all) "
        "| paused s plain / encrypted | encrypted speed / plain |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['mib']} MiB | {r['plain_s']:.2f} ({', '.join(f'{x:.2f}' for x in r['plain_all'])}) "
            f"| {r['enc_s']:.2f} ({', '.join(f'{x:.2f}' for x in r['enc_all'])}) "
            f"| {r['plain_paused']:.3f} / {r['enc_paused']:.3f} | {r['ratio']:.2f} |"
        )
    return "\n".join(out) + f"\n\nOne core of this machine: {cipher_speed()}.\n"
