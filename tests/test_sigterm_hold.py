"""A SIGTERM to the job's own processes (issue 16: Slurm's scancel and
scontrol requeue signal every process of the job, the program's included):
at its default disposition it is held until the final checkpoint, which
then stops the job; a program's own handler is called as before; with no
agent to answer it still kills, within the bound (native/shim/sigterm.c)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CKPTD, Ckptd, compile_workload, run_plain

ANSWER_BOUND_S = 3.0  # sigterm.c TERM_ANSWER_MS


@pytest.fixture(scope="module")
def prog(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "sigterm_hold")


def launcher(c: Ckptd, job: str, argv: list[str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CKPTD, "launch", *extra, "--job", job, "--", *argv],
        env=c.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def term_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def test_scancel_sigterm_to_every_process_takes_a_final_checkpoint(ckptd: Ckptd, prog: str) -> None:
    """SIGTERM at once to the launcher, its daemon, ckptd-init and every
    process of the job, whose SIGTERM is at its default: the final checkpoint
    is still taken, the launcher exits 143, and the resumed job (which must
    not die of that SIGTERM again) ends as an uninterrupted run."""
    argv = [prog, "60"]
    plain = run_plain(argv)
    p = launcher(ckptd, "scancel", argv)
    ckptd.wait_log("scancel", r"^step 20 ok$")
    job_pids = ckptd.status("scancel")["pids"]
    assert len(job_pids) >= 2  # the program and its child
    daemons = ckptd.daemon_pids()
    term_all([p.pid, *daemons, *ckptd.init_pids(), *job_pids])
    out1, err1 = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{d}").exists() for d in daemons):
        time.sleep(0.1)
    st = ckptd.status("scancel")
    assert st["state"] == "stopped", st
    assert len(ckptd.ctl_json("list", "scancel")) >= 1
    p = launcher(ckptd, "scancel", argv, "--resume")
    out2, err2 = p.communicate(timeout=120)
    assert p.returncode == 0, err2
    assert "resumed from ckpt-" in err2
    assert "BAD" not in out1 + out2
    assert out1 + out2 == plain.stdout  # every step once: nothing redone, nothing lost


def test_a_programs_own_sigterm_handler_is_called(ckptd: Ckptd, prog: str) -> None:
    """--sigterm forward: the launcher passes SIGTERM on, and the one sent
    to the program itself reaches its own handler, which it reads back."""
    argv = [prog, "40", "handler"]
    p = launcher(ckptd, "own", argv, "--sigterm", "forward")
    ckptd.wait_log("own", r"^step 10 ok$")
    main = min(ckptd.status("own")["pids"])
    term_all([p.pid, main])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "got SIGTERM" in out and "BAD" not in out, out
    assert out.endswith("step 40 ok\ndone\n")


def test_a_sigterm_from_inside_the_job_is_not_held(ckptd: Ckptd, prog: str) -> None:
    """The program SIGTERMs its own child (a pool terminating its workers)
    while a launcher with the checkpoint policy follows the job: the child
    dies of it at once, and the job is not stopped."""
    argv = [prog, "20", "killchild"]
    plain = run_plain(argv)
    p = launcher(ckptd, "inside", argv)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert "child killed" in out and out == plain.stdout
    assert ckptd.ctl_json("list", "inside") == []


def test_sigterm_kills_within_the_bound_when_no_agent_answers(ckptd: Ckptd, prog: str) -> None:
    """The agent stopped (SIGSTOP): the held SIGTERM is delivered after the
    bound, the process dies of it; not at once (it was held)."""
    ckptd.launch("mute", [prog, "600"])
    ckptd.wait_log("mute", r"^step 3 ok$")
    main = min(ckptd.status("mute")["pids"])
    daemons = ckptd.daemon_pids()
    for d in daemons:
        os.kill(d, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        os.kill(main, signal.SIGTERM)
        while Path(f"/proc/{main}").exists() and Path(f"/proc/{main}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() - t0 < ANSWER_BOUND_S + 5, "SIGTERM did not kill within the bound"
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        for d in daemons:
            os.kill(d, signal.SIGCONT)
    assert took >= ANSWER_BOUND_S - 0.5, f"died after {took:.1f} s: the SIGTERM was not held for the agent"
    deadline = time.monotonic() + 30
    while ckptd.status("mute")["state"] in ("running", "checkpointing") and time.monotonic() < deadline:
        time.sleep(0.1)
    st = ckptd.status("mute")
    assert st.get("exit_signal") == signal.SIGTERM, st
