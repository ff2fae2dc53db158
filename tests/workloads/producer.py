"""The head of a shell pipeline: N records, 10 ms apart.  Usage: producer.py N"""

import sys
import time

for i in range(int(sys.argv[1])):
    print(f"record {i} value {i * 7919 % 1000}", flush=True)
    time.sleep(0.01)
