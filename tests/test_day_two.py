"""Day two (issue 16): `ckptctl rm`, `logs --tail` and `logs -f`'s exit
status, `inspect JOB [ID]`, read-only commands that start no daemon,
`--max-restarts`, and what `ckptd launch` refuses before the job runs: a
static or set-ID program, and unusable checkpoint storage."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CKPTD, PYTHON, Ckptd
from test_bad_input import NOT_FOUND, PRECONDITION, STORAGE, one_line_error

# ---- ckptctl rm ----


def test_rm_refuses_a_running_job_then_forgets_it_and_its_checkpoints(ckptd: Ckptd, counter: Path) -> None:
    ckptd.launch("rmme", [PYTHON, str(counter), "1000"])
    ckptd.wait_log("rmme", r"^tick 3$")
    path = Path(ckptd.checkpoint("rmme")["path"])
    p = ckptd.ctl("rm", "rmme", check=False)
    assert p.returncode == PRECONDITION
    one_line_error(p, "rmme is running", "ckptctl kill rmme")
    assert ckptd.status("rmme")["state"] == "running" and path.is_dir()  # untouched
    ckptd.ctl("kill", "rmme")
    log = ckptd.log_file("rmme")
    assert "ckpt-000001" in ckptd.ctl("rm", "rmme").stdout
    assert not path.exists() and log.exists()  # its checkpoints go, its log stays
    assert [j["name"] for j in ckptd.ctl_json("jobs")] == []
    assert ckptd.ctl("status", "rmme", check=False).returncode == NOT_FOUND
    ckptd.launch("rmme", ["sleep", "0.5"])  # the name is free again
    assert ckptd.wait("rmme") == 0


def test_rm_keep_checkpoints(ckptd: Ckptd, counter: Path) -> None:
    ckptd.launch("keepme", [PYTHON, str(counter), "1000"])
    ckptd.wait_log("keepme", r"^tick 3$")
    path = Path(ckptd.checkpoint("keepme")["path"])
    ckptd.ctl("kill", "keepme")
    ckptd.ctl("rm", "keepme", "--keep-checkpoints")
    assert path.is_dir() and (path / "manifest.json").exists()
    assert ckptd.ctl("status", "keepme", check=False).returncode == NOT_FOUND
    assert ckptd.ctl("rm", "keepme", check=False).returncode == NOT_FOUND


def test_launch_over_checkpoints_kept_by_rm_is_refused(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    """A fresh job under the name and --ckpt-dir is refused rather than taking them for its own."""
    argv = [PYTHON, str(counter), "400"]
    ckptd.launch("kept", argv)
    ckptd.wait_log("kept", r"^tick 3$")
    info = ckptd.checkpoint("kept")
    ckptd.ctl("kill", "kept")
    ckptd.ctl("rm", "kept", "--keep-checkpoints")
    kept = Path(info["path"])
    assert kept.is_dir()
    for extra in ([], ["--resume"], ["--detach"]):
        p = ckptd.run(CKPTD, "launch", *extra, "--job", "kept", "--", *argv, check=False)
        assert p.returncode == PRECONDITION, p.stderr
        one_line_error(p, "kept", str(kept.parent), "1 checkpoint(s) of an earlier job", "--keep-checkpoints")
        assert kept.is_dir()  # untouched
    shutil.move(str(kept), str(tmp_path / "moved"))  # what the message says to do
    p = ckptd.run(CKPTD, "launch", "--job", "kept", "--", PYTHON, str(counter), "3")
    assert p.stdout == "tick 0\ntick 1\ntick 2\nfinished\n"
    assert ckptd.ctl_json("list", "kept") == []


# ---- logs ----


def test_logs_tail(ckptd: Ckptd) -> None:
    ckptd.launch("tail", ["sh", "-c", "sleep 0.5; for i in 1 2 3 4 5; do echo out $i; echo err $i >&2; done"])
    assert ckptd.wait("tail") == 0
    assert ckptd.ctl("logs", "tail", "--tail", "2", "--stream", "stdout").stdout == "out 4\nout 5\n"
    assert ckptd.ctl("logs", "tail", "--tail", "1", "--stream", "stderr").stdout == "err 5\n"
    assert ckptd.ctl("logs", "tail", "--tail", "0").stdout == ""
    assert len(ckptd.ctl("logs", "tail", "--tail", "99").stdout.splitlines()) == 10


def test_logs_follow_exits_with_the_jobs_status(ckptd: Ckptd) -> None:
    ckptd.launch("fol", ["sh", "-c", "for i in $(seq 1 40); do echo line $i; sleep 0.05; done; exit 7"])
    ckptd.wait_log("fol", r"^line 3$")
    p = ckptd.ctl("logs", "-f", "--tail", "1", "fol", check=False)
    assert p.returncode == 7, p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1] == "line 40" and len(lines) < 40  # from the tail on, to the end
    assert lines == [f"line {i}" for i in range(41 - len(lines), 41)]
    # an ended job: its log, and its status at once
    assert ckptd.ctl("logs", "-f", "fol", check=False).returncode == 7


# ---- inspect JOB [ID] ----


def test_inspect_a_job_or_one_of_its_checkpoints(ckptd: Ckptd, counter: Path) -> None:
    ckptd.launch("insp", [PYTHON, str(counter), "1000"])
    ckptd.wait_log("insp", r"^tick 3$")
    ckptd.checkpoint("insp")
    ckptd.checkpoint("insp")
    assert ckptd.ctl("inspect", "insp").stdout.startswith("ckpt-000002: job insp")
    assert ckptd.ctl("inspect", "insp", "1", "--verify").stdout.startswith("ckpt-000001: job insp")
    for args, words in (
        (["insp", "9"], ["insp has no checkpoint 9"]),
        (["nosuch"], ["unknown job 'nosuch'"]),
        (["nosuch", "1"], ["unknown job 'nosuch'"]),
        ([str(ckptd.home / "nowhere" / "ckpt-000001")], ["no checkpoint directory"]),
    ):
        p = ckptd.ctl("inspect", *args, check=False)
        assert p.returncode == NOT_FOUND, (args, p.stderr)
        one_line_error(p, *words)
    ckptd.ctl("kill", "insp")


# ---- read-only commands with no daemon ----

HEAVY = ("grpc", "google.protobuf", "cffi", "numpy", "rich", "cryptography", "ckptd.v1.ckptd_pb2")
PROBE = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = [m for m in {heavy!r} if m in sys.modules]
sys.stderr.write(f"\\nPROBE {{code}} {{' '.join(heavy)}}\\n")
"""


