"""Round trips of whole process trees: every process checkpointed together,
all of them SIGKILLed, the tree rebuilt (same pids, parents, sessions and
groups, the pipes, sockets and shared memory between them, the bytes in
flight), and the final output byte for byte an uninterrupted run's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CKPTCTL, PYTHON, WORKLOADS, Ckptd, kill_restart_twice, run_plain

MARKS = (50, 150, 250, 350, 500)  # progress at which to checkpoint (3x), kill, kill again


def round_trip(c: Ckptd, job: str, argv: list[str], mark: str, nprocs: int, *, at: tuple[int, ...] = MARKS) -> str:
    """The job's final stdout after kill_restart_twice at progress marks
    mark.format(n); at least nprocs processes in every checkpoint."""
    c.launch(job, argv)
    infos = kill_restart_twice(c, job, mark.format, at)
    assert all(i["processes"] >= nprocs for i in infos), infos
    assert c.wait(job) == 0
    return c.log(job, "stdout")


def test_fork_pipes_shared_anonymous_memory(ckptd: Ckptd) -> None:
    argv = [PYTHON, str(WORKLOADS / "tree_pipes.py"), "700"]
    plain = run_plain(argv)
    assert round_trip(ckptd, "tree", argv, r"^step {} ", 2) == plain.stdout
    assert plain.stdout.splitlines()[-1].startswith("child exit 7 ")


def test_multiprocessing_pool_queue_shared_memory_pipe(ckptd: Ckptd) -> None:
    argv = [PYTHON, str(WORKLOADS / "mp_pool.py"), "600"]
    plain = run_plain(argv)
    # the parent, the producer Process and two Pool workers
    assert round_trip(ckptd, "mp", argv, r"^step {} ", 4) == plain.stdout


def test_shell_pipeline(ckptd: Ckptd) -> None:
    # sed -u: line by line (tr would pass the records on in 4 KiB bursts, the
    # last ones only as the job ends, after the marks the test waits for)
    upper = "sed -u y/abcdefghijklmnopqrstuvwxyz/ABCDEFGHIJKLMNOPQRSTUVWXYZ/"
    pipeline = f"{PYTHON} {WORKLOADS / 'producer.py'} 700 | {upper} | {PYTHON} {WORKLOADS / 'consumer.py'}"
    argv = ["bash", "-c", pipeline]
    plain = run_plain(argv)
    assert round_trip(ckptd, "pipe", argv, r"^consumed {} ", 3) == plain.stdout


def test_unix_sockets_with_data_in_flight(ckptd: Ckptd, tmp_path: Path) -> None:
    argv = [PYTHON, str(WORKLOADS / "unix_ipc.py"), "700"]
    plain = run_plain([*argv, str(tmp_path / "ref.sock")])
    got = round_trip(ckptd, "unix", [*argv, str(tmp_path / "job.sock")], r"^round {} ", 2)
    assert got == plain.stdout
    assert "passed: via scm_rights" in got


def test_unix_socket_directory_removed_before_restart(ckptd: Ckptd, tmp_path: Path) -> None:
    """multiprocessing binds its listeners in /tmp/pymp-* directories and
    removes them at exit: a restart makes the directory of a bound socket
    again rather than fail."""
    argv = [PYTHON, str(WORKLOADS / "unix_ipc.py"), "500"]
    plain = run_plain([*argv, str(tmp_path / "ref.sock")])
    sockdir = tmp_path / "pymp-like" / "sub"
    sockdir.mkdir(parents=True)
    ckptd.launch("gone", [*argv, str(sockdir / "listener")])
    ckptd.wait_log("gone", r"^round 100 ")
    ckptd.checkpoint("gone")
    ckptd.kill9("gone")
    shutil.rmtree(tmp_path / "pymp-like")
    ckptd.ctl("restart", "gone")
    assert ckptd.wait("gone") == 0
    assert ckptd.log("gone", "stdout") == plain.stdout
    assert (sockdir / "listener").is_socket()


def test_lifecycle_fifo_memfd_sessions_signals_spawn(ckptd: Ckptd, tmp_path: Path) -> None:
    ref, live = tmp_path / "ref", tmp_path / "live"
    ref.mkdir()
    live.mkdir()
    argv = [PYTHON, str(WORKLOADS / "lifecycle.py"), "700"]
    plain = run_plain([*argv, str(ref)])
    got = round_trip(ckptd, "life", [*argv, str(live)], r"^round {} ", 3)
    assert got == plain.stdout
    assert "zombie exit 5" in got and "grouped exit 9" in got


def test_tcp_loopback_between_processes(ckptd: Ckptd) -> None:
    argv = [PYTHON, str(WORKLOADS / "tcp_ipc.py"), "700"]
    plain = run_plain(argv)
    assert round_trip(ckptd, "tcp", argv, r"^round {} ", 2) == plain.stdout
    # what the checkpoint holds, as `ckptctl inspect` shows it
    shown = ckptd.ctl("inspect", ckptd.ctl_json("list", "tcp")[0]["path"]).stdout
    assert "listening on 127.0.0.1:" in shown and "listening on [0000:" in shown
    assert re.search(r"pid \d+ \(parent 2\)", shown) and " -> 127.0.0.1:" in shown


def test_tcp_restarted_many_times_loses_no_byte(ckptd: Ckptd) -> None:
    """Six checkpoint, kill, restart cycles at different moments of a TCP
    exchange with Nagle on: bytes an ACK releases while the processes are
    being dumped must land in exactly one image (the SETTLE step)."""
    argv = [PYTHON, str(WORKLOADS / "tcp_ipc.py"), "900"]
    plain = run_plain(argv)
    ckptd.launch("tcpn", argv)
    for n in (60, 160, 260, 360, 460, 560):
        ckptd.wait_log("tcpn", rf"^round {n} ")
        ckptd.checkpoint("tcpn")
        ckptd.kill9("tcpn")
        ckptd.ctl("restart", "tcpn")
    assert ckptd.wait("tcpn") == 0
    assert ckptd.log("tcpn", "stdout") == plain.stdout


def test_checkpoints_while_children_come_and_go(ckptd: Ckptd) -> None:
    """fork/exit/wait, subprocess and posix_spawn many times a second: every
    checkpoint lands on a consistent tree, whatever is being created or reaped."""
    argv = [PYTHON, str(WORKLOADS / "busy.py"), "900"]
    plain = run_plain(argv)
    ckptd.launch("busy", argv)
    ckptd.wait_log("busy", r"^round 100 ")
    infos = [ckptd.checkpoint("busy") for _ in range(6)]
    assert [i["id"] for i in infos] == [1, 2, 3, 4, 5, 6]
    ckptd.kill9("busy")
    ckptd.ctl("restart", "busy")
    ckptd.wait_log("busy", r"^round 700 ")
    ckptd.kill9("busy")
    ckptd.ctl("restart", "busy", "--from", "2")
    assert ckptd.wait("busy") == 0
    assert ckptd.log("busy", "stdout") == plain.stdout


# ---- PyTorch (CPU): installed only for these tests ----


def torch_env(c: Ckptd, torch_path: str) -> dict[str, str]:
    if torch_path:
        c.env["PYTHONPATH"] = torch_path
    return {"PYTHONPATH": torch_path} if torch_path else {}


def test_torch_dataloader_workers(ckptd: Ckptd, torch_path: str, tmp_path: Path) -> None:
    env = torch_env(ckptd, torch_path)
    ref, live = tmp_path / "ref", tmp_path / "live"
    ref.mkdir()
    live.mkdir()
    argv = [PYTHON, str(WORKLOADS / "torch_dataloader.py"), "40"]
    plain = run_plain([*argv, str(ref)], env=env)
    got = round_trip(ckptd, "dl", [*argv, str(live)], r"^step {} ", 3)
    assert got == plain.stdout
    assert (live / "model.pt").read_bytes() == (ref / "model.pt").read_bytes()


def test_torchrun_gloo_two_ranks(ckptd: Ckptd, torch_path: str) -> None:
    """torchrun's agent and its two ranks: the TCPStore and gloo's TCP
    connections over loopback, checkpointed in the middle of all_reduces."""
    env = torch_env(ckptd, torch_path)
    run = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2"]

    def argv(port: int) -> list[str]:
        return [*run, "--master-port", str(port), str(WORKLOADS / "ddp_gloo.py"), "700"]

    plain = run_plain(argv(29531), env=env)
    got = round_trip(ckptd, "ddp", argv(29532), r"^step {} ", 3)
    assert plain.stdout.splitlines()[-1].endswith("ranks agree True")
    assert got == plain.stdout


def test_descriptors_in_flight_retry_then_refuse(ckptd: Ckptd, tmp_path: Path) -> None:
    """A descriptor in flight in a Unix socket's queue whose kind ckptd
    cannot save (a UDP socket; a pipe's end beside it would be saved,
    test_in_flight.py) keeps the passing refusal.  The coordinator aborts
    the round (the job runs on), waits a moment and tries again: once the
    process has taken the descriptors, the checkpoint succeeds without the
    caller seeing the failures.  A descriptor that stays in flight through
    every try is refused with a clear error, no checkpoint is recorded, and
    the job's output is unharmed."""
    c = ckptd
    argv = [PYTHON, str(WORKLOADS / "fd_in_flight.py"), "300"]
    ref_flag = tmp_path / "ref.flag"
    ref_flag.touch()
    plain = run_plain([*argv, str(ref_flag)])

    # in flight through every try: refused, nothing committed, the job runs on
    flag = tmp_path / "flag"
    c.launch("scm", [*argv, str(flag)])
    c.wait_log("scm", r"^sent$")
    failed = c.ctl("checkpoint", "scm", check=False)
    assert failed.returncode == 4, failed.stderr
    assert "file descriptor in flight" in failed.stderr and "UDP" in failed.stderr, failed.stderr
    assert re.search(r"tried ([5-9]|\d\d+) times", failed.stderr), failed.stderr  # for 10 s, not 4 tries
    assert c.ctl_json("list", "scm") == []
    assert c.status("scm")["state"] == "running"

    # taken between two tries: the checkpoint succeeds
    attempt = subprocess.Popen(
        [CKPTCTL, "checkpoint", "scm", "--json"], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while "trying again" not in c.status("scm").get("operation", ""):
        assert time.monotonic() < deadline and attempt.poll() is None, attempt.communicate()
        time.sleep(0.05)
    flag.touch()
    out, err = attempt.communicate(timeout=120)
    assert attempt.returncode == 0, err
    assert json.loads(out)["id"] == 1
    c.wait_log("scm", r"^step 100 ")
    c.kill9("scm")
    c.ctl("restart", "scm")
    assert c.wait("scm") == 0
    assert c.log("scm", "stdout") == plain.stdout


def test_short_lived_children_never_fail_a_checkpoint(ckptd: Ckptd) -> None:
    """Children that exit while a checkpoint parks the tree (gone, or zombies
    not yet reaped) are left out of it, not a reason to fail it."""
    argv = [PYTHON, str(WORKLOADS / "short_lived.py"), "900"]
    ckptd.launch("brief", argv)
    ckptd.wait_log("brief", r"^round 5 ")
    for _ in range(20):  # one in 30 failed before ("process N is gone ([Errno 32] Broken pipe)")
        ckptd.checkpoint("brief")  # an AssertionError if one is refused
        assert ckptd.status("brief")["state"] == "running"
    assert len(ckptd.ctl_json("list", "brief")) == 20
    ckptd.ctl("kill", "brief")


def test_restart_of_a_process_parked_inside_fork(ckptd: Ckptd) -> None:
    """A checkpoint often parks the parent inside fork's handlers, holding the
    shim's connection lock; its restored copy used to wait for that lock
    before its first HELLO, and the restart hung for a minute (one restart in
    five of this job).  Six restarts, each from a checkpoint taken amid 30
    forks, and the output is what an uninterrupted run prints."""
    rounds = 300
    argv = [PYTHON, str(WORKLOADS / "short_lived.py"), str(rounds)]
    ckptd.launch("forks", argv)
    ckptd.wait_log("forks", r"^round 5 ")
    for _ in range(6):
        for _ in range(2):
            ckptd.checkpoint("forks")
        ckptd.kill9("forks")
        ckptd.ctl("restart", "forks", timeout=40)
        assert ckptd.status("forks")["state"] == "running"
    assert ckptd.wait("forks") == 0
    # each round's 30 children exit with i % 7: 85 a round
    assert ckptd.log("forks", "stdout").splitlines() == [f"round {r} total {85 * (r + 1)}" for r in range(rounds)]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="pid namespaces: root and unshare")
