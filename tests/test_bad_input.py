"""Bad input: a one-line error that says what to do, a meaningful exit
status, and nothing lost (the job keeps running, earlier checkpoints stay
intact and restorable)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, flip_byte, run_plain

# exit statuses (README, ckptd/errors.py)
NOT_FOUND, PRECONDITION, CORRUPT, STORAGE = 3, 4, 5, 6


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    err = proc.stderr.strip()
    assert err.startswith("error: "), err
    assert "\n" not in err, f"not one line: {err!r}"
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    return err


def launch_script(c: Ckptd, tmp_path: Path, job: str, text: str) -> None:
    """Run a small Python program as a job; return once it ticks."""
    script = tmp_path / f"{job}.py"
    script.write_text(text)
    c.launch(job, [PYTHON, str(script)])
    c.wait_log(job, r"^tick 3$")


def assert_refused(c: Ckptd, job: str, *words: str) -> None:
    """The checkpoint is refused with the reason, and the job runs on."""
    p = c.ctl("checkpoint", job, check=False)
    assert p.returncode == PRECONDITION
    one_line_error(p, *words)
    assert c.status(job)["state"] == "running"


def test_unknown_job(ckptd: Ckptd) -> None:
    for cmd in (["status", "nosuch"], ["checkpoint", "nosuch"], ["restart", "nosuch"], ["wait", "nosuch"]):
        p = ckptd.ctl(*cmd, check=False)
        assert p.returncode == NOT_FOUND, (cmd, p.stderr)
        one_line_error(p, "nosuch", "ckptctl jobs")


def test_restart_while_running_refused_then_forced(ckptd: Ckptd, counter: Path) -> None:
    plain = run_plain([PYTHON, str(counter), "150"])  # the reference, run meanwhile
    ckptd.launch("live", [PYTHON, str(counter), "150"])
    ckptd.wait_log("live", r"^tick 5$")
    ckptd.checkpoint("live")
    pids = ckptd.status("live")["pids"]
    p = ckptd.ctl("restart", "live", check=False)
    assert p.returncode == PRECONDITION
    one_line_error(p, "still running", "--force")
    st = ckptd.status("live")
    assert st["state"] == "running" and st["pids"] == pids  # untouched
    ckptd.ctl("restart", "live", "--force")
    st = ckptd.status("live")
    assert st["state"] == "running" and st["pids"] != pids and st["generation"] == 1
    assert ckptd.wait("live") == 0
    assert ckptd.log("live") == plain.stdout


def test_restart_without_checkpoint(ckptd: Ckptd, counter: Path) -> None:
    ckptd.launch("nock", [PYTHON, str(counter), "400"])
    ckptd.wait_log("nock", r"^tick 3$")
    ckptd.kill9("nock")
    p = ckptd.ctl("restart", "nock", check=False)
    assert p.returncode == PRECONDITION
    one_line_error(p, "no checkpoint", "ckptctl checkpoint nock")
    assert ckptd.status("nock")["state"] == "failed"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_image_caught_before_restore(ckptd: Ckptd, counter: Path, damage: str) -> None:
    plain = run_plain([PYTHON, str(counter), "120"])  # the reference, run meanwhile
    ckptd.launch("bad", [PYTHON, str(counter), "120"])
    ckptd.wait_log("bad", r"^tick 10$")
    ckptd.checkpoint("bad")
    ckptd.wait_log("bad", r"^tick 40$")
    second = ckptd.checkpoint("bad")
    ckptd.wait_log("bad", r"^tick 60$")
    ckptd.kill9("bad")
    log_before = ckptd.log_file("bad").read_bytes()

    ckpt = Path(second["path"])
    if damage == "flip":
        target = ckpt / "proc-2" / "pages.img"
        flip_byte(target)
        words = ("checksum", "--from")
    else:
        target = ckpt / "proc-2" / "core.img"
        os.truncate(target, os.path.getsize(target) // 2)
        words = ("bytes, expected", "--from")
    p = ckptd.ctl("restart", "bad", check=False)
    assert p.returncode == CORRUPT, p.stderr
    one_line_error(p, *words)
    assert ckptd.status("bad")["state"] == "failed"  # nothing started
    assert ckptd.log_file("bad").read_bytes() == log_before  # nothing touched

    ckptd.ctl("restart", "bad", "--from", "1")  # the earlier one still works
    assert ckptd.wait("bad") == 0
    assert ckptd.log("bad") == plain.stdout


JOURNAL = """
import sys, time
out = open(sys.argv[1], "w")
for i in range(200):
    out.write(f"step {i}\\n")
    out.flush()
    print(f"tick {i}", flush=True)
    time.sleep(0.05)
