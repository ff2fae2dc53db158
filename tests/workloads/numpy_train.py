"""Deterministic numpy training loop holding a few hundred MiB.

Prints one line per step, appends each step's loss to a results file that it
opens, appends to and closes every step, and writes the final weights.
Usage: numpy_train.py OUTDIR [STEPS] [MIB]
"""

import hashlib
import sys
import time

import numpy as np

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
mib = int(sys.argv[3]) if len(sys.argv) > 3 else 256

rng = np.random.default_rng(1234)
X = rng.standard_normal((4096, 512))
y = X @ rng.standard_normal(512) + 0.01 * rng.standard_normal(4096)
w = np.zeros(512)
ballast = np.full(mib * (1 << 20) // 8, 1.5)  # resident memory the checkpoint must carry
for step in range(steps):
    grad = X.T @ (X @ w - y) / len(y)
    w -= 0.05 * grad
    ballast[step::997] += w[step % 512]
    loss = float(np.mean((X @ w - y) ** 2))
    print(f"step {step} loss {loss:.15e}", flush=True)
    with open(f"{out}/losses.txt", "a") as f:
        f.write(f"{step} {loss:.15e}\n")
    time.sleep(0.15)
np.save(f"{out}/weights.npy", w)
print("weights", hashlib.sha256(w.tobytes()).hexdigest(), "ballast", float(ballast.sum()), flush=True)
