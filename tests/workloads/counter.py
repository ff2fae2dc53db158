"""Prints `tick I` for I in range(N), 50 ms apart, then `finished`.  Usage: counter.py N"""

import sys
import time

for i in range(int(sys.argv[1])):
    print(f"tick {i}", flush=True)
    time.sleep(0.05)
print("finished", flush=True)
