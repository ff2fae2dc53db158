"""Descriptors in flight in a Unix socket (issue 19): messages that carry
descriptors (SCM_RIGHTS sent, not yet received) are saved with their bytes
at the boundaries they were sent with, and after a restart the receiver
gets the same bytes and equivalent descriptors: a pipe's read end with its
bytes, a file at its offset that is still one open file description with
the sender's copy, a socket with its own queue (tests/workloads/in_flight.c).
On a stream, descriptors are saved when their bytes follow the queue's head
or other descriptors' bytes (a peek cannot see where they start otherwise).
What cannot be sent again stays a passing refusal (retried, then refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Ckptd, compile_workload, run_plain
from test_bad_input import assert_refused

from ckptd.image.core import constant
from ckptd.image.plan import load_processes

STEPS = "12"  # received at step 8 (RECV_AT), once the test says so


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "in_flight")


def _round_trip(c: Ckptd, exe: str, tmp_path: Path, job: str, mode: str) -> str:
    """conftest.exact_round_trip, but the job receives only once it is
    restarted (the reference at once): whatever the checkpoint's pace, the
    descriptors are in flight when it is taken."""
    ref_flag, flag = tmp_path / "ref.flag", tmp_path / "flag"
    ref_flag.touch()
    plain = run_plain([exe, STEPS, mode, str(tmp_path), str(ref_flag)])
    c.launch(job, [exe, STEPS, mode, str(tmp_path), str(flag)])
    c.wait_log(job, r"^step 3 ok")
    c.checkpoint(job)
    c.wait_log(job, r"^step 6 ok")
    c.kill9(job)
    c.ctl("restart", job)
    flag.touch()
    rc = c.wait(job)
    out = c.log(job)
    assert rc == 0 and "BAD " not in out, out[-2000:]
    assert c.log(job, "stdout") == plain.stdout
    ckpt = Path(c.ctl_json("list", job)[-1]["path"])
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["attempts"] == 1  # saved, not waited for
    in_flight = [
        int(fd.type)
        for p in load_processes(ckpt, manifest)
        for fd in p.core.records["fds"]
        if fd.flags & constant("CK_FDF_IN_FLIGHT")
    ]
    assert len(in_flight) == 3, in_flight  # the pipe's end, the file, the socket
    return out


def test_descriptors_in_flight_on_a_stream(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    out = _round_trip(ckptd, exe, tmp_path, "ifs", "stream")
    assert 'received "B" with 2 descriptors' in out and "parent: file at 6" in out


def test_descriptors_in_flight_on_datagrams(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    out = _round_trip(ckptd, exe, tmp_path, "ifd", "dgram")
    assert 'received "" with 1 descriptors' in out and "parent: file at 6" in out


def test_stream_descriptors_after_bytes_stay_refused(ckptd: Ckptd, exe: str, tmp_path: Path) -> None:
    """On a stream, "AAAA" then "B" sent with a descriptor: a peek shows where
    the descriptor's bytes end, never where they start, so they are not
    saved: a passing state, retried for the checkpoint's timeout, then
    refused with the reason while the job runs on, nothing committed.  (A
    socket in flight that carries descriptors in flight itself is refused
    the same way: mode "nested".)"""
    ckptd.launch("ifw", [exe, "200", "wide", str(tmp_path)])
    ckptd.wait_log("ifw", r"^step 2 ok")
    assert_refused(ckptd, "ifw", "file descriptors in flight", "boundary", "tried")
    assert ckptd.ctl_json("list", "ifw") == []
    ckptd.ctl("kill", "ifw")
