"""A big buffer of which a small share of pages changes every step: the
shape incremental checkpoints are made for.  Usage: dirty_pages.py STEPS MIB
[PERCENT [DELAY]]: every DELAY seconds (default 0.02) a step rewrites one byte in PERCENT% (default 1) of the
buffer's pages, chosen at random (seeded); the last line is the whole
buffer's sha256, so any stale page after a restore shows, and the number
of a descriptor opened last (ckptd's own descriptors must not shift it)."""

import hashlib
import os
import random
import sys
import time

steps, mib = int(sys.argv[1]), int(sys.argv[2])
percent = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.02
rng = random.Random(0)
# in pieces: randbytes takes under 256 MiB at a time
buf = bytearray(b"".join(rng.randbytes(min(64, mib - i) << 20) for i in range(0, mib, 64)))
pages = len(buf) // 4096
per_step = max(1, int(pages * percent / 100))
for step in range(steps):
    touched = rng.sample(range(pages), per_step)
    for p in touched:
        buf[p * 4096 + step % 4096] = (buf[p * 4096 + step % 4096] + 1) & 0xFF
    print(f"step {step} {sum(buf[p * 4096] for p in touched[:8])}", flush=True)
    time.sleep(delay)
# the lowest free descriptor, as without ckptd: the shim keeps its own high
fd = os.open("/dev/null", os.O_RDONLY)
print("sha256", hashlib.sha256(buf).hexdigest(), "fd", fd, flush=True)
