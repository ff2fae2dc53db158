"""The restore plan: how a checkpointed process tree is built again.

Every process's image describes only what that process holds: a pipe end
by inode, a socket with its peer's inode, a shared mapping by device and
inode.  This package matches them up across the whole job and writes the
plan that `ckptd-restore --build` (native/restorer/plan.c) carries out as
pid 2 of the new pid namespace: create each shared object once at a fixed
descriptor number (a "slot") that every process inherits, put back the
bytes that were in flight, then fork the tree with its old pids.

One module per kind of object, named as its native/restorer/plan_<kind>.c
is: pipe.py (pipes, FIFOs), unix.py (Unix sockets), tcp.py, dgram.py (UDP,
ping and raw sockets), shm.py (shared
memory objects), deleted.py (deleted files and directories), file.py (files
opened by path), eventfd.py, timerfd.py, signalfd.py, pidfd.py and
inotify.py (which refuse one several processes share), sysv.py (System V
IPC objects, kept under their ids), pty.py (pseudo-terminals, controlling
terminals); tree.py (the process
tree); planner.py (the planner, and what the kinds share).

The same planning runs while a checkpoint is taken (before it is
committed), so a tree that could not be restored is refused at checkpoint
time, with the reason, and the job keeps running.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core import CoreImage
from ..sockaddr import endpoint, ip_sockaddr
from .deleted import DeletedFiles
from .dgram import DgramSockets
from .eventfd import Eventfds
from .file import Files
from .inotify import Inotifies
from .pidfd import Pidfds
from .pipe import Pipes
from .planner import Kind, PlanError, Planner, ProcessImage
from .pty import Ptys
from .shm import SharedMemory
from .signalfd import Signalfds
from .sysv import SysvIpc
from .tcp import TcpSockets
from .timerfd import Timerfds
from .tree import Tree, Zombie
from .unix import UnixSockets

__all__ = ["KINDS", "PlanError", "ProcessImage", "Zombie", "build_plan", "load_processes", "plan_for_checkpoint"]

# every kind, in the order its objects are planned (and their slots numbered)
KINDS: tuple[type[Kind], ...] = (
    Pipes,
    UnixSockets,
    TcpSockets,
    DgramSockets,
    SharedMemory,
    DeletedFiles,
    Files,
    Eventfds,
    Timerfds,
    Signalfds,
    Pidfds,
    Inotifies,
    SysvIpc,
    Ptys,
)


def build_plan(
    procs: list[ProcessImage],
    zombies: list[Zombie],
    log_pipes: dict[int, int],
    other_ranks: Iterable[str] = (),
    shared: Iterable[Iterable[Iterable[int]]] = (),
) -> str:
    """The plan's text; PlanError says why a tree cannot be rebuilt.
    other_ranks: the addresses of the job's other ranks (their connections
    are rebuilt one end at a time); shared: the open file descriptions
    several processes share, each as its [pid, fd] pairs."""
    ranks = {endpoint(ip_sockaddr(a))[0] for a in other_ranks}
    planner = Planner(procs, log_pipes, shared, ranks, KINDS)
    tree = Tree(planner.procs, zombies)
    planner.gather()
    tree.check()
    tree.check_processes()
    return "\n".join(planner.lines(tree.lines())) + "\n"


def load_processes(checkpoint: Path, manifest: dict[str, Any]) -> list[ProcessImage]:
    return [
        ProcessImage(checkpoint / p["dir"], CoreImage.load(checkpoint / p["dir"] / "core.img"))
        for p in manifest.get("processes", [])
    ]


def plan_for_checkpoint(checkpoint: Path, manifest: dict[str, Any]) -> str:
    zombies = [Zombie.from_dict(z) for z in manifest.get("zombies", [])]
    log_pipes = {int(ino): fd for fd, ino in ((1, manifest.get("stdout_ino", 0)), (2, manifest.get("stderr_ino", 0)))}
    log_pipes.pop(0, None)
    return build_plan(
        load_processes(checkpoint, manifest),
        zombies,
        log_pipes,
        manifest.get("other_ranks", []),
        manifest.get("shared_files", []),
    )
