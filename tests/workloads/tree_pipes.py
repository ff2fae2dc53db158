"""A parent and a forked child in lock step over two pipes, sharing an
anonymous MAP_SHARED page; the child exits with 7.  Usage: tree_pipes.py N"""

import mmap
import os
import struct
import sys
import time

n = int(sys.argv[1])
shared = mmap.mmap(-1, 4096)  # MAP_SHARED | MAP_ANONYMOUS, inherited by the child
r, w = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    os.close(w2)
    for i in range(n):
        struct.pack_into("<i", shared, 0, i)
        os.write(w, struct.pack("<i", i * i))
        os.read(r2, 1)  # lock step
    os._exit(7)
os.close(w)
os.close(r2)
total = 0
for i in range(n):
    (v,) = struct.unpack("<i", os.read(r, 4))
    total += v
    print(f"step {i} got {v} total {total} shared {struct.unpack_from('<i', shared, 0)[0]}", flush=True)
    time.sleep(0.01)
    os.write(w2, b"x")
_, st = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(st), "total", total, flush=True)
