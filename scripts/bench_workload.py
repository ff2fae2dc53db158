"""Benchmark workload: holds MIB MiB resident in each of PROCS processes and
records its own progress.

With PROCS > 1 the first process forks the others before anything is
allocated, so every process has MIB MiB of its own.  Every millisecond
each notes the time; on SIGUSR1 the first process prints the longest gap
between two notes since the previous SIGUSR1, which is how long it was
paused (by a checkpoint, say), measured from inside.  All processes are
paused and resumed together, so its gap is the job's.
With a third argument PCT (incremental checkpoints), the background
writes all land on one page, and SIGUSR2 rewrites PCT% of the pages (at
random, one word each) and prints "dirtied N": exactly what changes
between two checkpoints is under the benchmark's control.
BENCH_FILL=weights fills the memory as a model's weights look (float32,
normally distributed) rather than with a cheap integer pattern.
Usage: bench_workload.py MIB [PROCS [PCT]]
"""

import os
import signal
import sys
import time

mib = int(sys.argv[1])
procs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
dirty_pct = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
first = True
for _ in range(procs - 1):
    if os.fork() == 0:
        first = False
        break

import numpy as np  # noqa: E402  (after fork: each process maps its own copy)

if os.environ.get("BENCH_FILL") == "weights":  # like a model's: float32, normally distributed
    data = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 4, dtype=np.float32).view(np.uint64)
else:
    data = np.arange(mib * (1 << 20) // 8, dtype=np.uint64)  # resident, not compressible to nothing
    data *= 2654435761
report = [False]
dirty = [False]
signal.signal(signal.SIGUSR1, lambda s, f: report.__setitem__(0, True))
signal.signal(signal.SIGUSR2, lambda s, f: dirty.__setitem__(0, True))
words_per_page = 4096 // 8
npages = len(data) // words_per_page
rng = np.random.default_rng(1)


# the pages of every round, chosen up front: choosing them later would
# write numpy's scratch memory too, and the benchmark wants PCT% exactly
rounds = (
    [rng.choice(npages, size=int(npages * dirty_pct / 100), replace=False) * words_per_page for _ in range(32)]
    if dirty_pct
    else []
)
done = [0]


def dirty_pages() -> int:
    words = rounds[done[0] % len(rounds)]
    done[0] += 1
    data[words] += 1
    return len(words)


if dirty_pct:
    dirty_pages()  # once before "ready": the allocator has the room it needs from then on
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
    if not dirty_pct:
        i += 4099
    if dirty[0]:
        dirty[0] = False
        print(f"dirtied {dirty_pages()}", flush=True)
    if report[0]:
        report[0] = False
        print(f"max_gap_s {worst:.6f}", flush=True)
        worst = 0.0
