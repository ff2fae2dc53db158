"""Local state (issue 15): a runtime directory someone else made is refused
before anything in it is used; everything ckptd writes under CKPTD_HOME and on
checkpoint storage is its user's alone, while the job keeps its user's umask;
a symlink planted in a shared checkpoint directory is never written through;
no output shows the job's environment unless asked for."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CKPTCTL, CKPTD, PYTHON, WORKLOADS, Ckptd, ckptd_at
from test_bad_input import one_line_error

from ckptd.native import init_binary
from ckptd.paths import Home

NOBODY = 65534
STORAGE = 6  # exit status: not writable (README)
PRECIOUS = "root's own data\n"
OLD = 1_000_000_000  # the planted target's mtime, to see that nothing touched it

UMASK_JOB = """
import os, sys, time
mask = os.umask(0)
os.umask(mask)
print(f"umask {mask:03o}", flush=True)
with open(sys.argv[1], "w") as f:  # a file of the job's own: its user's umask applies
    f.write("mine\\n")
for i in range(400):
    print(f"tick {i}", flush=True)
    time.sleep(0.05)
"""


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Ckptd, Path]]:
    """A Ckptd and the runtime directory its CLI will use (under /tmp: removed afterwards)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    run_dir = Home(home).run_dir
    with ckptd_at(home) as c:
        c.env.pop("XDG_RUNTIME_DIR", None)
        try:
            yield c, run_dir
        finally:
            c.cleanup()
            if run_dir.is_symlink():
                run_dir.unlink()
            shutil.rmtree(run_dir, ignore_errors=True)


def precious_file(path: Path) -> Path:
    path.write_text(PRECIOUS)
    path.chmod(0o600)
    os.utime(path, (OLD, OLD))
    return path


def assert_untouched(path: Path) -> None:
    assert path.read_text() == PRECIOUS
    assert path.stat().st_mtime == OLD


def assert_refused_everywhere(c: Ckptd, tmp_path: Path, *words: str) -> None:
    """`ckptctl jobs` and `ckptd launch` refuse, naming what they refuse; no
    daemon starts and no job exists."""
    for cmd in ([CKPTCTL, "jobs"], [CKPTD, "launch", "--detach", "--job", "j", "--", "true"]):
        p = c.run(*cmd, check=False)
        assert p.returncode == STORAGE, (cmd, p.stderr)
        one_line_error(p, *words)
    assert c.daemon_pids() == []
    assert not (c.home / "jobs").exists() or not any((c.home / "jobs").iterdir())


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory as another user")
def test_runtime_dir_of_another_user_refused(runtime: tuple[Ckptd, Path], tmp_path: Path) -> None:
    c, run_dir = runtime
    # another user got there first: a 0777 directory of theirs, daemon.lock a
    # symlink to a file of root's, and a coordinator socket of theirs listening
    target = precious_file(tmp_path / "precious")
    run_dir.mkdir()
    run_dir.chmod(0o777)
    os.chown(run_dir, NOBODY, NOBODY)
    os.symlink(target, run_dir / "daemon.lock")
    os.lchown(run_dir / "daemon.lock", NOBODY, NOBODY)
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(run_dir / "coordinator.sock"))
    os.chown(run_dir / "coordinator.sock", NOBODY, NOBODY)
    fake.listen(8)
    fake.setblocking(False)
    try:
        assert_refused_everywhere(c, tmp_path, str(run_dir), "owned by uid 65534", "remove it")
        assert_untouched(target)
        with pytest.raises(BlockingIOError):  # nobody connected to the fake coordinator
            fake.accept()
    finally:
        fake.close()


def test_runtime_dir_not_private_refused(runtime: tuple[Ckptd, Path], tmp_path: Path) -> None:
    c, run_dir = runtime
    run_dir.mkdir()
    run_dir.chmod(0o755)  # ours, but others may look in (and, 0777, plant things)
    assert_refused_everywhere(c, tmp_path, str(run_dir), "mode 0755", "remove it")
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o755  # refused, not silently "fixed"
    run_dir.rmdir()
    # a symlink to a private directory of ours is refused as well
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    run_dir.symlink_to(elsewhere)
    assert_refused_everywhere(c, tmp_path, str(run_dir), "symbolic link")
    assert list(elsewhere.iterdir()) == []
    run_dir.unlink()
    # as told: removed, it is made again, private, and everything works
    c.start_daemon()  # (read-only commands make nothing: a command that needs the daemon)
    assert c.ctl("jobs").stdout.strip() == "no jobs"
    st = run_dir.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    lock = (run_dir / "daemon.lock").lstat()
    assert stat.S_ISREG(lock.st_mode) and stat.S_IMODE(lock.st_mode) == 0o600


