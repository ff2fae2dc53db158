"""`ckptd launch` in the foreground, periodic checkpoints, and the CLI contract."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CKPTCTL, CKPTD, PYTHON, Ckptd, run_plain


def test_foreground_passthrough_and_exit_status(ckptd: Ckptd) -> None:
    p = ckptd.popen_launch("fg", ["sh", "-c", "echo out1; echo err1 >&2; echo out2; exit 3"])
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3
    assert out == "out1\nout2\n"
    assert "err1\n" in err and "ckptd: job fg" in err
    # the log keeps both streams; each in order (their interleaving is as the
    # relay happened to read two separate pipes)
    assert sorted(ckptd.log("fg").splitlines()) == ["err1", "out1", "out2"]
    assert ckptd.log("fg", "stdout") == "out1\nout2\n"
    assert ckptd.log("fg", "stderr") == "err1\n"
    st = ckptd.status("fg")
    assert st["state"] == "exited" and st["exit_code"] == 3


def test_a_job_that_ends_at_once_is_seen_ended(ckptd: Ckptd) -> None:
    """The agent's report that a short job exited can reach the coordinator
    before StartJob's answer ("running"); the stale answer must not win, or
    `ckptctl wait` waits for ever (it did, now and then, under load)."""
    for i in range(8):
        ckptd.launch(f"short{i}", ["true"])
    for i in range(8):
        assert ckptd.wait(f"short{i}", timeout=30) == 0, ckptd.status(f"short{i}")
        assert ckptd.status(f"short{i}")["state"] == "exited"


def test_foreground_launch_reports_sigkill(ckptd: Ckptd, counter: Path) -> None:
    p = ckptd.popen_launch("fgk", [PYTHON, str(counter), "1000"])
    ckptd.wait_log("fgk", r"^tick 3$")
    ckptd.kill9("fgk")
    assert p.wait(timeout=30) == 128 + signal.SIGKILL


def test_command_not_found(ckptd: Ckptd) -> None:
    p = ckptd.popen_launch("nf", ["/nonexistent/program"])
    _, err = p.communicate(timeout=60)
    assert p.returncode == 127
    assert "cannot run /nonexistent/program" in err


def test_interval_checkpoints_and_wait_across_restart(ckptd: Ckptd, counter: Path) -> None:
    # 240 ticks of 50 ms: still running at the kill -9 below after the CLI calls, on a loaded machine too
    plain = run_plain([PYTHON, str(counter), "240"])  # the reference, run meanwhile
    ckptd.launch("per", [PYTHON, str(counter), "240"], "--interval", "1.5")
    ckptd.wait_log("per", r"^tick 80$")
    checkpoints = ckptd.ctl_json("list", "per")
    assert len(checkpoints) >= 2, checkpoints
    for c in checkpoints:
        ckptd.ctl("inspect", "--verify", c["path"])
    # a waiter started before the failure sees the job through its restart
    waiter = subprocess.Popen([CKPTCTL, "wait", "per"], env=ckptd.env, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    ckptd.kill9("per")
    time.sleep(0.5)
    assert waiter.poll() is None  # a SIGKILLed job is not finished: it can be restarted
    ckptd.ctl("restart", "per")
    assert waiter.wait(timeout=120) == 0
    assert "waiting for a restart" in waiter.stderr.read()
    assert ckptd.log("per") == plain.stdout


def test_auto_restart_after_kill9_and_sigterm_preemption(ckptd: Ckptd, counter: Path) -> None:
    """--auto-restart: a job SIGKILLed from outside comes back from its last
    checkpoint with nobody calling restart.  SIGTERM to the foreground
    launch takes a final checkpoint and stops the job (exit 143)."""
    plain_1 = run_plain([PYTHON, str(counter), "120"])  # the reference, run meanwhile
    plain_2 = run_plain([PYTHON, str(counter), "80"])
    ckptd.launch("auto", [PYTHON, str(counter), "120"], "--auto-restart")
    ckptd.wait_log("auto", r"^tick 20$")
    ckptd.checkpoint("auto")
    ckptd.wait_log("auto", r"^tick 40$")
    ckptd.kill9("auto")
    assert ckptd.wait("auto", timeout=120) == 0
    st = ckptd.status("auto")
    assert st["generation"] == 1 and st["state"] == "exited"
    assert ckptd.log("auto") == plain_1.stdout

    p = ckptd.popen_launch("term", [PYTHON, str(counter), "80"])
    ckptd.wait_log("term", r"^tick 10$")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped after ckpt-000001" in err
    assert ckptd.status("term")["state"] == "stopped"
    ckptd.ctl("restart", "term")
    assert ckptd.wait("term") == 0
    assert ckptd.log("term") == plain_2.stdout


def test_retention_keeps_last_and_milestones(ckptd: Ckptd, counter: Path) -> None:
    """--keep 2 --keep-every 3: after each commit the last two checkpoints and
    every third one stay; `ckptctl prune` applies a policy by hand; a pruned
    checkpoint is a clear error for restart, and the kept ones restore."""
    plain = run_plain([PYTHON, str(counter), "200"])  # the reference, run meanwhile
    # full images: the policy alone decides (test_incremental has chains, whose links stay)
    ckptd.launch("ret", [PYTHON, str(counter), "200"], "--keep", "2", "--keep-every", "3", "--full-every", "1")
    for n in range(7):
        ckptd.wait_log("ret", rf"^tick {5 + 5 * n}$")
        ckptd.checkpoint("ret")
    # killed at once: on a loaded machine the job could finish during the
    # prune calls below (pruning needs no live job)
    ckptd.kill9("ret")
    assert [c["id"] for c in ckptd.ctl_json("list", "ret")] == [3, 6, 7]
    job_dir = Path(ckptd.ctl_json("list", "ret")[0]["path"]).parent
    assert sorted(p.name for p in job_dir.iterdir() if p.name.startswith(".")) == []  # nothing half-deleted
    assert ckptd.ctl("prune", "ret", "--keep", "0", check=False).returncode == 2
    assert ckptd.ctl("prune", "ret", check=False).returncode == 2
    kept = ckptd.ctl_json("prune", "ret", "--keep", "1", "--keep-every", "6")
    assert [c["id"] for c in kept] == [6, 7]
    p = ckptd.ctl("restart", "ret", "--from", "3", check=False)
    assert p.returncode == 3 and "has no checkpoint 3" in p.stderr, p.stderr
    ckptd.ctl("restart", "ret", "--from", "6")
    assert ckptd.wait("ret") == 0
    assert ckptd.log("ret") == plain.stdout


def test_status_json_and_jobs(ckptd: Ckptd, counter: Path) -> None:
    ckptd.launch("js", [PYTHON, str(counter), "400"])
    ckptd.wait_log("js", r"^tick 2$")
    st = ckptd.status("js")
    assert st["state"] == "running"
    assert len(st["pids"]) == 1 and os.path.exists(f"/proc/{st['pids'][0]}")
    assert st["processes"][0]["under_shim"] is True and st["processes"][0]["pid"] == 2
    jobs = ckptd.ctl_json("jobs")
    assert [j["name"] for j in jobs] == ["js"]
    nodes = ckptd.ctl_json("nodes")
    assert len(nodes) == 1 and nodes[0]["alive"] is True and nodes[0]["gpu"].startswith("none")
    ckptd.ctl("kill", "js")
    st = ckptd.status("js")
    assert st["state"] == "killed" and st["pids"] == []
    p = ckptd.ctl("kill", "js", check=False)
    assert p.returncode == 4 and "not running" in p.stderr


def test_job_name_rules(ckptd: Ckptd) -> None:
    bad = ckptd.run(CKPTD, "launch", "--job", "../evil", "--", "true", check=False)
    assert bad.returncode == 2 and "invalid job name" in bad.stderr
    ckptd.run(CKPTD, "launch", "--job", "dup", "--", "true")
    again = ckptd.run(CKPTD, "launch", "--job", "dup", "--", "true", check=False)
    assert again.returncode == 4 and "already exists" in again.stderr
    generated = ckptd.run(CKPTD, "launch", "--", "true")
    assert generated.stderr.startswith("ckptd: job ")


@pytest.mark.parametrize(
    "argv",
    [
        [CKPTD, "--help"],
        [CKPTD, "launch", "--help"],
        [CKPTD, "coordinator", "--help"],
        [CKPTD, "agent", "--help"],
        [CKPTD, "daemon", "--help"],
        [CKPTCTL, "--help"],
        *[
            [CKPTCTL, c, "--help"]
            for c in (
                "jobs",
                "status",
                "list",
                "checkpoint",
                "restart",
                "kill",
                "wait",
                "logs",
                "nodes",
                "inspect",
                "shutdown",
            )
        ],
    ],
)
def test_help_everywhere(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "usage:" in p.stdout


def test_usage_errors_exit_2() -> None:
    assert subprocess.run([CKPTCTL, "frobnicate"], capture_output=True, timeout=30).returncode == 2
    assert subprocess.run([CKPTCTL, "restart"], capture_output=True, timeout=30).returncode == 2
