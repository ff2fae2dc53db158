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

Under launch --dedup the writers of ranks other than 0 compare as they
write (native/shim/writeout_dedup.c): the agent hands each writer rank 0's
pages (`write_spec`, the tool's "peer" and "run" lines), and the writer
leaves the pages rank 0 holds alike as holes and lists them in pages.match,
in the tool's words.  `plan` then takes those matches instead of running
the tool, and a process whose image cannot refer to rank 0's pages after
all gets them copied back from rank 0's files into its holes (`fill`), so
that it keeps an image as complete as one written without --dedup.
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

from .checksum import WRITER_XATTR, forget_writer_digest, writer_digest
from .core import CoreImage, constant, ffi

PAGE = 4096
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
DEDUP_SUFFIX = ".dedup"
TOOL = "ckptd-dedup"
SPEC = "dedup.spec"  # the agent -> the writer (writeout_dedup.c)
WRITER_MATCHES = "pages.match"  # the writer -> the agent
PROGRESS = "pages.progress"  # rank 0's writer -> the other ranks' writers
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
            lines += [f"run {off} {n}" for off, n in sorted(runs)]  # the writer reads them in file order
        return "\n".join(lines) + "\n"

    def settle(self) -> None:
        """Once rank 0's writers are done: the sizes its files have now.
        Raises OSError for one that is not there (its writer failed)."""
        self.files = [(final, path.stat().st_size) for (final, _), path in zip(self.files, self.paths, strict=True)]


def _stored_runs(core: CoreImage) -> list[tuple[int, int]]:
    """(offset, npages) of the runs an image holds in its own pages.img
    (not by reference to another image's)."""
    return [(int(r.offset), int(r.npages)) for r in core.records["runs"] if not r.src and int(r.npages)]


def index_peer(peer_dir: Path, peer_final: str, *, written: bool = True) -> PeerPages:
    """peer_dir: rank 0's directory of this round; peer_final: where it will
    be, relative to the job's directory (ckpt-000004/rank-0).  written=False:
    its writers may still be writing (their sizes are where their runs end
    until `settle`)."""
    peer = PeerPages()
    for proc in sorted(peer_dir.glob("proc-*")):
        core = CoreImage.load(proc / "core.img")
        runs = _stored_runs(core)
        if not runs:
            continue
        size = (proc / "pages.img").stat().st_size if written else max(off + n * PAGE for off, n in runs)
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
    missing: list[Match] = field(default_factory=list)  # left out by the writer, not referred to: fill first

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
    return _parse_matches(out, peer, TOOL)


def _parse_matches(out: list[str], peer: PeerPages, who: str) -> tuple[list[Match], str | None]:
    """The tool's (or the writer's) answer, its "done" line last."""
    if not out or not out[-1].startswith("done "):
        raise CkptdError(Code.INTERNAL, f"{who} did not finish its list of matches")
    matches: list[Match] = []
    digest = None
    for line in out[:-1]:
        word, *rest = line.split()
        if word == "digest" and len(rest) == 2:
            digest = " ".join(rest)
            continue
        try:
            own, f, off, n = (int(x) for x in rest)
        except ValueError:
            raise CkptdError(Code.INTERNAL, f"{who} answered {line!r}") from None
        if word != "match" or not 0 <= f < len(peer.files) or n <= 0 or own % PAGE or off % PAGE:
            raise CkptdError(Code.INTERNAL, f"{who} answered {line!r}")
        matches.append((own, f, off, n))
    matches.sort()
    return matches, digest


# Filesystems whose pages every process of this machine sees through one
# page cache, as soon as they are written: the only ones where a writer may
# compare with rank 0's pages while rank 0's writer writes them.  On a
# network filesystem a client may keep a page it read ahead before it was
# written; there the comparison comes after rank 0 is done (the tool).
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "overlay", "zfs"})


def compared_while_written(path: Path) -> bool:
    """Whether path lies on a filesystem in LOCAL_FILESYSTEMS (the mount
    that holds it, as /proc/self/mountinfo lists it)."""
    best, fstype = "", ""
    target = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, right.split()[0]
    return fstype in LOCAL_FILESYSTEMS


