"""System V IPC: the objects of the job's own IPC namespace (shared memory
segments, semaphore sets, message queues), saved once for the job by the
agent (agent/sysv_ipc.py: sysv-ipc/objects.json and a data file each) and
made again under their old ids, filled, before the tree is forked
(native/restorer/plan_sysv.c).  Each process attaches its segments again
itself (restorer/mem.c), by id: no slot is needed.  An attachment whose
segment was not saved (a job sharing the host's IPC namespace: one run in a
user namespace) is refused.

SEM_UNDO: each process's adjustments (semadj, tracked by the shim,
native/shim/eintr.c) are added to its sets' values here; each process's
restorer then takes its own back with a semop with SEM_UNDO
(native/restorer/semundo.c), which leaves the saved values and gives it
its adjustments again."""

from __future__ import annotations

import json
import struct
from typing import Any

from ..core import constant
from .planner import Kind, PlanError, Planner, ProcessImage, Steps, hex_arg

OBJECTS = "sysv-ipc/objects.json"
SEMVMX = 32767  # the kernel's largest semaphore value


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
        self._dir = path.parent
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
        adds = self._sem_undo(objects)
        for o in objects.get("sem", []):
            extra = adds.get(int(o["id"]), {})
            undo = hex_arg(b"".join(struct.pack("<Ii", n, v) for n, v in sorted(extra.items()))) if extra else ""
            st.create.append(f"sysvsem {_head(o)} {int(o['nsems'])} {data(o)} {undo}".rstrip())
        for o in objects.get("msg", []):
            st.create.append(f"sysvmsg {_head(o)} {int(o['qbytes'])} {int(o['count'])} {data(o)}")

    def _sem_undo(self, objects: dict[str, list[dict[str, Any]]]) -> dict[int, dict[int, int]]:
        """semid -> semnum -> the sum of every process's adjustment, checked to fit."""
        sets = {int(o["id"]): o for o in objects.get("sem", [])}
        total: dict[int, dict[int, int]] = {}
        raises: dict[tuple[int, int], int] = {}
        for p in self.planner.procs:
            for u in p.core.sem_undo():
                if u["kind"] != constant("CK_SEM_UNDO_ADJ"):
                    continue
                semid, n, adj = u["semid"], u["semnum"], u["adj"]
                o = sets.get(semid)
                if o is None or not 0 <= n < int(o["nsems"]):
                    raise PlanError(
                        f"{p.label()} holds a SEM_UNDO adjustment on System V semaphore {n} of set {semid}, "
                        "which was not saved"
                    )
                total.setdefault(semid, {})[n] = total.get(semid, {}).get(n, 0) + adj
                if adj < 0:
                    raises[(semid, n)] = raises.get((semid, n), 0) - adj
        for semid, per in total.items():
            o = sets[semid]
            nsems = int(o["nsems"])
            values = struct.unpack(f"<{nsems}H", (self._dir / str(o["file"])).read_bytes()[: 2 * nsems])
            for n, adj in per.items():
                # all the raises done, none of the lowering yet: the highest it gets in the restorer
                top = values[n] + adj + raises.get((semid, n), 0)
                if not 0 <= values[n] + adj <= SEMVMX or top > SEMVMX:
                    raise PlanError(
                        f"System V semaphore {n} of set {semid} (value {values[n]}) cannot hold the processes' "
                        f"SEM_UNDO adjustments (sum {adj}) while they are restored: ckptd cannot restore it"
                    )
        return total


def _head(o: dict[str, Any]) -> str:
    return f"{int(o['id'])} {int(o['key'])} {int(o['mode'])} {int(o['uid'])} {int(o['gid'])}"
