"""Memory of each kind the writer of pages.img handles its own way, all
rewritten and checked at every step: a private buffer (the forked writer
writes it), an anonymous MAP_SHARED mapping and a MADV_DONTFORK one (both
written during the pause, and read back by a writer that hashes), and a
PROT_NONE one (read through /proc/self/mem).  Prints "step N ok" while
every region holds the previous step's value.  Usage: mixed_memory.py STEPS"""

import ctypes
import mmap
import sys
import time

import numpy as np

MIB = 1 << 20
PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE

libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

steps = int(sys.argv[1])
private = np.zeros(32 * MIB // 8, dtype=np.uint64)
shared_map = mmap.mmap(-1, MIB)  # MAP_SHARED | MAP_ANONYMOUS
dontfork_map = mmap.mmap(-1, MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
dontfork_map.madvise(mmap.MADV_DONTFORK)
hidden_map = mmap.mmap(-1, MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
hidden_addr = ctypes.addressof(ctypes.c_char.from_buffer(hidden_map))
regions = {
    "private": private,
    "shared": np.frombuffer(shared_map, dtype=np.uint64),
    "dontfork": np.frombuffer(dontfork_map, dtype=np.uint64),
    "hidden": np.frombuffer(hidden_map, dtype=np.uint64),
}


def protect(prot: int) -> None:
    if libc.mprotect(hidden_addr, MIB, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")


for i, a in enumerate(regions.values()):
    a[:] = i
protect(PROT_NONE)
for step in range(1, steps + 1):
    protect(PROT_RW)
    # a different value per region and step, in every word
    bad = [n for i, (n, a) in enumerate(regions.items()) if not (a == (step - 1) * 7 + i).all()]
    for i, a in enumerate(regions.values()):
        a[:] = step * 7 + i
    protect(PROT_NONE)  # mostly PROT_NONE, so that checkpoints find it so
    print(f"step {step} {'ok' if not bad else 'bad ' + ','.join(bad)}", flush=True)
    time.sleep(0.02)
print("done", flush=True)
