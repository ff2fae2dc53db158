"""One job on one node: its incarnations (each a ckptd-init process tree),
the shim connections of its processes, and its state.

    agent ──Popen──▶ ckptd-init (relay, host pid ns)
                        └─ reaper (pid 1 of the job's pid namespace)
                              └─ job (pid 2) ─▶ its children...

The relay writes the job's output to <job dir>/output.log and its exit
status to <runtime dir>/exit.json, so both survive an agent restart; a new
agent re-adopts live incarnations from runtime.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import psutil
from google.protobuf import json_format

from ckptd import faults
from ckptd.errors import CkptdError, Code
from ckptd.image.crypt import job_key
from ckptd.jobstate import LIVE, JobState
from ckptd.native import init_binary, shim_library
from ckptd.paths import Home, JobDir, job_umask
from ckptd.v1 import ckptd_pb2 as pb

from .lazy import LazyFill
from .owner import Owner, files_as, job_work_dir, prepare_job_dir, resolve_owner
from .shim_link import ShimConnection

log = logging.getLogger(__name__)

WRITER_COMM = "ckptd-writer"  # the name native/shim/writeout.c gives its writer


@dataclass
class Incarnation:
    """One run of ckptd-init: the original launch or a restore."""

    generation: int
    init_pid: int
    control: str  # the relay's control socket
    exit_file: str
    runtime_dir: str
    started: float
    restored_from: str = ""
    # where its processes write (the restorer's status files): runtime_dir,
    # or a directory of the job's owner (agent/owner.py)
    status_dir: str = ""
    # a restore's processes were told to RESUME (every image verified, or a
    # lazy restore's checks run on after it); until then they are parked, and
    # an agent that re-adopts the incarnation kills it: nothing unverified runs
    released: bool = True
    # when ckptd-init started, in clock ticks since boot (/proc/PID/stat): tells
    # its pid from a reused one whatever the wall clock did since (`started`, a
    # wall-clock time, moved by hours when the clock was set; 0: written before)
    start_ticks: int = 0

    def save(self) -> None:
        path = Path(self.runtime_dir) / "runtime.json"
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, runtime_dir: Path) -> Incarnation:
        return cls(**json.loads((runtime_dir / "runtime.json").read_text()))


@dataclass
class ExitInfo:
    code: int | None = None
    signal: int | None = None


def start_ticks(pid: int) -> int:
    """When a process started, in clock ticks since boot (field 22 of
    /proc/PID/stat): unlike psutil's create_time, which adds it to a boot
    time computed from the wall clock, setting the clock does not move it."""
    st = _read_stat(None, str(pid))
    return st.start if st else 0


def spec_to_json(spec: pb.JobSpec) -> str:
    return json_format.MessageToJson(spec, preserving_proto_field_name=True, sort_keys=True)


def spec_from_json(text: str) -> pb.JobSpec:
    return json_format.Parse(text, pb.JobSpec())


def job_dir_of(spec: pb.JobSpec) -> JobDir:
    """Where a job keeps its log: a rank of a multi-node job has its own,
    under the job's directory."""
    if spec.rank.job:
        return JobDir(JobDir.of(spec.ckpt_dir, spec.rank.job).path / f"rank-{spec.rank.rank}")
    return JobDir.of(spec.ckpt_dir, spec.name)


