"""System V IPC: the objects of the job's own IPC namespace (shared memory
segments, semaphore sets, message queues), saved once for the job by the
agent (agent/sysv_ipc.py: sysv-ipc/objects.json and a data file each) and
made again under their old ids, filled, before the tree is forked
(native/restorer/plan_sysv.c).  Each process attaches its segments again
itself (restorer/mem.c), by id: no slot is needed.  An attachment whose
segment was not saved (a job sharing the host's IPC namespace: one run in a
user namespace) is refused."""

from __future__ import annotations

import json
from typing import Any

from ..core import constant
from .planner import Kind, PlanError, Planner, ProcessImage, Steps, hex_arg

OBJECTS = "sysv-ipc/objects.json"


class SysvIpc(Kind):
    def __init__(self, planner: Planner) -> None:
        super().__init__(planner)
        self.attached: dict[int, ProcessImage] = {}  # shmid -> a process that has it attached

    def gather_vma(self, p: ProcessImage, v: Any) -> None:
        if v.flags & constant("CK_VMA_SYSV"):
            self.attached.setdefault(int(v.ino), p)

    def plan(self, st: Steps) -> None:
        if not self.planner.procs:
            return
        base = self.planner.procs[0].dir.parent
        path = base / OBJECTS
        objects: dict[str, list[dict[str, Any]]] = json.loads(path.read_text()) if path.exists() else {}
        saved = {int(o["id"]) for o in objects.get("shm", [])}
        for shmid, p in sorted(self.attached.items()):
            if shmid not in saved:
                raise PlanError(
                    f"{p.label()} has System V shared memory attached (shmid {shmid}): ckptd saves System V "
                    "IPC only for a job in its own IPC namespace (a job run as root)"
                )

        def data(o: dict[str, Any]) -> str:
            return hex_arg(str(path.parent / str(o["file"])))

        for o in objects.get("shm", []):
            st.create.append(f"sysvshm {_head(o)} {int(o['size'])} {data(o)}")
        for o in objects.get("sem", []):
            st.create.append(f"sysvsem {_head(o)} {int(o['nsems'])} {data(o)}")
        for o in objects.get("msg", []):
            st.create.append(f"sysvmsg {_head(o)} {int(o['qbytes'])} {int(o['count'])} {data(o)}")


def _head(o: dict[str, Any]) -> str:
    return f"{int(o['id'])} {int(o['key'])} {int(o['mode'])} {int(o['uid'])} {int(o['gid'])}"
