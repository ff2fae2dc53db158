"""Benchmark workload: holds SIZE bytes resident and records its own progress.

Every millisecond it notes the time; on SIGUSR1 it prints the longest gap
between two notes since the previous SIGUSR1, which is how long it was
paused (by a checkpoint, say), measured from inside.  Usage: bench_workload.py MIB
"""

import signal
import sys
import time

import numpy as np

mib = int(sys.argv[1])
data = np.arange(mib * (1 << 20) // 8, dtype=np.uint64)  # resident, not compressible to nothing
data *= 2654435761
report = [False]
signal.signal(signal.SIGUSR1, lambda s, f: report.__setitem__(0, True))
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
