"""A parent stepping along, and a child holding 768 MiB that exits on its
own while a checkpoint of the job is writing its pages: 0.1 s after a
pages.img.part appears (the agent is then waiting for its writer), or 4 s
after it started (after a restart, say).
The child's exit status and the parent's steps are the same however the
two interleave.  After its steps the parent waits for a file named
release in CKPTD_HOME, so that it is still there for the test's kill -9
however slow the checkpoint was.  Usage: exit_mid_checkpoint.py STEPS"""

import glob
import os
import sys
import time

import numpy as np

steps = int(sys.argv[1])
root = os.path.join(os.environ["CKPTD_HOME"], "checkpoints", os.environ["CKPTD_JOB"])
pid = os.fork()
if pid == 0:
    data = np.arange(768 << 17, dtype=np.int64)  # its writer takes a while
    deadline = time.monotonic() + 4
    print("child ready", file=sys.stderr, flush=True)  # not in stdout: when is up to timing
    while time.monotonic() < deadline and not glob.glob(os.path.join(root, "**", "pages.img.part"), recursive=True):
        time.sleep(0.005)
    time.sleep(0.1)
    os._exit(int(data[-1] % 7))
for step in range(1, steps + 1):
    print(f"step {step}", flush=True)
    time.sleep(0.05)
while not os.path.exists(os.path.join(os.environ["CKPTD_HOME"], "release")):
    time.sleep(0.05)
_, status = os.waitpid(pid, 0)
print("child exited", os.waitstatus_to_exitcode(status), flush=True)
