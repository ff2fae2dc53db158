#!/usr/bin/env python3
"""Why ckptd's writer keeps little of an image in the page cache: the raw
sequential write of SIZE MiB (write + fsync from one small buffer, as
scripts/bench.py measures its baseline) three ways, alternating, in one run:

  plain     the baseline: nothing else in memory;
  resident  the same, with SIZE MiB of anonymous memory resident in the
            process, as a job being checkpointed has;
  recycled  resident, and the page cache dropped 256 MiB behind the write
            once on disk (sync_file_range, POSIX_FADV_DONTNEED), as the
            writer of a hashed pages.img does (native/shim/writeout.c).

On a VM that hands freed memory back to its host, the page cache a write
needs beyond what was freed lately is fresh memory, which the host must
supply first; that, not the disk, is what `resident` pays.

    scripts/bench_page_cache.py [--dir /var/tmp] [--mib 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("bench_page_cache")

CHUNK = 1 << 20
STEP = 64 << 20  # as the writer: writeback queued every 64 MiB
BEHIND = 256 << 20  # and no more than this kept cached
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4

libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def write(path: Path, size: int, recycle: bool) -> float:
    """GB/s of writing size bytes to path and fsyncing it."""
    buf = os.urandom(CHUNK)
    t = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        off = started = dropped = 0
        while off < size:
            off += os.write(fd, buf[: min(CHUNK, size - off)])
            if recycle and off >= started + STEP:
                libc.sync_file_range(fd, started, off - started, SYNC_FILE_RANGE_WRITE)
                started = off
                if off >= dropped + BEHIND + STEP:
                    upto = off - BEHIND
                    flags = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
                    libc.sync_file_range(fd, dropped, upto - dropped, flags)
                    os.posix_fadvise(fd, dropped, upto - dropped, os.POSIX_FADV_DONTNEED)
                    dropped = upto
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.monotonic() - t
    path.unlink()
    return size / elapsed / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="directory to write in (default /var/tmp)")
    ap.add_argument("--mib", type=int, default=4096, help="bytes written, and resident, in MiB (default 4096)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three ways (default 3)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    size = args.mib << 20
    path = args.dir / f"bench-page-cache-{os.getpid()}.bin"
    results: dict[str, list[float]] = {"plain": [], "resident": [], "recycled": []}
    for r in range(args.rounds):
        results["plain"].append(write(path, size, recycle=False))
        resident = np.ones(size // 8, dtype=np.uint64)  # touched: every page present
        results["resident"].append(write(path, size, recycle=False))
        results["recycled"].append(write(path, size, recycle=True))
        del resident
        log.info("round %d: %s", r + 1, ", ".join(f"{k} {v[-1]:.2f} GB/s" for k, v in results.items()))
    plain = statistics.median(results["plain"])
    log.info("\n| write of %d MiB | GB/s (median of %d) | / plain |", args.mib, args.rounds)
    log.info("|---|---:|---:|")
    for k, v in results.items():
        log.info("| %s | %.2f | %.2f |", k, statistics.median(v), statistics.median(v) / plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
