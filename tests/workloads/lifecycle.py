"""Process lifecycle and the rest of the IPC: a named FIFO, a memfd shared
with a child, a child in its own session, another in its own process group,
signals between processes, a zombie reaped only at the end, posix_spawn and
subprocess (vfork + exec).  Usage: lifecycle.py ROUNDS DIR"""

import mmap
import os
import signal
import struct
import subprocess
import sys
import time

rounds, d = int(sys.argv[1]), sys.argv[2]
fifo = os.path.join(d, "fifo")
if not os.path.exists(fifo):
    os.mkfifo(fifo)

mfd = os.memfd_create("ckptd-test")
os.ftruncate(mfd, 8192)
# read and written as whole aligned 8-byte words: struct's pack_into and
# unpack_from go byte by byte, and a reader behind the writer (as after a
# restart) could see half of an old and half of a new value
shared = memoryview(mmap.mmap(mfd, 8192)).cast("q")

# a zombie: exits at once with status 5, reaped only at the very end
zombie = os.fork()
if zombie == 0:
    os._exit(5)

got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))

worker = os.fork()
if worker == 0:
    os.setsid()  # its own session
    w = open(fifo, "wb", buffering=0)  # noqa: SIM115 (held until _exit)
    m = memoryview(mmap.mmap(mfd, 8192)).cast("q")
    for i in range(rounds):
        m[1] = i * 3
        w.write(struct.pack("<q", i))
        if i % 10 == 0:
            os.kill(os.getppid(), signal.SIGUSR1)
        time.sleep(0.01)
    os._exit(0)

grouped = os.fork()
if grouped == 0:
    os.setpgid(0, 0)  # its own process group
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(9))
    while True:
        signal.pause()

os.setpgid(grouped, grouped)  # both sides, as shells do: no race with the child
r = open(fifo, "rb", buffering=0)  # noqa: SIM115 (held for the whole run)
print("ids", os.getpgid(grouped) == grouped, os.getsid(worker) == worker, flush=True)
for i in range(rounds):
    (v,) = struct.unpack("<q", r.read(8))
    print(f"round {i} fifo {v} memfd {shared[1] >= v * 3}", flush=True)
    if i % 40 == 0:
        # posix_spawn and subprocess while the tree runs
        pid = os.posix_spawn("/bin/echo", ["echo", f"spawned {i}"], os.environ)
        os.waitpid(pid, 0)
        print(
            subprocess.run(["/bin/echo", f"subprocess {i}"], capture_output=True, text=True).stdout.strip(), flush=True
        )
    time.sleep(0.01)
os.waitpid(worker, 0)
os.kill(grouped, signal.SIGTERM)
print("grouped exit", os.waitstatus_to_exitcode(os.waitpid(grouped, 0)[1]), flush=True)
print("zombie exit", os.waitstatus_to_exitcode(os.waitpid(zombie, 0)[1]), flush=True)
print("signals", len(got) > 0, flush=True)
