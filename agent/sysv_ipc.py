"""System V IPC: every object of a job's IPC namespace, saved once for the job.

A root job runs in its own IPC namespace (ckptd-init makes it), so every
shared memory segment, semaphore set and message queue in it is the job's.
At the dump step, while every process is parked, the agent saves them all
into the checkpoint's (rank's) directory, under sysv-ipc/: objects.json
(each object's key, id, mode, owner and size) and one data file each (a
segment's bytes, a set's values, a queue's messages in order with their
types, read with msgrcv(MSG_COPY), which leaves them queued).  The restore
plan (ckptd/image/plan/sysv.py) makes them again under the same ids in the
restore's fresh IPC namespace (native/restorer/plan_sysv.c); each process
attaches its segments at their old addresses itself (restorer/mem.c).

Reading them needs the job's namespace: a short child process (this module
run as a program) joins it with setns(), so the agent's own threads never
change namespace.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.image.core import CoreImage, constant

DIR = "sysv-ipc"
CLONE_NEWIPC = 0x08000000
IPC_NOWAIT = 0o4000
MSG_COPY = 0o40000
IPC_RMID = 0
IPC_STAT = 2
GETALL = 13
SHM_RDONLY = 0o10000
SHM_DEST = 0o1000
SHM_INFO, SEM_INFO, MSG_INFO = 14, 19, 12
_MSQID_DS_SIZE, _MSG_QBYTES_OFF = 120, 88  # struct msqid_ds on x86_64


def own_namespace(host_pid: int) -> bool:
    """Whether the process is in an IPC namespace of its own (not the agent's)."""
    try:
        return os.stat(f"/proc/{host_pid}/ns/ipc").st_ino != os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        return False


def holds_objects(host_pid: int) -> bool:
    """Whether host_pid's IPC namespace holds any object, asked from a
    thread of its own that joins the namespace and ends (it changes no
    other thread's namespace): the kernel's counts, *ctl(*_INFO).  Most jobs
    hold none, and starting the saving child (a Python interpreter, about
    0.1 s of CPU) in every rank's pause would make the stall grow with the
    ranks sharing a node's cores.  True when it cannot tell."""
    answer = [True]

    def ask() -> None:
        try:
            libc = _join(host_pid)
        except OSError:
            return
        info = (ctypes.c_int * 64)()  # larger than struct shm_info, seminfo and msginfo
        # shm_info.used_ids, seminfo.semusz, msginfo.msgpool: the objects that exist (man 2 shmctl)
        counts = []
        for call, args, at in (
            (libc.shmctl, (0, SHM_INFO, info), 0),
            (libc.semctl, (0, 0, SEM_INFO, info), 7),
            (libc.msgctl, (0, MSG_INFO, info), 0),
        ):
            if call(*args) < 0:
                return
            counts.append(info[at])
        answer[0] = any(counts)

    t = threading.Thread(target=ask, name="ckptd-ipc-count", daemon=True)
    t.start()
    t.join()
    return answer[0]


def _helper(args: list[str], failed: str) -> None:
    """This module run as a child (`python -m ckptd.agent.sysv_ipc ARGS`),
    which joins the job's IPC namespace for good (the agent never does);
    its last line of stderr goes into the error."""
    r = subprocess.run(
        [sys.executable, "-m", "ckptd.agent.sysv_ipc", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",  # python -m looks in the working directory first: a source tree there would shadow ckptd
    )
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise CkptdError(Code.FAILED_PRECONDITION, f"{failed}: {why}")


def save(host_pid: int, directory: Path, encrypted: bool = False) -> None:
    """Save the objects of host_pid's IPC namespace into directory/sysv-ipc
    (nothing when it holds none, or is not the job's own)."""
    if not own_namespace(host_pid) or not holds_objects(host_pid):
        return
    _helper([str(host_pid), str(directory)], "cannot save the job's System V IPC objects")
    saved = directory / DIR
    if encrypted and saved.exists():
        shutil.rmtree(saved)
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            "the job holds System V IPC objects, which ckptd does not encrypt yet: checkpoint it without --encrypt",
        )


def check_sem_undo(cores: list[CoreImage]) -> None:
    """Refuse a checkpoint whose SEM_UNDO adjustments the shims cannot know:
    a SETVAL, SETALL or IPC_RMID clears every process's adjustments on the
    set in the kernel, but only the caller's shim sees it (native/shim/eintr.c).
    A clear that came after another process's adjustment began leaves that
    process's shim with an adjustment the kernel no longer has."""
    adj = constant("CK_SEM_UNDO_ADJ")
    clears: list[tuple[int, int, str]] = []  # (semid, when, by whom) of each process's last clear of a set
    begun: list[tuple[int, int, str]] = []  # (semid, when, whose) of every adjustment
    for core in cores:
        who = f"pid {int(core.proc.pid)} in the job ({core.string(core.proc.exe) or '?'})"
        for u in core.sem_undo():
            if u["kind"] == adj:
                begun.append((u["semid"], u["ns"], who))
            else:
                clears.append((u["semid"], u["ns"], who))
    for (semid, ns, who), (cleared, at, by) in itertools.product(begun, clears):
        if cleared in (semid, -1) and at > ns and by != who:
            which = f"set {semid}" if cleared >= 0 else f"set {semid} (or another of many)"
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"{by} set or removed System V semaphore {which} after {who} changed it with SEM_UNDO: "
                "ckptd cannot know that process's undo adjustment now",
            )


