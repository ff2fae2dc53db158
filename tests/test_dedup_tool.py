"""ckptd-dedup, the page comparison behind `launch --dedup`
(native/common/dedup_tool.c, ckptd/image/dedup.py): it finds the stretches
of one pages file another holds too, compared byte for byte, with the
digest of the file as it reads once they are punched out; and any bad
input (a truncated file, a run past its end, a malformed spec) fails
clearly and leaves the image as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import xxhash
from conftest import PYTHON, WORKLOADS, Ckptd

from ckptd.errors import CkptdError
from ckptd.image import dedup
from ckptd.image.checksum import hash_file, writer_digest
from ckptd.image.core import CoreImage
from ckptd.native import native_path

P = 4096


def tool(spec: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(native_path("ckptd-dedup")), *args], input=spec, capture_output=True, text=True, check=False
    )


def pages(n: int, seed: int) -> list[bytes]:
    return [(seed * 1_000_003 + i).to_bytes(8, "little") * (P // 8) for i in range(n)]


@pytest.mark.parametrize("stride", ["1", "3"])
def test_stretches_found_and_compared(tmp_path: Path, stride: str) -> None:
    peer_pages = pages(40, 1)
    odd = pages(3, 2)
    near = bytearray(peer_pages[25])
    near[-1] ^= 1  # one byte off: never taken for the peer's page
    own_pages = [odd[0], *peer_pages[5:20], odd[1], bytes(near), *peer_pages[26:36], *peer_pages[0:6], odd[2]]
    (tmp_path / "peer").write_bytes(b"".join(peer_pages))
    own = b"".join(own_pages)
    (tmp_path / "own").write_bytes(own)
    n = len(own_pages)
    # the peer's two runs and the own file's two runs split stretches
    spec = f"peer {tmp_path}/peer\nrun 0 20\nrun {20 * P} 20\nown {tmp_path}/own\nrun 0 10\nrun {10 * P} {n - 10}\n"
    p = tool(spec, "--stride", stride, "--digest")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    matches = [tuple(int(x) for x in line.split()[1:]) for line in lines if line.startswith("match ")]
    assert matches == [
        (1 * P, 0, 5 * P, 9),  # own run 1 ends after 9 of them
        (10 * P, 0, 14 * P, 6),  # the peer's first run ends at page 20
        (18 * P, 0, 26 * P, 10),
        (28 * P, 0, 0, 6),
    ]
    zeroed = bytearray(own)
    for off, _, _, npages in matches:
        zeroed[off : off + npages * P] = bytes(npages * P)
    digest = next(line.split()[1:] for line in lines if line.startswith("digest "))
    assert digest == [xxhash.xxh3_128_hexdigest(bytes(zeroed)), str(len(own))]
    assert lines[-1].split()[0] == "done" and int(lines[-1].split()[3]) == 31


@pytest.mark.parametrize(
    "case, message",
    [
        ("truncated", "past the end of its file (truncated?)"),
        ("unaligned", "not page aligned"),
        ("missing", "cannot open"),
        ("malformed", "bad run line"),
        ("no own", "no own file"),
        ("garbage", "bad line"),
    ],
)
def test_bad_input_fails_clearly(tmp_path: Path, case: str, message: str) -> None:
    (tmp_path / "a").write_bytes(b"\1" * 8 * P)
    (tmp_path / "b").write_bytes(b"\1" * 4 * P)  # "truncated": its core.img says 8 pages
    spec = {
        "truncated": f"peer {tmp_path}/a\nrun 0 8\nown {tmp_path}/b\nrun 0 8\n",
        "unaligned": f"peer {tmp_path}/a\nrun 100 2\nown {tmp_path}/b\nrun 0 4\n",
        "missing": f"peer {tmp_path}/nothing\nrun 0 8\nown {tmp_path}/b\nrun 0 4\n",
        "malformed": f"peer {tmp_path}/a\nrun 0 x\nown {tmp_path}/b\nrun 0 4\n",
        "no own": f"peer {tmp_path}/a\nrun 0 8\n",
        "garbage": f"peer {tmp_path}/a\nrun 0 8\nrm -rf /\n",
    }[case]
    p = tool(spec)
    assert p.returncode == 2 and p.stderr.startswith("ckptd-dedup: ") and message in p.stderr, p.stderr
    assert "done" not in p.stdout


def memory_of(proc_dir: Path, files: dict[int, Path]) -> dict[int, bytes]:
    """Every page an image restores, by address: its own pages.img for src
    0, files[n] for SOURCES[n-1]."""
    core = CoreImage.load(proc_dir / "core.img")
    data = {0: (proc_dir / "pages.img").read_bytes(), **{k: f.read_bytes() for k, f in files.items()}}
    out = {}
    for r in core.records["runs"]:
        for i in range(int(r.npages)):
            off = int(r.offset) + i * P
            out[int(r.vaddr) + i * P] = data[int(r.src)][off : off + P]
    return out


def process_image(c: Ckptd) -> Path:
    """The image directory of a real process, checkpointed and killed."""
    c.launch("one", [PYTHON, str(WORKLOADS / "dirty_pages.py"), "400", "8"])
    c.wait_log("one", r"^step 2 ")
    info = c.checkpoint("one")
    c.kill9("one")
    return next(Path(info["path"]).glob("proc-*"))


def test_plan_and_apply_against_a_copy_and_a_truncated_peer(ckptd: Ckptd, tmp_path: Path) -> None:
    """A real image against a copy of itself: every page it holds becomes a
    reference, the memory it restores is the same, the digest recorded is
    the file's.  Against a truncated copy the tool fails, plan raises, and
    the image is untouched."""
    proc = process_image(ckptd)
    job = tmp_path / "job"
    peer_dir, own_dir = job / "ckpt-x" / "rank-0", job / "ckpt-x" / "rank-1"
    shutil.copytree(proc, peer_dir / proc.name)
    shutil.copytree(proc, own_dir / proc.name)
    own = own_dir / proc.name
    before = memory_of(own, {})
    stored = sum(int(r.npages) * P for r in CoreImage.load(own / "core.img").records["runs"] if not r.src)

    # the peer truncated: nothing happens
    short = job / "short" / "rank-0"
    shutil.copytree(proc, short / proc.name)
    os.truncate(short / proc.name / "pages.img", (short / proc.name / "pages.img").stat().st_size // 2)
    core_bytes = (own / "core.img").read_bytes()
    with pytest.raises(CkptdError, match="past the end of its file"):
        dedup.plan(own, dedup.index_peer(short, "short/rank-0"))
    assert (own / "core.img").read_bytes() == core_bytes
    assert not (own / ("core.img" + dedup.DEDUP_SUFFIX)).exists()
    assert memory_of(own, {}) == before

    peer = dedup.index_peer(peer_dir, "ckpt-x/rank-0")
    rw = dedup.plan(own, peer)
    assert rw is not None and rw.deduped_bytes == stored, (rw, stored)
    assert dedup.apply(rw, peer) == stored
    core = CoreImage.load(own / "core.img")
    assert core.page_sources() == [
        {"path": f"ckpt-x/rank-0/{proc.name}/pages.img", "size": (peer_dir / proc.name / "pages.img").stat().st_size}
    ]
    assert all(r.src == 1 for r in core.records["runs"])
    assert memory_of(own, {1: peer_dir / proc.name / "pages.img"}) == before
    recorded = writer_digest(own / "pages.img")
    if recorded is not None:  # where the filesystem keeps user xattrs
        assert recorded == hash_file(own / "pages.img")


def test_pages_a_writer_left_out_become_references_or_come_back(ckptd: Ckptd, tmp_path: Path) -> None:
    """What the agent does with a writer that compared as it wrote
    (native/shim/writeout_dedup.c): the pages it left out as holes, listed
    in pages.match, become references to rank 0's file; where the image
    cannot take them (the process is gone, say), `fill` copies them back
    from rank 0's file and the image restores the same memory on its own.
    A list the writer did not finish is refused."""
    proc = process_image(ckptd)
    peer_dir = tmp_path / "ckpt-x" / "rank-0"
    shutil.copytree(proc, peer_dir / proc.name)
    runs = [(int(r.offset), int(r.npages)) for r in CoreImage.load(proc / "core.img").records["runs"] if not r.src]
    left = [(off, 0, off, n) for off, n in runs[1:]]  # the first run written, the others left out
    stored = sum(n * P for _, _, _, n in left)

    def left_out(name: str) -> Path:
        own = tmp_path / name / proc.name
        shutil.copytree(proc, own)
        fd = os.open(own / "pages.img", os.O_WRONLY)
        for off, _, _, n in left:
            dedup._libc.fallocate(fd, dedup.FALLOC_FL_PUNCH_HOLE | dedup.FALLOC_FL_KEEP_SIZE, off, n * P)
        os.close(fd)
        lines = [f"match {own_off} {f} {off} {n}" for own_off, f, off, n in left]
        (own / dedup.WRITER_MATCHES).write_text("\n".join([*lines, f"done 0 0 {stored // P}"]) + "\n")
        return own

    before = memory_of(proc, {})
    peer = dedup.index_peer(peer_dir, "ckpt-x/rank-0")

    own = left_out("referred")
    assert dedup.writer_matches(own, peer) == (sorted(left), f"done 0 0 {stored // P}")
    rw = dedup.plan(own, peer, sorted(left))
    assert rw is not None and rw.deduped_bytes == stored and not rw.missing
    dedup.apply(rw, peer)
    assert memory_of(own, {1: peer_dir / proc.name / "pages.img"}) == before

    own = left_out("filled")
    assert memory_of(own, {}) != before  # holes
    rw = dedup.plan(own, peer, sorted(left))
    assert rw is not None
    dedup.discard(rw)  # the shim could not take the new runs
    dedup.fill(own, peer, sorted(left))
    assert not (own / ("core.img" + dedup.DEDUP_SUFFIX)).exists()
    assert memory_of(own, {}) == before
    assert (own / "pages.img").read_bytes() == (proc / "pages.img").read_bytes()
    assert writer_digest(own / "pages.img") is None  # finalize hashes it again

    unfinished = left_out("unfinished")
    (unfinished / dedup.WRITER_MATCHES).write_text(f"match {left[0][0]} 0 {left[0][2]} {left[0][3]}\n")
    with pytest.raises(CkptdError, match="the writer did not finish its list of matches"):
        dedup.writer_matches(unfinished, peer)
    (unfinished / dedup.WRITER_MATCHES).write_text("match 5 0 0 1\ndone 0 0 1\n")
    with pytest.raises(CkptdError, match="the writer answered 'match 5 0 0 1'"):
        dedup.writer_matches(unfinished, peer)


def test_writers_compare_only_where_one_page_cache_serves(tmp_path: Path) -> None:
    """Rank r's writers compare with rank 0's pages while they are written
    only on a filesystem this machine's page cache serves alone (a network
    filesystem's client may keep a page it read ahead before it was
    written); elsewhere they write every page and ckptd-dedup compares
    after them."""
    assert dedup.compared_while_written(tmp_path)
    assert not dedup.compared_while_written(Path("/proc/self"))
    assert not dedup.compared_while_written(Path("/sys/kernel"))
