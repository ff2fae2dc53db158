"""The tail of a shell pipeline: sums the last field of every line."""

import sys

total = 0
for n, line in enumerate(sys.stdin):
    total += int(line.split()[-1])
    if n % 10 == 0:
        print(f"consumed {n} total {total}", flush=True)
print("final", total, flush=True)
