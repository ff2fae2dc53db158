"""Whether the shim can be preloaded into the program a job starts: refused
at launch, not at the first checkpoint (where "not running under the
shim" would come hours into a run).

The dynamic loader reads LD_PRELOAD, so a statically linked program (an ELF
without PT_INTERP, a static-pie included) never loads the shim; and a
set-user-ID or set-group-ID program that changes the job's ids runs in the
loader's secure mode, which ignores a preload from ckptd's directory.  Only
the program itself is checked (a script: its interpreter): what it execs
later is found at the first checkpoint, which is refused then.
"""

from __future__ import annotations

import os
import stat
import struct
from typing import BinaryIO

from ckptd.errors import CkptdError, Code

PT_INTERP = 3


def resolve(program: str, path_env: str, cwd: str) -> str | None:
    """The file execvp would run for program (None: not found; the launch
    then fails as it always did, with status 127)."""
    if "/" in program:
        full = os.path.join(cwd, program)
        return full if os.path.isfile(full) else None
    for d in (path_env or "/usr/local/bin:/usr/bin:/bin").split(":"):
        full = os.path.join(cwd, d or ".", program)
        if os.path.isfile(full) and os.access(full, os.X_OK):
            return full
    return None


def is_static_elf(head: bytes, f: BinaryIO) -> bool:
    """An ELF executable (head: its first 64 bytes or more) with no PT_INTERP program header."""
    if head[4] == 2:  # ELFCLASS64
        (phoff,) = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    else:
        (phoff,) = struct.unpack_from("<I", head, 0x1C)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x2A)
    f.seek(phoff)
    table = f.read(phentsize * phnum)
    for i in range(phnum):
        if len(table) >= (i + 1) * phentsize and struct.unpack_from("<I", table, i * phentsize)[0] == PT_INTERP:
            return False
    return True


def check_preloadable(argv0: str, path_env: str, cwd: str, uid: int, gid: int, *, depth: int = 0) -> None:
    """FAILED_PRECONDITION (exit 4) when the shim cannot be preloaded into
    the program argv0 names, run as uid:gid."""
    path = resolve(argv0, path_env, cwd)
    if path is None:
        return
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(256)  # an ELF header, or a script's #! line
            if head[:4] == b"\x7fELF" and len(head) >= 64 and is_static_elf(head, f):
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"{path} is statically linked: the ckptd shim cannot be preloaded into it, so it could never "
                    "be checkpointed; run a dynamically linked build",
                )
    except OSError:
        return  # unreadable: exec says what is wrong
    if (st.st_mode & stat.S_ISUID and st.st_uid != uid) or (st.st_mode & stat.S_ISGID and st.st_gid != gid):
        which = "set-user-ID" if st.st_mode & stat.S_ISUID and st.st_uid != uid else "set-group-ID"
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"{path} is {which}: the loader ignores the ckptd shim in it, so it could never be checkpointed; "
            "run a copy without that bit",
        )
    if head[:2] == b"#!" and depth == 0:  # a script: its interpreter is what runs
        words = head[2:].split(b"\n", 1)[0].split()
        if words:
            check_preloadable(words[0].decode(errors="replace"), path_env, cwd, uid, gid, depth=depth + 1)