def group_or_other_accessible(root: Path) -> list[str]:
    """Everything below root (root itself excluded) that anyone but its owner may touch."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                bad.append(f"{stat.S_IMODE(st.st_mode):04o} {os.path.join(dirpath, name)}")
    return bad


def test_private_files_and_the_jobs_own_umask(ckptd: Ckptd, tmp_path: Path) -> None:
    c = ckptd
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    script = tmp_path / "umask_job.py"
    script.write_text(UMASK_JOB)
    own = tmp_path / "own.txt"
    # the launcher's umask (027) is the one the daemon it starts gives the job
    c.run(
        CKPTD, "launch", "--detach", "--job", "um", "--ckpt-dir", str(ckpts), "--",
        PYTHON, str(script), str(own), umask=0o027,
    )  # fmt: skip
    c.wait_log("um", r"^tick 3$")
    assert "umask 027\n" in c.log("um")
    assert stat.S_IMODE(own.stat().st_mode) == 0o640  # the job's file: its umask, not the daemon's 077
    c.checkpoint("um")
    c.wait_log("um", r"^tick 10$")
    c.kill9("um")
    c.ctl("restart", "um")
    c.wait_log("um", r"^tick 30$")
    c.checkpoint("um")  # an incremental one on top
    c.ctl("kill", "um")
    for root in (c.home, ckpts):
        assert group_or_other_accessible(root) == [], root
    assert any((ckpts / "um").glob("ckpt-*/**/pages.img"))  # the walk saw the images


@pytest.mark.skipif(os.getuid() != 0, reason="the planted link's target is a file of root's")
@pytest.mark.parametrize("planted", ["output.log", "output.idx"])
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_symlink_planted_in_shared_ckpt_dir(ckptd: Ckptd, tmp_path: Path, planted: str, dangling: bool) -> None:
    shared = tmp_path / "shared"
    (shared / "evil").mkdir(parents=True)
    target = tmp_path / "root-file"
    if not dangling:
        precious_file(target)
    os.symlink(target, shared / "evil" / planted)
    p = ckptd.run(
        CKPTD, "launch", "--detach", "--job", "evil", "--ckpt-dir", str(shared), "--", PYTHON,
        str(WORKLOADS / "counter.py"), "5", check=False,
    )  # fmt: skip
    assert p.returncode == STORAGE, p.stderr
    one_line_error(p, str(shared / "evil" / planted), "symbolic link", "--job")
    if dangling:
        assert not target.exists()  # not created through the link
    else:
        assert_untouched(target)
    assert ckptd.ctl_json("jobs") == []  # nothing registered


def test_ckptd_init_never_writes_through_a_symlink(tmp_path: Path) -> None:
    """The agent's check above says why; ckptd-init's O_NOFOLLOW is what holds
    when a link appears between that check and the open."""
    target = precious_file(tmp_path / "root-file")
    (tmp_path / "output.log").symlink_to(target)
    p = subprocess.run(
        [
            str(init_binary()), "--log", str(tmp_path / "output.log"), "--index", str(tmp_path / "output.idx"),
            "--control", str(tmp_path / "c.sock"), "--exit-file", str(tmp_path / "exit.json"),
            *([] if os.getuid() == 0 else ["--userns"]), "--", "echo", "hello",
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert p.returncode == 125
    assert "is a symbolic link: refusing" in p.stderr, p.stderr
    assert_untouched(target)
    assert not (tmp_path / "exit.json").exists()


def test_environment_only_when_asked(ckptd: Ckptd, counter: Path) -> None:
    c = ckptd
    secret = "xyz-4f1c9e-token"
    c.env["SECRET_TOKEN"] = secret
    c.launch("envjob", [PYTHON, str(counter), "4000"])
    c.wait_log("envjob", r"^tick 3$")
    info = c.checkpoint("envjob")
    outputs = {
        "status --json": c.ctl("status", "envjob", "--json").stdout,
        "status": c.ctl("status", "envjob").stdout,
        "jobs --json": c.ctl("jobs", "--json").stdout,
        "jobs": c.ctl("jobs").stdout,
        "list --json": c.ctl("list", "envjob", "--json").stdout,
        "inspect --json": c.ctl("inspect", info["path"], "--json").stdout,
        "inspect": c.ctl("inspect", info["path"]).stdout,
    }
    for what, out in outputs.items():
        assert "envjob" in out, what  # the command answered about the job
        assert secret not in out, f"`ckptctl {what}` shows the job's environment"
    assert c.ctl_json("status", "envjob", "--show-env")["spec"]["env"]["SECRET_TOKEN"] == secret
    assert f"SECRET_TOKEN={secret}" in c.ctl("status", "envjob", "--show-env").stdout
    (job,) = c.ctl_json("jobs", "--show-env")
    assert job["spec"]["env"]["SECRET_TOKEN"] == secret
    killed = c.ctl("kill", "envjob", "--json").stdout
    assert "envjob" in killed and secret not in killed
    # where it is stored, it is its user's alone
    ckpt = Path(info["path"])
    for f in (c.home / "jobs" / "envjob.json", ckpt.parent / "job.json", ckpt / "manifest.json"):
        assert secret in f.read_text(), f
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_relay_sockets_of_a_crashed_machine_are_swept(ckptd: Ckptd, counter: Path) -> None:
    """Relays killed with their machine leave their control sockets in the
    runtime directory; the next daemon removes those nobody listens on, and
    keeps a live job's."""
    run_dir = Home(ckptd.home).run_dir
    ckptd.launch("gone", [PYTHON, str(counter), "1000"])
    ckptd.wait_log("gone", r"^tick 3$")
    ckptd.crash_node("gone")
    stale = sorted(run_dir.glob("init-*.sock"))
    assert stale, sorted(p.name for p in run_dir.iterdir())
    ckptd.launch("live", [PYTHON, str(counter), "1000"])  # a new daemon
    ckptd.wait_log("live", r"^tick 3$")
    left = sorted(run_dir.glob("init-*.sock"))
    assert not set(stale) & set(left), left
    assert len(left) == 1  # the live job's relay still answers on its own
    ckptd.ctl("kill", "live")
