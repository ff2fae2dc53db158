"""A deterministic PyTorch training loop on the GPU holding GIB GiB of
device memory.  Usage: train_cuda.py STEPS GIB.  Prints the loss every step
and, at the end, the sha256 of the trained weights and of the device
ballast, so that any device page lost in a checkpoint shows."""

import hashlib
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch

steps, gib = int(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
dev = torch.device("cuda")
# device memory the checkpoint must carry: a deterministic pattern
ballast = torch.arange(int(gib * (1 << 30)) // 4, dtype=torch.int32, device=dev)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 512, device=dev)
y = torch.randint(0, 10, (256,), device=dev)
for step in range(steps):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    ballast[step] += 1
    print(f"step {step} loss {loss.item():.8f}", flush=True)
    time.sleep(0.05)
weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(weights).hexdigest(), flush=True)
print("ballast", hashlib.sha256(ballast.cpu().numpy().tobytes()).hexdigest(), flush=True)
