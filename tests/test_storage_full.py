"""Storage that fills up under a running job (issue 20): output written
while the disk is full is lost, but the log and its index stay one
another's image, so `ckptctl logs` shows exactly what the log kept (a
partly written chunk used to stay in output.log while the index skipped
it: the next chunks' offsets pointed into the wrong bytes, and `logs`
dropped bytes and joined lines)."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import faultmatrix
import pytest
from conftest import PYTHON, Ckptd

# lines of 100 bytes: chunks cross the tmpfs's 4 KiB pages, so a full disk
# cuts some of them in the middle
CHATTY = """
import sys, time
for i in range(int(sys.argv[1])):
    print(f"line {i:06d} " + "x" * 87, flush=True)
    time.sleep(0.005)
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Take every free byte of the file system."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    return filler


@faultmatrix.cell(
    "storage fills up (a full tmpfs) under output.log",
    "any",
    "the job runs on; the log and its index agree; `ckptctl logs` shows every byte the log kept, in order",
)
def test_log_and_index_agree_after_the_disk_filled_up(ckptd: Ckptd, small_disk: Path, tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    ckptd.launch("full", [PYTHON, str(script), "3000"], "--ckpt-dir", str(small_disk))
    ckptd.wait_log("full", r"^line 000100 ")
    filler = fill(small_disk)
    ckptd.wait_log("full", r"^line 000100 ")  # still running
    time.sleep(1)  # lines lost meanwhile
    filler.unlink()
    assert ckptd.wait("full") == 0
    log = ckptd.log_file("full")
    index = log.with_name("output.idx").read_bytes()
    data = log.read_bytes()
    assert len(index) % 16 == 0
    offset = 0
    for i in range(0, len(index), 16):
        at, length, stream = struct.unpack("<QII", index[i : i + 16])
        assert at == offset, f"record {i // 16} at {at}, the log's bytes so far end at {offset}"
        assert stream == 1
        offset += length
    assert offset == len(data), (offset, len(data))
    lines = ckptd.log("full", "stdout").splitlines()
    assert lines[-1].startswith("line 002999 ")
    assert len(lines) < 3000  # the disk really was full for a while
    # `ckptctl logs` reads through the index: every byte the log kept, in order
    assert ckptd.log("full", "stdout") == data.decode()
