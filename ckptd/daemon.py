"""Running the daemons, and the embedded default.

`ckptd coordinator` and `ckptd agent` run one service each.  On one machine
`ckptd launch` (and ckptctl) need nothing running beforehand: when no
coordinator answers on $CKPTD_HOME's socket and CKPTD_COORDINATOR is unset,
they start `ckptd daemon` in the background, which hosts a coordinator and
this node's agent in one process, and exits after a while with no jobs.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from ckptd.errors import CkptdError, Code
from ckptd.paths import Home, default_node
from ckptd.rpc import bind, make_server, reachable
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DAEMON_START_TIMEOUT_S = 30.0
DEFAULT_IDLE_EXIT_S = 1800.0


def setup_logging(home: Home, name: str, verbose: bool = False) -> None:
    home.logs_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(home.logs_dir / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def _wait_for_signal(stop: threading.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def run_coordinator(home: Home, listen: str, stop: threading.Event | None = None) -> None:
    from ckptd.coordinator.server import Coordinator, CoordinatorService

    stop = stop or threading.Event()
    home.ensure()
    coordinator = Coordinator(home)
    server = make_server()
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(coordinator, stop.set), server)
    address = bind(server, listen)
    server.start()
    coordinator.start()
    log.info("coordinator listening on %s", address)
    _wait_for_signal(stop)
    coordinator.stop()
    server.stop(2).wait()


def run_agent(
    home: Home, node: str, coordinator: str, listen: str, *, stop: threading.Event | None = None, ip: str = ""
) -> None:
    from ckptd.agent.node import AgentNode
    from ckptd.agent.server import AgentService

    stop = stop or threading.Event()
    home.ensure()
    server = make_server()
    address = bind(server, listen)
    agent = AgentNode(home, node, address, coordinator, ip)
    pb_grpc.add_AgentServicer_to_server(AgentService(agent), server)
    server.start()
    agent.start()
    log.info("agent for node %s listening on %s, coordinator %s", node, address, coordinator)
    _wait_for_signal(stop)
    agent.stop()
    server.stop(2).wait()


def run_local(home: Home, idle_exit_s: float) -> None:
    """Coordinator and this node's agent in one process, on Unix sockets."""
    from ckptd.agent.node import AgentNode
    from ckptd.agent.server import AgentService
    from ckptd.coordinator.jobs import RUNNING
    from ckptd.coordinator.server import Coordinator, CoordinatorService

    home.ensure()
    stop = threading.Event()
    node = default_node()
    coordinator = Coordinator(home)
    cserver = make_server()
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(coordinator, stop.set), cserver)
    caddr = bind(cserver, f"unix:{home.coordinator_socket}")
    aserver = make_server()
    aaddr = bind(aserver, f"unix:{home.agent_socket(node)}")
    agent = AgentNode(home, node, aaddr, caddr)
    pb_grpc.add_AgentServicer_to_server(AgentService(agent), aserver)
    cserver.start()
    aserver.start()
    coordinator.start()
    agent.start()
    log.info("local ckptd (coordinator %s, agent %s for node %s) pid %d", caddr, aaddr, node, os.getpid())

    def idle_watch() -> None:
        idle_since = time.monotonic()
        while not stop.wait(5.0):
            busy = any(r.status.state in RUNNING for r in coordinator.registry.all())
            if busy:
                idle_since = time.monotonic()
            elif idle_exit_s > 0 and time.monotonic() - idle_since > idle_exit_s:
                log.info("no job for %.0f s: exiting", idle_exit_s)
                stop.set()

    threading.Thread(target=idle_watch, daemon=True).start()
    _wait_for_signal(stop)
    agent.stop()
    coordinator.stop()
    aserver.stop(1).wait()
    cserver.stop(1).wait()
    with contextlib.suppress(FileNotFoundError):
        home.coordinator_socket.unlink()


def coordinator_address(home: Home, start: bool = True) -> str:
    """The coordinator to talk to, starting the embedded one if need be."""
    remote = os.environ.get("CKPTD_COORDINATOR")
    if remote:
        return remote
    address = f"unix:{home.coordinator_socket}"
    if home.coordinator_socket.exists() and reachable(address):
        return address
    if not start:
        raise CkptdError(Code.UNAVAILABLE, f"no ckptd coordinator is running for CKPTD_HOME={home.root}")
    home.ensure()
    lock_path = home.run_dir / "daemon.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter at a time
        if home.coordinator_socket.exists() and reachable(address):
            return address
        _spawn_local_daemon(home)
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if home.coordinator_socket.exists() and reachable(address, timeout=0.5):
                _wait_agent(home)
                return address
            time.sleep(0.1)
    raise CkptdError(
        Code.UNAVAILABLE,
        f"the local ckptd daemon did not start; see {home.logs_dir / 'daemon.log'}",
    )


def _wait_agent(home: Home) -> None:
    address = f"unix:{home.agent_socket(default_node())}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if home.agent_socket(default_node()).exists() and reachable(address, timeout=0.5):
            time.sleep(0.2)  # let it register
            return
        time.sleep(0.05)


def _spawn_local_daemon(home: Home) -> None:
    idle = os.environ.get("CKPTD_IDLE_EXIT", str(DEFAULT_IDLE_EXIT_S))
    env = dict(os.environ, CKPTD_HOME=str(home.root))
    for var in ("LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
        env.pop(var, None)
    out = open(home.logs_dir / "daemon.out", "ab")  # noqa: SIM115 - handed to the child
    subprocess.Popen(
        [sys.executable, "-m", "ckptd.cli.ckptd_main", "daemon", "--idle-exit", idle],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        start_new_session=True,
        close_fds=True,
        cwd="/",
    )
    out.close()
