"""The network between nodes cut (issue 20's fault-injection matrix): a
node's cable pulled (its port on the fabric set down) during a multi-node
checkpoint round and during a restart onto another node.

What the ranks' TCP connections carry is saved in repair mode, one end at
a time (ARCHITECTURE.md, "TCP between ranks"), and the coordinator talks to
the agents on their own sockets, so a round with the cable out has no
reason to fail: either it commits a checkpoint that restores byte-identical,
or it fails with a one-line error naming the rank and commits nothing.
Either way the job runs on, its ranks' connections survive the cut (TCP
retransmits), and once the cable is back a new checkpoint succeeds and
restores byte-identical.  Same cluster as tests/test_multinode.py (fixed
namespace names: serial)."""

from __future__ import annotations

import json
import os
import shutil
import time

import faultmatrix
import pytest
from conftest import PYTHON
from test_multinode import DP, MultiNode, assert_identical, plain_run, three_nodes

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces for nodes need root"),
    pytest.mark.skipif(shutil.which("nsenter") is None, reason="nsenter (util-linux) not installed"),
    pytest.mark.slow,
    pytest.mark.serial,
]

__all__ = ["three_nodes"]  # the fixture, used by name

ROUND = (
    "the round commits a checkpoint that restores byte-identical, or fails with a one-line error and commits "
    "nothing; the job runs on and goes on once the link is back; a new checkpoint restores byte-identical"
)
RESTART = (
    "the restart onto another node rebuilds every rank; the ranks wait for the link (TCP retransmits) and "
    "the job ends byte-identical to an uninterrupted run"
)


def step_of(m: MultiNode, job: str, rank: int) -> int:
    lines = [ln for ln in m.rank_output(job, rank).decode().splitlines() if ln.startswith("step")]
    return int(lines[-1].split()[1]) if lines else 0


@faultmatrix.cell("network between nodes cut (veth down)", "drain", ROUND)
def test_checkpoint_round_with_the_cable_pulled(three_nodes: MultiNode) -> None:
    m = three_nodes
    args = ["--steps", "400", "--delay", "0.02", "--dim", "4096"]
    expected = plain_run(2, args)
    m.launch("cut", [PYTHON, DP, *args], "--nodes", "a,b")
    m.wait_line("cut", 1, b"step   20")
    assert m.checkpoint("cut")["id"] == 1
    m.cluster.set_link("b", up=False)
    try:
        time.sleep(0.5)  # the ranks' all-reduce is stuck in flight now
        stuck = step_of(m, "cut", 1)
        p = m.ctl("checkpoint", "cut", "--timeout", "20", "--json", check=False)
        st = m.status("cut")
        assert st["state"] == "running", st  # the job runs on
        assert step_of(m, "cut", 1) <= stuck + 1  # (and really was cut off)
    finally:
        m.cluster.set_link("b", up=True)
    listed = [c["id"] for c in m.checkpoints("cut")]
    if p.returncode == 0:
        during = json.loads(p.stdout)
        assert listed == [1, during["id"]], listed
        shown = json.loads(m.ctl("inspect", during["path"], "--verify", "--json").stdout)
        assert shown["verified"]
    else:
        during = None
        err = p.stderr.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert listed == [1], listed  # nothing committed
        assert not list((m.storage / "cut").glob(".ckpt-*")), "a failed round left its directory"
    # the link is back: the ranks go on, and a new round succeeds
    m.wait_line("cut", 1, f"step {stuck + 40:4d}".encode(), timeout=120)
    after = m.checkpoint("cut")
    m.cluster.kill_node("b")
    m.wait_state("cut", ("lost", "failed"))
    # the checkpoint taken with the cable out, when there is one: it must restore as well as any
    chosen = during or after
    resp = json.loads(m.ctl("restart", "cut", "--from", str(chosen["id"]), "--on", "1=c", "--json").stdout)
    assert resp["checkpoint"]["id"] == chosen["id"]
    assert_identical(m, "cut", expected)


@faultmatrix.cell("network between nodes cut (veth down)", "release", RESTART)
def test_restart_on_another_node_with_its_cable_pulled(three_nodes: MultiNode) -> None:
    m = three_nodes
    args = ["--steps", "300", "--delay", "0.02", "--dim", "4096"]
    expected = plain_run(2, args)
    m.launch("rcut", [PYTHON, DP, *args], "--nodes", "a,b")
    m.wait_line("rcut", 1, b"step   20")
    info = m.checkpoint("rcut")
    m.wait_line("rcut", 1, b"step   40")
    m.cluster.kill_node("b")
    m.wait_state("rcut", ("lost", "failed"))
    m.cluster.set_link("c", up=False)  # the node the rank moves to cannot reach rank 0 yet
    try:
        resp = json.loads(m.ctl("restart", "rcut", "--on", "1=c", "--json").stdout)
        assert resp["checkpoint"]["id"] == info["id"]
        assert [(r["rank"], r["node"]) for r in resp["status"]["ranks"]] == [(0, "a"), (1, "c")]
        time.sleep(2)
        assert m.status("rcut")["state"] == "running"
    finally:
        m.cluster.set_link("c", up=True)
    assert_identical(m, "rcut", expected)
