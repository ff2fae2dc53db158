"""Per-rank network namespaces with virtual IPs ("VIPs") for multi-node jobs.

Every rank of a job runs in its own network namespace with a /32 VIP that
follows it across restarts, so TCP peers keep talking to the same address
whichever node the rank is restored on.  The agent's own (current) netns acts
as the *node* netns:

    rank netns  ck-<hash>:   lo up; eth0 = VIP/32 up; "default dev eth0" (scope link)
    node netns  (caller's):  ckv<hash> = peer of the rank's eth0, proxy_arp=1, rp_filter=0
                             VIP/32 dev ckv<hash>              (only while the carrier is up)
                             blackhole VIP/32 metric 4242      (always, while the rank lives here)
                             other VIP/32 via <other node IP>  (set_job_routes)

The rank's eth0 has no gateway: it ARPs for every destination and the node
side answers by proxy ARP, so no addresses are needed on the node side.

Kernel behaviour this relies on (checked on Linux 6.18):

* "Carrier" is the admin state of the node-side veth end.  With it down the
  rank's eth0 is NO-CARRIER: what the rank sends is dropped by the veth, and
  the kernel flushes routes through the node-side end and refuses to add one
  ("Device for nexthop is not up", ENETDOWN).  set_carrier(up=True) therefore
  re-adds VIP/32 dev ckv<hash>.
* The rank's "default dev eth0" can be added while eth0 is admin-up but has no
  carrier; it is only marked "linkdown" and route lookups (ip route get,
  bind()+connect() in TCP repair mode) still succeed.  The kernel does require
  eth0 to be admin-up, so eth0 goes up before the route is added.  (This holds
  as long as conf/*/ignore_routes_with_linkdown stays 0, the default.)
* The node keeps a high-metric blackhole route for a local VIP: while the
  carrier is down, traffic for the rank is dropped silently instead of
  answered with ICMP unreachable (which would fail peers' connect() at once)
  or leaked to the node's default gateway.  Peers just retransmit until the
  rank is back.

Nothing here forks: the agent is a multi-threaded gRPC server, where a
forked child may crash before it execs (pyroute2's netns.create and
IPRoute(netns=...) fork, and did crash here).  A rank netns is made and
entered by a short-lived thread instead: the network namespace belongs to
the thread, so unshare() or setns() there leaves the rest of the agent in
the node's namespace.  All calls are serialised by a module lock.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import ipaddress
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from pyroute2 import IPRoute, NetlinkError  # type: ignore[import-untyped,unused-ignore]

log = logging.getLogger(__name__)

NETNS_DIR = "/run/netns"
RANK_IFNAME = "eth0"
# Marks the routes we own, so we never delete someone else's route to a VIP.
RTPROT_CKPTD = 212
# Lower priority than any real route (metric 0), so it only wins while there is none.
BLACKHOLE_METRIC = 4242
# Every VIP of a job this node takes part in: "unreachable" below everything
# else, so a rank that is not up yet (a launch in progress) is answered with
# ICMP host unreachable at once (connect() fails and the job retries) rather
# than followed to the node's default gateway (a SYN lost in the network).
RESERVED_METRIC = 4243

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21

_lock = threading.RLock()

# The job-wide routes this agent put in last, so that the ranks of a job on
# this node, each setting up its network in a restart, do not each replace
# every VIP's routes again: R ranks on a node made R times (all ranks) netlink
# requests per restart, one per route (BENCHMARKS.md, the rank curve).  An
# entry counts for INSTALLED_FOR_S only, since a restart's ranks set up within
# seconds and a route someone else removed meanwhile is then put back by the
# next restart; a VIP's "via" entry is forgotten whenever this module routes
# that VIP otherwise (the rank now here, its carrier up, its netns removed).
INSTALLED_FOR_S = 30.0
_reserved: dict[str, float] = {}  # VIP -> when its "unreachable" route went in
_via: dict[str, tuple[str, float]] = {}  # VIP -> (node IP, when its route via that node went in)


def _fresh(when: float | None, now: float) -> bool:
    return when is not None and now - when < INSTALLED_FOR_S


def _forget_route(vip: str) -> None:
    _via.pop(vip, None)


def _routed_via(vip: str, node_ip: str, now: float) -> bool:
    entry = _via.get(vip)
    return entry is not None and entry[0] == node_ip and _fresh(entry[1], now)


_ALIAS_RE = re.compile(r"vip=(\d+\.\d+\.\d+\.\d+)")


class RankNetError(Exception):
    """A rank-network operation failed; the message says what to do about it."""


@dataclass(frozen=True)
class RankAddress:
    """One rank of a job and where it runs."""

    rank: int
    vip: str  # e.g. "10.213.1.1"
    node_ip: str  # underlay IP of the node hosting it ("" if unknown)


def _hash(node: str, job: str, rank: int) -> str:
    return hashlib.sha1(f"{node}/{job}/{rank}".encode()).hexdigest()[:10]


def netns_name(node: str, job: str, rank: int) -> str:
    """Name of the rank's netns under /run/netns (hashed: names must stay short)."""
    return "ck-" + _hash(node, job, rank)


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def _veth_name(node: str, job: str, rank: int) -> str:
    # Same hash as the netns, so ckv<h> in a node netns identifies ck-<h>; 13 chars <= IFNAMSIZ-1.
    return "ckv" + _hash(node, job, rank)


