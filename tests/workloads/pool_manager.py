"""A multiprocessing.Pool whose tasks take Manager proxies: each task
unpickles a proxy, which opens a new connection to the Manager's listener
(and another when it is dropped), so the listener almost always has a
connection on its way in.  STEPS printed rounds, then tasks that change
nothing until the file GO exists, then "done".  Usage: pool_manager.py STEPS GO"""

import hashlib
import multiprocessing as mp
import os
import sys
import time


def task(args):
    step, k, d, log = args
    d[f"{step}.{k}"] = step * 7 + k  # a proxy call through this task's connection
    log.append((step, k))
    prev = d.get(f"{step - 1}.{k}", -1)  # the previous round is complete: deterministic
    return step, k, prev


def peek(args):
    k, d = args
    return d.get(f"0.{k}", -1)


def main() -> None:
    steps, go = int(sys.argv[1]), sys.argv[2]
    with mp.Manager() as m, mp.Pool(3) as pool:
        d, log = m.dict(), m.list()
        h = hashlib.sha256()
        for step in range(steps):
            res = pool.map(task, [(step, k, d, log) for k in range(4)])
            h.update(repr((res, sorted(d.items()), sorted(log))).encode())
            print(f"step {step} {h.hexdigest()[:16]}", flush=True)
            time.sleep(0.02)
        while not os.path.exists(go):  # still busy, changing nothing
            assert pool.map(peek, [(k, d) for k in range(4)]) == [0 * 7 + k for k in range(4)]
        print("done", len(d), len(log), flush=True)


if __name__ == "__main__":
    main()
