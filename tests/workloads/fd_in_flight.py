"""A pipe's write end and a UDP socket (a kind ckptd cannot save) sit in a
Unix socket's queue (SCM_RIGHTS sent, not received) until FLAG exists; then
the process takes them and writes through the pipe.
Usage: fd_in_flight.py STEPS FLAG"""

import array
import hashlib
import os
import socket
import sys
import time

steps, flag = int(sys.argv[1]), sys.argv[2]
r, w = os.pipe()
a, b = socket.socketpair()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
a.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w, u.fileno()]))])
os.close(w)
u.close()
print("sent", flush=True)
while not os.path.exists(flag):
    time.sleep(0.005)
_, anc, _, _ = b.recvmsg(1, socket.CMSG_SPACE(8))
passed, udp = array.array("i", anc[0][2])
os.close(udp)
print("received", flush=True)
h = hashlib.sha256()
for i in range(steps):
    os.write(passed, i.to_bytes(4, "little"))
    h.update(os.read(r, 4))
    print(f"step {i} {h.hexdigest()[:16]}", flush=True)
    time.sleep(0.02)
