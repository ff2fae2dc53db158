"""The demo's training job: an unmodified, deterministic numpy regression.

It knows nothing about ckptd.  It prints its loss every step, appends it to
OUTDIR/losses.txt (opening and closing the file each time) and writes the
final weights to OUTDIR/weights.npy.  Usage: demo_train.py OUTDIR [STEPS]
"""

import hashlib
import sys
import time

import numpy as np

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
rng = np.random.default_rng(7)
X = rng.standard_normal((20_000, 1_024))  # ~160 MiB of features
y = X @ rng.standard_normal(1_024) + 0.1 * rng.standard_normal(20_000)
w = np.zeros(1_024)
for step in range(steps):
    w -= 0.02 * X.T @ (X @ w - y) / len(y)
    loss = float(np.mean((X @ w - y) ** 2))
    print(f"step {step:3d}  loss {loss:.12f}", flush=True)
    with open(f"{out}/losses.txt", "a") as f:
        f.write(f"{step} {loss:.17g}\n")
    time.sleep(0.1)
np.save(f"{out}/weights.npy", w)
print("final weights sha256", hashlib.sha256(w.tobytes()).hexdigest(), flush=True)
