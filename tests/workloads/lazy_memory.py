"""A job whose address space changes under a lazy restore's fill.

A private anonymous buffer of SIZE MiB (mmap through libc, so it is what a
lazy restore fills on demand) holds a pattern.  Every step it:
  - discards one MiB with MADV_DONTNEED, checks it reads as zeros, writes it
    again (the pager must not fill it with old contents afterwards);
  - grows or shrinks the buffer by one MiB with mremap, which may move it
    (the pager must fill the pages where they went);
  - every 20 steps forks a child that hashes the whole buffer (the child
    must see the parent's contents, not zeros).
Each step prints the hash of one MiB; the last prints the hash of all of it.

usage: lazy_memory.py STEPS SIZE_MIB [DELAY_S]
"""

import ctypes
import hashlib
import os
import sys
import time

MIB = 1 << 20
PROT_RW = 0x3
MAP_PRIVATE_ANON = 0x02 | 0x20
MADV_DONTNEED = 4
MREMAP_MAYMOVE = 1

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def view(addr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


def main() -> None:
    steps, size_mib = int(sys.argv[1]), int(sys.argv[2])
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
    size = size_mib * MIB
    addr = libc.mmap(None, size, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        sys.exit(f"mmap: {os.strerror(ctypes.get_errno())}")
    for m in range(size_mib):
        view(addr + m * MIB, MIB)[:] = bytes([(m * 7 + i) % 251 for i in range(256)]) * (MIB // 256)
    print(f"ready {size_mib} MiB", flush=True)
    for step in range(steps):
        m = step % size_mib
        libc.madvise(addr + m * MIB, MIB, MADV_DONTNEED)
        page = view(addr + m * MIB, MIB)
        if any(page[::4096]):
            sys.exit(f"step {step}: MiB {m} is not zero after MADV_DONTNEED")
        page[:] = bytes([(step + i) % 253 for i in range(256)]) * (MIB // 256)
        new = size + MIB if step % 2 == 0 else size - MIB
        moved = libc.mremap(addr, size, new, MREMAP_MAYMOVE)
        if moved == ctypes.c_void_p(-1).value:
            sys.exit(f"mremap: {os.strerror(ctypes.get_errno())}")
        if new > size:
            view(moved + size, MIB)[:] = bytes([step % 256]) * MIB
        addr, size = moved, new
        if step % 20 == 19:
            pid = os.fork()
            if pid == 0:
                print(f"child of step {step}: {hashlib.sha256(view(addr, size)).hexdigest()[:16]}", flush=True)
                os._exit(0)
            os.waitpid(pid, 0)
        h = hashlib.sha256(view(addr + ((step * 13) % (size // MIB)) * MIB, MIB)).hexdigest()[:16]
        print(f"step {step} {h}", flush=True)
        time.sleep(delay)
    print(f"done {hashlib.sha256(view(addr, size)).hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