def test_a_jobs_processes_are_found_in_its_namespace_and_the_ones_nested_in_it() -> None:
    """The agent reads the stat of the processes in a job's pid namespace
    (agent/runtime.py ProcTable), and of those in a namespace nested in it:
    it finds what a pass over every process finds, down to a process two
    namespaces deep, and nothing of another namespace."""
    from ckptd.agent.runtime import ProcTable, job_pid_ns

    # like ckptd-init: a relay in this namespace, its child pid 1 of a new one; and one nested deeper
    job = subprocess.Popen(["unshare", "--pid", "--fork", "--", "unshare", "--pid", "--fork", "sleep", "60"])
    other = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        table = ProcTable()
        while len(table.descendants(job.pid)) < 2 or not table.descendants(other.pid):
            assert time.monotonic() < deadline, "the unshare processes never started"
            time.sleep(0.05)
        ns = job_pid_ns(job.pid)
        assert ns and ns.startswith("pid:[") and ns != job_pid_ns(os.getpid()), ns
        every = [(e.pid, e.ppid, e.comm) for e in table.descendants(job.pid)]
        assert [comm for _, _, comm in every] == ["unshare", "sleep"], every
        assert [(e.pid, e.ppid, e.comm) for e in table.descendants(job.pid, ns=ns)] == every
        theirs = {e.pid for e in table.descendants(other.pid)}
        read = {e.pid for entries in table.children(ns).values() for e in entries}
        assert theirs and not theirs & read, (theirs, read)  # another job's: passed over
        assert os.getpid() not in read  # nor this namespace's
    finally:
        for p in (job, other):
            for e in ProcTable().descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e.pid, signal.SIGKILL)
            p.kill()
            p.wait()
