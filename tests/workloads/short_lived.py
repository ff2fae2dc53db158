"""A parent that keeps 30 children alive at once, each living about 20 ms
(a data loader's short tasks, a shell's pipelines): checkpoints land while
children are being born, exiting and reaped.

usage: short_lived.py ROUNDS
"""

import os
import sys
import time

total = 0
for r in range(int(sys.argv[1])):
    kids = []
    for i in range(30):
        pid = os.fork()
        if pid == 0:
            time.sleep(0.02)
            os._exit(i % 7)
        kids.append(pid)
    for pid in kids:
        _, status = os.waitpid(pid, 0)
        total += os.waitstatus_to_exitcode(status)
    print(f"round {r} total {total}", flush=True)