def write_spec(proc_dir: Path, peer: PeerPages | None) -> None:
    """Hand a process's writer rank 0's pages (or None: write them all).
    The agent writes it as root into a directory the job's user owns: made
    beside it with O_EXCL | O_NOFOLLOW (never through a link the job left)
    and renamed into place, so that the writer reads it whole."""
    text = (peer.spec() if peer is not None and peer.files else "none\n").encode()
    dfd = os.open(proc_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        part = SPEC + ".part"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part, dir_fd=dfd)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        os.rename(part, SPEC, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def forget_spec(proc_dir: Path) -> None:
    """Once the writer is done: the checkpoint holds nothing the agent wrote there."""
    for name in (SPEC, SPEC + ".part"):
        (proc_dir / name).unlink(missing_ok=True)


def writer_matches(proc_dir: Path, peer: PeerPages) -> tuple[list[Match], str] | None:
    """The pages the process's writer left out (pages.match), or None if it
    wrote every page; with its last line, for the agent's log: "done
    INDEXED HASHED MATCHED" (pages), then the milliseconds it spent in all,
    waiting for rank 0's writers, and hashing their pages (waits
    included).  Raises CkptdError for a list it did not finish."""
    path = proc_dir / WRITER_MATCHES
    try:
        out = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    return _parse_matches(out, peer, "the writer")[0], out[-1]


def fill(proc_dir: Path, peer: PeerPages, matches: list[Match]) -> None:
    """Copy pages a writer left out back from rank 0's files into their
    holes: the image is then complete on its own.  Its writer's digest
    (which read the holes as zeros) no longer holds."""
    pages = proc_dir / "pages.img"
    forget_writer_digest(pages)
    out = os.open(pages, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for own, f, off, n in matches:
            src = os.open(peer.paths[f], os.O_RDONLY | os.O_CLOEXEC)
            try:
                done = 0
                while done < n * PAGE:
                    k = os.copy_file_range(src, out, n * PAGE - done, off + done, own + done)
                    if k <= 0:
                        raise OSError(5, f"rank 0's {peer.paths[f]} ends early")
                    done += k
            finally:
                os.close(src)
    finally:
        os.close(out)


def _runs_of(
    core: CoreImage,
    peer: PeerPages,
    pages: Path,
    sources: list[dict[str, Any]],
    found: tuple[list[Match], str | None] | None,
) -> Any:
    """The image's runs with every stretch rank 0 holds alike (found: the
    writer's matches and digest; None: ask the tool) turned into a
    reference; returns (runs as tuples, per-VMA (first, count), holes,
    bytes, the sources to add, the digest of pages once punched, the
    matches not turned into references)."""
    own_runs = _stored_runs(core)
    if found is None:
        found = find_matches(peer, pages, own_runs) if own_runs else ([], None)
    matches, digest = found
    kept: list[Match] = []
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
                    kept.append((own, f, off, n))
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
    return runs, vma_runs, holes, deduped, new_sources, digest, kept


def _section_bytes(core: CoreImage, type_const: str) -> bytes:
    for i in range(min(core.header.nsections, constant("CK_MAX_SECTIONS"))):
        s = core.header.sections[i]
        if s.type == constant(type_const):
            return bytes(core.data[s.offset : s.offset + s.size])
    return b""


def plan(proc_dir: Path, peer: PeerPages, left_out: list[Match] | None = None) -> Rewrite | None:
    """Write core.img.dedup for one process image; None if rank 0 holds
    none of its pages.  left_out: the pages its writer did not write (it
    compared them itself), which the new image must refer to or get back
    (Rewrite.missing); None: ckptd-dedup compares the written image."""
    core = CoreImage.load(proc_dir / "core.img")
    pages = proc_dir / "pages.img"
    if not pages.stat().st_size:
        return None
    sources = core.page_sources()
    found = None
    if left_out is not None:  # its writer hashed it with the holes read as zeros: the file once punched
        digest = writer_digest(pages)
        found = (left_out, f"{digest} {pages.stat().st_size}" if digest else None)
    runs, vma_runs, holes, deduped, new_sources, digest, kept = _runs_of(core, peer, pages, sources, found)
    if not deduped:
        if kept:  # none became a reference: the caller fills them all
            raise CkptdError(Code.INTERNAL, "no room in core.img for rank 0's pages")
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
    rw = Rewrite(proc_dir, deduped, holes, digest, kept if left_out is not None else [])
    rw.new_core.write_bytes(bytes(data))
    CoreImage.load(rw.new_core)  # read back: a malformed rewrite is never applied
    return rw


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def apply(rw: Rewrite, peer: PeerPages) -> int:
    """Put the new core.img in place and free the copies; returns the bytes
    freed (0 where the filesystem cannot punch holes: the pages stay, unused).
    With every hole punched, pages.img gets the digest ckptd-dedup computed
    for it as its writer's (checksum.WRITER_XATTR): finalize need not read
    it all again to hash it."""
    forget_writer_digest(rw.proc_dir / "pages.img")  # its bytes change here
    if rw.missing:
        fill(rw.proc_dir, peer, rw.missing)
    os.replace(rw.new_core, rw.proc_dir / "core.img")
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
