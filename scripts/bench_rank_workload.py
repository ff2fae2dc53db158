"""Benchmark workload for multi-node jobs: one rank of a star all-reduce.

Holds MIB MiB resident; every few milliseconds sends a 64 KiB message to
rank 0 and waits for its answer (rank 0 answers every rank), so bytes are
always in flight between the ranks.  On SIGUSR1 it prints the longest gap
between two rounds since the previous SIGUSR1: how long the job was paused
(by a checkpoint, say), measured from inside.
Usage: bench_rank_workload.py MIB   (rank and rank 0's address from $CKPTD_*)
"""

import os
import signal
import socket
import sys
import time

import numpy as np

mib = int(sys.argv[1])
rank = int(os.environ.get("CKPTD_RANK", "0"))
nranks = int(os.environ.get("CKPTD_NRANKS", "1"))
master = os.environ.get("CKPTD_MASTER_ADDR", "127.0.0.1")
MSG = 64 << 10

data = np.arange(mib * (1 << 20) // 8, dtype=np.uint64)  # resident, not compressible to nothing
data *= 2654435761


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise SystemExit("peer closed")
        buf += chunk
    return bytes(buf)


peers = []
if rank == 0:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 29611))
    srv.listen(nranks)
    peers = [srv.accept()[0] for _ in range(nranks - 1)]
else:
    for _ in range(600):
        try:
            peers = [socket.create_connection((master, 29611))]
            break
        except OSError:
            time.sleep(0.1)
report = [False]
signal.signal(signal.SIGUSR1, lambda s, f: report.__setitem__(0, True))
print("ready", flush=True)
payload = bytes(MSG)
last = time.monotonic()
worst = 0.0
i = 0
while True:
    for p in peers:
        if rank == 0:
            recv_exact(p, MSG)
            p.sendall(payload)
        else:
            p.sendall(payload)
            recv_exact(p, MSG)
    time.sleep(0.002)
    now = time.monotonic()
    worst = max(worst, now - last)
    last = now
    data[i % len(data)] += 1  # keep writing to memory
    i += 4099
    if report[0]:
        report[0] = False
        print(f"max_gap_s {worst:.6f}", flush=True)
        worst = 0.0
