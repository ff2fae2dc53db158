"""Moving a committed checkpoint between tiers: a whole directory copied
file by file, memory images optionally zstd-compressed on the way up and
decompressed on the way down.

Every copy is durable before it is named: files are fsynced in a temporary
directory which the caller renames into place.  Holes (pages another rank's
image holds, see dedup.py) stay holes in a plain copy.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from ckptd.errors import CkptdError, Code

from .checksum import ALGORITHM, fsync_path
from .manifest import verify_files

CHUNK = 8 << 20
ZSTD_SUFFIX = ".zst"
UPLOAD_RECORD = "upload.json"  # in a shared-tier copy: how its files were stored
CODECS = ("", "zstd", "auto")
ZSTD_LEVEL = 1  # the fast end: compression must keep up with the disk
AUTO_SAMPLE = 4 << 20  # "auto" compresses a file when samples of it shrink ...
AUTO_SAMPLES = 8
AUTO_RATIO = 0.8  # ... below this fraction

Progress = Callable[[int], None]


@dataclass
class CopyReport:
    """What one tier copy did: logical bytes, bytes stored, files compressed."""

    bytes: int = 0
    stored: int = 0
    compressed: list[str] = field(default_factory=list)


def is_memory_image(rel: str) -> bool:
    return rel == "pages.img" or rel.endswith("/pages.img")


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            out.append(str((Path(dirpath) / name).relative_to(root)))
    return sorted(out)


def _copy_sparse(src: Path, dst: Path, progress: Progress | None) -> int:
    """Copy the data extents of src; holes stay holes.  Returns bytes copied."""
    copied = 0
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        size = os.fstat(fi.fileno()).st_size
        pos = 0
        in_kernel = True
        while pos < size:
            try:
                data = os.lseek(fi.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            if progress:  # a hole costs nothing, but counts as done
                progress(data - pos)
            end = os.lseek(fi.fileno(), data, os.SEEK_HOLE)
            off = data
            while off < end:
                n = _copy_range(fi.fileno(), fo.fileno(), min(end - off, CHUNK), off) if in_kernel else 0
                if n < 0:  # across filesystems (a local stage, a network tier): through this process
                    in_kernel = False
                if n <= 0 and not in_kernel:
                    chunk = os.pread(fi.fileno(), min(end - off, CHUNK), off)
                    n = os.pwrite(fo.fileno(), chunk, off) if chunk else 0
                if n <= 0:
                    raise OSError(f"short copy of {src} at {off}")
                off += n
                copied += n
                if progress:
                    progress(n)
            pos = end
        if progress and size > pos:
            progress(size - pos)
        os.ftruncate(fo.fileno(), size)
        os.fsync(fo.fileno())
    return copied


def _copy_range(fd_in: int, fd_out: int, count: int, off: int) -> int:
    """copy_file_range, or -1 where the kernel cannot copy between these two
    files (EXDEV: two filesystems, as a stage and a shared tier mostly are)."""
    try:
        return os.copy_file_range(fd_in, fd_out, count, off, off)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return -1
        raise


def worth_compressing(path: Path, write_bw: float = 0.0) -> bool:
    """ "auto": compress when samples spread over the file shrink below
    AUTO_RATIO (incompressible memory, random weights say, stays off the
    compressor) and the compressor, on half the cores, outruns write_bw, the
    bytes per second the last plain upload reached (0: not known yet), so
    compressing does not slow the upload down."""
    size = path.stat().st_size
    if size == 0:
        return False
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    raw = packed = 0
    busy = 0.0
    with open(path, "rb", buffering=0) as f:
        for i in range(AUTO_SAMPLES):
            f.seek(size * i // AUTO_SAMPLES)
            chunk = f.read(AUTO_SAMPLE)
            t0 = time.perf_counter()
            packed += len(cctx.compress(chunk))
            busy += time.perf_counter() - t0
            raw += len(chunk)
    if raw == 0 or packed >= raw * AUTO_RATIO:
        return False
    if not write_bw:
        return True
    # An upload reads, compresses and writes one chunk after the other, so
    # compressing pays off when the time it takes is less than the write
    # time it saves: size/speed < (1 - ratio) * size/write_bw.  The
    # compressor shares the cores with reading and writing: half of them.
    speed = raw / max(busy, 1e-9) * max(1, (os.cpu_count() or 1) // 2)
    return speed * (1 - packed / raw) > write_bw


def _compress(src: Path, dst: Path, progress: Progress | None) -> int:
    """zstd with one worker per core.  Returns the bytes written."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1, write_checksum=True)
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        with cctx.stream_writer(fo, closefd=False) as w:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while n := fi.readinto(buf):
                w.write(view[:n])
                if progress:
                    progress(n)
        fo.flush()
        os.fsync(fo.fileno())
        return fo.tell()


