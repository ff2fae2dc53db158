"""A deterministic PyTorch CPU training loop fed by DataLoader(num_workers=2).
Usage: torch_dl.py EPOCHS OUTDIR"""

import hashlib
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


class Synthetic(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, (x[:4].sum() > 0).long()


def main() -> None:
    epochs, out = int(sys.argv[1]), sys.argv[2]
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(
        Synthetic(),
        batch_size=16,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(1),
        persistent_workers=True,
    )
    step = 0
    for epoch in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} epoch {epoch} loss {loss.item():.6f}", flush=True)
            step += 1
            time.sleep(0.01)
    torch.save(model.state_dict(), f"{out}/model.pt")
    h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print("weights", h, flush=True)


if __name__ == "__main__":
    main()
