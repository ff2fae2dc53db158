"""Children created and reaped all the time: fork, subprocess, posix_spawn.
Usage: busy.py ROUNDS"""

import os
import subprocess
import sys
import time

total = 0
for i in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(i % 7)
    total += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out = subprocess.run(["/bin/echo", str(i)], capture_output=True, text=True).stdout
    total += int(out)
    pid = os.posix_spawn("/bin/true", ["true"], os.environ)
    total += os.waitpid(pid, 0)[1]
    print(f"round {i} total {total}", flush=True)
    time.sleep(0.005)
print("done", total, flush=True)