def _require_caps(sys_admin: bool = False) -> None:
    """Fail early with an actionable message instead of a bare EPERM from netlink or mount."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return  # can't tell; let the real call fail
    missing = []
    if not eff & (1 << _CAP_NET_ADMIN):
        missing.append("CAP_NET_ADMIN")
    if sys_admin and not eff & (1 << _CAP_SYS_ADMIN):
        missing.append("CAP_SYS_ADMIN")
    if missing:
        raise RankNetError(
            f"rank networking needs {' and '.join(missing)}: run the ckptd agent as root "
            "(or grant the capabilities) to give ranks their own network namespaces"
        )


def _check_vip(vip: str) -> None:
    try:
        ipaddress.IPv4Address(vip)
    except ValueError as e:
        raise RankNetError(f"invalid VIP {vip!r}: expected an IPv4 address such as 10.213.1.1") from e


def _fail(what: str, e: BaseException) -> RankNetError:
    code = getattr(e, "code", None) or getattr(e, "errno", None)
    if code in (errno.EPERM, errno.EACCES):
        return RankNetError(f"{what}: permission denied; run the ckptd agent as root (needs CAP_NET_ADMIN)")
    return RankNetError(f"{what}: {e}")


def _write_sysctl(path: str, value: str) -> None:
    try:
        with open(path, encoding="ascii") as f:
            if f.read().strip() == value:
                return  # already set: avoid needless writes (and failures on a read-only /proc/sys)
        with open(path, "w", encoding="ascii") as f:
            f.write(value)
    except OSError as e:
        raise _fail(f"cannot set {path} to {value}", e) from e


@contextmanager
def _ipr() -> Iterator[Any]:
    """An IPRoute in the calling thread's netns."""
    ipr = IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MNT_DETACH = 2

T = TypeVar("T")


