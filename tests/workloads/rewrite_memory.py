"""A job that rewrites every page of its memory, over and over: the worst
case of a copy-on-write capture, which then copies all of it.

usage: rewrite_memory.py MIB PASSES
"""

import hashlib
import sys
import time

mib, passes = int(sys.argv[1]), int(sys.argv[2])
buf = bytearray(mib << 20)
pages = len(buf) // 4096
for n in range(passes):
    buf[n % 4096 :: 4096] = bytes([n % 251]) * pages  # one byte in every page
    print(f"pass {n}", flush=True)
    time.sleep(0.01)
print("sha256", hashlib.sha256(buf).hexdigest(), flush=True)
