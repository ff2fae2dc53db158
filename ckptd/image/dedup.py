"""Pages stored once across the ranks of a checkpoint.

Data-parallel ranks hold the same weights.  Every rank's images of a round
are complete before any rank's Finalize begins (the coordinator's phases
are barriers), so in Finalize each rank r > 0 compares the pages its own
images hold with the pages rank 0's images of the same round hold.  A page
of r's pages.img that rank 0 wrote too (the same bytes, compared byte for
byte) becomes a reference to rank 0's pages.img, through the SOURCES
section incremental images already use, and its copy is punched out of r's
pages.img (the file keeps its size, its blocks are freed).

The page by page work is native/common/dedup_tool.c (ckptd-dedup): it
hashes rank 0's stored pages into a table, walks r's pages, and once a page
is found and compared equal it follows the match with memcmp alone, page
after page, so that two identical images cost a read of each and a hash
of rank 0's pages.  It answers matched stretches, (own offset, rank 0's
file, its offset, pages); this module turns them into page runs, one
stretch at a time.  A tool that fails (a truncated file, a run past the
end of a file) changes nothing: the process keeps its image as it was.

One process's image is rewritten in three steps:
  1. `plan` builds the new core.img beside the old one (core.img.dedup) and
     reads it back;
  2. the caller has the process's shim take the new page runs (REBASE), so
     that its next incremental image refers to the pages where they are now;
  3. `apply` renames the new core.img over the old one and punches the holes.
A process whose shim cannot take the runs keeps its image as it was.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.native import native_path

from .checksum import WRITER_XATTR, forget_writer_digest
from .core import CoreImage, constant, ffi

PAGE = 4096
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
DEDUP_SUFFIX = ".dedup"
TOOL = "ckptd-dedup"
# rank 0's pages hashed into the tool's table: every one (a matching
# stretch of any length is found); N > 1 hashes 1/N of them and may miss
# stretches shorter than N pages
STRIDE = 1


@dataclass
class PeerPages:
    """Rank 0's pages files and the runs of pages they hold themselves (not
    by reference), to be handed to ckptd-dedup."""

    files: list[tuple[str, int]] = field(default_factory=list)  # (job-relative path, size)
    paths: list[Path] = field(default_factory=list)  # where they are now
    runs: list[list[tuple[int, int]]] = field(default_factory=list)  # per file: (offset, npages)

    def spec(self) -> str:
        lines = []
        for path, runs in zip(self.paths, self.runs, strict=True):
            lines.append(f"peer {path}")
            lines += [f"run {off} {n}" for off, n in runs]
        return "\n".join(lines) + "\n"


def _stored_runs(core: CoreImage) -> list[tuple[int, int]]:
    """(offset, npages) of the runs an image holds in its own pages.img
    (not by reference to another image's)."""
    return [(int(r.offset), int(r.npages)) for r in core.records["runs"] if not r.src and int(r.npages)]


def index_peer(peer_dir: Path, peer_final: str) -> PeerPages:
    """peer_dir: rank 0's directory of this round; peer_final: where it will
    be, relative to the job's directory (ckpt-000004/rank-0)."""
    peer = PeerPages()
    for proc in sorted(peer_dir.glob("proc-*")):
        core = CoreImage.load(proc / "core.img")
        size = (proc / "pages.img").stat().st_size
        runs = _stored_runs(core)
        if not size or not runs:
            continue
        peer.files.append((f"{peer_final}/{proc.name}/pages.img", size))
        peer.paths.append(proc / "pages.img")
        peer.runs.append(runs)
    return peer


@dataclass
class Rewrite:
    """A process image with the pages rank 0 holds alike pointing there."""

    proc_dir: Path
    deduped_bytes: int
    holes: list[tuple[int, int]]  # (offset, length) in its pages.img
    digest: str | None = None  # "HEX SIZE": pages.img's xxh3-128 once every hole is punched

    @property
    def new_core(self) -> Path:
        return self.proc_dir / ("core.img" + DEDUP_SUFFIX)


Match = tuple[int, int, int, int]  # (own offset, peer file, peer offset, npages)


def find_matches(peer: PeerPages, pages: Path, own_runs: list[tuple[int, int]]) -> tuple[list[Match], str | None]:
    """The stretches of own_runs ((offset, npages) in pages) that rank 0's
    files hold alike, compared byte for byte by ckptd-dedup, sorted by own
    offset; and "HEX SIZE", the xxh3-128 and size of pages as it reads
    once they are punched out (None where the tool could not hash).  Raises
    CkptdError where the tool fails (nothing is changed)."""
    spec = peer.spec() + f"own {pages}\n" + "".join(f"run {off} {n}\n" for off, n in own_runs)
    try:
        p = subprocess.run(
            [str(native_path(TOOL)), "--stride", str(STRIDE), "--digest"],
            input=spec.encode(),
            capture_output=True,
            check=False,
        )
    except OSError as e:
        raise CkptdError(Code.INTERNAL, f"{TOOL} did not start: {e}") from None
    out = p.stdout.decode(errors="replace").splitlines()
    if p.returncode != 0 or not out or not out[-1].startswith("done "):
        why = p.stderr.decode(errors="replace").strip() or f"exit status {p.returncode}"
        raise CkptdError(Code.INTERNAL, f"{TOOL} failed on {pages}: {why}")
    matches: list[Match] = []
    digest = None
    for line in out[:-1]:
        word, *rest = line.split()
        if word == "digest" and len(rest) == 2:
            digest = " ".join(rest)
            continue
        own, f, off, n = (int(x) for x in rest)
        if word != "match" or not 0 <= f < len(peer.files) or n <= 0:
            raise CkptdError(Code.INTERNAL, f"{TOOL} answered {line!r}")
        matches.append((own, f, off, n))
    matches.sort()
    return matches, digest


def _runs_of(core: CoreImage, peer: PeerPages, pages: Path, sources: list[dict[str, Any]]) -> Any:
    """The image's runs with every stretch rank 0 holds alike turned into a
    reference; returns (runs as tuples, per-VMA (first, count), holes,
    bytes, the sources to add, the digest of pages once punched)."""
    own_runs = _stored_runs(core)
    matches, digest = find_matches(peer, pages, own_runs) if own_runs else ([], None)
    starts = [m[0] for m in matches]
    src_of: dict[int, int] = {}  # peer file -> this image's source number
    runs: list[list[int]] = []  # [vaddr, npages, offset, src]
    vma_runs: list[tuple[int, int]] = []
    holes: list[tuple[int, int]] = []
    deduped = 0

    def add(first: int, vaddr: int, npages: int, where: int, src: int) -> None:
        last = runs[-1] if len(runs) > first else None
        if (
            last is not None
            and last[3] == src
            and last[0] + last[1] * PAGE == vaddr
            and last[2] + last[1] * PAGE == where
        ):
            last[1] += npages
        else:
            runs.append([vaddr, npages, where, src])

    for v in core.records["vmas"]:
        first = len(runs)
        for r in core.records["runs"][int(v.first_run) : int(v.first_run) + int(v.nruns)]:
            vaddr, npages, offset = int(r.vaddr), int(r.npages), int(r.offset)
            if r.src:
                runs.append([vaddr, npages, offset, int(r.src)])
                continue
            end = offset + npages * PAGE
            at = offset  # the run's pages before it are placed
            for own, f, off, n in matches[bisect.bisect_left(starts, offset) : bisect.bisect_left(starts, end)]:
                if own < at or own + n * PAGE > end:
                    raise CkptdError(Code.INTERNAL, f"{TOOL}: a match at {own} crosses a run of {pages}")
                if f not in src_of and len(sources) + len(src_of) >= constant("CK_MAX_SOURCES"):
                    digest = None  # no room for another source: keep the copy (which the digest took out)
                    continue
                if own > at:
                    add(first, vaddr + (at - offset), (own - at) // PAGE, at, 0)
                src = src_of.setdefault(f, len(sources) + len(src_of) + 1)
                add(first, vaddr + (own - offset), n, off, src)
                deduped += n * PAGE
                if holes and holes[-1][0] + holes[-1][1] == own:
                    holes[-1] = (holes[-1][0], holes[-1][1] + n * PAGE)
                else:
                    holes.append((own, n * PAGE))
                at = own + n * PAGE
            if end > at:
                add(first, vaddr + (at - offset), (end - at) // PAGE, at, 0)
        vma_runs.append((first, len(runs) - first))
    new_sources = [peer.files[f] for f, _ in sorted(src_of.items(), key=lambda kv: kv[1])]
    return runs, vma_runs, holes, deduped, new_sources, digest


def _section_bytes(core: CoreImage, type_const: str) -> bytes:
    for i in range(min(core.header.nsections, constant("CK_MAX_SECTIONS"))):
        s = core.header.sections[i]
        if s.type == constant(type_const):
            return bytes(core.data[s.offset : s.offset + s.size])
    return b""


def plan(proc_dir: Path, peer: PeerPages) -> Rewrite | None:
    """Write core.img.dedup for one process image; None if rank 0 holds
    none of its pages."""
    core = CoreImage.load(proc_dir / "core.img")
    pages = proc_dir / "pages.img"
    if not pages.stat().st_size:
        return None
    sources = core.page_sources()
    runs, vma_runs, holes, deduped, new_sources, digest = _runs_of(core, peer, pages, sources)
    if not deduped:
        return None
    f = ffi()
    data = bytearray(core.data)

    def append(blob: bytes) -> tuple[int, int]:
        data.extend(b"\0" * (-len(data) % 8))  # records are read in place: keep them aligned
        off = len(data)
        data.extend(blob)
        return off, len(blob)

    # VMAs: the same records, with their runs' new positions
    vmas = bytearray(_section_bytes(core, "CK_SEC_VMAS"))
    vma_recs = f.from_buffer("struct ck_vma[]", vmas)
    for i, (first, count) in enumerate(vma_runs):
        vma_recs[i].first_run = first
        vma_recs[i].nruns = count
    run_recs = f.new("struct ck_page_run[]", len(runs))
    for i, (vaddr, npages, off, src) in enumerate(runs):
        run_recs[i].vaddr, run_recs[i].npages, run_recs[i].offset, run_recs[i].src = vaddr, npages, off, src
    strings = bytearray(core.blobs["strings"]) or bytearray(b"\0")
    src_blob = bytearray(_section_bytes(core, "CK_SEC_SOURCES"))
    for path, size in new_sources:
        rec = f.new("struct ck_page_source *")
        rec.path = len(strings)
        rec.size = size
        strings.extend(path.encode() + b"\0")
        src_blob.extend(bytes(f.buffer(rec)))
    sections = {
        "CK_SEC_VMAS": (append(bytes(vmas)), len(vma_runs)),
        "CK_SEC_RUNS": (append(bytes(f.buffer(run_recs))), len(runs)),
        "CK_SEC_SOURCES": (append(bytes(src_blob)), len(sources) + len(new_sources)),
        "CK_SEC_STRINGS": (append(bytes(strings)), len(strings)),
    }
    header = f.from_buffer("struct ck_header *", data)
    for const, ((off, size), count) in sections.items():
        slot = next(
            (i for i in range(header.nsections) if header.sections[i].type == constant(const)),
            None,
        )
        if slot is None:
            if header.nsections >= constant("CK_MAX_SECTIONS"):
                return None
            slot = header.nsections
            header.nsections += 1
        header.sections[slot].type = constant(const)
        header.sections[slot].offset = off
        header.sections[slot].size = size
        header.sections[slot].count = count
    header.file_size = len(data)
    del header
    rw = Rewrite(proc_dir, deduped, holes, digest)
    rw.new_core.write_bytes(bytes(data))
    CoreImage.load(rw.new_core)  # read back: a malformed rewrite is never applied
    return rw


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def apply(rw: Rewrite) -> int:
    """Put the new core.img in place and free the copies; returns the bytes
    freed (0 where the filesystem cannot punch holes: the pages stay, unused).
    With every hole punched, pages.img gets the digest ckptd-dedup computed
    for it as its writer's (checksum.WRITER_XATTR): finalize need not read
    it all again to hash it."""
    os.replace(rw.new_core, rw.proc_dir / "core.img")
    forget_writer_digest(rw.proc_dir / "pages.img")  # its bytes change here
    fd = os.open(rw.proc_dir / "pages.img", os.O_WRONLY)
    freed = 0
    try:
        for off, length in rw.holes:
            if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length) != 0:
                break
            freed += length
        if rw.digest and freed == sum(length for _, length in rw.holes):
            with contextlib.suppress(OSError):  # no user xattrs here: finalize hashes the file
                if rw.digest.endswith(f" {os.fstat(fd).st_size}"):
                    os.setxattr(fd, WRITER_XATTR, rw.digest.encode())
    finally:
        os.close(fd)
    return freed


def discard(rw: Rewrite) -> None:
    rw.new_core.unlink(missing_ok=True)