"""


def test_memory_image_failing_its_checksum_during_rebuild_undoes_the_rollback(ckptd: Ckptd, tmp_path: Path) -> None:
    """pages.img is checked while the restore reads it, after the job's files
    were rolled back: a mismatch kills the parked processes and puts the
    files and the log back as the crash left them."""
    script = tmp_path / "journal.py"
    script.write_text(JOURNAL)
    journal, plain_journal = tmp_path / "journal.txt", tmp_path / "plain.txt"
    plain = run_plain([PYTHON, str(script), str(plain_journal)])  # the reference, run meanwhile
    ckptd.launch("undo", [PYTHON, str(script), str(journal)])
    ckptd.wait_log("undo", r"^tick 10$")
    ckptd.checkpoint("undo")
    ckptd.wait_log("undo", r"^tick 30$")
    second = ckptd.checkpoint("undo")
    ckptd.wait_log("undo", r"^tick 50$")
    ckptd.kill9("undo")
    at_crash = journal.read_bytes()
    log_before = ckptd.log_file("undo").read_bytes()
    assert at_crash.count(b"\n") >= 50

    target = Path(second["path"]) / "proc-2" / "pages.img"
    flip_byte(target)
    p = ckptd.ctl("restart", "undo", check=False)
    assert p.returncode == CORRUPT, p.stderr
    one_line_error(p, "pages.img fails its checksum", "--from")
    st = ckptd.status("undo")
    assert st["state"] == "failed" and st["pids"] == [], st
    assert journal.read_bytes() == at_crash  # rolled back to the checkpoint, then put back
    assert ckptd.log_file("undo").read_bytes() == log_before
    assert not list(ckptd.home.rglob("undo-ckpt-*"))  # no journal left behind

    ckptd.ctl("restart", "undo", "--from", "1")
    assert ckptd.wait("undo") == 0
    assert ckptd.log("undo") == plain.stdout
    assert journal.read_bytes() == plain_journal.read_bytes()


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make path read-only for new files (root ignores permissions: use a
    read-only bind mount; open files, like the job's log, stay writable)."""
    if os.getuid() == 0:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(mode)


