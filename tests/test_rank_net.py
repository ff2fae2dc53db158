"""Per-rank virtual IPs across nodes modelled as network namespaces (agent/rank_net.py + tests/cluster.py).

Loads agent/rank_net.py by path inside each node's netns, so it needs neither
the installed package nor a running agent.  Needs root and `ip netns`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import IP, NETNS_DIR, Cluster

RANK_NET = Path(__file__).resolve().parent.parent / "agent" / "rank_net.py"
PYTHON = sys.executable
JOB = "j"
VIP0, VIP1 = "10.213.1.1", "10.213.1.2"
PORT = 7000

# Runs rank_net calls in the current (node) netns: argv = [path to rank_net.py, JSON list of [func, args]].
NODE_OPS = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("rank_net", sys.argv[1])
rn = importlib.util.module_from_spec(spec)
sys.modules["rank_net"] = rn
spec.loader.exec_module(rn)
out = []
for func, args in json.loads(sys.argv[2]):
    if func == "set_job_routes":
        args = [args[0], [rn.RankAddress(*r) for r in args[1]]]
    out.append(getattr(rn, func)(*args))
print(json.dumps(out))
"""

ECHO_SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    with c:
        c.sendall(c.recv(1024))
"""

CLIENT = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        s.sendall(b"ping")
        print("ok" if s.recv(16) == b"ping" else "bad")
except socket.timeout:
    print("timeout")
except OSError as e:
    print("error", e.errno)
"""

