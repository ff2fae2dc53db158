"""Data-parallel SGD over plain TCP sockets, in numpy: one process per rank.

Every step each rank computes the gradient of a least-squares loss on its
own shard and sends it to rank 0, which averages them and sends the new
weights back to everyone (a star all-reduce).  Each rank prints its loss
per step; rank 0 prints a digest of the final weights.  The output depends
only on the seed and the rank count, never on addresses or timing.

    dp_sgd.py [--steps N] [--dim D] [--delay S] [--model-mib M]
    (--model-mib: every rank also holds M MiB of "model" that changes the
    same way on every rank, as data-parallel replicas do; each rank prints
    its digest at the end)
    rank, ranks and rank 0's address from $CKPTD_RANK, $CKPTD_NRANKS,
    $CKPTD_MASTER_ADDR (default 127.0.0.1), port $DP_PORT (default 29411)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import struct
import sys
import time

import numpy as np


def send_array(sock: socket.socket, a: np.ndarray) -> None:
    data = a.astype(np.float64).tobytes()
    sock.sendall(struct.pack("<Q", len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def recv_array(sock: socket.socket) -> np.ndarray:
    (n,) = struct.unpack("<Q", recv_exact(sock, 8))
    return np.frombuffer(recv_exact(sock, n), dtype=np.float64).copy()


def connect(master: str, port: int) -> socket.socket:
    for _ in range(600):
        try:
            s = socket.create_connection((master, port), timeout=5)
            s.settimeout(None)
            return s
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"cannot reach rank 0 at {master}:{port}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=32768)
    ap.add_argument("--delay", type=float, default=0.02)
    ap.add_argument("--model-mib", type=int, default=0)
    args = ap.parse_args()
    rank = int(os.environ.get("CKPTD_RANK", "0"))
    nranks = int(os.environ.get("CKPTD_NRANKS", "1"))
    master = os.environ.get("CKPTD_MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("DP_PORT", "29411"))

    rng = np.random.default_rng(1234 + rank)
    x = rng.standard_normal((64, args.dim)) / np.sqrt(args.dim)
    true_w = np.random.default_rng(99).standard_normal(args.dim)
    y = x @ true_w
    w = np.zeros(args.dim)
    # the replicated model: the same seed on every rank, the same updates
    model = np.random.default_rng(7).standard_normal(args.model_mib << 17)

    peers: list[socket.socket] = []
    if rank == 0:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(nranks)
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < nranks - 1:
            c, _ = srv.accept()
            (r,) = struct.unpack("<I", recv_exact(c, 4))
            by_rank[r] = c
        peers = [by_rank[r] for r in sorted(by_rank)]
    else:
        s = connect(master, port)
        s.sendall(struct.pack("<I", rank))
        peers = [s]

    for step in range(args.steps):
        err = x @ w - y
        loss = float(err @ err) / len(y)
        grad = 2 * x.T @ err / len(y)
        if rank == 0:
            total = grad.copy()
            for p in peers:
                total += recv_array(p)
            w = w - 0.5 * total / nranks
            for p in peers:
                send_array(p, w)
        else:
            send_array(peers[0], grad)
            w = recv_array(peers[0])
        if len(model):
            at = (step * 4096) % len(model)
            model[at : at + 4096] += w[:64].sum()  # w is bitwise the same on every rank
        print(f"rank {rank} step {step:4d} loss {loss:.12f}", flush=True)
        time.sleep(args.delay)
    if rank == 0:
        print(f"weights {hashlib.sha256(w.tobytes()).hexdigest()}", flush=True)
    if len(model):
        print(f"rank {rank} model {hashlib.sha256(model.tobytes()).hexdigest()}", flush=True)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