def ns_pid(host_pid: int) -> int:
    """The pid a process has inside its own (innermost) pid namespace."""
    try:
        with open(f"/proc/{host_pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class ProcEntry:
    """One process as /proc/PID/stat has it."""

    pid: int
    ppid: int
    state: str  # "Z": exited, not yet reaped
    comm: str


class ProcTable:
    """A job's processes by parent, from one pass over /proc.  Finding a
    job's processes means reading every candidate's stat (the kernel lists
    children only with CONFIG_PROC_CHILDREN, which this one may lack), and a
    round asks for them several times per job.  A job whose processes all
    said HELLO is looked at through its own /proc instead
    (JobRuntime._own_look); this pass finds the rest, and names a process
    that escaped the shim.  Two things keep it from growing with what else
    the node runs:

    - a pass for a job (its pid namespace, job_pid_ns) reads the stat of
      the processes in that namespace or one nested in it, the only places
      a descendant of its ckptd-init can be; every other process (a node's
      kernel threads, its daemons, other jobs and ranks) costs one readlink
      of its ns/pid: a pass over 123 processes took 0.31 ms against 0.85.
      At 32 ranks over 16 namespace nodes sharing one /proc, these passes
      were most of the agents' Python time in a pause (BENCHMARKS.md);
    - one pass answers every question about that namespace asked before it
      began (single flight): callers that queue behind a pass take the next
      one together.  Never stale: a caller gets a pass that began after it
      asked."""

    KEEP_S = 60.0  # a namespace's last pass is forgotten once this old (its job ended)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._passes: dict[str | None, tuple[float, dict[int, list[ProcEntry]]]] = {}

    def children(self, ns: str | None = None) -> dict[int, list[ProcEntry]]:
        """ns: a pid namespace's ns/pid link (job_pid_ns); None: every process."""
        asked = time.monotonic()
        with self._lock:
            began, table = self._passes.get(ns, (-1.0, {}))
            if began < asked:
                began = time.monotonic()
                table = _scan_proc(ns)
                self._passes = {k: v for k, v in self._passes.items() if v[0] > began - self.KEEP_S}
                self._passes[ns] = (began, table)
            return table

    def descendants(self, pid: int, *, ns: str | None = None) -> list[ProcEntry]:
        """pid's children, theirs, and so on (breadth first), found in ns."""
        children = self.children(ns)
        out, todo = [], [pid]
        while todo:
            for c in children.get(todo.pop(), ()):
                out.append(c)
                todo.append(c.pid)
        return out


def job_pid_ns(init_pid: int) -> str | None:
    """The pid namespace ckptd-init (its relay) made for the job's processes,
    as its ns/pid_for_children link reads ("pid:[N]"); None if unreadable."""
    try:
        return os.readlink(f"/proc/{init_pid}/ns/pid_for_children")
    except OSError:
        return None


NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2), linux/nsfs.h


def _nested_in(proc: int, name: str, ns: str) -> bool:
    """Whether process name's pid namespace lies inside ns (a job that made
    a namespace of its own: its processes there are still the job's)."""
    import fcntl

    try:
        fd = os.open(f"{name}/ns/pid", os.O_RDONLY, dir_fd=proc)
    except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
        return False
    except OSError:  # cannot tell: its stat is read, as any process's once was
        return True
    try:
        while True:
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:  # the top, or a parent outside this process's view
                return False
            os.close(fd)
            fd = parent
            if f"pid:[{os.fstat(fd).st_ino}]" == ns:
                return True
    finally:
        os.close(fd)


class _Stat(NamedTuple):
    state: str
    ppid: int
    comm: str
    start: int  # clock ticks since boot: with the pid, which process it is


def _read_stat(proc: int | None, name: str) -> _Stat | None:
    """NAME/stat under the /proc opened as proc (None: the agent's own);
    None if the process is gone."""
    try:
        fd = os.open(f"{name}/stat" if proc is not None else f"/proc/{name}/stat", os.O_RDONLY, dir_fd=proc)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    head, _, tail = stat.rpartition(b")")
    f = tail.split(None, 20)  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    if len(f) < 20:
        return None
    # after ")": state ppid pgrp session ... starttime is field 22 (index 19 here)
    return _Stat(f[0].decode(), int(f[1]), head.partition(b"(")[2].decode(errors="replace"), int(f[19]))


def _scan_proc(ns: str | None = None) -> dict[int, list[ProcEntry]]:
    # os.open/os.read relative to /proc, not open(): the Python file object
    # cost a third of a scan (9 µs a process is the kernel's own part here)
    children: dict[int, list[ProcEntry]] = {}
    inside: dict[str, bool] = {} if ns is None else {ns: True}  # by ns/pid link, for this pass
    proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(proc):
            if not name.isdigit():
                continue
            if ns is not None:
                try:
                    link = os.readlink(f"{name}/ns/pid", dir_fd=proc)
                except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                    continue
                except OSError:  # not ours to look into (an agent not run as root): its stat tells
                    link = ""
                if link:
                    known = inside.get(link)
                    if known is None:
                        known = inside[link] = _nested_in(proc, name, ns)
                    if not known:
                        continue
            st = _read_stat(proc, name)
            if st is None:  # exited meanwhile
                continue
            children.setdefault(st.ppid, []).append(
                ProcEntry(pid=int(name), ppid=st.ppid, state=st.state, comm=st.comm)
            )
    finally:
        os.close(proc)
    return children