def probe(c: Ckptd, module: str, *args: str) -> tuple[int, list[str], str]:
    """Run a CLI in-process and report its exit status and the heavy modules it imported."""
    p = c.run(PYTHON, "-c", PROBE.format(heavy=HEAVY), module, *args, check=False)
    line = p.stderr.rstrip().splitlines()[-1].split()
    assert line[0] == "PROBE", p.stderr
    return int(line[1]), line[2:], p.stdout


def test_read_only_commands_start_no_daemon_and_load_no_grpc(ckptd: Ckptd, counter: Path) -> None:
    """With no daemon, `jobs`, `status`, `list`, `inspect` and `--help`
    answer from the records on disk: nothing is started, and neither gRPC
    nor protobuf (nor cffi, rich...) is imported (their timing, as a ratio
    to a bare `python3 -c pass`: scripts/bench_cli.py)."""
    ckptd.launch("ro", [PYTHON, str(counter), "1000"])
    ckptd.wait_log("ro", r"^tick 3$")
    ckptd.checkpoint("ro")
    ckptd.ctl("kill", "ro")
    ckptd.ctl("shutdown")
    deadline = time.monotonic() + 30
    while ckptd.daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ckptd.daemon_pids()
    ctl, main = "ckptd.cli.ckptctl", "ckptd.cli.ckptd_main"
    for module, args, want in (
        (ctl, ["jobs"], "killed"),
        (ctl, ["status", "ro"], "ckpt-000001"),
        (ctl, ["list", "ro"], "ckpt-000001"),
        (ctl, ["jobs", "--json"], '"name": "ro"'),
        (ctl, ["--help"], "checkpoint"),
        (main, ["--help"], "launch"),
        (main, ["launch", "--help"], "--max-restarts"),
    ):
        code, heavy, out = probe(ckptd, module, *args)
        assert code == 0 and want in out, (args, out)
        assert heavy == [], (args, heavy)
        assert not ckptd.daemon_pids(), args
    assert ckptd.ctl("status", "nosuch", check=False).returncode == NOT_FOUND
    assert ckptd.ctl("inspect", "ro", "--verify").stdout.startswith("ckpt-000001: job ro")
    assert not ckptd.daemon_pids()


