"""UDP, ICMP ping and raw sockets come back exactly, or the checkpoint is
refused (issue 19; every one was refused before).

tests/workloads/udp.c sets the sockets up and checks them from inside at
every step (family, type, protocol, flags, addresses, options), while pairs
of them exchange datagrams across the restart.  Datagrams queued and not
yet read are not saved: the round is refused as a passing state and tried
again until the program has read them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CKPTCTL, Ckptd, compile_workload, exact_round_trip, kill_restart_finish, run_plain
from test_bad_input import assert_refused, one_line_error

STEPS = "40"  # 4 s


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "udp")


def test_udp_sockets_round_trip(ckptd: Ckptd, exe: str) -> None:
    """IPv4 and IPv6 UDP sockets, bound (SO_REUSEADDR, SO_REUSEPORT, v6-only),
    connected (bound by connect()), unbound, non-blocking or close-on-exec,
    with SO_BROADCAST, buffer sizes, TOS/TCLASS, TTL/hop limits, multicast
    TTL, loop and interface, IP_RECVERR and packet info; two of them shared
    with a child.  Each pair exchanges datagrams at every step, the sender's
    address checked on arrival."""
    exact_round_trip(ckptd, "udp", [exe, STEPS, "dgram"])


def test_raw_sockets_round_trip(ckptd: Ckptd, exe: str) -> None:
    """Raw IPv4 sockets of their protocol (one bound, one connected with its
    TTL, one with IP_HDRINCL writing its own headers) and a raw IPv6 one
    connected to ::1 (its peer, which getpeername() cannot tell, read from
    /proc/net/raw6 inside)."""
    exact_round_trip(ckptd, "raw", [exe, STEPS, "raw"])


@pytest.fixture
def ping_allowed() -> Iterator[None]:
    """ICMP ping sockets for root's group (the range is the whole netns's)."""
    knob = Path("/proc/sys/net/ipv4/ping_group_range")
    old = knob.read_text()
    knob.write_text("0 0")
    try:
        yield
    finally:
        knob.write_text(old)


@pytest.mark.serial
def test_icmp_ping_socket_round_trip(ckptd: Ckptd, exe: str, ping_allowed: None) -> None:
    """A ping socket (SOCK_DGRAM, IPPROTO_ICMP) bound with its ICMP id pings
    127.0.0.1 at every step: the echo replies find it again after the restart."""
    exact_round_trip(ckptd, "ping", [exe, STEPS, "ping"])


def test_queued_datagram_is_waited_for(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """A datagram received and not yet read refuses the round as a passing
    state (its source address could not be put back exactly): the
    coordinator tries again, and once the program has read it the
    checkpoint succeeds, one success for the user; the restart is exact."""
    flag, ref_flag = tmp_path / "read", tmp_path / "ref-read"
    ref_flag.touch()
    plain = run_plain([exe, "60", "queued", str(ref_flag)])
    c = ckptd
    c.launch("qd", [exe, "60", "queued", str(flag)])
    c.wait_log("qd", r"^step 2 ok")
    attempt = subprocess.Popen(
        [CKPTCTL, "checkpoint", "qd", "--json"], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    operation = ""
    while "trying again" not in operation:
        assert time.monotonic() < deadline and attempt.poll() is None, attempt.communicate()
        time.sleep(0.05)
        operation = c.status("qd").get("operation", "")
    assert "datagrams received and not yet read" in operation, operation
    flag.touch()
    _, err = attempt.communicate(timeout=120)
    assert attempt.returncode == 0, err
    info = c.ctl_json("list", "qd")[-1]
    assert json.loads((Path(info["path"]) / "manifest.json").read_text())["attempts"] >= 2
    kill_restart_finish(c, "qd", plain)


def test_multicast_memberships_round_trip(ckptd: Ckptd, exe: str) -> None:
    """An IPv4 and an IPv6 socket that joined groups on lo are members again
    after the restart (MCAST_MSFILTER asked from inside), and the IPv4 one
    gets the datagram sent to its group at every step."""
    exact_round_trip(ckptd, "mc", [exe, STEPS, "group"])


def test_multicast_source_filter_is_refused(ckptd: Ckptd, exe: str) -> None:
    ckptd.launch("mcf", [exe, "600", "groupfilter"])
    ckptd.wait_log("mcf", r"^step 2 ok")
    assert_refused(ckptd, "mcf", "multicast group 239.1.2.3 on lo", "source filter")


def _own_address() -> str:
    """An address of the benchmarking range (RFC 2544) no other test uses."""
    return str(ipaddress.ip_address("198.18.0.0") + (os.getpid() % 65000) + 2)


@pytest.mark.serial
def test_socket_bound_to_a_node_address(ckptd: Ckptd, exe: str) -> None:
    """A socket bound to an address of the node comes back where the address
    exists, and the restart fails, naming the address, where it does not."""
    addr = _own_address()
    ip = ["ip", "addr", "add", f"{addr}/32", "dev", "lo"]
    subprocess.run(ip, check=True)
    try:
        argv = [exe, STEPS, "addr", addr]
        plain = run_plain(argv)
        ckptd.launch("na", argv)
        ckptd.wait_log("na", r"^step 3 ok")
        ckptd.checkpoint("na")
        assert "done" in plain.stdout  # (it needs the address to the end)
        ckptd.kill9("na")
        subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", "lo"], check=True)
        p = ckptd.ctl("restart", "na", check=False)
        assert p.returncode != 0
        one_line_error(p, "does not exist on this node", addr)
        subprocess.run(ip, check=True)
        ckptd.ctl("restart", "na")
        rc = ckptd.wait("na")
        out = ckptd.log("na")
        assert rc == 0 and "BAD " not in out, out[-2000:]
        assert ckptd.log("na", "stdout") == plain.stdout
    finally:
        subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", "lo"], check=False, capture_output=True)
