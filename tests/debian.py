"""Debian packages a test needs, installed when missing (CI runs as root on a
fresh machine): a test whose component cannot be installed fails, it never
skips, so a green run cannot hide a missing install step."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import pytest


def install(packages: list[str], present: Callable[[], bool]) -> None:
    """`apt-get install PACKAGES` unless `present()` already holds, waiting
    out another apt's lock (two test workers, or the machine's own apt) and
    updating the package lists once on any other failure (a fresh machine's
    lists are empty, an old machine's may name files gone from the mirror); fails
    the test, naming the command to run, when the packages cannot be had."""
    if present():
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    updated = False
    last = ""
    for _ in range(60):
        p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
        if p.returncode == 0 and present():
            return
        last = p.stderr or p.stdout
        if "lock" in last:
            time.sleep(10)
        elif not updated:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600, check=False)
            updated = True
        else:
            break
    pytest.fail(f"cannot install {' '.join(packages)} ({' '.join(command)}): {last.strip()[-500:]}")
