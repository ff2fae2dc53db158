"""Running the daemons, and the embedded default.

`ckptd coordinator` and `ckptd agent` run one service each.  On one machine
`ckptd launch` (and ckptctl) need nothing running beforehand: when no
coordinator answers on $CKPTD_HOME's socket and CKPTD_COORDINATOR is unset,
they start `ckptd daemon` in the background, which hosts a coordinator and
this node's agent in one process, and exits after a while with no jobs.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ckptd import limits
from ckptd.auth import DEFAULT_ADMINS, Policy
from ckptd.errors import EXIT_CODES, CkptdError, Code
from ckptd.image import seal
from ckptd.jobstate import JobState
from ckptd.paths import Home, default_node, private_umask
from ckptd.rpc import bind, call, coordinator_stub, make_server, reachable, use_tls
from ckptd.tls import TlsFiles, subject_of
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DAEMON_START_TIMEOUT_S = 30.0
DEFAULT_IDLE_EXIT_S = limits.DEFAULT_IDLE_EXIT_S
# a draining daemon waits this long for the launcher that started it (under Slurm) to hear how it went
STARTER_GRACE_S = 10.0


LOG_FORMATS = limits.LOG_FORMATS
# log messages whose first argument is the job's name
JOB_FIRST = ("job %s", "auto-restart: job %s", "periodic checkpoint of %s", "auto-restart of %s")


class JsonFormatter(logging.Formatter):
    """`--log-format json`: one JSON object per line (ts, level, logger, msg,
    and job when the record names one), for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        job = getattr(record, "job", None)
        # the daemons' messages about a job start "job %s: ..." (or "... of %s"): its name is the first argument
        named = isinstance(record.msg, str) and record.msg.startswith(JOB_FIRST)
        if job is None and named and isinstance(record.args, tuple) and record.args:
            job = record.args[0]
        if job is not None:
            entry["job"] = str(job)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(home: Home, name: str, verbose: bool = False, log_format: str = "text") -> None:
    """A daemon's start: its files are private from here on (paths.py), its log first."""
    private_umask()
    home.logs_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(home.logs_dir / f"{name}.log")
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def _wait_for_signal(stop: threading.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


@dataclass(frozen=True)
class Security:
    """A daemon's TLS identity (None: Unix sockets only) and its admins."""

    tls: TlsFiles | None = None
    admins: tuple[str, ...] = DEFAULT_ADMINS

    def apply(self, role: str, name: str = "") -> Policy:
        """Present this identity on outgoing TCP calls; the policy for incoming ones."""
        if self.tls is not None:
            cn, got = subject_of(self.tls.cert)
            if got != role or (name and cn != name):
                want = f"{role} {name}".strip()
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"{self.tls.directory}/cert.pem is a {got} certificate for {cn!r}, not a {want} one; "
                    f"issue one with `ckptd certs issue --{role} {name or 'NAME'}`",
                )
        use_tls(self.tls)
        return Policy(self.admins)


# glibc gives each thread that allocates an arena of its own, up to eight
# per core, and a daemon's threads come and go (its step pool's, its RPCs',
# each restart's): what the arenas keep fragments.  The local daemon grew
# from 105 to 199 MiB over 300 checkpoints and 18 restarts, and stayed at
# 93-95 MiB with two arenas (scripts/soak.py, BENCHMARKS.md "Soak").
M_ARENA_MAX = -8  # <malloc.h>
DAEMON_MALLOC_ARENAS = 2


