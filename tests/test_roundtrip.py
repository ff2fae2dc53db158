"""Round trips of real, unmodified programs: checkpoint several times while
they run, SIGKILL every process, restart from the latest checkpoint, SIGKILL
again, restart from the first one, and require the final output (log and
files) to be byte for byte what an uninterrupted run produces."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, kill_restart_twice, run_plain


def test_numpy_training(ckptd: Ckptd, outdir: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    argv = [str(WORKLOADS / "numpy_train.py"), "50", "256"]
    plain = run_plain([PYTHON, argv[0], str(ref), *argv[1:]])

    ckptd.launch("np", [PYTHON, argv[0], str(outdir), *argv[1:]])
    infos = kill_restart_twice(ckptd, "np", lambda n: rf"^step {n} ", (6, 12, 18, 24, 32))
    assert infos[0]["size_bytes"] > 200 << 20  # the ballast is in there
    assert ckptd.wait("np") == 0
    assert ckptd.log("np") == plain.stdout
    assert (outdir / "losses.txt").read_bytes() == (ref / "losses.txt").read_bytes()
    assert (outdir / "weights.npy").read_bytes() == (ref / "weights.npy").read_bytes()
    st = ckptd.status("np")
    assert st["state"] == "exited" and st["exit_code"] == 0 and st["generation"] == 2


def test_python_threads_and_blas(ckptd: Ckptd) -> None:
    argv = [PYTHON, str(WORKLOADS / "threads_blas.py"), "90"]
    plain = run_plain(argv)
    ckptd.launch("thr", argv)
    kill_restart_twice(ckptd, "thr", lambda n: rf"^round {n} ", (8, 18, 28, 38, 50))
    assert ckptd.wait("thr") == 0
    assert ckptd.log("thr") == plain.stdout


def _send_usr1_when_waiting(c: Ckptd, job: str) -> None:
    c.wait_log(job, r"^waiting for SIGUSR1")
    (pid,) = c.status(job)["pids"]
    os.kill(pid, signal.SIGUSR1)


def test_file_io_by_offset_and_sigusr1(ckptd: Ckptd, outdir: Path, tmp_path: Path) -> None:
    data = tmp_path / "input.bin"
    data.write_bytes(os.urandom(64 * 1024 * 70))
    ref = tmp_path / "ref"
    ref.mkdir()
    plain = run_plain_with_usr1([PYTHON, str(WORKLOADS / "file_io.py"), str(data), str(ref)])

    ckptd.launch("fio", [PYTHON, str(WORKLOADS / "file_io.py"), str(data), str(outdir)])
    kill_restart_twice(ckptd, "fio", lambda n: rf"^block {n} ", (8, 18, 28, 38, 50))
    _send_usr1_when_waiting(ckptd, "fio")  # the handler must survive the restore
    assert ckptd.wait("fio") == 0
    assert ckptd.log("fio") == plain
    for name in ("data.bin", "journal.txt"):
        assert (outdir / name).read_bytes() == (ref / name).read_bytes(), name


def run_plain_with_usr1(argv: list[str]) -> str:
    import subprocess

    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("waiting for SIGUSR1"):
            time.sleep(0.2)
            p.send_signal(signal.SIGUSR1)
    assert p.wait(timeout=60) == 0
    return "".join(lines)


def test_c_pthreads_condvar_setitimer(ckptd: Ckptd, ctimer: str) -> None:
    plain = run_plain([ctimer, "300"])
    ckptd.launch("ct", [ctimer, "300"])
    kill_restart_twice(ckptd, "ct", lambda n: rf"^round {n} ", (40, 80, 120, 160, 220))
    assert ckptd.wait("ct") == 0
    assert ckptd.log("ct") == plain.stdout


def test_pid_and_tids_unchanged_after_restart(ckptd: Ckptd, tmp_path: Path) -> None:
    """The job sees the same pid and thread ids before and after a restart."""
    script = tmp_path / "ids.py"
    script.write_text(
        "import os, sys, threading, time\n"
        "ev = threading.Event()\n"
        "def say(text):\n"
        "    sys.stdout.write(text + '\\n'); sys.stdout.flush()\n"
        "def t():\n"
        "    while True:\n"
        "        say(f'thread {threading.get_native_id()}'); ev.wait(0.2)\n"
        "threading.Thread(target=t, daemon=True).start()\n"
        "for i in range(200):\n"
        "    say(f'main {os.getpid()} {threading.get_native_id()} {i}'); time.sleep(0.05)\n"
    )
    ckptd.launch("ids", [PYTHON, str(script)])
    ckptd.wait_log("ids", r"^main \d+ \d+ 5$")
    ckptd.checkpoint("ids")
    before = ckptd.log("ids").splitlines()
    ckptd.kill9("ids")
    ckptd.ctl("restart", "ids")
    ckptd.wait_log("ids", r"^main \d+ \d+ 60$")
    after = ckptd.log("ids").splitlines()

    def ids(lines: list[str], kind: str) -> set[str]:
        return {" ".join(line.split()[1:3]) for line in lines if line.startswith(kind)}

    assert ids(before, "main") == ids(after, "main") and len(ids(after, "main")) == 1
    assert ids(before, "thread") == ids(after, "thread") and len(ids(after, "thread")) == 1
    ckptd.ctl("kill", "ids")


@pytest.mark.parametrize("restart_from", ["latest", "first"])
def test_restart_after_node_crash_finds_job_on_disk(ckptd: Ckptd, ctimer: str, restart_from: str) -> None:
    """The machine goes down: job, ckptd-init and the daemons all die.  With
    the same CKPTD_HOME, `ckptctl restart` starts fresh daemons, finds the job
    and its checkpoints on disk, and the job finishes identically."""
    plain = run_plain([ctimer, "150"])
    ckptd.launch("crash", [ctimer, "150"])
    ckptd.wait_log("crash", r"^round 30 ")
    ckptd.checkpoint("crash")
    ckptd.wait_log("crash", r"^round 60 ")
    ckptd.checkpoint("crash")
    ckptd.wait_log("crash", r"^round 80 ")
    ckptd.crash_node("crash")
    assert not ckptd.daemon_pids()
    args = ["restart", "crash"] + (["--from", "1"] if restart_from == "first" else [])
    ckptd.ctl(*args)
    assert ckptd.wait("crash") == 0
    assert ckptd.log("crash") == plain.stdout
