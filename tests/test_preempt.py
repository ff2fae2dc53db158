"""Launch or resume in one command, preemption signals, and a launcher that
dies: `ckptd launch --resume`, `--checkpoint-signal`, `ckptctl restart
--attach` (issue 16).  A requeued batch script runs the same command line
again; the outputs of its runs, one after the other, read as one plain run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import CKPTCTL, CKPTD, PYTHON, Ckptd, run_plain
from test_bad_input import one_line_error

PRECONDITION, USAGE = 4, 2
N = "160"  # ticks, 50 ms apart: 8 s


def resume(c: Ckptd, job: str, argv: list[str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CKPTD, "launch", "--resume", "--job", job, *extra, "--", *argv],
        env=c.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def attach(c: Ckptd, job: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CKPTCTL, "restart", job, "--attach", *extra],
        env=c.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def exited(pid: int) -> bool:
    """pid is gone, or a zombie its stopped parent (the launcher) cannot reap yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_state(c: Ckptd, job: str, state: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status(job)
        if st["state"] == state:
            return st
        time.sleep(0.1)
    raise AssertionError(f"job {job} is {c.status(job)['state']}, not {state}, after {timeout}s")


def test_resume_launches_fresh_and_is_refused_while_running(ckptd: Ckptd, counter: Path) -> None:
    plain = run_plain([PYTHON, str(counter), N])
    first = resume(ckptd, "fresh", [PYTHON, str(counter), N])
    ckptd.wait_log("fresh", r"^tick 5$")
    pids = ckptd.status("fresh")["pids"]
    second = ckptd.run(CKPTD, "launch", "--resume", "--job", "fresh", "--", PYTHON, str(counter), N, check=False)
    assert second.returncode == PRECONDITION
    one_line_error(second, "fresh", "running")
    st = ckptd.status("fresh")
    assert st["state"] == "running" and st["pids"] == pids  # untouched
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert out == plain.stdout


def test_resume_replaces_a_job_that_failed_before_any_checkpoint(ckptd: Ckptd, counter: Path) -> None:
    """A batch job killed before its first checkpoint: the requeued script's
    `launch --resume` starts it afresh, with a fresh log."""
    plain = run_plain([PYTHON, str(counter), "60"])
    ckptd.launch("early", [PYTHON, str(counter), "60"])
    ckptd.wait_log("early", r"^tick 5$")
    ckptd.kill9("early")
    assert ckptd.status("early")["state"] == "failed"
    p = resume(ckptd, "early", [PYTHON, str(counter), "60"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out == plain.stdout
    assert ckptd.log("early", "stdout") == plain.stdout  # a fresh log, not the lost run's and this one's
    assert ckptd.status("early").get("generation", 0) == 0  # a fresh job: no restart counted


def test_checkpoint_signal_usr1_exits_for_requeue_and_resume_finishes(ckptd: Ckptd, counter: Path) -> None:
    plain = run_plain([PYTHON, str(counter), N])
    argv = [PYTHON, str(counter), N]
    p = resume(ckptd, "usr1", argv, "--checkpoint-signal", "USR1")
    ckptd.wait_log("usr1", r"^tick 20$")
    p.send_signal(signal.SIGUSR1)
    out1, err1 = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGUSR1, err1
    assert "stopped after ckpt-000001" in err1
    st = ckptd.status("usr1")
    assert st["state"] == "stopped"
    p = resume(ckptd, "usr1", argv, "--checkpoint-signal", "USR1")
    out2, err2 = p.communicate(timeout=120)
    assert p.returncode == 0, err2
    assert "resumed from ckpt-000001" in err2
    assert out1 + out2 == plain.stdout  # every tick once: nothing redone, nothing lost


def test_kill9_of_the_launcher_stops_the_job_after_a_final_checkpoint(ckptd: Ckptd, counter: Path) -> None:
    plain = run_plain([PYTHON, str(counter), N])
    argv = [PYTHON, str(counter), N]
    p = resume(ckptd, "orphan", argv)
    ckptd.wait_log("orphan", r"^tick 20$")
    p.kill()
    p.communicate(timeout=30)
    wait_state(ckptd, "orphan", "stopped")
    assert [c["name"] for c in ckptd.ctl_json("list", "orphan")] == ["ckpt-000001"]
    p = resume(ckptd, "orphan", argv)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert plain.stdout.endswith(out) and out.startswith("tick ")
    assert ckptd.log("orphan", "stdout") == plain.stdout


def test_sigterm_to_every_ckptd_process_as_slurm_sends_it(ckptd: Ckptd, counter: Path) -> None:
    """scancel / scontrol requeue signal every process below the batch script:
    the launcher, the daemon it started, ckptd-init.  The daemon stays for
    the final checkpoint, then exits; the launcher exits 143."""
    plain = run_plain([PYTHON, str(counter), N])
    argv = [PYTHON, str(counter), N]
    p = resume(ckptd, "term", argv)
    ckptd.wait_log("term", r"^tick 20$")
    job_pids = set(ckptd.status("term")["pids"])
    daemons = ckptd.daemon_pids()
    assert daemons
    victims = [p.pid, *daemons, *(pid for pid in ckptd.init_pids() if pid not in job_pids)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    out1, err1 = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{d}").exists() for d in daemons):
        time.sleep(0.1)
    assert not any(Path(f"/proc/{d}").exists() for d in daemons), "the daemon did not exit after its jobs stopped"
    assert ckptd.status("term")["state"] == "stopped"  # a fresh daemon reads it back
    p = resume(ckptd, "term", argv)
    out2, err2 = p.communicate(timeout=120)
    assert p.returncode == 0, err2
    assert out1 + out2 == plain.stdout


def test_the_daemons_final_checkpoint_first_under_slurm(ckptd: Ckptd, counter: Path) -> None:
    """Under Slurm the daemon's SIGTERM may win: it takes the final
    checkpoint before the launcher (held here) asks for one.  The daemon
    stays until the launcher that started it has exited, so that it learns
    which checkpoint stopped its job: it says so and exits 143, and does not
    report a failed final checkpoint."""
    ckptd.env["SLURM_JOB_ID"] = "1"  # the daemon goes with its starter (daemon --exit-with)
    plain = run_plain([PYTHON, str(counter), N])
    argv = [PYTHON, str(counter), N]
    p = resume(ckptd, "late", argv)
    ckptd.wait_log("late", r"^tick 20$")
    daemons = ckptd.daemon_pids()
    assert daemons
    log = ckptd.home / "logs" / "daemon.log"
    os.kill(p.pid, signal.SIGSTOP)
    try:
        for d in daemons:
            os.kill(d, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "job late stopped after ckpt-000001" not in log.read_text():
            time.sleep(0.1)
        time.sleep(3)  # longer than a daemon takes to exit once it has nothing to wait for
        assert not any(exited(d) for d in daemons), "the daemon left before the launcher that started it"
        os.kill(p.pid, signal.SIGTERM)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    out1, err1 = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err1
    assert "stopped after ckpt-000001" in err1 and "failed" not in err1, err1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(exited(d) for d in daemons):
        time.sleep(0.1)
    assert all(exited(d) for d in daemons), "the daemon did not exit after its starter"
    assert ckptd.status("late")["state"] == "stopped"
    p = resume(ckptd, "late", argv)
    out2, err2 = p.communicate(timeout=120)
    assert p.returncode == 0, err2
    assert out1 + out2 == plain.stdout


def test_restart_attach_stays_in_the_foreground(ckptd: Ckptd, counter: Path) -> None:
    plain = run_plain([PYTHON, str(counter), N])
    ckptd.launch("att", [PYTHON, str(counter), N])
    ckptd.wait_log("att", r"^tick 10$")
    ckptd.checkpoint("att")
    ckptd.wait_log("att", r"^tick 30$")
    ckptd.kill9("att")
    p = attach(ckptd, "att", "--checkpoint-signal", "USR1")
    ckptd.wait_log("att", r"^tick 50$")
    p.send_signal(signal.SIGUSR1)
    out1, err1 = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGUSR1, err1
    assert ckptd.status("att")["state"] == "stopped"
    p = attach(ckptd, "att")
    out2, err2 = p.communicate(timeout=120)
    assert p.returncode == 0, err2
    # from the checkpoint on, once; with PYTHONUNBUFFERED, print() makes two writes (the
    # text, then its newline), and a checkpoint between them starts out1 with the newline
    assert out1.lstrip("\n").startswith("tick ") and plain.stdout.endswith(out1 + out2)
    assert ckptd.log("att", "stdout") == plain.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--checkpoint-signal", "KILL", "--job", "x"], ["SIGKILL", "cannot be caught"]),
        (["--checkpoint-signal", "NOPE", "--job", "x"], ["NOPE", "not a signal"]),
        (["--sigterm", "forward", "--checkpoint-signal", "TERM", "--job", "x"], ["--sigterm forward", "contradict"]),
        (["--resume"], ["--resume needs --job"]),
    ],
)
def test_bad_preemption_flags_are_refused(ckptd: Ckptd, args: list[str], words: list[str]) -> None:
    p = ckptd.run(CKPTD, "launch", *args, "--", "true", check=False)
    assert p.returncode == USAGE
    one_line_error(p, *words)
