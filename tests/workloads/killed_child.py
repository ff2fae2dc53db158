"""A parent stepping along, and a child holding 256 MiB that the test
SIGKILLs while a checkpoint writes its image (tests/test_transient.py);
the parent kills it at the end in any case.  Usage: killed_child.py STEPS"""

import os
import signal
import sys
import time

steps = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    data = os.urandom(1 << 20) * 256  # pages that are not zero: their image takes a while to write
    print("child", os.getpid(), file=sys.stderr, flush=True)  # not in stdout: the plain run has no test
    while True:
        time.sleep(1)
for step in range(1, steps + 1):
    print(f"step {step}", flush=True)
    time.sleep(0.05)
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
print("done", flush=True)