def _in_thread(fn: Callable[[], T]) -> T:
    """Run fn in a new thread (whose netns it may change) and return its result or raise its error."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=run, name="rank-netns")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _create_netns(path: str) -> None:
    """A new network namespace, kept alive by a bind mount at path (what `ip netns add` does)."""

    def make() -> None:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        with open(path, "w"):
            pass
        _check(_libc.mount(b"/proc/thread-self/ns/net", path.encode(), None, MS_BIND, None), f"mount {path}")

    os.makedirs(NETNS_DIR, exist_ok=True)
    _in_thread(make)


def _remove_netns(path: str) -> None:
    _libc.umount2(path.encode(), MNT_DETACH)  # not mounted (a stale file): nothing to undo
    os.unlink(path)


def _in_netns(path: str, fn: Callable[[Any], T]) -> T:
    """fn(ipr) with an IPRoute inside the netns at path."""

    def enter() -> T:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns {path}")
        finally:
            os.close(fd)
        with _ipr() as ipr:
            return fn(ipr)

    return _in_thread(enter)


def _link_index(ipr: Any, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return int(found[0]) if found else None


def _ignore(codes: tuple[int, ...], fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except NetlinkError as e:
        if e.code not in codes:
            raise


def _vip_of(ipr: Any, idx: int, rank_ns: str) -> str | None:
    """The VIP of a rank: from the node-side veth's alias, else from the rank's eth0."""
    for link in ipr.link("get", index=idx):
        m = _ALIAS_RE.search(link.get("IFLA_IFALIAS") or "")
        if m:
            return m.group(1)
    if os.path.exists(rank_ns):
        try:

            def find(ns: Any) -> str | None:
                for addr in ns.addr("dump", family=2):
                    if addr.get("IFA_LABEL") == RANK_IFNAME:
                        return str(addr.get("IFA_ADDRESS"))
                return None

            return _in_netns(rank_ns, find)
        except (OSError, NetlinkError) as e:
            log.debug("cannot read the VIP from %s: %s", rank_ns, e)
    return None


def _route_to_veth(ipr: Any, vip: str, idx: int) -> None:
    ipr.route("replace", dst=f"{vip}/32", oif=idx, scope="link", proto=RTPROT_CKPTD)


def enable_forwarding() -> None:
    """net.ipv4.ip_forward=1 in the current (node) netns: the node routes between ranks and the underlay."""
    with _lock:
        _write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")


def create_rank_netns(node: str, job: str, rank: int, vip: str, carrier: bool) -> str:
    """Create the rank's netns and its veth; returns the netns path.  Recreates it if it exists."""
    _check_vip(vip)
    _require_caps(sys_admin=True)
    name, veth = netns_name(node, job, rank), _veth_name(node, job, rank)
    path = netns_path(name)
    with _lock:
        _forget_route(vip)  # its route "via" another node is deleted below
        delete_rank_netns(node, job, rank)  # idempotent: start from scratch
        enable_forwarding()
        try:
            _create_netns(path)
        except OSError as e:
            raise _fail(f"cannot create network namespace {path}", e) from e
        try:
            with _ipr() as ipr:
                # The peer is created straight in the rank netns, so "eth0" never clashes with the node's.
                ipr.link("add", ifname=veth, kind="veth", state="down", peer={"ifname": RANK_IFNAME, "net_ns_fd": path})
                idx = _link_index(ipr, veth)
                if idx is None:
                    raise RankNetError(f"veth {veth} vanished right after creation")
                ipr.link("set", index=idx, ifalias=f"ckptd vip={vip} {node}/{job}/{rank}"[:255])
                _write_sysctl(f"/proc/sys/net/ipv4/conf/{veth}/proxy_arp", "1")
                _write_sysctl(f"/proc/sys/net/ipv4/conf/{veth}/rp_filter", "0")

                def inside(ns: Any) -> None:
                    lo = _link_index(ns, "lo")
                    eth = _link_index(ns, RANK_IFNAME)
                    if lo is None or eth is None:
                        raise RankNetError(f"{path}: lo or {RANK_IFNAME} missing after creation")
                    ns.link("set", index=lo, state="up")
                    ns.addr("add", index=eth, address=vip, prefixlen=32)
                    # eth0 must be admin-up before the route is accepted; the missing carrier is fine.
                    ns.link("set", index=eth, state="up")
                    ns.route("replace", dst="0.0.0.0/0", oif=eth, scope="link")

                _in_netns(path, inside)
                # A stale metric-0 route of ours (e.g. "via" the rank's previous node) would bypass the blackhole.
                # type=unicast: with priority 0 ("any") the kernel would otherwise match the blackhole too.
                _ignore(
                    (errno.ESRCH,), ipr.route, "del", dst=f"{vip}/32", type="unicast", priority=0, proto=RTPROT_CKPTD
                )
                ipr.route("replace", dst=f"{vip}/32", type="blackhole", priority=BLACKHOLE_METRIC, proto=RTPROT_CKPTD)
                if carrier:
                    ipr.link("set", index=idx, state="up")
                    _route_to_veth(ipr, vip, idx)
        except (OSError, NetlinkError, RankNetError) as e:
            try:
                delete_rank_netns(node, job, rank)
            except RankNetError as cleanup:
                log.warning("cleanup after a failed create of %s: %s", path, cleanup)
            if isinstance(e, RankNetError):
                raise
            raise _fail(f"cannot set up the network of rank {rank} of job {job} ({path})", e) from e
    log.info("rank %s/%s: netns %s, vip %s, veth %s, carrier %s", job, rank, path, vip, veth, carrier)
    return path


