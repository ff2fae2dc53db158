"""TCP over loopback between a parent and its children, data always in
flight: a dual-stack IPv6 listener with an IPv4 client, an IPv4 pair with
Nagle on and a pair with TCP_NODELAY.  The IPv4 listener sets SO_REUSEADDR
only with --reuse.  Usage: tcp_ipc.py ROUNDS [--reuse]"""

import os
import socket
import sys
import time

rounds = int(sys.argv[1])
AHEAD = 4

v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
v6.bind(("::", 0))
v6.listen(8)
port6 = v6.getsockname()[1]
v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
if "--reuse" in sys.argv:
    v4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
v4.bind(("127.0.0.1", 0))
v4.listen(8)
port4 = v4.getsockname()[1]

pid = os.fork()
if pid == 0:
    a = socket.create_connection(("127.0.0.1", port6))
    b = socket.create_connection(("127.0.0.1", port4))
    b.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fa, fb = a.makefile("rb"), b.makefile("rb")
    for _ in range(rounds):
        x = fa.readline().strip()
        y = fb.readline().strip()
        a.sendall(b"%s+%s\n" % (x, y))
    os._exit(4)

ca, _ = v6.accept()
cb, _ = v4.accept()
cb.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ra = ca.makefile("rb")


def send(i: int) -> None:
    ca.sendall(b"a%05d\n" % i)
    cb.sendall(b"b%05d\n" % i)


for i in range(min(AHEAD, rounds)):
    send(i)
for i in range(rounds):
    print(f"round {i} {ra.readline().decode().strip()}", flush=True)
    if i + AHEAD < rounds:
        send(i + AHEAD)
    time.sleep(0.01)
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
