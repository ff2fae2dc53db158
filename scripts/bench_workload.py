"""Benchmark workload: holds MIB MiB resident in each of PROCS processes and
records its own progress.

With PROCS > 1 the first process forks the others before anything is
allocated, so every process has MIB MiB of its own.  Every millisecond
each notes the time; on SIGUSR1 the first process prints the longest gap
between two notes since the previous SIGUSR1, which is how long it was
paused (by a checkpoint, say), measured from inside.  All processes are
paused and resumed together, so its gap is the job's.
Usage: bench_workload.py MIB [PROCS]
"""

import os
import signal
import sys
import time

mib = int(sys.argv[1])
procs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
first = True
for _ in range(procs - 1):
    if os.fork() == 0:
        first = False
        break

import numpy as np  # noqa: E402  (after fork: each process maps its own copy)

data = np.arange(mib * (1 << 20) // 8, dtype=np.uint64)  # resident, not compressible to nothing
data *= 2654435761
report = [False]
signal.signal(signal.SIGUSR1, lambda s, f: report.__setitem__(0, True))
if first:
    print("ready", flush=True)
last = time.monotonic()
worst = 0.0
i = 0
while True:
    time.sleep(0.001)
    now = time.monotonic()
    worst = max(worst, now - last)
    last = now
    data[i % len(data)] += 1  # keep writing to memory
    i += 4099
    if report[0]:
        report[0] = False
        print(f"max_gap_s {worst:.6f}", flush=True)
        worst = 0.0
