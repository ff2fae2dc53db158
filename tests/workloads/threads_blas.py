"""Several Python threads (locks, condition variables, a queue) plus
multi-threaded BLAS, with deterministic output.

A producer thread makes matrices, two worker threads multiply them (BLAS uses
its own threads underneath), a collector orders the results under a
condition variable.  Usage: threads_blas.py ROUNDS
"""

import queue
import sys
import threading
import time

import numpy as np

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
work: queue.Queue = queue.Queue(maxsize=4)
results: dict[int, float] = {}
cond = threading.Condition()
lock = threading.Lock()
total = [0.0]


def producer() -> None:
    for i in range(rounds):
        rng = np.random.default_rng(i)
        work.put((i, rng.standard_normal((160, 160))))
        time.sleep(0.1)
    for _ in range(2):
        work.put(None)


def worker() -> None:
    while (item := work.get()) is not None:
        i, a = item
        v = float(np.trace(a @ a.T @ a))  # BLAS
        with lock:
            total[0] += i
        with cond:
            results[i] = v
            cond.notify_all()


threads = [threading.Thread(target=producer)] + [threading.Thread(target=worker) for _ in range(2)]
for t in threads:
    t.start()
for i in range(rounds):
    with cond:
        cond.wait_for(lambda i=i: i in results)
        print(f"round {i} value {results[i]:.10e}", flush=True)
for t in threads:
    t.join()
print(f"total {total[0]} threads done", flush=True)
