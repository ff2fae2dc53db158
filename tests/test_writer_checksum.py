"""The writer of pages.img hashes it as it writes it (native/shim/
checksum.c): the agent takes that digest instead of reading the image back.
A wrong digest would make every restart from the image fail, so each test
checks it against the file and restarts from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import PYTHON, WORKLOADS, Ckptd

from ckptd.image.checksum import ALGORITHM, WRITER_XATTR, hash_file, writer_digest


def expected(steps: int) -> str:
    return "".join(f"step {s} ok\n" for s in range(1, steps + 1)) + "done\n"


def pages_entries(info: dict) -> list[tuple[Path, str]]:
    d = Path(info["path"])
    manifest = json.loads((d / "manifest.json").read_text())
    return [(d / e["path"], e[ALGORITHM]) for e in manifest["files"] if e["path"].endswith("pages.img")]


@pytest.mark.parametrize("hasher", ["writer", "agent"])
def test_every_kind_of_mapping_hashes_to_the_file(ckptd: Ckptd, hasher: str) -> None:
    """A job with private, MAP_SHARED, MADV_DONTFORK and PROT_NONE memory,
    which the writer writes or reads back each its own way: the manifest's
    checksum is the file's, it came from the writer (writer) or from the
    agent (agent: CKPTD_WRITER_CHECKSUM=0), and the job restarts from a
    full and an incremental image to the same output."""
    c = ckptd
    if hasher == "agent":
        c.env["CKPTD_WRITER_CHECKSUM"] = "0"  # the job inherits the launcher's environment
    steps = 80
    c.launch("mix", [PYTHON, str(WORKLOADS / "mixed_memory.py"), str(steps)])
    c.wait_log("mix", r"^step 10 ")
    full = c.checkpoint("mix")
    c.wait_log("mix", r"^step 25 ")
    incremental = c.checkpoint("mix")
    assert incremental["parent"] == full["name"]
    entries = pages_entries(full) + pages_entries(incremental)
    assert entries
    for path, digest in entries:
        assert digest == hash_file(path), path
    by_writer = [writer_digest(path) for path, _ in pages_entries(full)]
    if hasher == "writer":
        assert by_writer == [d for _, d in pages_entries(full)]
    else:
        assert by_writer == [None]
    c.kill9("mix")
    c.ctl("restart", "mix")
    assert c.wait("mix") == 0
    assert c.log("mix", "stdout") == expected(steps)


def test_a_digest_that_does_not_fit_the_file_is_not_taken(tmp_path: Path) -> None:
    """Only a well-formed digest recorded for the file's present size counts;
    anything else, and no digest, leaves the agent to hash the file."""
    f = tmp_path / "pages.img"
    f.write_bytes(os.urandom(3 * 4096))
    good = hash_file(f)
    try:
        os.setxattr(f, WRITER_XATTR, f"{good} {3 * 4096}".encode())
    except OSError as e:
        pytest.skip(f"no user xattrs on {tmp_path}: {e}")
    assert writer_digest(f) == good
    for value in (f"{good} 4096", f"{good}", f"{good[:-1]}g {3 * 4096}", f"{good}0 {3 * 4096}", "\xff"):
        os.setxattr(f, WRITER_XATTR, value.encode("utf-8", "surrogateescape"))
        assert writer_digest(f) is None, value
    os.removexattr(f, WRITER_XATTR)
    assert writer_digest(f) is None