PROCS = ProcTable()


class JobRuntime:
    def __init__(
        self,
        home: Home,
        node: str,
        spec: pb.JobSpec,
        on_change: Callable[[JobRuntime], None],
        owner: Owner | None = None,
    ) -> None:
        self.home = home
        self.node = node
        self.spec = spec
        self.name = spec.name
        self.job_dir = job_dir_of(spec)
        # the user its processes run as (agent/owner.py), and the shim socket
        # they reach (the agent gives another user's job that user's own)
        self.owner = owner or resolve_owner(spec.owner, node)
        self.shim_socket = home.shim_socket(node)
        self.cond = threading.Condition()
        self.state = JobState.STARTING
        self.message = ""
        self.operation = ""
        self.generation = 0
        self.incarnation: Incarnation | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.exit: ExitInfo | None = None
        self.shims: dict[int, ShimConnection] = {}  # by host pid
        self.netns = ""  # a rank's network namespace (see rank_net.py)
        self.kill_requested = False
        self.stop_reason = ""
        self.restored_cuda: set[int] = set()  # pids in the job whose GPU memory a restore puts back
        self.lazy: LazyFill | None = None  # restart --lazy: the memory still being filled
        # a kill for a failure found while the job ran (fail_running): why, and
        # what to undo once its processes are gone, before the state says so
        self.failure = ""
        self.before_end: Callable[[], None] | None = None
        self._spawning = False
        self._on_change = on_change
        # held SIGTERMs (native/shim/sigterm.c): the guarding launchers' policies
        # (hold, forward), a SIGTERM this agent passes on itself, and the
        # incarnation whose final checkpoint a held one asked for
        self._term_launchers = {True: 0, False: 0}
        self._term_passed_until = 0.0
        self._term_asked = -1
        # the incarnation's reaper as (relay's pid, its pid, its start), for a
        # look through the job's own /proc (_own_look); and the newest look
        # at the job's processes, by when it began
        self._reaper: tuple[int, int, int] | None = None
        self._last_look: tuple[float, list[ProcEntry]] = (-1.0, [])
        self._init_known: tuple[Incarnation, psutil.Process] | None = None  # _init_process's last answer

    # ---- process tree ----

    def _init_process(self) -> psutil.Process | None:
        inc = self.incarnation
        if not inc:
            return None
        if inc.start_ticks:
            if start_ticks(inc.init_pid) != inc.start_ticks:  # gone, or the pid reused
                return None
            known = self._init_known
            if known is not None and known[0] is inc:
                # the same process as the last call: one read of its stat, not a new
                # psutil.Process (a rank's pause asks two or three times)
                return known[1]
        try:
            p = psutil.Process(inc.init_pid)
            if not inc.start_ticks and p.create_time() > inc.started + 5:  # pid reused (or the clock set forward)
                return None
        except psutil.Error:
            return None
        if inc.start_ticks:
            self._init_known = (inc, p)
        return p

    def _job_processes(self, *, fresh: bool = True) -> list[ProcEntry]:
        """The job's processes, zombies included: ckptd-init's reaper excluded,
        and a shim's page writer (native/shim/writeout.c), a short-lived copy
        of a job process, never part of the job itself.  fresh=False: the
        newest look already made, for a tree that cannot have changed since
        the caller's last fresh look (every process of it parked)."""
        init = self._init_process()
        if not init:
            return []
        if not fresh and self._last_look[0] >= 0:
            return self._last_look[1]
        began = time.monotonic()
        look = self._own_look(init.pid)
        if look is None:
            under = PROCS.descendants(init.pid, ns=job_pid_ns(init.pid))
            reapers = [c.pid for c in under if c.ppid == init.pid]
            look = [c for c in under if c.pid not in reapers and c.comm != WRITER_COMM]
            if len(reapers) == 1 and (ticks := start_ticks(reapers[0])):
                self._reaper = (init.pid, reapers[0], ticks)
        with self.cond:
            if began > self._last_look[0]:
                self._last_look = (began, look)
        return look

    def _own_look(self, init_pid: int) -> list[ProcEntry] | None:
        """The job's processes through its own /proc, the one ckptd-init's
        reaper mounted for the job's pid namespace: a listing of the job's
        few processes, not a pass over every process of the node (a rank's
        pause makes two or three looks). Only when every process in it
        (but the reaper and page writers) is one whose shim said HELLO,
        under that pid, and started when that connection's process did;
        None otherwise (a process without a shim, a zombie, one in a pid
        namespace of its own: ProcTable's pass answers, and names them)."""
        reaper = self._reaper
        if reaper is None or reaper[0] != init_pid:
            return None
        try:
            base = os.open(f"/proc/{reaper[1]}/root/proc", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            own = _read_stat(base, "1")  # the job's pid 1 is the reaper, if this is its /proc
            if own is None or own.start != reaper[2]:
                return None
            with self.cond:
                by_pid = {c.pid: c.host_pid for c in self.shims.values() if not c.closed.is_set()}
            out = []
            for name in os.listdir(base):
                if not name.isdigit() or name == "1":
                    continue
                inside = _read_stat(base, name)
                if inside is None:  # exited meanwhile
                    continue
                if inside.comm == WRITER_COMM:
                    continue
                host_pid = by_pid.get(int(name))
                if inside.state == "Z" or host_pid is None:
                    return None
                host = _read_stat(None, str(host_pid))
                if host is None or host.start != inside.start:  # not the process that said HELLO
                    return None
                out.append(ProcEntry(pid=host_pid, ppid=host.ppid, state=host.state, comm=host.comm))
            return out
        finally:
            os.close(base)

    def init_pids(self) -> list[int]:
        """Host pids of the incarnation's ckptd-init: its relay, then its reaper."""
        init = self._init_process()
        if init is None:
            return []
        with contextlib.suppress(psutil.Error):
            return [init.pid, *(c.pid for c in init.children())]
        return [init.pid]

    def fault(self, phase: str) -> None:
        """A test's fault point (ckptd/faults.py) at the end of `phase` on this job."""
        faults.point(phase, "agent", self.live_pids, self.init_pids)

    def live_pids(self) -> list[int]:
        """Host pids of the job's processes (the reaper excluded)."""
        return sorted(c.pid for c in self._job_processes() if c.state != "Z")

    def zombies(self, *, parked: bool = False) -> list[dict[str, int]]:
        """The job's exited-but-unreaped children, with their ids inside the job
        and their wait status, so that a restore recreates them.  parked: every
        process of the job is parked since a look that found nobody new (no
        parent can reap, fork or exit meanwhile): the newest pass over /proc
        answers, without a new one in the pause."""
        out = []
        for c in self._job_processes(fresh=not parked):
            if c.state != "Z":
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{c.pid}/stat").read_text().rsplit(")", 1)[1].split()
                # after ")": state ppid pgrp session ... exit_code is field 52 (index 49 here)
                ppid, pgrp, session = (int(x) for x in fields[1:4])
                out.append(
                    {
                        "pid": ns_pid(c.pid),
                        "ppid": ns_pid(ppid),
                        "pgid": ns_pid(pgrp) or 0,
                        "sid": ns_pid(session) or 0,
                        "wstatus": int(fields[49]),
                    }
                )
        return out

    def alive(self) -> bool:
        return self._init_process() is not None and self.state in LIVE

    # ---- starting ----

    def _runtime_dir(self, generation: int) -> Path:
        d = self.home.agent_dir(self.node) / "jobs" / self.name / f"gen-{generation}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def job_env(self) -> dict[str, str]:
        env = dict(self.spec.env)
        preload = str(shim_library())
        old = env.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{preload}:{old}" if old else preload
        env["CKPTD_JOB"] = self.name
        env["CKPTD_SHIM_SOCKET"] = str(self.shim_socket)
        env["CKPTD_SEM_UNDO"] = "0"  # the shim sets it to 1 in place while an exec would lose SEM_UNDO adjustments
        if self.owner.switch:
            env.update(self.owner.env())
        return env

    def owner_files(self) -> contextlib.AbstractContextManager[None]:
        """File operations with the job's owner's identity (agent/owner.py)."""
        return files_as(self.owner)

    def key(self) -> bytes | None:
        """The job's encryption key (None: not encrypted), read with its
        owner's identity: a user cannot have root read a file for them."""
        with self.owner_files():
            return job_key(self.spec)

    @property
    def work_dir(self) -> Path:
        """The job's own files on this node (restore plans, the rollback
        journal): in the agent's directory, or, for another user's job, in
        that user's (reached with owner_files)."""
        if self.owner.switch:
            return job_work_dir(self.home, self.node, self.name, self.owner)
        return self.home.agent_dir(self.node) / "jobs" / self.name

    def refuses(self, conn: ShimConnection) -> str:
        """Why a process's HELLO naming this job is not taken ("" if it is):
        it must run as the job's owner (any uid in a root job, whose processes
        may drop privileges: Owner.any_uid) and be in the job's process tree."""
        other_uid = conn.uid != self.owner.uid
        if other_uid and not self.owner.any_uid:
            return f"it runs as uid {conn.uid}, the job as {self.owner.uid}"
        if other_uid and conn.pidfd is None:
            return f"it runs as uid {conn.uid}, and this kernel cannot name the process behind a socket (SO_PEERPIDFD)"
        deadline = time.monotonic() + 10
        with self.cond:  # a process may say HELLO before spawn has recorded its incarnation
            while self._spawning and time.monotonic() < deadline:
                self.cond.wait(0.1)
        inc = self.incarnation
        if inc is None:
            return "the job has no running incarnation"
        pid = conn.host_pid
        for _ in range(4096):
            if pid == inc.init_pid:
                # the ancestry read was the connecting process's own, not a
                # later one's with its pid (the socket is open to every uid)
                return "it exited" if conn.gone() else ""
            if pid <= 1:
                break
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        return "it is not a process of the job"

    def forget_incarnations(self) -> None:
        """Before a fresh launch: the runtime directories of an ended job of
        this name (one `launch --resume` replaces) go, so that generations,
        which `ckptctl status` shows as restarts, count from 0 again."""
        for d in (self.home.agent_dir(self.node) / "jobs" / self.name).glob("gen-*"):
            shutil.rmtree(d, ignore_errors=True)
        if self.owner.switch:
            work = self.work_dir  # made as root, then read as the owner
            with self.owner_files():
                for d in work.glob("gen-*"):
                    shutil.rmtree(d, ignore_errors=True)

    def _next_generation(self) -> int:
        base = self.home.agent_dir(self.node) / "jobs" / self.name
        gens = [int(p.name[4:]) for p in base.glob("gen-*") if p.name[4:].isdigit()]
        return max(gens, default=-1) + 1

    def spawn(
        self, program: list[str], restore: bool, restored_from: str = "", keep_fd: int | None = None
    ) -> Incarnation:
        """Start a new incarnation: ckptd-init running `program` as pid 2.

        "{runtime_dir}" in program is replaced by the incarnation's runtime
        directory (where the restorer writes its status).  keep_fd (the
        encryption key's memfd) is inherited by `program` alone."""
        generation = self._next_generation()
        rt = self._runtime_dir(generation)
        control = self.home.init_socket(self.name, generation)
        shared = rt  # where the job's processes write
        if self.owner.switch:
            # another user's job: what its processes write is in that user's directory
            prepare_job_dir(self.job_dir.path, [self.job_dir.log, self.job_dir.index], self.owner, self.node)
            shared = self.work_dir / f"gen-{generation}"
            with self.owner_files():
                shared.mkdir(mode=0o700)
            control = shared / "init.sock"
        program = [a.replace("{runtime_dir}", str(shared)) for a in program]
        exit_file = shared / "exit.json"
        cmd = [
            str(init_binary()),
            "--log", str(self.job_dir.log),
            "--index", str(self.job_dir.index),
            "--control", str(control),
            "--exit-file", str(exit_file),
        ]  # fmt: skip
        if self.owner.switch:
            cmd += self.owner.init_args()  # --user ... --userns
        elif os.getuid() != 0:
            cmd.append("--userns")
        if self.netns:
            with self.owner_files():
                hosts = self._hosts_file(shared)
            cmd += ["--netns", self.netns, "--hostname", self.spec.rank.hostname, "--hosts", hosts]
        if restore:
            cmd.append("--restore")
        if keep_fd is not None:
            cmd += ["--keep-fd", str(keep_fd)]
        cmd += ["--", *program]
        cwd = self.spec.cwd or "/"
        if not os.path.isdir(cwd):
            raise CkptdError(Code.FAILED_PRECONDITION, f"the job's working directory {cwd} does not exist on this node")
        if self.owner.switch:
            with self.owner_files():
                reachable = os.access(cwd, os.X_OK, effective_ids=True)
            if not reachable:
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"user {self.owner.name} cannot enter the job's working directory {cwd} on this node",
                )
        with self.cond:
            # before the processes start: their shims say HELLO as soon as they
            # run, maybe before Popen returns here (refuses() waits for this)
            self.shims = {}
            self._spawning = True
        with open(rt / "init.log", "ab") as err:
            try:
                popen = subprocess.Popen(
                    cmd,
                    env=self.job_env(),
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(keep_fd,) if keep_fd is not None else (),
                    umask=self.spec.umask if self.spec.HasField("umask") else job_umask(),  # the daemon's is 077
                )
            except OSError as e:
                with self.cond:
                    self._spawning = False
                    self.cond.notify_all()
                raise CkptdError(Code.INTERNAL, f"cannot start ckptd-init: {e}") from e
        inc = Incarnation(
            generation=generation,
            init_pid=popen.pid,
            control=str(control),
            exit_file=str(exit_file),
            runtime_dir=str(rt),
            started=time.time(),
            start_ticks=start_ticks(popen.pid),
            restored_from=restored_from,
            status_dir=str(shared),
            released=not restore,
        )
        inc.save()
        with self.cond:
            self._spawning = False
            self.generation = generation
            self.incarnation = inc
            self.popen = popen
            self.exit = None
            self.kill_requested = False
            self.stop_reason = ""
            self.lazy = None
            self.failure = ""
            self.before_end = None
            self.state = JobState.RESTORING if restore else JobState.RUNNING
            self.message = f"restoring from {restored_from}" if restore else ""
            self.cond.notify_all()
        threading.Thread(target=self._monitor, args=(inc,), name=f"monitor-{self.name}", daemon=True).start()
        self._on_change(self)
        return inc

    def _hosts_file(self, runtime_dir: Path) -> str:
        """/etc/hosts as the rank sees it: the node's, then every rank's host
        name at its virtual IP (what gloo and NCCL resolve to pick their
        interface), so a restarted rank finds the same names."""
        try:
            base = Path("/etc/hosts").read_text()
        except OSError:
            base = "127.0.0.1 localhost\n"
        job = self.spec.rank.job
        lines = [f"{r.vip}\t{f'{job}-{r.rank}'[:63]}" for r in self.spec.rank.ranks]
        path = runtime_dir / "hosts"
        path.write_text(base.rstrip("\n") + "\n# ckptd: the ranks of job " + job + "\n" + "\n".join(lines) + "\n")
        path.chmod(0o644)  # the job's /etc/hosts: readable by whoever it runs as
        return str(path)

    def adopt(self, inc: Incarnation) -> bool:
        """Take over an incarnation started by an earlier agent."""
        self.incarnation = inc
        self.generation = inc.generation
        if self._init_process() is None:
            self.incarnation = None
            return False
        threading.Thread(target=self._monitor, args=(inc,), name=f"monitor-{self.name}", daemon=True).start()
        if not inc.released:
            # the agent that rebuilt it died before it said RESUME: whether
            # every image verified is unknown, so its parked processes go
            self.state = JobState.RESTORING
            self.failure = (
                f"its restart from {inc.restored_from} was cut short by an agent restart before every image "
                f"was verified; `ckptctl restart {self.spec.rank.job or self.name}` starts it again"
            )
            self.kill(requested=False)
            return True
        self.state = JobState.RUNNING
        self.message = "re-adopted after an agent restart"
        return True

    # ---- ending ----

    def _monitor(self, inc: Incarnation) -> None:
        popen = self.popen if self.incarnation is inc else None
        if popen is not None:
            rc = popen.wait()
        else:
            rc = None
            self._wait_adopted(inc)
        with self.owner_files():  # written by the relay, as the job's owner
            exit_info = self._read_exit(inc, rc)
        # a relay killed (with its namespace, or by kill -9) leaves its control socket: the job is over
        with contextlib.suppress(OSError):
            os.unlink(inc.control)
        with self.cond:
            if self.incarnation is not inc:
                return
            self.exit = exit_info
            for conn in self.shims.values():
                conn.close()
            if self.before_end is not None:
                undo, self.before_end = self.before_end, None
                undo()  # under the lock: nobody sees the end before it is done
            if self.failure:
                self.state, self.message = JobState.FAILED, self.failure
            elif self.kill_requested and self.stop_reason:
                self.state, self.message = JobState.STOPPED, self.stop_reason
            elif self.kill_requested:
                self.state, self.message = JobState.KILLED, "killed by `ckptctl kill`"
            elif exit_info.signal == signal.SIGKILL:
                self.state = JobState.FAILED
                self.message = (
                    "killed by SIGKILL (node failure, OOM killer or kill -9); "
                    f"`ckptctl restart {self.spec.rank.job or self.name}` resumes it from its last checkpoint"
                )
            elif exit_info.signal:
                self.state, self.message = JobState.EXITED, f"terminated by signal {exit_info.signal}"
            elif exit_info.code is None:
                self.state, self.message = JobState.FAILED, self._init_error(inc) or "ckptd-init failed"
            else:
                self.state, self.message = JobState.EXITED, f"exit status {exit_info.code}"
            self.operation = ""
            self.cond.notify_all()
        log.info("job %s generation %d ended: %s (%s)", self.name, inc.generation, self.state, self.message)
        self._on_change(self)

    def _wait_adopted(self, inc: Incarnation) -> None:
        """Until an adopted incarnation's ckptd-init (not our child) is gone:
        at once through a pidfd, so that `ckptctl kill` answers with the end
        it caused, not a stale "running"."""
        init = self._init_process()
        fd = -1
        if init is not None:
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(init.pid)
        try:
            while self._init_process() is not None and self.incarnation is inc:
                if fd < 0:
                    time.sleep(0.5)
                else:
                    select.select([fd], [], [], 0.5)
        finally:
            if fd >= 0:
                os.close(fd)

    @staticmethod
    def _init_error(inc: Incarnation) -> str:
        with contextlib.suppress(OSError):
            lines = (Path(inc.runtime_dir) / "init.log").read_text(errors="replace").strip().splitlines()
            if lines:
                return lines[-1]
        return ""

    @staticmethod
    def _read_exit(inc: Incarnation, rc: int | None) -> ExitInfo:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(Path(inc.exit_file).read_text())
            return ExitInfo(code=data.get("exit_code"), signal=data.get("signal"))
        # the relay itself was killed: no exit file
        if rc is not None and rc < 0:
            return ExitInfo(signal=-rc)
        return ExitInfo(code=None)

    def term_policy(self, hold: bool) -> Callable[[], None]:
        """A guarding launcher follows the job with SIGTERM policy `hold`
        until the returned function is called (once is enough)."""
        with self.cond:
            self._term_launchers[hold] += 1
        done = threading.Event()

        def release() -> None:
            with self.cond:
                if not done.is_set():
                    done.set()
                    self._term_launchers[hold] -= 1

        return release

    def term_held(self, draining: bool, sender: int) -> bool:
        """Whether a SIGTERM one of its processes holds waits for a final
        checkpoint: a launcher with the checkpoint policy follows it, or the
        daemon drains with no launcher saying forward; never the SIGTERM
        this agent passes on itself (SignalJob), nor one a process of the job
        sent (sender: its pid as the receiver sees it, 0 from outside the
        job's pid namespace): a pool terminating its workers, a raise()."""
        with self.cond:
            if self.state not in LIVE or time.monotonic() < self._term_passed_until:
                return False
            held = self._term_launchers[True] > 0 or (draining and self._term_launchers[False] == 0)
        return held and not (sender and any(ns_pid(p) == sender for p in self.live_pids()))

    def first_term_of_incarnation(self) -> bool:
        with self.cond:
            first, self._term_asked = self._term_asked != self.generation, self.generation
            return first

    def signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            with self.cond:
                self._term_passed_until = time.monotonic() + 10.0  # it is delivered, not held (sigterm.c)
        pids = self.live_pids()
        if not pids:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {self.name} has no live process to signal")
        main = pids[0]
        for pid in pids:
            if ns_pid(pid) == 2:
                main = pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(main, sig)

    def fail_running(self, generation: int, why: str, undo: Callable[[], None] | None = None) -> None:
        """A failure found while incarnation `generation` runs: kill it; it
        ends as "failed" with `why`, after `undo`.  One that has ended
        already gets `undo` and the message now."""
        with self.cond:
            if self.generation != generation:
                return  # a later restart owns the job now
            if self.failure:
                return  # the first failure is the one to report
            if self.state in LIVE:
                self.failure, self.before_end = why, undo
                alive = True
            else:
                alive = False
                if undo is not None:
                    undo()
                self.state, self.message = JobState.FAILED, why
                self.cond.notify_all()
        if alive:
            self.kill(requested=False)
        else:
            self._on_change(self)

    def kill(self, stop_reason: str = "", requested: bool = True) -> None:
        """Kill the whole incarnation: SIGKILL to the reaper ends the namespace.
        With a stop_reason the job ends as "stopped" (preemption), not
        "killed"; not requested, it ends as "failed" (and can be restarted)."""
        with self.cond:
            self.kill_requested = requested
            self.stop_reason = stop_reason
        init = self._init_process()
        if init is None:
            return
        with contextlib.suppress(psutil.Error):
            for child in init.children():
                child.kill()
            init.kill()

    def wait_ended(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            # until its monitor has recorded the end (the state a caller reports), not only until init is gone
            while self.state in LIVE and (self.incarnation is not None or self._init_process() is not None):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.2))
        return True

    # ---- the relay ----

    def drain_output(self) -> dict[str, int]:
        """Ask the relay to flush the job's pipes into the log.

        Returns the log and index sizes ("log", "index") and the inodes of the
        job's stdout and stderr pipes ("stdout_ino", "stderr_ino")."""
        inc = self.incarnation
        if not inc:
            raise CkptdError(Code.FAILED_PRECONDITION, f"job {self.name} is not running")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            try:
                s.connect(inc.control)
                peer = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                if peer != inc.init_pid:  # the socket is in a directory of the job's owner
                    raise OSError(f"{inc.control} is served by pid {peer}, not by the relay (pid {inc.init_pid})")
                s.sendall(b"DRAIN\n")
                reply = s.makefile("rb").readline().decode()
            except OSError as e:
                raise CkptdError(Code.INTERNAL, f"cannot reach the output relay of job {self.name}: {e}") from e
        fields = dict(part.split("=", 1) for part in reply.split()[1:] if "=" in part)
        if not reply.startswith("OK"):
            raise CkptdError(Code.INTERNAL, f"output relay of job {self.name}: {reply.strip()}")
        return {k: int(v) for k, v in fields.items()}

    # ---- reporting ----

    def status(self) -> pb.JobStatus:
        with self.cond:
            st = pb.JobStatus(
                name=self.name,
                state=self.state.pb,
                node=self.node,
                generation=self.generation,
                log_path=str(self.job_dir.log),
                message=self.message,
                spec=self.spec,
                operation=self.operation,
            )
            if self.exit:
                st.has_exit = True
                st.exit_code = self.exit.code or 0
                st.exit_signal = self.exit.signal or 0
            shims = dict(self.shims)
        if self.state in LIVE:
            for pid in self.live_pids():
                conn = shims.get(pid)
                st.pids.append(pid)
                st.processes.append(
                    pb.ProcessInfo(
                        pid=conn.pid if conn else ns_pid(pid),
                        host_pid=pid,
                        exe=conn.exe if conn else exe_of(pid),
                        under_shim=conn is not None,
                    )
                )
        return st


def exe_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""
