"""Incremental checkpoints: after a full one, each checkpoint writes only the
pages written since its parent and takes the others from earlier
checkpoints.  Round trips from chains of 1, 2 and 10 incrementals, after
retention has removed what no kept checkpoint needs, and with a link of a
chain deleted by hand."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

from conftest import CKPTD, PYTHON, WORKLOADS, Ckptd, run_plain
from google.protobuf import json_format

from ckptd.daemon import coordinator_address
from ckptd.paths import Home
from ckptd.rpc import call, coordinator_stub
from ckptd.v1 import ckptd_pb2 as pb

DIRTY = [PYTHON, str(WORKLOADS / "dirty_pages.py"), "400", "32"]  # 32 MiB, 1% of its pages a step


def checkpoints_at(c: Ckptd, job: str, steps: range, *, rpc: bool = False) -> list[dict[str, Any]]:
    """A checkpoint at each step; rpc: through the coordinator's API instead
    of ckptctl, whose start-up (half a second) would let a long series fall
    behind the job."""
    stub = coordinator_stub(coordinator_address(Home(c.home), start=False)) if rpc else None
    infos = []
    done = -2
    for wanted in steps:
        # A test that starts late (or a machine under load) finds every step
        # printed already: each checkpoint still comes after a whole step the
        # job ran after the last capture, so that its incremental image holds
        # pages the job changed in between.  `done` is read once the last
        # checkpoint has answered, so its capture came before step done+1 was
        # printed, and step done+2 changed its pages after that print.
        c.wait_log(job, rf"^step {max(wanted, done + 2)} ")
        if stub is None:
            infos.append(c.checkpoint(job))
        else:
            info = call(stub.Checkpoint, pb.CheckpointRequest(job=job), 120, "coordinator")
            infos.append(json_format.MessageToDict(info, preserving_proto_field_name=True))
        log = c.log_file(job).read_text(errors="replace")  # as wait_log reads it: fast
        done = max(int(n) for n in re.findall(r"(?m)^step (\d+) ", log))
    return infos


def restart_and_finish(c: Ckptd, job: str, *args: str) -> str:
    if c.status(job)["state"] in ("running", "checkpointing"):
        c.kill9(job)
    c.ctl("restart", job, *args)
    assert c.wait(job) == 0
    return c.log(job, "stdout")


def test_chain_of_ten_incrementals_and_shorter_chains(ckptd: Ckptd) -> None:
    c = ckptd
    plain = run_plain(DIRTY)
    c.launch("inc", DIRTY, "--full-every", "16")
    infos = checkpoints_at(c, "inc", range(20, 240, 20), rpc=True)  # 11: a full one and 10 incrementals
    listed = {i["name"]: i for i in c.ctl_json("list", "inc")}
    full = listed[infos[0]["name"]]
    assert full["parent"] == "" and full["logical_bytes"] == full["size_bytes"] > 32 << 20
    for prev, cur in itertools.pairwise(infos):
        entry = listed[cur["name"]]
        assert entry["parent"] == prev["name"]
        assert infos[0]["name"] in entry["depends_on"]
        # about 20% of the buffer's pages changed between two checkpoints (20 steps of 1%), plus
        # the interpreter's own churn: far less than the full image, while what it restores is the same
        assert entry["size_bytes"] < full["size_bytes"] * 0.45, entry
        assert entry["logical_bytes"] > full["size_bytes"] * 0.9, entry

    # the newest: a chain of 10 incrementals on top of the full one
    assert restart_and_finish(c, "inc") == plain.stdout
    # a chain of 2, then of 1
    assert restart_and_finish(c, "inc", "--from", str(infos[2]["id"])) == plain.stdout
    assert restart_and_finish(c, "inc", "--from", str(infos[1]["id"])) == plain.stdout


def test_the_first_checkpoint_after_a_restart_builds_on_the_one_it_came_from(ckptd: Ckptd) -> None:
    """The restorer write-protects the memory it rebuilds before anything
    runs in it and each restored process takes its image as its last one
    (ADOPT, native/shim/track.c): the first checkpoint after a restart is
    an incremental one on the checkpoint restored from, not a full one.  A
    chain that spans two restarts restores the uninterrupted run's output
    (its last line is the buffer's sha256: a stale page would show), from
    its newest link and from each earlier one.  Restarted from an older
    link than the newest, the next checkpoint builds on that link."""
    c = ckptd
    plain = run_plain(DIRTY)
    c.launch("adopt", DIRTY, "--full-every", "16")
    chain = checkpoints_at(c, "adopt", range(20, 21))  # the full one
    for upto in (60, 100):
        c.kill9("adopt")
        c.ctl("restart", "adopt")  # from the newest: the chain's last link
        chain += checkpoints_at(c, "adopt", range(upto - 20, upto + 1, 20))  # two after each restart
    listed = {i["name"]: i for i in c.ctl_json("list", "adopt")}
    full = listed[chain[0]["name"]]
    assert full["parent"] == "" and full["size_bytes"] > 32 << 20
    for prev, cur in itertools.pairwise(chain):
        entry = listed[cur["name"]]
        assert entry["parent"] == prev["name"], entry
        assert chain[0]["name"] in entry["depends_on"], entry
        # 20 steps of 1% of the buffer's pages and the interpreter's churn: far less than everything
        assert entry["size_bytes"] < full["size_bytes"] * 0.45, entry
        assert entry["logical_bytes"] > full["size_bytes"] * 0.9, entry
    # from an older link (the first after the first restart): the next one builds on it, not on the newest
    c.kill9("adopt")
    c.ctl("restart", "adopt", "--from", str(chain[1]["id"]))
    (older,) = checkpoints_at(c, "adopt", range(60, 61))  # the log was cut back to the link's step
    entry = {i["name"]: i for i in c.ctl_json("list", "adopt")}[older["name"]]
    assert entry["parent"] == chain[1]["name"], entry
    assert entry["size_bytes"] < full["size_bytes"] * 0.45 < full["size_bytes"] * 0.9 < entry["logical_bytes"], entry
    assert restart_and_finish(c, "adopt") == plain.stdout  # from it
    for info in (chain[1], chain[3]):  # the first link after each restart
        assert restart_and_finish(c, "adopt", "--from", str(info["id"])) == plain.stdout


def test_small_incrementals_are_staged_and_restore(ckptd: Ckptd) -> None:
    """An incremental image small next to the process (here a few 0.25%
    steps of 256 MiB) is staged: copied aside while the job is parked and
    written after it resumes (native/shim/writeout.c); a full one is written
    by a forked writer.  Both restore to the uninterrupted run's output."""
    big = [PYTHON, str(WORKLOADS / "dirty_pages.py"), "100", "256", "0.25", "0.1"]
    plain = run_plain(big)
    ckptd.launch("stg", big, "--full-every", "16")
    infos = checkpoints_at(ckptd, "stg", range(10, 16, 2), rpc=True)
    capture = {}
    for info in infos:
        manifest = json.loads((Path(info["path"]) / "manifest.json").read_text())
        main = next(p for p in manifest["processes"] if p["pid"] == 2)
        capture[info["name"]] = main["capture"]
    modes = list(capture.values())
    assert modes[0] == "writer" and "staged" in modes[1:], capture
    staged = next(i for i in infos if capture[i["name"]] == "staged")
    ckptd.ctl("inspect", "--verify", staged["path"])
    assert restart_and_finish(ckptd, "stg", "--from", str(staged["id"])) == plain.stdout


def test_full_every_starts_new_chains_and_retention_keeps_what_they_need(ckptd: Ckptd) -> None:
    c = ckptd
    plain = run_plain(DIRTY)
    c.launch("gc", DIRTY, "--full-every", "3")
    infos = checkpoints_at(c, "gc", range(20, 140, 20))  # 6: chains [1, 2, 3] and [4, 5, 6]
    listed = c.ctl_json("list", "gc")
    names = [i["name"] for i in listed]
    assert [i["parent"] for i in listed] == ["", names[0], names[1], "", names[3], names[4]]
    # retention keeps the newest and what its pages come from: the second chain
    kept = c.ctl_json("prune", "gc", "--keep", "1")
    assert [i["id"] for i in kept] == [4, 5, 6], kept
    assert restart_and_finish(c, "gc") == plain.stdout

    # a link of the chain removed by hand: the checkpoints that need it are refused with a
    # clear error, a plain restart takes the newest one that is complete
    c.launch("gc2", DIRTY, "--full-every", "3")
    infos = checkpoints_at(c, "gc2", range(20, 100, 20))  # [1, 2, 3] and [4]
    shutil.rmtree(infos[1]["path"])
    c.kill9("gc2")
    refused = c.ctl("restart", "gc2", "--from", "3", check=False)
    assert refused.returncode == 5, refused.stderr
    assert f"builds on {infos[1]['name']}, which is missing" in refused.stderr
    assert c.status("gc2")["state"] == "failed"  # nothing was started
    assert restart_and_finish(c, "gc2") == plain.stdout  # from 4, a full one


def test_full_every_one_and_bad_values(ckptd: Ckptd) -> None:
    c = ckptd
    bad = c.run(CKPTD, "launch", "--detach", "--job", "x", "--full-every", "0", "--", "true", check=False)
    assert bad.returncode == 2 and "--full-every must be at least 1" in bad.stderr
    c.launch("full", DIRTY, "--full-every", "1")
    checkpoints_at(c, "full", range(20, 80, 20))
    listed = c.ctl_json("list", "full")
    assert [i["parent"] for i in listed] == ["", "", ""]
    assert all(i["logical_bytes"] == i["size_bytes"] for i in listed)
    c.kill9("full")
    c.ctl("restart", "full")
    assert c.wait("full") == 0


def test_page_hashes_where_write_protection_is_not_used(ckptd: Ckptd) -> None:
    """CKPTD_TRACK=hash: the fallback for kernels without asynchronous
    userfaultfd write protection finds the changed pages by their hashes.
    The images are as small as with write protection, a chain of them
    restores the same output, and so does one after a restart (the first
    checkpoint after a restore is a full one again)."""
    c = ckptd
    short = [*DIRTY[:2], "240", DIRTY[3]]
    plain = run_plain(short)
    c.env["CKPTD_TRACK"] = "hash"  # the job inherits the launcher's environment
    c.launch("hash", short, "--full-every", "16")
    infos = checkpoints_at(c, "hash", range(20, 80, 20))
    listed = {i["name"]: i for i in c.ctl_json("list", "hash")}
    full = listed[infos[0]["name"]]
    assert full["parent"] == ""
    for prev, cur in itertools.pairwise(infos):
        entry = listed[cur["name"]]
        assert entry["parent"] == prev["name"]
        assert entry["size_bytes"] < full["size_bytes"] * 0.45, entry
        assert entry["logical_bytes"] > full["size_bytes"] * 0.9, entry
    assert restart_and_finish(c, "hash") == plain.stdout  # a chain of 2 incrementals

    # restored from the first: the next checkpoints are a full one, then an incremental again
    c.ctl("restart", "hash", "--from", str(infos[0]["id"]))
    after = checkpoints_at(c, "hash", range(40, 80, 20))
    listed = {i["name"]: i for i in c.ctl_json("list", "hash")}
    assert listed[after[0]["name"]]["size_bytes"] > full["size_bytes"] * 0.9  # full: no table after a restore
    assert listed[after[1]["name"]]["size_bytes"] < full["size_bytes"] * 0.45
    assert restart_and_finish(c, "hash") == plain.stdout