def test_read_only_checkpoint_dir(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    plain = run_plain([PYTHON, str(counter), "120"])  # the reference, run meanwhile
    store = tmp_path / "store"
    ckptd.launch("ro", [PYTHON, str(counter), "120"], "--ckpt-dir", str(store))
    jobdir = store / "ro"
    ckptd.wait_log("ro", r"^tick 5$")
    first = ckptd.checkpoint("ro")
    with read_only(jobdir):
        p = ckptd.ctl("checkpoint", "ro", check=False)
        assert p.returncode == STORAGE, p.stderr
        one_line_error(p, "not writable", "--ckpt-dir")
        assert ckptd.status("ro")["state"] == "running"
    assert [c["id"] for c in ckptd.ctl_json("list", "ro")] == [1]
    ckptd.ctl("inspect", "--verify", first["path"])  # still whole
    assert not [n for n in os.listdir(jobdir) if ".tmp-" in n]
    assert ckptd.wait("ro") == 0
    assert (jobdir / "output.log").read_text() == plain.stdout


def _wait_file_pattern(path: Path, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if text in path.read_text():
                return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path}")


GROWER = """
import os, sys, time
ballast = bytearray(os.urandom(16 << 20))
out = open(sys.argv[1], "wb")
print("small", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
out.write(os.urandom(40 << 20)); out.flush()
print("big", flush=True)
for i in range(100):
    print("tick", i, flush=True)
    time.sleep(0.05)
print("finished", len(ballast), flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="mounting a small tmpfs needs root")
def test_checkpoint_storage_full(ckptd: Ckptd, tmp_path: Path) -> None:
    """The disk fills up in the middle of writing the image: the checkpoint
    fails cleanly, the job keeps running, the earlier checkpoint survives."""
    store = tmp_path / "small"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=72m", "tmpfs", str(store)], check=True)
    try:
        script = tmp_path / "grower.py"
        script.write_text(GROWER)
        go = tmp_path / "go"
        # full images: an incremental second checkpoint would fit
        ckptd.launch(
            "full",
            [PYTHON, str(script), str(tmp_path / "data.bin"), str(go)],
            "--ckpt-dir",
            str(store),
            "--full-every",
            "1",
        )
        _wait_file_pattern(store / "full" / "output.log", "small")
        first = ckptd.checkpoint("full")
        go.touch()
        _wait_file_pattern(store / "full" / "output.log", "big")
        p = ckptd.ctl("checkpoint", "full", check=False)
        assert p.returncode == STORAGE, p.stderr
        one_line_error(p, "full")
        assert ckptd.status("full")["state"] == "running"
        assert [c["id"] for c in ckptd.ctl_json("list", "full")] == [1]
        assert not [n for n in os.listdir(store / "full") if ".tmp-" in n]
        ckptd.ctl("inspect", "--verify", first["path"])
        assert ckptd.wait("full") == 0
        assert "finished" in (store / "full" / "output.log").read_text()
    finally:
        ckptd.cleanup()
        subprocess.run(["umount", "-l", str(store)], check=False)


def test_process_not_launched_under_ckptd(ckptd: Ckptd) -> None:
    plain = subprocess.Popen(["sleep", "60"])
    try:
        ckptd.start_daemon()
        p = ckptd.ctl("checkpoint", str(plain.pid), check=False)
        assert p.returncode == NOT_FOUND
        one_line_error(p, str(plain.pid), "not launched under ckptd", "ckptd launch")
        assert plain.poll() is None
    finally:
        plain.kill()


STATIC = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) { for (int i = 0; i < 600; i++) { printf("static %d\n", i); fflush(stdout); usleep(50000); } return 0; }
"""


def static_program(tmp_path: Path) -> Path:
    """STATIC built as a static ELF: a program the shim cannot be preloaded into."""
    src = tmp_path / "static.c"
    src.write_text(STATIC)
    exe = tmp_path / "static"
    subprocess.run(["gcc", "-static", "-O2", str(src), "-o", str(exe)], check=True)
    return exe


def test_process_that_escaped_the_shim(ckptd: Ckptd, tmp_path: Path) -> None:
    exe = static_program(tmp_path)
    # exec'd by the job (a static program launched directly is refused at
    # launch: test_day_two.test_static_program_refused_at_launch)
    ckptd.launch("esc", ["sh", "-c", f"exec {exe}"])
    ckptd.wait_log("esc", r"^static 3$")
    (pid,) = ckptd.status("esc")["pids"]
    assert_refused(ckptd, "esc", str(pid), "not running under the ckptd shim")
    assert ckptd.status("esc")["processes"][0]["under_shim"] is False
    ckptd.ctl("kill", "esc")


LATE_STATIC = """
import os, subprocess, sys, time
child = None
for i in range(3000):
    if child is None and os.path.exists(sys.argv[2]):
        child = subprocess.Popen([sys.argv[1]])
    print("tick", i, flush=True)
    time.sleep(0.02)
"""


def test_a_process_that_escapes_the_shim_after_a_checkpoint_is_refused_by_name(ckptd: Ckptd, tmp_path: Path) -> None:
    """The job checkpoints while all its processes are under the shim, so
    that the agent's next looks go through the job's own /proc
    (agent/runtime.py JobRuntime._own_look). Then it starts a static
    program: the next checkpoint is refused, naming it, and the job runs
    on, both processes."""
    exe = static_program(tmp_path)
    script = tmp_path / "late.py"
    script.write_text(LATE_STATIC)
    go = tmp_path / "go"
    ckptd.launch("late", [PYTHON, str(script), str(exe), str(go)])
    ckptd.wait_log("late", r"^tick 3$")
    first = ckptd.checkpoint("late")
    second = ckptd.checkpoint("late")  # its looks at the job's processes are the fast ones now
    go.touch()
    ckptd.wait_log("late", r"^static 3$")
    st = ckptd.status("late")
    escaped = [p for p in st["processes"] if not p["under_shim"]]
    assert len(st["pids"]) == 2 and len(escaped) == 1
    assert_refused(ckptd, "late", f"pid {escaped[0]['pid']} in the job", str(exe), "not running under the ckptd shim")
    assert [c["id"] for c in ckptd.ctl_json("list", "late")] == [first["id"], second["id"]]
    assert len(ckptd.status("late")["pids"]) == 2  # the whole tree runs on
    ckptd.ctl("kill", "late")


FANOTIFY = """
import ctypes, time
assert ctypes.CDLL(None).fanotify_init(0, 0) >= 0
for i in range(400):
    print("tick", i, flush=True)
    time.sleep(0.02)
"""


def test_unsupported_descriptor_named(ckptd: Ckptd, tmp_path: Path) -> None:
    launch_script(ckptd, tmp_path, "inot", FANOTIFY)  # inotify is saved now (issue 19)
    assert_refused(ckptd, "inot", "unsupported file descriptor", "fanotify", "pid 2")
    assert ckptd.ctl_json("list", "inot") == []
    assert ckptd.wait("inot") == 0
    assert ckptd.log("inot").splitlines()[-1] == "tick 399"


TCP_OUT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
for i in range(300):
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    print("tick", i, flush=True)
    time.sleep(0.02)
"""


def test_tcp_connection_leaving_the_job_refused(ckptd: Ckptd, tmp_path: Path) -> None:
    """A connection to a server outside the job cannot come back by itself:
    refused with both addresses, the job runs on, nothing is committed."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    script = tmp_path / "tcp_out.py"
    script.write_text(TCP_OUT)
    ckptd.launch("tout", [PYTHON, str(script), str(port)])
    ckptd.wait_log("tout", r"^tick 3$")
    assert_refused(ckptd, "tout", "TCP connection", f"127.0.0.1:{port}", "outside the job")
    assert ckptd.ctl_json("list", "tout") == []
    assert ckptd.wait("tout") == 0
    assert ckptd.log("tout").splitlines()[-1] == "tick 299"
    server.close()


IO_URING = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 8, params)  # io_uring_setup through glibc's syscall()
print("io_uring", "fd" if fd >= 0 else os.strerror(ctypes.get_errno()), flush=True)
for i in range(400):
    print("tick", i, flush=True)
    time.sleep(0.02)
