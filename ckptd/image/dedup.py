"""Pages stored once across the ranks of a checkpoint.

Data-parallel ranks hold the same weights.  Every rank's images of a round
are complete before any rank's Finalize begins (the coordinator's phases
are barriers), so in Finalize each rank r > 0 compares the pages its own
images hold with the pages rank 0's images of the same round hold.  A page
of r's pages.img that rank 0 wrote too (same 64-bit xxh3, then the same
bytes) becomes a reference to rank 0's pages.img, through the SOURCES
section incremental images already use, and its copy is punched out of r's
pages.img (the file keeps its size, its blocks are freed).

One process's image is rewritten in three steps:
  1. `plan` builds the new core.img beside the old one (core.img.dedup);
  2. the caller has the process's shim take the new page runs (REBASE), so
     that its next incremental image refers to the pages where they are now;
  3. `apply` renames the new core.img over the old one and punches the holes.
A process whose shim cannot take the runs keeps its image as it was.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .checksum import forget_writer_digest
from .core import CoreImage, constant, ffi

PAGE = 4096
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
DEDUP_SUFFIX = ".dedup"


@dataclass
class PeerPages:
    """Every page rank 0's images hold themselves (not by reference), by hash."""

    by_hash: dict[int, tuple[int, int]] = field(default_factory=dict)  # hash -> (file, offset)
    files: list[tuple[str, int]] = field(default_factory=list)  # (job-relative path, size)
    maps: list[mmap.mmap] = field(default_factory=list)

    def close(self) -> None:
        for m in self.maps:
            m.close()

    def find(self, page: memoryview) -> tuple[int, int] | None:
        hit = self.by_hash.get(xxhash.xxh3_64_intdigest(page))
        if hit is None:
            return None
        f, off = hit
        return hit if self.maps[f][off : off + PAGE] == page else None


def _map(path: Path) -> mmap.mmap | None:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)


def index_peer(peer_dir: Path, peer_final: str) -> PeerPages:
    """peer_dir: rank 0's directory of this round; peer_final: where it will
    be, relative to the job's directory (ckpt-000004/rank-0)."""
    peer = PeerPages()
    for proc in sorted(peer_dir.glob("proc-*")):
        core = CoreImage.load(proc / "core.img")
        mm = _map(proc / "pages.img")
        if mm is None:
            continue
        fi = len(peer.files)
        peer.files.append((f"{peer_final}/{proc.name}/pages.img", len(mm)))
        peer.maps.append(mm)
        view = memoryview(mm)
        for run in core.records["runs"]:
            if run.src:
                continue
            for off in range(int(run.offset), int(run.offset) + int(run.npages) * PAGE, PAGE):
                peer.by_hash.setdefault(xxhash.xxh3_64_intdigest(view[off : off + PAGE]), (fi, off))
    return peer


@dataclass
class Rewrite:
    """A process image with the pages rank 0 holds alike pointing there."""

    proc_dir: Path
    deduped_bytes: int
    holes: list[tuple[int, int]]  # (offset, length) in its pages.img

    @property
    def new_core(self) -> Path:
        return self.proc_dir / ("core.img" + DEDUP_SUFFIX)


def _runs_of(core: CoreImage, peer: PeerPages, own: memoryview, sources: list[dict[str, Any]]) -> Any:
    """The image's runs with every page rank 0 holds alike turned into a
    reference; returns (runs as tuples, per-VMA (first, count), holes, bytes)."""
    src_of: dict[int, int] = {}  # peer file -> this image's source number
    runs: list[list[int]] = []  # [vaddr, npages, offset, src]
    vma_runs: list[tuple[int, int]] = []
    holes: list[tuple[int, int]] = []
    deduped = 0
    for v in core.records["vmas"]:
        first = len(runs)
        for r in core.records["runs"][int(v.first_run) : int(v.first_run) + int(v.nruns)]:
            if r.src:
                runs.append([int(r.vaddr), int(r.npages), int(r.offset), int(r.src)])
                continue
            for i in range(int(r.npages)):
                vaddr, off = int(r.vaddr) + i * PAGE, int(r.offset) + i * PAGE
                hit = peer.find(own[off : off + PAGE])
                if (
                    hit is not None
                    and hit[0] not in src_of
                    and len(sources) + len(src_of) >= constant("CK_MAX_SOURCES")
                ):
                    hit = None  # no room for another source: keep the copy
                if hit is None:
                    src, where = 0, off
                else:
                    if hit[0] not in src_of:
                        src_of[hit[0]] = len(sources) + len(src_of) + 1
                    src, where = src_of[hit[0]], hit[1]
                    deduped += PAGE
                    if holes and holes[-1][0] + holes[-1][1] == off:
                        holes[-1] = (holes[-1][0], holes[-1][1] + PAGE)
                    else:
                        holes.append((off, PAGE))
                last = runs[-1] if len(runs) > first else None
                if (
                    last is not None
                    and last[3] == src
                    and last[0] + last[1] * PAGE == vaddr
                    and last[2] + last[1] * PAGE == where
                ):
                    last[1] += 1
                else:
                    runs.append([vaddr, 1, where, src])
        vma_runs.append((first, len(runs) - first))
    new_sources = [peer.files[f] for f, _ in sorted(src_of.items(), key=lambda kv: kv[1])]
    return runs, vma_runs, holes, deduped, new_sources


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
    mm = _map(proc_dir / "pages.img")
    if mm is None:
        return None
    try:
        sources = core.page_sources()
        runs, vma_runs, holes, deduped, new_sources = _runs_of(core, peer, memoryview(mm), sources)
    finally:
        mm.close()
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
    rw = Rewrite(proc_dir, deduped, holes)
    rw.new_core.write_bytes(bytes(data))
    CoreImage.load(rw.new_core)  # read back: a malformed rewrite is never applied
    return rw


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def apply(rw: Rewrite) -> int:
    """Put the new core.img in place and free the copies; returns the bytes
    freed (0 where the filesystem cannot punch holes: the pages stay, unused)."""
    os.replace(rw.new_core, rw.proc_dir / "core.img")
    forget_writer_digest(rw.proc_dir / "pages.img")  # its bytes change here
    fd = os.open(rw.proc_dir / "pages.img", os.O_WRONLY)
    freed = 0
    try:
        for off, length in rw.holes:
            if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length) != 0:
                break
            freed += length
    finally:
        os.close(fd)
    return freed


def discard(rw: Rewrite) -> None:
    rw.new_core.unlink(missing_ok=True)