def set_carrier(node: str, job: str, rank: int, up: bool) -> None:
    """Connect (up) or cut (down) the rank from the network without touching its netns."""
    _require_caps()
    veth = _veth_name(node, job, rank)
    with _lock:
        try:
            with _ipr() as ipr:
                idx = _link_index(ipr, veth)
                if idx is None:
                    raise RankNetError(
                        f"no network for rank {rank} of job {job} on node {node} (veth {veth} missing): "
                        "create_rank_netns first"
                    )
                ipr.link("set", index=idx, state="up" if up else "down")
                if up:
                    # The kernel flushed the route when the link went down.
                    vip = _vip_of(ipr, idx, netns_path(netns_name(node, job, rank)))
                    if vip is None:
                        raise RankNetError(f"cannot tell the VIP of rank {rank} of job {job}: recreate its netns")
                    _forget_route(vip)
                    _route_to_veth(ipr, vip, idx)
        except (OSError, NetlinkError) as e:
            raise _fail(f"cannot set the carrier of rank {rank} of job {job} {'up' if up else 'down'}", e) from e
    log.info("rank %s/%s: carrier %s", job, rank, "up" if up else "down")


def delete_rank_netns(node: str, job: str, rank: int) -> None:
    """Remove the rank's veth, netns and node routes; nothing to do if they are gone."""
    _require_caps()
    veth = _veth_name(node, job, rank)
    path = netns_path(netns_name(node, job, rank))
    with _lock:
        try:
            with _ipr() as ipr:
                idx = _link_index(ipr, veth)
                vip = _vip_of(ipr, idx, path) if idx is not None else None
                if idx is not None:
                    # Deleting one end destroys the pair, even if processes still hold the rank netns open.
                    _ignore((errno.ENODEV,), ipr.link, "del", index=idx)
                if vip is not None:
                    _forget_route(vip)
                    _ignore(
                        (errno.ESRCH,),
                        ipr.route,
                        "del",
                        dst=f"{vip}/32",
                        type="blackhole",
                        priority=BLACKHOLE_METRIC,
                        proto=RTPROT_CKPTD,
                    )
        except (OSError, NetlinkError) as e:
            raise _fail(f"cannot remove the network of rank {rank} of job {job}", e) from e
        if os.path.lexists(path):
            try:
                _remove_netns(path)  # unmount + unlink; the netns itself dies with its last process
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _fail(f"cannot remove network namespace {path}", e) from e
            log.info("rank %s/%s: removed netns %s", job, rank, path)


def reserve_vips(vips: list[str]) -> None:
    """An "unreachable" route for each VIP of the job, under the real ones
    (those put in here in the last INSTALLED_FOR_S are left as they are)."""
    _require_caps()
    for vip in vips:
        _check_vip(vip)
    with _lock:
        now = time.monotonic()
        todo = [vip for vip in vips if not _fresh(_reserved.get(vip), now)]
        if not todo:
            return
        try:
            with _ipr() as ipr:
                for vip in todo:
                    ipr.route("replace", dst=f"{vip}/32", type="unreachable", priority=RESERVED_METRIC,
                              proto=RTPROT_CKPTD)  # fmt: skip
                    _reserved[vip] = now
        except (OSError, NetlinkError) as e:
            raise _fail("cannot reserve the job's addresses", e) from e


def set_job_routes(local_node_ip: str, ranks: list[RankAddress]) -> None:
    """Route the VIPs of ranks on other nodes via those nodes (local ranks are
    routed by create_rank_netns); a route put in here in the last
    INSTALLED_FOR_S, via the same node, is left as it is."""
    _require_caps()
    remote = [r for r in ranks if r.node_ip and r.node_ip != local_node_ip]
    for r in remote:
        _check_vip(r.vip)
    with _lock:
        now = time.monotonic()
        todo = [r for r in remote if not _routed_via(r.vip, r.node_ip, now)]
        if not todo:
            return
        try:
            with _ipr() as ipr:
                for r in todo:
                    try:
                        ipr.route("replace", dst=f"{r.vip}/32", gateway=r.node_ip, proto=RTPROT_CKPTD)
                        _via[r.vip] = (r.node_ip, now)
                    except NetlinkError as e:
                        if e.code == errno.ENETUNREACH:
                            raise RankNetError(
                                f"cannot route rank {r.rank} ({r.vip}) via {r.node_ip}: "
                                "that node IP is not on a directly connected network of this node"
                            ) from e
                        raise
                    log.debug("route %s/32 via %s (rank %s)", r.vip, r.node_ip, r.rank)
        except (OSError, NetlinkError) as e:
            raise _fail("cannot set the job's routes", e) from e
