"""Process and thread attributes come back exactly after a restart, or the
checkpoint is refused naming them (issue 18, "Exact or refused"): the
program (tests/workloads/proc_attrs.c) checks its own state at every step,
before the checkpoint and after the restart."""

from __future__ import annotations

import os

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip, reachable_by_others
from test_bad_input import assert_refused

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="sets attributes only root may set (loginuid, uids)")


@pytest.fixture(scope="module")
def proc_attrs(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "proc_attrs")


@pytest.mark.parametrize(
    "attr",
    [
        *("subreaper", "pdeathsig", "oom", "thp", "loginuid", "timerslack", "keepcaps", "dumpable", "nnp"),
        "nice,cpus,batch",
    ],
)
def test_process_attribute(ckptd: Ckptd, proc_attrs: str, attr: str) -> None:
    """One attribute set (the others stay at their defaults, and are checked
    too): child subreaper, parent-death signal, oom_score_adj, THP-disable,
    audit loginuid, timer slack (two threads, each its own), keep-caps,
    dumpable, no_new_privs; and each thread's own scheduling (nice value,
    CPU affinity, SCHED_BATCH), which a restart used to give back as the
    node's."""
    exact_round_trip(ckptd, attr.replace(",", "-"), [proc_attrs, "40", "attrs", attr])


def test_rseq_glibc(ckptd: Ckptd, proc_attrs: str) -> None:
    """glibc's rseq registration comes back with its area, length and signature."""
    exact_round_trip(ckptd, "rseq", [proc_attrs, "40", "rseq"])


def test_rseq_own(ckptd: Ckptd, proc_attrs: str) -> None:
    """A program's own rseq area (glibc's turned off) is registered again."""
    argv = ["env", "GLIBC_TUNABLES=glibc.pthread.rseq=0", proc_attrs, "40", "rseq-own"]
    exact_round_trip(ckptd, "rseqown", argv)


def test_root_job_dropping_privileges(ckptd: Ckptd, proc_attrs: str) -> None:
    """A root job that switches to other uids, gids, groups and capabilities
    (and forks a child as the new uid, which says HELLO as that uid) is
    checkpointed and comes back with them, in every thread.  Its processes
    write their images as the uid they took: the checkpoint directory must
    be reachable by it."""
    ckpt_dir = ckptd.home / "checkpoints"
    ckpt_dir.mkdir(mode=0o711, exist_ok=True)
    ckpt_dir.chmod(0o711)
    with reachable_by_others(ckpt_dir):
        exact_round_trip(ckptd, "creds", [proc_attrs, "40", "creds"])


def test_seccomp_refused(ckptd: Ckptd, proc_attrs: str) -> None:
    ckptd.launch("seccomp", [proc_attrs, "600", "seccomp"])
    ckptd.wait_log("seccomp", r"^step 2 ok")
    assert_refused(ckptd, "seccomp", "seccomp")


def test_pending_siginfo(ckptd: Ckptd, proc_attrs: str) -> None:
    """Signals pending at the checkpoint come back with their siginfo (code,
    sender, value), every queued instance of an RT signal in its order, and
    a thread's own on that thread."""
    exact_round_trip(ckptd, "sigqueue", [proc_attrs, "40", "sigqueue"])
