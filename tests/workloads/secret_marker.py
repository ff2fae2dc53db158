"""A job whose memory, written file and output hold known plaintext, for
launch --encrypt: none of it may appear in its checkpoints.  Usage:
secret_marker.py STEPS MIB OUTFILE [DELAY]: a buffer of MIB MiB filled with
MARKER (and a few random bytes per page), of which 0.25% of the pages change
every step; OUTFILE gets one MARKER line per step; stdout one "step N
MARKER-N" line per step, and the buffer's sha256 at the end."""

import hashlib
import random
import sys
import time

MARKER = b"ckptd-plaintext-marker-7f3a"
steps, mib, outfile = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
rng = random.Random(0)
page = (MARKER * (4096 // len(MARKER) + 1))[:4096]
buf = bytearray(page * (mib * 256))
pages = len(buf) // 4096
with open(outfile, "a") as out:
    for step in range(steps):
        for p in rng.sample(range(pages), max(1, pages // 400)):
            buf[p * 4096 + 4000 + step % 64] = rng.randrange(256)
        out.write(f"{MARKER.decode()} {step}\n")
        out.flush()
        print(f"step {step} {MARKER.decode()}-{step}", flush=True)
        time.sleep(delay)
print("sha256", hashlib.sha256(buf).hexdigest(), flush=True)
