"""A multi-node cluster on one machine, for tests: every node is a network namespace.

    ckt-fabric:  bridge br0 with one port (ckf<i>) per node
    ckt-<name>:  eth0 = 10.99.0.<i>/24 (peer of ckf<i>), lo up, ip_forward=1

The host's own networking is never touched.  Node processes are started with
`nsenter --net` rather than `ip netns exec`: the latter also gives them a
private mount namespace, so the rank netns an agent mounts under /run/netns
would be invisible here (the host would only see an empty file) and could not
be entered or cleaned up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

IP = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else "ip"
NSENTER = "nsenter"
NETNS_DIR = Path("/run/netns")
FABRIC = "ckt-fabric"
BRIDGE = "br0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([IP, *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def _ns_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of a netns file; None unless it is a real nsfs one (not a stale empty file)."""
    try:
        st = os.stat(path)
        ns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st.st_dev == ns.st_dev else None


def _pids_in_netns(ids: set[tuple[int, int]]) -> list[int]:
    """Every process whose network namespace is one of `ids` (never ours: we are in the host's)."""
    ids = ids - {_ns_id("/proc/self/ns/net")}
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, os.getpid()):
            nsid = _ns_id(f"/proc/{entry}/ns/net")
            if nsid is not None and nsid in ids:
                pids.append(int(entry))
    return pids


def _kill_tree(root: int) -> list[int]:
    """SIGKILL a process and all its descendants, collected first so none can escape by reparenting."""
    try:
        proc = psutil.Process(root)
        victims = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []
    return _kill([p.pid for p in victims])


def _kill(pids: list[int]) -> list[int]:
    killed = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


class Cluster:
    """Nodes as network namespaces on one bridge; agents started and killed per node."""

    def __init__(self, tmp: Path, names: list[str], prefix: str = "ckt", sweep_strays: bool = True) -> None:
        """prefix names its namespaces (scripts/bench.py's own nodes are not a
        test's); sweep_strays: teardown also removes rank netns that appeared
        while it ran whose node is gone (a test's own, nobody else's then)."""
        self.tmp = tmp
        self.names = list(names)
        self.prefix = prefix
        self.fabric = f"{prefix}-fabric"
        self.sweep_strays = sweep_strays
        self.agents: dict[str, subprocess.Popen[Any]] = {}
        self._logs: list[Any] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._ck_before: set[str] = set()

    # -- names ------------------------------------------------------------

    def netns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def _index(self, name: str) -> int:
        return self.names.index(name) + 1

    def _port(self, name: str) -> str:
        return f"ckf{self._index(name)}"  # short: node names can be long

    def node_ip(self, name: str) -> str:
        return f"10.99.0.{self._index(name)}"

    # -- network ----------------------------------------------------------

    def setup_network(self) -> None:
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        self._ck_before = {p.name for p in NETNS_DIR.glob("ck-*")}
        for ns in (self.fabric, *(self.netns(n) for n in self.names)):
            _ip("netns", "del", ns, check=False)  # left over from a crashed run
        _ip("netns", "add", self.fabric)
        _ip("-n", self.fabric, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.fabric, "link", "set", BRIDGE, "up")
        for name in self.names:
            ns, port = self.netns(name), self._port(name)
            _ip("netns", "add", ns)
            _ip("-n", self.fabric, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.fabric, "link", "set", port, "master", BRIDGE)
            _ip("-n", self.fabric, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.node_ip(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            # /proc/sys/net belongs to the netns of the process that opens it.
            subprocess.run(
                [NSENTER, f"--net={NETNS_DIR / ns}", "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
                check=True,
            )

    # -- processes --------------------------------------------------------

    def run_in(self, name: str, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside the node's netns (same mount namespace as the host, see the module doc)."""
        return self.run_in_netns(str(NETNS_DIR / self.netns(name)), argv, **popen_kwargs)

    def run_in_netns(self, path: str, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv in any netns (e.g. a rank's); teardown kills it even if that netns is gone by then."""
        p = subprocess.Popen([NSENTER, f"--net={path}", "--", *argv], **popen_kwargs)
        self._procs.append(p)
        return p

    def start_agent(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        out = open(self.tmp / f"agent-{name}.log", "ab")  # noqa: SIM115 -- closed in teardown
        self._logs.append(out)
        p = self.run_in(name, argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.agents[name] = p
        return p

    def _rank_netns(self, name: str) -> list[str]:
        """The rank netns hosted by a node: rank_net names the node-side veth ckv<h> for netns ck-<h>."""
        p = _ip("-n", self.netns(name), "-o", "link", "show", check=False)
        found = []
        for line in p.stdout.splitlines():
            ifname = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if ifname.startswith("ckv") and (NETNS_DIR / f"ck-{ifname[3:]}").exists():
                found.append(f"ck-{ifname[3:]}")
        return found

    def kill_node(self, name: str) -> list[int]:
        """The node dies: SIGKILL its agent tree and everything in its netns and rank netns, then unplug it."""
        killed: list[int] = []
        agent = self.agents.pop(name, None)
        if agent is not None:
            killed += _kill_tree(agent.pid)
        ids = {
            nsid
            for ns in (self.netns(name), *self._rank_netns(name))
            if (nsid := _ns_id(str(NETNS_DIR / ns))) is not None
        }
        for pid in _pids_in_netns(ids):
            if pid not in killed:
                killed += _kill_tree(pid)
        if agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=5)
        for p in self._procs:
            if p.pid in killed:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        # Deleting the fabric end destroys the pair, so the node's eth0 goes too.
        _ip("-n", self.fabric, "link", "del", self._port(name), check=False)
        log.info("node %s killed: pids %s", name, killed)
        return killed

    def set_link(self, name: str, up: bool) -> None:
        """Pull (or plug back) the node's cable: its port on the fabric goes down (up)."""
        _ip("-n", FABRIC, "link", "set", self._port(name), "up" if up else "down")

    def teardown(self) -> None:
        """Kill everything the cluster started and delete every netns it or its agents made.  Never raises."""
        try:
            ours = [self.netns(n) for n in self.names]
            ranks: set[str] = set()
            for n in self.names:
                with contextlib.suppress(Exception):
                    ranks.update(self._rank_netns(n))
            # Rank netns whose node veth is already gone (killed node, moved rank) but that appeared meanwhile.
            if self.sweep_strays:
                ranks.update(p.name for p in NETNS_DIR.glob("ck-*") if p.name not in self._ck_before)
            for agent in list(self.agents.values()):
                _kill_tree(agent.pid)
            self.agents.clear()
            ids = {nsid for ns in (self.fabric, *ours, *ranks) if (nsid := _ns_id(str(NETNS_DIR / ns))) is not None}
            for pid in _pids_in_netns(ids):
                _kill_tree(pid)
            for p in self._procs:
                with contextlib.suppress(Exception):
                    if p.poll() is None:
                        p.kill()
                    p.wait(timeout=5)
                    for pipe in (p.stdin, p.stdout, p.stderr):
                        if pipe is not None:
                            pipe.close()
            for ns in (*sorted(ranks), *ours, self.fabric):
                if os.path.lexists(NETNS_DIR / ns) and _ip("netns", "del", ns, check=False).returncode != 0:
                    with contextlib.suppress(OSError):
                        (NETNS_DIR / ns).unlink()  # a stale file whose mount is gone
            for f in self._logs:
                with contextlib.suppress(Exception):
                    f.close()
            self._logs.clear()
        except Exception:
            log.exception("cluster teardown")