"""


@pytest.mark.parametrize("allow", [False, True])
def test_io_uring_hidden_or_refused(ckptd: Ckptd, tmp_path: Path, allow: bool) -> None:
    """A ring's state is kernel memory no checkpoint can carry: by default a
    job is told io_uring does not exist (libraries fall back to epoll) and
    checkpoints work; with CKPTD_ALLOW_IO_URING=1 it gets the ring and a
    checkpoint is refused, naming it."""
    if allow:
        ckptd.env["CKPTD_ALLOW_IO_URING"] = "1"
    launch_script(ckptd, tmp_path, "uring", IO_URING)
    first = ckptd.log("uring").splitlines()[0]
    if allow:
        assert first == "io_uring fd"
        assert_refused(ckptd, "uring", "io_uring")
        ckptd.ctl("kill", "uring")
    else:
        assert first == f"io_uring {os.strerror(errno.ENOSYS)}"
        assert ckptd.checkpoint("uring")["id"] == 1
        ckptd.ctl("kill", "uring")


def test_two_checkpoints_at_once(ckptd: Ckptd, outdir: Path) -> None:
    ckptd.launch("two", [PYTHON, str(WORKLOADS / "numpy_train.py"), str(outdir), "200", "256"])
    ckptd.wait_log("two", r"^step 2 ")
    procs = [
        subprocess.Popen(
            ["ckptctl", "checkpoint", "two", "--json"],
            env=ckptd.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    ok = [r for r in results if r[0] == 0]
    assert ok, results
    for rc, err in results:
        assert rc == 0 or (rc == PRECONDITION and "already in progress" in err), (rc, err)
    ids = [c["id"] for c in ckptd.ctl_json("list", "two")]
    assert ids == list(range(1, len(ok) + 1))
    for c in ckptd.ctl_json("list", "two"):
        ckptd.ctl("inspect", "--verify", c["path"])
    ckptd.ctl("kill", "two")


POSIX_TIMER = """
import ctypes, signal, time
librt = ctypes.CDLL(None, use_errno=True)
timer = ctypes.c_void_p()
signal.signal(signal.SIGALRM, lambda s, f: None)
assert librt.timer_create(2, None, ctypes.byref(timer)) == 0  # CLOCK_PROCESS_CPUTIME_ID, SIGALRM
for i in range(400):
    print("tick", i, flush=True)
    time.sleep(0.02)
"""


def test_posix_timer_on_cpu_clock_refused_not_dropped(ckptd: Ckptd, tmp_path: Path) -> None:
    """POSIX timers are restored (tests/test_timers_signals.py), but not on a
    CPU-time clock (the process's CPU time starts again at a restart)."""
    launch_script(ckptd, tmp_path, "ptimer", POSIX_TIMER)
    assert_refused(ckptd, "ptimer", "POSIX timer", "CPU-time")
    ckptd.ctl("kill", "ptimer")


TREE_WITH_STATIC = """
import subprocess, sys, time
child = subprocess.Popen([sys.argv[1]])
for i in range(1500):
    print("tick", i, flush=True)
    time.sleep(0.02)
child.kill()
"""


def test_process_in_tree_that_escaped_the_shim(ckptd: Ckptd, tmp_path: Path) -> None:
    """One process of a tree cannot be checkpointed: the refusal names it
    (its pid in the job and its program), and the whole tree runs on."""
    exe = static_program(tmp_path)
    script = tmp_path / "tree.py"
    script.write_text(TREE_WITH_STATIC)
    ckptd.launch("tree", [PYTHON, str(script), str(exe)])
    ckptd.wait_log("tree", r"^static 3$")
    ckptd.wait_log("tree", r"^tick 3$")
    st = ckptd.status("tree")
    escaped = [p for p in st["processes"] if not p["under_shim"]]
    assert len(st["pids"]) == 2 and len(escaped) == 1
    assert_refused(ckptd, "tree", f"pid {escaped[0]['pid']} in the job", str(exe), "not running under the ckptd shim")
    assert ckptd.ctl_json("list", "tree") == []
    assert len(ckptd.status("tree")["pids"]) == 2  # the whole tree runs on
    ckptd.ctl("kill", "tree")
