"""A buffer the job rewrites whole at every step, checking first that it
still holds the previous step's value everywhere.  A checkpoint whose pages
were not all taken at the same instant (some written after the job ran on)
shows after a restart as "torn".  Usage: snapshot.py STEPS MIB [SLEEP]"""

import sys
import time

import numpy as np

steps, mib = int(sys.argv[1]), int(sys.argv[2])
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
a = np.zeros(mib << 17, dtype=np.int64)
for step in range(1, steps + 1):
    ok = int(a.min()) == step - 1 == int(a.max())
    a[:] = step
    print(f"step {step} {'ok' if ok else 'torn'}", flush=True)
    time.sleep(pause)
print("done", int(a.sum()), flush=True)
