"""Unix sockets between a parent and its child, always with data queued:
stream, datagram and seqpacket pairs, a named listener, and a pipe whose
read end travels over SCM_RIGHTS.  Usage: unix_ipc.py ROUNDS SOCKET_PATH"""

import array
import os
import socket
import sys
import time

rounds, path = int(sys.argv[1]), sys.argv[2]
AHEAD = 3  # messages the parent keeps in flight on every channel

stream = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
dgram = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
seq = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
if os.path.exists(path):
    os.unlink(path)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(4)
pr, pw = os.pipe()

pid = os.fork()
if pid == 0:
    for s in (stream[0], dgram[0], seq[0], listener):
        s.close()
    os.close(pr)
    named = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    named.connect(path)
    # the pipe's write end goes to the parent as SCM_RIGHTS
    named.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pw]))])
    os.close(pw)
    sf = stream[1].makefile("rb")
    for _ in range(rounds):
        line = sf.readline()
        d = dgram[1].recv(100)
        q = seq[1].recv(100)
        n = named.recv(6, socket.MSG_WAITALL)
        reply = b"%s|%s|%s|%s" % (line.strip(), d, q, n)
        stream[1].sendall(reply + b"\n")
    os._exit(3)

for s in (stream[1], dgram[1], seq[1]):
    s.close()
os.close(pw)
conn, _ = listener.accept()
msg, anc, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(4))
fds = array.array("i")
fds.frombytes(anc[0][2][:4])
passed_w = fds[0]
os.write(passed_w, b"via scm_rights\n")
print("passed:", os.read(pr, 100).decode().strip(), flush=True)

rf = stream[0].makefile("rb")


def send(i: int) -> None:
    stream[0].sendall(b"s%05d\n" % i)
    dgram[0].send(b"d%05d" % i)
    seq[0].send(b"q%05d" % i)
    conn.sendall(b"n%05d" % i)


for i in range(min(AHEAD, rounds)):
    send(i)
for i in range(rounds):
    print(f"round {i} {rf.readline().decode().strip()}", flush=True)
    if i + AHEAD < rounds:
        send(i + AHEAD)
    time.sleep(0.01)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