# bind() to the VIP and connect() in TCP repair mode: what a restore does before the carrier is up.
REPAIR_CONNECT = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.IPPROTO_TCP, 19, 1)  # TCP_REPAIR
s.bind((sys.argv[1], 40000))
s.connect((sys.argv[2], int(sys.argv[3])))
print("ok")
"""


def _netns_entries() -> set[str]:
    return {p.name for p in NETNS_DIR.glob("ck*")} if NETNS_DIR.is_dir() else set()


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (creates network namespaces)"
    if shutil.which("nsenter") is None:
        return "nsenter (util-linux) not installed"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 not installed"
    probe = f"ckt-probe-{os.getpid()}"
    p = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns add` unusable here: {p.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    why = _usable()
    if why:
        pytest.skip(why)
    c = Cluster(tmp_path, ["a", "b", "c"])
    try:
        c.setup_network()
        yield c
    finally:
        c.teardown()


def node_call(c: Cluster, node: str, *ops: tuple[str, list[Any]]) -> list[Any]:
    p = c.run_in(
        node,
        [PYTHON, "-c", NODE_OPS, str(RANK_NET), json.dumps(ops)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, f"rank_net on node {node} failed: {err}"
    return list(json.loads(out))


def start_echo(c: Cluster, path: str, vip: str) -> subprocess.Popen[str]:
    p = c.run_in_netns(path, [PYTHON, "-c", ECHO_SERVER, vip, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def in_netns_output(c: Cluster, path: str, argv: list[str], timeout: float = 30) -> str:
    p = c.run_in_netns(path, argv, stdout=subprocess.PIPE, text=True)
    return str(p.communicate(timeout=timeout)[0]).strip()


def client(c: Cluster, path: str, dst: str, timeout: float = 3.0) -> str:
    return in_netns_output(c, path, [PYTHON, "-c", CLIENT, dst, str(PORT), str(timeout)], timeout + 30)


def ranks(node1_ip: str, c: Cluster) -> list[list[Any]]:
    return [[0, VIP0, c.node_ip("a")], [1, VIP1, node1_ip]]


def test_rank_vips_across_nodes(cluster: Cluster) -> None:
    c = cluster
    before = _netns_entries() - {c.netns(n) for n in c.names} - {"ckt-fabric"}
    agent_b = c.start_agent("b", [PYTHON, "-c", "import time; time.sleep(300)"], dict(os.environ))

    # Rank 0 on a (created twice: recreate must be idempotent), rank 1 on b.
    r = ranks(c.node_ip("b"), c)
    rank0 = node_call(
        c, "a", ("create_rank_netns", ["a", JOB, 0, VIP0, True]), ("create_rank_netns", ["a", JOB, 0, VIP0, True])
    )[1]
    node_call(c, "a", ("set_job_routes", [c.node_ip("a"), r]))
    rank1_b = node_call(
        c, "b", ("create_rank_netns", ["b", JOB, 1, VIP1, True]), ("set_job_routes", [c.node_ip("b"), r])
    )[0]
    assert Path(rank0).exists() and Path(rank1_b).exists()

    server = start_echo(c, rank1_b, VIP1)
    assert client(c, rank0, VIP1) == "ok"

    # Carrier down: packets to rank 1 are silently dropped (the blackhole on b), so connect() times out...
    node_call(c, "b", ("set_carrier", ["b", JOB, 1, False]))
    assert client(c, rank0, VIP1, timeout=1.0) == "timeout"
    assert client(c, rank1_b, VIP0, timeout=1.0) == "timeout"
    # ...but rank 1 can still look up routes, bind its VIP and connect() in repair mode.
    p = subprocess.run([IP, "-n", Path(rank1_b).name, "route", "get", VIP0], capture_output=True, text=True)
    assert p.returncode == 0 and "dev eth0" in p.stdout, p.stderr
    assert in_netns_output(c, rank1_b, [PYTHON, "-c", REPAIR_CONNECT, VIP1, VIP0, str(PORT)]) == "ok"

    node_call(c, "b", ("set_carrier", ["b", JOB, 1, True]))
    assert client(c, rank0, VIP1) == "ok"

    # Node b dies: its agent and the rank in its rank netns go with it.
    killed = c.kill_node("b")
    assert agent_b.pid in killed and server.pid in killed
    assert server.wait(timeout=10) != 0

    # Rank 1 restarts on c with the same VIP; a learns the new route.
    r = ranks(c.node_ip("c"), c)
    rank1_c = node_call(
        c, "c", ("create_rank_netns", ["c", JOB, 1, VIP1, True]), ("set_job_routes", [c.node_ip("c"), r])
    )[0]
    node_call(c, "a", ("set_job_routes", [c.node_ip("a"), r]))
    server = start_echo(c, rank1_c, VIP1)
    assert client(c, rank0, VIP1) == "ok"
    server0 = start_echo(c, rank0, VIP0)  # and the other way round
    assert client(c, rank1_c, VIP0) == "ok"
    server0.kill()
    server0.wait()

    # delete_rank_netns removes the netns and the node's routes to it, and tolerates absence.
    node_call(c, "a", ("delete_rank_netns", ["a", JOB, 0]), ("delete_rank_netns", ["a", JOB, 0]))
    assert not Path(rank0).exists()
    routes = subprocess.run([IP, "-n", c.netns("a"), "route", "show", VIP0], capture_output=True, text=True)
    assert routes.stdout.strip() == ""

    c.teardown()
    assert server.wait(timeout=10) != 0
    assert _netns_entries() - before == set(), "teardown left network namespaces behind"


def test_a_rank_that_moves_here_and_away_again_gets_its_route_back(cluster: Cluster) -> None:
    """set_job_routes leaves a route it put in moments ago alone (every rank
    of a job on a node asks for the same routes in a restart), but not one
    this node changed since: rank 1, routed via b, is restored here on a and
    removed again, then routed via b once more, all in one agent process;
    and a rank that moved from b to c within the same seconds is routed via c."""
    c = cluster
    via_b = [[1, VIP1, c.node_ip("b")]]
    via_c = [[1, VIP1, c.node_ip("c")]]

    def route_on_a() -> str:
        p = subprocess.run([IP, "-n", c.netns("a"), "route", "show", VIP1], capture_output=True, text=True)
        return p.stdout.strip()

    node_call(
        c,
        "a",
        ("set_job_routes", [c.node_ip("a"), via_b]),
        ("create_rank_netns", ["a", JOB, 1, VIP1, True]),
        ("delete_rank_netns", ["a", JOB, 1]),
        ("set_job_routes", [c.node_ip("a"), via_b]),
    )
    assert f"via {c.node_ip('b')}" in route_on_a()

    node_call(c, "a", ("set_job_routes", [c.node_ip("a"), via_b]), ("set_job_routes", [c.node_ip("a"), via_c]))
    assert f"via {c.node_ip('c')}" in route_on_a()
    assert f"via {c.node_ip('b')}" not in route_on_a()