# ---- --auto-restart --max-restarts ----


def kill9_now(c: Ckptd, job: str) -> None:
    for pid in c.status(job)["pids"]:
        os.kill(pid, 9)


def test_max_restarts(ckptd: Ckptd, counter: Path) -> None:
    """--max-restarts 1: the first kill -9 is followed by a restart from the
    checkpoint, the second is not; a plain non-zero exit never is."""
    ckptd.launch("mr", [PYTHON, str(counter), "100000"], "--max-restarts", "1")
    ckptd.wait_log("mr", r"^tick 3$")
    ckptd.checkpoint("mr")
    kill9_now(ckptd, "mr")  # (conftest's kill9 waits to see it failed: the restart may come first)
    deadline = time.monotonic() + 60
    while ckptd.status("mr")["generation"] != 1 or ckptd.status("mr")["state"] != "running":
        assert time.monotonic() < deadline, ckptd.status("mr")
        time.sleep(0.2)
    kill9_now(ckptd, "mr")
    daemon_log = ckptd.home / "logs" / "daemon.log"
    deadline = time.monotonic() + 30
    while "after 1 automatic restarts (--max-restarts 1)" not in daemon_log.read_text():
        assert time.monotonic() < deadline, daemon_log.read_text()[-2000:]
        time.sleep(0.2)
    st = ckptd.status("mr")
    assert st["state"] == "failed" and st["generation"] == 1

    ckptd.launch("ex", ["sh", "-c", "sleep 1; exit 3"], "--auto-restart")
    assert ckptd.wait("ex") == 3
    assert ckptd.status("ex")["generation"] == 0


# ---- refused at launch ----


@pytest.fixture(scope="module")
def static_program(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("static")
    (d / "p.c").write_text("#include <unistd.h>\nint main(void) { sleep(30); return 0; }\n")
    subprocess.run(["gcc", "-static", "-O", "-o", str(d / "static"), str(d / "p.c")], check=True)
    return str(d / "static")


def assert_launch_refused(c: Ckptd, job: str, argv: list[str], code: int, *words: str, **kw: str) -> None:
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    p = c.run(CKPTD, "launch", "--job", job, *extra, "--", *argv, check=False, timeout=60)
    assert p.returncode == code, p.stderr
    one_line_error(p, *words)
    assert c.ctl("status", job, check=False).returncode == NOT_FOUND  # nothing left of it


def test_static_program_refused_at_launch(ckptd: Ckptd, static_program: str, tmp_path: Path) -> None:
    assert_launch_refused(ckptd, "st", [static_program], PRECONDITION, static_program, "statically linked")
    script = tmp_path / "script"  # a script run by a static interpreter: the same
    script.write_text(f"#!{static_program}\n")
    script.chmod(0o755)
    assert_launch_refused(ckptd, "st2", [str(script)], PRECONDITION, "statically linked")


@pytest.mark.skipif(os.getuid() != 0, reason="making a set-user-ID program of another user needs root")
def test_setuid_program_refused_at_launch(ckptd: Ckptd, tmp_path: Path) -> None:
    prog = tmp_path / "suid-sleep"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", prog)
    os.chown(prog, 65534, -1)  # nobody: running it changes the job's uid
    prog.chmod(0o4755)
    tmp_path.chmod(0o755)
    assert_launch_refused(ckptd, "su", [str(prog), "5"], PRECONDITION, str(prog), "set-user-ID")
    prog.chmod(0o755)  # without the bit it is an ordinary job
    ckptd.launch("su", [str(prog), "0.5"])
    assert ckptd.wait("su") == 0


def _tmpfs(where: Path, options: str) -> Path:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    return where


def test_storage_errors_at_launch(ckptd: Ckptd, tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert_launch_refused(ckptd, "nd", ["true"], STORAGE, "Not a directory", "--ckpt-dir", ckpt_dir=str(a_file))
    ro = _tmpfs(tmp_path / "ro", "ro,size=1m")
    full = _tmpfs(tmp_path / "full", "size=64k")
    try:
        assert_launch_refused(ckptd, "ro", ["true"], STORAGE, "Read-only file system", "--ckpt-dir", ckpt_dir=str(ro))
        with open(full / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        assert_launch_refused(ckptd, "full", ["true"], STORAGE, "is full", "free space", ckpt_dir=str(full))
    finally:
        for m in (ro, full):
            subprocess.run(["umount", "-l", str(m)], check=False)
