"""The process tree: its checks, its zombies, and the plan's process lines
(proc, zombie, helper) that native/restorer/plan_tree.c forks again."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core import constant
from .planner import PlanError, ProcessImage, hex_arg


@dataclass
class Zombie:
    """A child that had exited but was not yet reaped: it comes back as one."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    wstatus: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Zombie:
        return cls(int(d["pid"]), int(d["ppid"]), int(d["pgid"]), int(d["sid"]), int(d["wstatus"]))


@dataclass
class _Node:
    """A process of the tree to fork: a live one, a zombie, or a helper."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    label: str
    zombie: bool = False


def _kernel_specials() -> set[str]:
    """The vdso mappings every process gets from this kernel (this one's own):
    [vdso] and [vvar] where it has them ([vvar_vclock] is newer, left out)."""
    try:
        with open("/proc/self/maps") as f:
            names = {line.split()[-1] for line in f if line.rstrip().endswith("]")}
    except OSError:
        return set()
    return names & {"[vdso]", "[vvar]"}


class Tree:
    def __init__(self, procs: list[ProcessImage], zombies: list[Zombie]) -> None:
        self.procs = procs  # by pid
        self.zombies = zombies
        self.helpers: dict[int, _Node] = {}  # the sessions and groups whose leader has exited, by pid

    def check(self) -> None:
        """Every process comes back with its pid, parent, session and group.
        A process forks its children (clone3 set_tid).  An orphan (a child
        of the job's init) is forked with CLONE_PARENT by a child of init in
        its session: pid 2, the orphan leading that session, or a helper.
        A session or group whose leader has exited gets a helper: a process
        with the leader's pid that makes it, forks its orphans and exits
        before the job runs (plan.c)."""
        live = {p.pid: p for p in self.procs}
        if 2 not in live:
            raise PlanError("the job's first process (pid 2) is not in the checkpoint")
        for z in self.zombies:
            if z.ppid not in live:
                raise PlanError(f"zombie pid {z.pid} has a parent (pid {z.ppid}) that is not part of the job")
        nodes = {p.pid: _Node(p.pid, p.ppid, p.pgid, p.sid, p.label()) for p in self.procs}
        nodes.update(
            {z.pid: _Node(z.pid, z.ppid, z.pgid, z.sid, f"zombie pid {z.pid}", zombie=True) for z in self.zombies}
        )
        for n in sorted(nodes.values(), key=lambda n: n.pid):
            if n.sid and n.sid not in nodes:
                nodes[n.sid] = self.helpers[n.sid] = _Node(n.sid, 1, n.sid, n.sid, f"session {n.sid}")
        for n in sorted(nodes.values(), key=lambda n: n.pid):
            if n.pgid and n.pgid not in nodes:
                nodes[n.pgid] = self.helpers[n.pgid] = _Node(n.pgid, 1, n.pgid, n.sid, f"process group {n.pgid}")
        for n in nodes.values():
            if n.pid == 2 or not n.sid or not n.pgid:
                continue
            if n.ppid != 1 and n.ppid not in live:
                raise PlanError(f"{n.label} has a parent (pid {n.ppid}) that is not part of the job")
            if n.ppid == 1:
                spawner = nodes[2 if n.sid == n.pid else n.sid]
                if spawner.ppid != 1 or spawner.zombie:
                    raise PlanError(
                        f"{n.label} was orphaned in session {n.sid}, whose leader (pid {n.sid}) is not a child "
                        "of the job's init; such a tree cannot be rebuilt"
                    )
            elif n.sid not in (n.pid, nodes[n.ppid].sid):
                raise PlanError(
                    f"{n.label} is in session {n.sid}, which its parent left; such a tree cannot be rebuilt"
                )
            if n.pgid != n.pid and nodes[n.pgid].sid != n.sid:
                raise PlanError(
                    f"{n.label} is in process group {n.pgid} of another session; such a group cannot be rebuilt"
                )

    def check_processes(self) -> None:
        """What each process holds that the restorer cannot give back."""
        here = _kernel_specials()
        for p in self.procs:
            has = {
                "[vdso]" if v.flags & constant("CK_VMA_VDSO") else p.core.string(v.path)
                for v in p.core.records["vmas"]
                if v.flags & (constant("CK_VMA_VDSO") | constant("CK_VMA_VVAR"))
            }
            missing = sorted(here - has)
            if missing:
                raise PlanError(
                    f"{p.label()} has unmapped its {' and '.join(missing)}: ckptd cannot restore a process "
                    "without the kernel's vdso"
                )

    def lines(self) -> Iterator[str]:
        """After the objects: the processes to fork, with their old ids (check() first)."""
        for p in self.procs:
            yield f"proc {p.pid} {p.ppid} {p.pgid} {p.sid} {hex_arg(str(p.dir))}"
        for z in self.zombies:
            yield f"zombie {z.pid} {z.ppid} {z.pgid} {z.sid} {z.wstatus}"
        for h in self.helpers.values():
            yield f"helper {h.pid} {h.sid}"
