"""Reads one file, writes others by offset, handles SIGUSR1.

Reads INPUT in blocks; for each block writes a transformed block at the same
offset of OUT/data.bin (os.pwrite into a preallocated file) and appends a
line to OUT/journal.txt through a file kept open.  Then waits for SIGUSR1
and writes a summary.  Usage: file_io.py INPUT OUTDIR
"""

import hashlib
import os
import signal
import sys
import time

inp, out = sys.argv[1], sys.argv[2]
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))

size = os.path.getsize(inp)
block = 64 * 1024
fd_in = os.open(inp, os.O_RDONLY)
fd_out = os.open(f"{out}/data.bin", os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd_out, size)
journal = open(f"{out}/journal.txt", "w")  # noqa: SIM115
nblocks = (size + block - 1) // block
for i in range(nblocks):
    j = (i * 7) % nblocks  # out of order: offsets matter
    data = os.pread(fd_in, block, j * block)
    os.pwrite(fd_out, bytes(b ^ 0x5A for b in data), j * block)
    journal.write(f"block {j} {hashlib.sha256(data).hexdigest()[:16]}\n")
    journal.flush()
    print(f"block {i} -> {j}", flush=True)
    time.sleep(0.1)
print("waiting for SIGUSR1", flush=True)
while not got:
    signal.pause()
os.fsync(fd_out)
digest = hashlib.sha256(os.pread(fd_out, size, 0)).hexdigest()
print(f"got SIGUSR1; data {digest}", flush=True)
journal.write("done\n")
journal.close()