def _limit_malloc_arenas() -> None:
    """Before a daemon starts its threads (a C library without mallopt: as it is)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, DAEMON_MALLOC_ARENAS)


def _freeze_startup_objects() -> None:
    """What start-up made (modules, the gRPC and protobuf machinery, some
    50,000 objects) lives as long as the daemon: moved out of the cyclic
    collector's reach, a full collection no longer walks it (30-40 ms of CPU
    each, one of which landed in a checkpoint's command in 6; it could land
    in a pause)."""
    gc.collect()
    gc.freeze()


def run_coordinator(
    home: Home,
    listen: str,
    stop: threading.Event | None = None,
    security: Security | None = None,
    metrics: str = "",
) -> None:
    _limit_malloc_arenas()
    from ckptd.coordinator.server import Coordinator, CoordinatorService

    stop = stop or threading.Event()
    security = security or Security()
    policy = security.apply("coordinator")
    home.ensure()
    seal.install(home.root)  # the manifest key: made on first use, refused if others can read it
    coordinator = Coordinator(home)
    if metrics:
        coordinator.metrics.serve(metrics)
    server = make_server()
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(coordinator, stop.set, policy), server)
    address = bind(server, listen, security.tls)
    server.start()
    coordinator.start()
    _freeze_startup_objects()
    log.info("coordinator listening on %s", address)
    _wait_for_signal(stop)
    coordinator.stop()
    server.stop(2).wait()


def run_agent(
    home: Home,
    node: str,
    coordinator: str,
    listen: str,
    *,
    stop: threading.Event | None = None,
    ip: str = "",
    security: Security | None = None,
    metrics: str = "",
) -> None:
    _limit_malloc_arenas()
    from ckptd.agent.node import AgentNode
    from ckptd.agent.server import AgentService

    stop = stop or threading.Event()
    security = security or Security()
    policy = security.apply("node", node)
    home.ensure()
    seal.install(home.root)  # the manifest key: made on first use, refused if others can read it
    server = make_server()
    address = bind(server, listen, security.tls)
    agent = AgentNode(home, node, address, coordinator, ip)
    if metrics:  # this node's jobs and itself; checkpoints and restarts are counted by the coordinator
        from ckptd.metrics import Metrics

        m = Metrics()
        m.gauges.jobs = lambda: [j.state for j in list(agent.jobs.values())]
        m.gauges.nodes = lambda: [(node, True)]
        m.serve(metrics)
    pb_grpc.add_AgentServicer_to_server(AgentService(agent, policy), server)
    server.start()
    agent.start()
    _freeze_startup_objects()
    log.info("agent for node %s listening on %s, coordinator %s", node, address, coordinator)
    _wait_for_signal(stop)
    agent.stop()
    server.stop(2).wait()


def run_local(home: Home, idle_exit_s: float, metrics: str = "", exit_with: int = 0) -> None:
    """Coordinator and this node's agent in one process, on Unix sockets.
    exit_with: a pid; once it has exited, the daemon exits as soon as no job runs."""
    _limit_malloc_arenas()
    from ckptd.agent.node import AgentNode
    from ckptd.agent.server import AgentService
    from ckptd.coordinator.jobs import JobRecord
    from ckptd.coordinator.server import Coordinator, CoordinatorService

    home.ensure()
    seal.install(home.root)  # the manifest key: made on first use, refused if others can read it
    stop = threading.Event()
    node = default_node()
    coordinator = Coordinator(home)
    if metrics:
        coordinator.metrics.serve(metrics)
    cserver = make_server()
    policy = Policy()  # Unix sockets only: every caller is the daemon's own user
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(coordinator, stop.set, policy), cserver)
    caddr = bind(cserver, f"unix:{home.coordinator_socket}")
    aserver = make_server()
    aaddr = bind(aserver, f"unix:{home.agent_socket(node)}")
    coordinator.nodes.in_process.add(aaddr)
    agent = AgentNode(home, node, aaddr, caddr)
    pb_grpc.add_AgentServicer_to_server(AgentService(agent, policy), aserver)
    cserver.start()
    aserver.start()
    coordinator.start()
    agent.start()
    _freeze_startup_objects()
    log.info("local ckptd (coordinator %s, agent %s for node %s) pid %d", caddr, aaddr, node, os.getpid())

    starter = _pidfd(exit_with)

    def idle_watch() -> None:
        idle_since = time.monotonic()
        while not stop.wait(1.0 if starter is not None else 5.0):
            busy = any(JobState.of(r.status.state).live for r in coordinator.registry.all())
            if busy:
                idle_since = time.monotonic()
            elif idle_exit_s > 0 and time.monotonic() - idle_since > idle_exit_s:
                log.info("no job for %.0f s: exiting", idle_exit_s)
                stop.set()
            elif starter is not None and select.select([starter], [], [], 0)[0]:
                log.info("process %d that started this daemon has exited and no job runs: exiting", exit_with)
                stop.set()

    threading.Thread(target=idle_watch, daemon=True).start()
    draining = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        """SIGTERM with jobs running: not an exit.  Slurm (scancel, requeue,
        preemption) signals every process below the batch script, this daemon
        too when `ckptd launch` started it: the jobs' launchers are taking
        final checkpoints through it.  It takes them itself (a job whose
        launcher is gone, or a detached one), then exits."""
        live = [r for r in coordinator.registry.all() if JobState.of(r.status.state).live]
        if not live:
            stop.set()
        elif not draining.is_set():
            draining.set()
            agent.draining = True  # the SIGTERM the jobs' own processes got too waits for these (sigterm.c)
            log.warning("signal %d with %d job(s) running: final checkpoints, then exit", signum, len(live))
            threading.Thread(target=drain, args=(live, signum), daemon=True).start()

    def drain(live: list[JobRecord], signum: int) -> None:
        workers = [
            threading.Thread(target=coordinator.final_stop, args=(r, f"daemon got signal {signum}"), daemon=True)
            for r in live
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if starter is not None:
            # the launcher that started this daemon got the same signal (Slurm signals every
            # process of the job) and asks this coordinator how its job's final checkpoint went
            select.select([starter], [], [], STARTER_GRACE_S)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # `scancel --signal USR1` reaches this daemon too: not its business
        signal.signal(sig, signal.SIG_IGN)
    while not stop.wait(1.0):
        pass
    agent.stop()
    coordinator.stop()
    aserver.stop(1).wait()
    cserver.stop(1).wait()
    with contextlib.suppress(FileNotFoundError):
        home.coordinator_socket.unlink()


def _pidfd(pid: int) -> int | None:
    """A pidfd of pid (readable once it has exited), or None."""
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def coordinator_address(home: Home, start: bool = True) -> str:
    """The coordinator to talk to, starting the embedded one if need be."""
    remote = os.environ.get("CKPTD_COORDINATOR")
    if remote:
        return remote
    address = f"unix:{home.coordinator_socket}"
    # nothing in a runtime directory someone else controls is trusted
    if not home.check_run_dir(create=start):
        raise CkptdError(Code.UNAVAILABLE, f"no ckptd coordinator is running for CKPTD_HOME={home.root}")
    if home.our_socket(home.coordinator_socket) and reachable(address):
        return address
    if not start:
        raise CkptdError(Code.UNAVAILABLE, f"no ckptd coordinator is running for CKPTD_HOME={home.root}")
    home.ensure()
    lock = home.open_lock()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter at a time
        if home.our_socket(home.coordinator_socket) and reachable(address):
            return address
        out = home.logs_dir / "daemon.out"
        seen = out.stat().st_size if out.exists() else 0
        daemon = _spawn_local_daemon(home)
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if home.our_socket(home.coordinator_socket) and reachable(address, timeout=0.5):
                _wait_agent(address)
                return address
            if daemon.poll() is not None:
                raise _start_failure(out, seen, daemon.returncode)
            time.sleep(0.1)
    finally:
        os.close(lock)
    raise CkptdError(
        Code.UNAVAILABLE,
        f"the local ckptd daemon did not start; see {home.logs_dir / 'daemon.log'}",
    )


def _wait_agent(coordinator: str) -> None:
    """Until the new daemon's agent has registered with its coordinator: a
    command sent sooner finds no node ("no agent is running").  Asked, not
    slept on: a fixed pause raced the registration once reachable() no
    longer took 0.2 s."""
    from ckptd.v1 import ckptd_pb2 as pb

    stub = coordinator_stub(coordinator)
    node = default_node()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(CkptdError):
            if any(n.node == node and n.alive for n in call(stub.ListNodes, pb.Empty(), 1, "coordinator").nodes):
                return
        time.sleep(0.02)


def _start_failure(out: Path, seen: int, status: int) -> CkptdError:
    """The daemon's own one-line error (what it wrote to out past offset
    seen), with its exit status's code."""
    with contextlib.suppress(OSError), open(out, "rb") as f:
        f.seek(seen)
        lines = [x for x in f.read().decode(errors="replace").splitlines() if x.startswith("error: ")]
        if lines:
            code = next((c for c, n in EXIT_CODES.items() if n == status), Code.UNAVAILABLE)
            return CkptdError(code, f"the local ckptd daemon cannot start: {lines[-1][len('error: ') :]}")
    return CkptdError(Code.UNAVAILABLE, f"the local ckptd daemon exited with status {status} at start; see {out}")


def _spawn_local_daemon(home: Home) -> subprocess.Popen[bytes]:
    idle = os.environ.get("CKPTD_IDLE_EXIT", str(DEFAULT_IDLE_EXIT_S))
    env = dict(os.environ, CKPTD_HOME=str(home.root))
    for var in ("LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
        env.pop(var, None)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(home.logs_dir / "daemon.out", flags, 0o600)  # handed to the child
    argv = [sys.executable, "-m", "ckptd.cli.ckptd_main", "daemon", "--idle-exit", idle]
    if os.environ.get("SLURM_JOB_ID"):
        # Inside an allocation: under proctrack/linuxproc Slurm finds a job's
        # processes by ancestry, and this daemon (its own session, reparented
        # when its starter exits) would escape it; it goes with its starter.
        argv += ["--exit-with", str(os.getpid())]
    daemon = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        start_new_session=True,
        close_fds=True,
        cwd="/",
    )
    os.close(out)
    return daemon