def _decompress(src: Path, dst: Path, progress: Progress | None) -> int:
    dctx = zstandard.ZstdDecompressor()
    written = 0
    with open(src, "rb") as fi, open(dst, "wb", buffering=0) as fo:
        reader = dctx.stream_reader(fi)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := reader.readinto(buf):
            fo.write(view[:n])
            written += n
            if progress:
                progress(n)
        os.fsync(fo.fileno())
    return written


def _sync_dirs(root: Path) -> None:
    for dirpath, _dirs, _names in os.walk(root, topdown=False):
        fsync_path(dirpath)


def upload_copy(
    src: Path, dst: Path, codec: str, progress: Progress | None = None, write_bw: float = 0.0
) -> CopyReport:
    """Copy checkpoint directory src into the new directory dst (the shared
    tier), compressing memory images by codec, and record how in
    dst/upload.json.  Everything is fsynced; the caller renames dst.
    write_bw: see worth_compressing."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    t0 = time.monotonic()
    report = CopyReport()
    for rel in _files(src):
        s, d = src / rel, dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        size = s.stat().st_size
        report.bytes += size
        if is_memory_image(rel) and (codec == "zstd" or (codec == "auto" and worth_compressing(s, write_bw))):
            report.stored += _compress(s, d.with_name(d.name + ZSTD_SUFFIX), progress)
            report.compressed.append(rel)
        else:
            report.stored += _copy_sparse(s, d, progress)
    record = {"codec": "zstd" if report.compressed else "", "compressed": report.compressed,
              "bytes": report.bytes, "stored_bytes": report.stored,
              "seconds": round(time.monotonic() - t0, 3)}  # fmt: skip
    with open(dst / UPLOAD_RECORD, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _sync_dirs(dst)
    return report


def tree_bytes(root: Path) -> int:
    """The apparent size of every file under root: a transfer's total."""
    return sum((root / rel).stat().st_size for rel in _files(root))


def read_upload_record(path: Path) -> dict:
    try:
        data = json.loads((path / UPLOAD_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def fetch_copy(src: Path, dst: Path, progress: Progress | None = None) -> CopyReport:
    """The way down: copy shared-tier checkpoint src into the new directory
    dst as it was committed on the stage (memory images decompressed,
    upload.json left behind).  Everything is fsynced; the caller renames dst."""
    compressed = set(read_upload_record(src).get("compressed", []))
    report = CopyReport()
    for rel in _files(src):
        if rel == UPLOAD_RECORD:
            continue
        s = src / rel
        plain = rel.removesuffix(ZSTD_SUFFIX)
        (dst / plain).parent.mkdir(parents=True, exist_ok=True)
        if plain != rel and plain in compressed:
            report.bytes += _decompress(s, dst / plain, progress)
            report.compressed.append(plain)
        else:
            report.bytes += _copy_sparse(s, dst / rel, progress)
        report.stored += s.stat().st_size
    _sync_dirs(dst)
    return report


def verify_shared_copy(directory: Path, manifest: dict) -> None:
    """`ckptctl inspect --verify` of a shared-tier copy: every file the
    manifest lists, its compressed memory images decompressed on the fly,
    of its size and checksum."""
    import xxhash

    compressed = set(read_upload_record(directory).get("compressed", []))
    plain = dict(manifest, files=[e for e in manifest.get("files", []) if e["path"] not in compressed])
    verify_files(directory, plain)
    hint = "its stage copy, or an earlier checkpoint (--from ID), may still be whole"
    for entry in manifest.get("files", []):
        if entry["path"] not in compressed:
            continue
        h, size = xxhash.xxh3_128(), 0
        try:
            with open(directory / (entry["path"] + ZSTD_SUFFIX), "rb") as f:
                reader = zstandard.ZstdDecompressor().stream_reader(f)
                while chunk := reader.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
        except (OSError, zstandard.ZstdError) as e:
            raise CkptdError(
                Code.DATA_LOSS,
                f"shared copy {directory.name}: {entry['path']}{ZSTD_SUFFIX} is unreadable ({e}); {hint}",
            ) from None
        if size != entry["size"] or h.hexdigest() != entry[ALGORITHM]:
            raise CkptdError(
                Code.DATA_LOSS, f"shared copy {directory.name}: {entry['path']} fails its checksum; {hint}"
            )
