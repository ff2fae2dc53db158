"""Reading core.img through cffi, using the very header the C code is built with.

native/include/ckptd/image_format.h is the single definition of the layout:
the shim writes it, the restorer reads it, and this module hands the part
between its CFFI markers to cffi.cdef(), so the three cannot drift apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cffi import FFI

from ckptd.errors import CkptdError, Code
from ckptd.native import image_format_header

from .sockaddr import endpoint, show_endpoint

_BEGIN = "/* BEGIN CFFI */"
_END = "/* END CFFI */"

SECTIONS = {
    "proc": ("CK_SEC_PROC", "struct ck_proc"),
    "threads": ("CK_SEC_THREADS", "struct ck_thread"),
    "vmas": ("CK_SEC_VMAS", "struct ck_vma"),
    "runs": ("CK_SEC_RUNS", "struct ck_page_run"),
    "fds": ("CK_SEC_FDS", "struct ck_fd"),
    "epoll": ("CK_SEC_EPOLL", "struct ck_epoll_target"),
    "sigacts": ("CK_SEC_SIGACTS", "struct ck_sigaction"),
    "rlimits": ("CK_SEC_RLIMITS", "struct ck_rlimit"),
    "pending": ("CK_SEC_PENDING", "struct ck_pending"),
    "files": ("CK_SEC_FILES", "struct ck_file"),
    "sources": ("CK_SEC_SOURCES", "struct ck_page_source"),
}
BYTE_SECTIONS = {"auxv": "CK_SEC_AUXV", "strings": "CK_SEC_STRINGS", "blob": "CK_SEC_BLOB"}


@functools.cache
def ffi(header: Path | None = None) -> Any:
    text = (header or image_format_header()).read_text()
    start, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
    f = FFI()
    f.cdef(text[start:end])
    return f


@functools.cache
def _lib() -> Any:
    return ffi().dlopen(None)


def warm() -> None:
    """Parse the format's declarations, and the types reading a core.img
    names, now: the first time costs one core 70-90 ms (cffi's C parser),
    which an agent pays at its start rather than in a job's first
    checkpoint (finalize reads every process's core.img: agent/sysv_ipc.py
    check_sem_undo, the manifest's process records)."""
    f = ffi()
    _lib()
    for ctype in ("struct ck_header", "struct ck_sem_undo", *(t for _, t in SECTIONS.values())):
        f.sizeof(ctype)
        f.typeof(f"{ctype} *")
        f.typeof(f"{ctype}[]")


def constant(name: str) -> int:
    return int(getattr(_lib(), name))


def to_python(value: Any) -> Any:
    """A cffi struct/array as plain dicts, lists and ints."""
    f = ffi()
    t = f.typeof(value)
    if t.kind == "struct":
        return {name: to_python(getattr(value, name)) for name, _ in t.fields}
    if t.kind == "array":
        if t.item.cname == "char":
            return f.string(value).decode(errors="replace")
        return [to_python(v) for v in value]
    return value


def _in_jobs_proc(path: str) -> bool:
    """A path under the job's own /proc (ckptd-init mounts one for the job's
    pid namespace): /proc/7/status is the job's pid 7, never the host's, so
    nothing to compare with the host's files; the restorer reopens it once
    the whole tree exists (native/restorer/plan_tree.c)."""
    return path == "/proc" or path.startswith("/proc/")


@dataclass
class CoreImage:
    """One process's core.img, parsed."""

    path: Path
    data: bytes
    header: Any
    records: dict[str, list[Any]]
    blobs: dict[str, bytes]

    @property
    def proc(self) -> Any:
        return self.records["proc"][0]

    def string(self, offset: int) -> str:
        strings = self.blobs["strings"]
        if offset <= 0 or offset >= len(strings):
            return ""
        end = strings.index(b"\0", offset)
        return strings[offset:end].decode(errors="surrogateescape")

    @classmethod
    def load(cls, path: Path) -> CoreImage:
        f = ffi()
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CkptdError(Code.DATA_LOSS, f"cannot read {path}: {e.strerror}") from e
        hsize = f.sizeof("struct ck_header")
        if len(data) < hsize:
            raise CkptdError(Code.DATA_LOSS, f"{path} is truncated")
        header = f.from_buffer("struct ck_header *", data)
        if header.magic != constant("CK_CORE_MAGIC") or header.version != constant("CK_CORE_VERSION"):
            raise CkptdError(
                Code.DATA_LOSS,
                f"{path} is not a version-{constant('CK_CORE_VERSION')} ckptd core image "
                "(written by another ckptd version?)",
            )
        if header.file_size != len(data):
            raise CkptdError(Code.DATA_LOSS, f"{path} has the wrong size (truncated?)")
        by_type = {}
        for i in range(min(header.nsections, constant("CK_MAX_SECTIONS"))):
            s = header.sections[i]
            if s.offset + s.size > len(data):
                raise CkptdError(Code.DATA_LOSS, f"{path}: a section lies outside the file")
            by_type[s.type] = s
        records: dict[str, list[Any]] = {}
        for key, (const, ctype) in SECTIONS.items():
            s = by_type.get(constant(const))
            if s is None:
                records[key] = []
                continue
            size = f.sizeof(ctype)
            if s.size != s.count * size:
                raise CkptdError(Code.DATA_LOSS, f"{path}: section {key} has the wrong record size")
            base = f.from_buffer(f"{ctype}[]", memoryview(data)[s.offset : s.offset + s.size])
            records[key] = [base[i] for i in range(s.count)]
        blobs = {}
        for key, const in BYTE_SECTIONS.items():
            s = by_type.get(constant(const))
            blobs[key] = data[s.offset : s.offset + s.size] if s else b""
        if not records["proc"]:
            raise CkptdError(Code.DATA_LOSS, f"{path} has no process record")
        return cls(path=path, data=data, header=header, records=records, blobs=blobs)

    def blob_bytes(self, off: int, length: int) -> bytes:
        """length bytes of the BLOB section (socket addresses, names) from off."""
        return bytes(self.blobs["blob"][off : off + length]) if length else b""

    def sem_undo(self) -> list[dict[str, int]]:
        """The process's System V semaphore undo adjustments and clears (struct ck_sem_undo, shim/eintr.c)."""
        f = ffi()
        n, off = int(self.proc.nsemundo), int(self.proc.semundo_off)
        size = f.sizeof("struct ck_sem_undo")
        raw = self.blob_bytes(off, n * size)
        if len(raw) != n * size:
            raise CkptdError(Code.DATA_LOSS, f"{self.path}: the semaphore undo adjustments lie outside the image")
        out = []
        for i in range(n):
            u = f.from_buffer("struct ck_sem_undo *", bytearray(raw[i * size : (i + 1) * size]))
            out.append(
                {
                    "semid": int(u.semid),
                    "semnum": int(u.semnum),
                    "adj": int(u.adj),
                    "kind": int(u.kind),
                    "ns": int(u.ns),
                }
            )
        return out

    def blob_file_offset(self) -> int:
        """Where the BLOB section starts in core.img (queued pipe and socket data)."""
        for i in range(min(self.header.nsections, constant("CK_MAX_SECTIONS"))):
            s = self.header.sections[i]
            if s.type == constant("CK_SEC_BLOB"):
                return int(s.offset)
        return 0

    # ---- views used by the agent and `ckptctl inspect` ----

    def mapped_files(self) -> list[dict[str, Any]]:
        """Files mapped from disk (libraries, the executable, memory-mapped data)."""
        out: dict[str, dict[str, Any]] = {}
        prot_exec = 0x4
        for v in self.records["vmas"]:
            if not v.flags & constant("CK_VMA_FILE"):
                continue
            path = self.string(v.path)
            if _in_jobs_proc(path):
                continue
            entry = out.setdefault(
                path,
                {"path": path, "size": v.file_size, "mtime_ns": v.mtime_ns, "executable": False},
            )
            entry["executable"] = entry["executable"] or bool(v.prot & prot_exec)
        return list(out.values())

    def read_files(self) -> list[dict[str, Any]]:
        """Regular files open read-only: they must not change before a restart."""
        out = {}
        for fd in self.records["fds"]:
            if fd.type == constant("CK_FD_REG") and not fd.flags & constant("CK_FDF_WRITTEN"):
                path = self.string(fd.path)
                if not _in_jobs_proc(path):
                    out[path] = {"path": path, "size": fd.size, "mtime_ns": fd.mtime_ns}
        return list(out.values())

    def written_files(self) -> list[dict[str, Any]]:
        return [
            {
                "path": self.string(f.path),
                "size": f.size,
                "mode": f.mode,
                "mtime_ns": f.mtime_ns,
                "index": f.index,
                "saved": bool(f.flags & constant("CK_FILE_CONTENT_SAVED")),
            }
            for f in self.records["files"]
        ]

    def _fd_target(self, fd: Any) -> str:
        """What a descriptor points at, as `ckptctl inspect` shows it."""
        if fd.type == constant("CK_FD_TCP"):
            local = show_endpoint(endpoint(self.blob_bytes(int(fd.name_off), int(fd.name_len))))
            if fd.sock_state == constant("CK_SOCK_LISTEN"):
                return f"listening on {local}"
            if fd.sock_state == constant("CK_SOCK_CONNECTED"):
                peer = show_endpoint(endpoint(self.blob_bytes(int(fd.peer_off), int(fd.peer_len))))
                return f"{local} -> {peer}"
            return f"unconnected, {local}"
        if fd.type in (constant("CK_FD_UDP"), constant("CK_FD_RAW")):
            local = show_endpoint(endpoint(self.blob_bytes(int(fd.name_off), int(fd.name_len))))
            if fd.peer_len:
                return f"{local} -> {show_endpoint(endpoint(self.blob_bytes(int(fd.peer_off), int(fd.peer_len))))}"
            return local
        if fd.type == constant("CK_FD_UNIX") and fd.name_len:
            name = self.blob_bytes(int(fd.name_off), int(fd.name_len))
            # abstract names start with a NUL; path names end with one
            abstract = name[:1] == b"\0"
            shown = "@" + name[1:].decode(errors="replace") if abstract else name.rstrip(b"\0").decode(errors="replace")
            return f"{self.string(fd.path)} {shown}"
        return self.string(fd.path)

    def page_sources(self) -> list[dict[str, Any]]:
        """Earlier checkpoints' pages files this (incremental) image reads:
        path relative to the job's checkpoint directory, and expected size."""
        return [{"path": self.string(s.path), "size": int(s.size)} for s in self.records["sources"]]

    def summary(self) -> dict[str, Any]:
        p = self.proc
        return {
            "pid": p.pid,
            "exe": self.string(p.exe),
            "cwd": self.string(p.cwd),
            "threads": len(self.records["threads"]),
            "tids": [t.tid for t in self.records["threads"]],
            "vmas": len(self.records["vmas"]),
            "page_runs": len(self.records["runs"]),
            "pages_bytes": self.header.pages_size,
            "page_sources": self.page_sources(),
            "ppid": p.ppid,
            "fds": [
                {"fd": fd.fd, "type": _fd_type_name(fd.type), "target": self._fd_target(fd)}
                for fd in self.records["fds"]
            ],
            "written_files": len(self.records["files"]),
        }


def _fd_type_name(t: int) -> str:
    names = {
        "CK_FD_REG": "file",
        "CK_FD_DIR": "directory",
        "CK_FD_CHR": "device",
        "CK_FD_PIPE": "pipe",
        "CK_FD_EVENTFD": "eventfd",
        "CK_FD_EPOLL": "epoll",
        "CK_FD_STDIO": "stdio (reconnected to the log)",
        "CK_FD_DUP": "dup",
        "CK_FD_UNIX": "unix socket",
        "CK_FD_SHMEM": "shared memory",
        "CK_FD_TCP": "TCP socket",
        "CK_FD_OPATH": "O_PATH",
        "CK_FD_DELETED": "deleted file",
        "CK_FD_TIMERFD": "timerfd",
        "CK_FD_SIGNALFD": "signalfd",
        "CK_FD_PIDFD": "pidfd",
        "CK_FD_INOTIFY": "inotify",
        "CK_FD_UDP": "UDP socket",
        "CK_FD_RAW": "raw socket",
        "CK_FD_PTY_MASTER": "pseudo-terminal master",
        "CK_FD_PTY_SLAVE": "pseudo-terminal slave",
    }
    for const, name in names.items():
        if constant(const) == t:
            return name
    return f"type {t}"
