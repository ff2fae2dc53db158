"""A loopback TCP connection with a full window: the process writes until
its send buffer and the peer's receive buffer are full, so that bytes stay
unsent in its send queue while checkpoints are taken (the round's drain
step), then reads them all and says whether every byte came through once.
Usage: tcp_full.py TICKS"""

import hashlib
import socket
import sys
import time

ticks = int(sys.argv[1])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
out = socket.create_connection(listener.getsockname())
into, _ = listener.accept()
out.setblocking(False)
sent, n, i = hashlib.sha256(), 0, 0
while True:
    chunk = b"%08d" % i * 512
    try:
        k = out.send(chunk)
    except BlockingIOError:
        break
    sent.update(chunk[:k])
    n, i = n + k, i + 1
print("window full", flush=True)
for t in range(ticks):
    print(f"tick {t}", flush=True)
    time.sleep(0.05)
got, m = hashlib.sha256(), 0
while m < n:
    b = into.recv(1 << 16)
    if not b:
        break
    got.update(b)
    m += len(b)
print("every byte once", m == n and got.digest() == sent.digest(), flush=True)