def remove_destroyed(host_pid: int, directory: Path) -> None:
    """After a restore, once every process has attached its segments again:
    remove (IPC_RMID) those that had been removed while still attached, so
    that they go with their last detach, as they would have."""
    path = directory / DIR / "objects.json"
    if not path.exists():
        return
    ids = [str(o["id"]) for o in json.loads(path.read_text()).get("shm", []) if o.get("removed")]
    if not ids:
        return
    _helper(["--remove", str(host_pid), *ids], "cannot remove the job's removed System V segments again")


def _table(name: str) -> list[dict[str, int]]:
    """/proc/sysvipc/NAME, as the reader's IPC namespace has it: one dict per object."""
    lines = Path(f"/proc/sysvipc/{name}").read_text().splitlines()
    head = lines[0].split()
    rows = []
    for line in lines[1:]:
        row = dict(zip(head, line.split(), strict=False))
        rows.append({k: int(v, 8) if k == "perms" else int(v) for k, v in row.items()})
    return rows


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    libc.msgrcv.restype = ctypes.c_ssize_t
    libc.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
    return libc


def _fail(what: str, ident: int) -> None:
    err = ctypes.get_errno()
    sys.exit(f"{what} {ident}: {os.strerror(err)}")


def _common(row: dict[str, int], ident: str) -> dict[str, Any]:
    return {
        "id": row[ident],
        "key": row["key"] & 0xFFFFFFFF,
        "mode": row["perms"],
        "uid": row["uid"],
        "gid": row["gid"],
    }


def _dump(out: Path) -> dict[str, list[dict[str, Any]]]:
    libc = _libc()
    objects: dict[str, list[dict[str, Any]]] = {"shm": [], "sem": [], "msg": []}
    for row in _table("shm"):
        obj = dict(_common(row, "shmid"), size=row["size"], file=f"shm-{row['shmid']}.data")
        if row["perms"] & SHM_DEST:  # removed while attached: removed again once attached (remove_destroyed)
            obj["removed"] = True
        addr = libc.shmat(row["shmid"], None, SHM_RDONLY)
        if addr in (None, ctypes.c_void_p(-1).value):
            _fail("cannot attach System V shared memory segment", row["shmid"])
        try:
            (out / obj["file"]).write_bytes(ctypes.string_at(addr, row["size"]))
        finally:
            libc.shmdt(ctypes.c_void_p(addr))
        objects["shm"].append(obj)
    for row in _table("sem"):
        values = (ctypes.c_ushort * row["nsems"])()
        if libc.semctl(row["semid"], 0, GETALL, values) < 0:
            _fail("cannot read System V semaphore set", row["semid"])
        obj = dict(_common(row, "semid"), nsems=row["nsems"], file=f"sem-{row['semid']}.data")
        (out / obj["file"]).write_bytes(bytes(values))
        objects["sem"].append(obj)
    for row in _table("msg"):
        ds = ctypes.create_string_buffer(_MSQID_DS_SIZE)
        if libc.msgctl(row["msqid"], IPC_STAT, ds) < 0:
            _fail("cannot read System V message queue", row["msqid"])
        qbytes = int.from_bytes(ds.raw[_MSG_QBYTES_OFF : _MSG_QBYTES_OFF + 8], "little")
        buf = ctypes.create_string_buffer(8 + max(row["cbytes"], 1))
        records = bytearray()
        for i in range(row["qnum"]):  # the i-th message, left in the queue
            n = libc.msgrcv(row["msqid"], buf, row["cbytes"], i, IPC_NOWAIT | MSG_COPY)
            if n < 0:
                _fail("cannot read the messages of System V message queue", row["msqid"])
            records += buf.raw[:8] + n.to_bytes(8, "little") + buf.raw[8 : 8 + n] + bytes(-n % 8)
        obj = dict(_common(row, "msqid"), qbytes=qbytes, count=row["qnum"], file=f"msg-{row['msqid']}.data")
        (out / obj["file"]).write_bytes(bytes(records))
        objects["msg"].append(obj)
    return objects


def _join(host_pid: int) -> Any:
    """This thread into host_pid's IPC namespace; the libc that asks it.
    OSError if it cannot join."""
    libc = _libc()
    fd = os.open(f"/proc/{host_pid}/ns/ipc", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWIPC) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)
    return libc


def _joined(host_pid: int) -> Any:
    """_join, in the child: a failure ends it with its reason."""
    try:
        return _join(host_pid)
    except OSError as e:
        sys.exit(f"cannot join the IPC namespace of process {host_pid}: {e.strerror}")


def main(argv: list[str]) -> None:
    if argv[0] == "--remove":
        libc = _joined(int(argv[1]))
        for shmid in argv[2:]:
            if libc.shmctl(int(shmid), IPC_RMID, None) < 0:
                _fail("cannot remove System V shared memory segment", int(shmid))
        return
    host_pid, directory = int(argv[0]), Path(argv[1])
    _joined(host_pid)
    out = directory / DIR
    out.mkdir(exist_ok=True)
    objects = _dump(out)
    if not any(objects.values()):
        out.rmdir()
        return
    (out / "objects.json").write_text(json.dumps(objects, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
