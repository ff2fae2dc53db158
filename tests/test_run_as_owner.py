"""A root agent runs another user's job as that user (agent/owner.py):
`ckptd launch --as-user nobody` by root gives a job whose every process,
launched or restored, has nobody's uid, gid and groups, reaches nothing of
root's, and survives a checkpoint, kill -9 and restart byte for byte."""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import CKPTD, PYTHON, WORKLOADS, Ckptd, ckptd_at, reachable_by_others, run_plain

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="a root agent runs jobs as their owners")

NOBODY = pwd.getpwnam("nobody")
NOBODY_GROUPS = sorted(set(os.getgrouplist("nobody", NOBODY.pw_gid)))


@pytest.fixture
def root_ckptd(tmp_path: Path) -> Iterator[Ckptd]:
    """A root daemon, with a checkpoint directory and an interpreter nobody can reach."""
    tmp_path.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    ckpts.chmod(0o1777)  # a scratch directory every user may write, as /tmp (sticky)
    with reachable_by_others(Path(PYTHON), ckpts), ckptd_at(home) as c:
        yield c


def launch_as(c: Ckptd, user: str, job: str, argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    return c.run(
        CKPTD, "launch", "--detach", "--as-user", user, "--job", job, "--ckpt-dir", str(tmp / "ckpts"),
        "--", *argv, cwd="/", check=False,
    )  # fmt: skip


def ids(pid: int) -> dict[str, list[int]]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            fields[key] = [int(v) for v in value.split()]
    return fields


def assert_all_nobody(c: Ckptd, job: str) -> list[int]:
    pids = c.status(job)["pids"]
    assert pids
    for pid in pids:
        assert ids(pid) == {"Uid": [NOBODY.pw_uid] * 4, "Gid": [NOBODY.pw_gid] * 4, "Groups": NOBODY_GROUPS}, pid
    return pids


def test_job_runs_as_its_owner(root_ckptd: Ckptd, tmp_path: Path) -> None:
    c = root_ckptd
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    probe = (
        "import os, sys, time\n"
        "print('uid', os.getuid(), os.geteuid(), 'gid', os.getgid(), 'groups', sorted(os.getgroups()), flush=True)\n"
        "try:\n"
        f"    open({str(secret)!r}).read(); print('read the secret', flush=True)\n"
        "except OSError as e:\n"
        "    print('refused:', e, flush=True)\n"
        "print('HOME', os.environ['HOME'], 'USER', os.environ['USER'], flush=True)\n"
        "time.sleep(60)\n"
    )
    assert launch_as(c, "nobody", "probe", [PYTHON, "-c", probe], tmp_path).returncode == 0
    c.wait_log("probe", r"^HOME ")
    out = c.log("probe")
    print(out)
    # inside its user namespace the job sees its own ids; its groups map to nobody's
    assert f"uid {NOBODY.pw_uid} {NOBODY.pw_uid} gid {NOBODY.pw_gid}" in out
    assert f"refused: [Errno 13] Permission denied: '{secret}'" in out
    assert "read the secret" not in out
    assert f"HOME {NOBODY.pw_dir} USER nobody" in out
    # and from the host: every process, ckptd-init included, is nobody's
    assert_all_nobody(c, "probe")
    reaper = psutil.Process(c.status("probe")["pids"][0]).parent()
    relay = reaper.parent()
    for p in (reaper, relay):
        assert p.name() == "ckptd-init"
        assert ids(p.pid) == {"Uid": [NOBODY.pw_uid] * 4, "Gid": [NOBODY.pw_gid] * 4, "Groups": NOBODY_GROUPS}
    # the job's log is nobody's, in a directory only root may change
    log = Path(c.status("probe")["log_path"])
    assert log.stat().st_uid == NOBODY.pw_uid and log.stat().st_mode & 0o777 == 0o600
    assert log.parent.stat().st_uid == 0
    c.ctl("kill", "probe")


def test_round_trip_as_owner(root_ckptd: Ckptd, tmp_path: Path) -> None:
    c = root_ckptd
    live = tmp_path / "life"
    live.mkdir()
    os.chown(live, NOBODY.pw_uid, NOBODY.pw_gid)
    ref = tmp_path / "ref"
    ref.mkdir()
    argv = [PYTHON, str(WORKLOADS / "lifecycle.py"), "500"]
    plain = run_plain([*argv, str(ref)])
    assert launch_as(c, "nobody", "rt", [*argv, str(live)], tmp_path).returncode == 0
    c.wait_log("rt", r"^round 100 ")
    before = assert_all_nobody(c, "rt")
    assert len(before) >= 3
    info = c.checkpoint("rt")
    assert info["processes"] >= 3
    ckpt = Path(info["path"])
    assert ckpt.stat().st_uid == 0
    assert {p.stat().st_uid for p in ckpt.glob("proc-*")} == {NOBODY.pw_uid}
    c.wait_log("rt", r"^round 200 ")
    c.kill9("rt")
    c.ctl("restart", "rt")
    c.wait_log("rt", r"^round 260 ")
    assert_all_nobody(c, "rt")  # the restored processes too
    assert c.wait("rt") == 0
    assert c.log("rt", "stdout") == plain.stdout


def test_hello_from_outside_the_job_is_ignored(root_ckptd: Ckptd, tmp_path: Path) -> None:
    """The owner's shim socket is the owner's alone; a process of the owner
    that is not in the job cannot speak for it."""
    c = root_ckptd
    assert launch_as(c, "nobody", "hj", [PYTHON, str(WORKLOADS / "counter.py"), "2000"], tmp_path).returncode == 0
    c.wait_log("hj", r"^tick 5$")
    job_pid = c.status("hj")["pids"][0]
    sock = Path(_env_of(job_pid)["CKPTD_SHIM_SOCKET"])
    st = sock.stat()
    assert st.st_uid == NOBODY.pw_uid and st.st_mode & 0o777 == 0o600
    # another user cannot even connect
    other = subprocess.run(
        [PYTHON, "-c", f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r})"],
        user="daemon", group="daemon", extra_groups=[], capture_output=True, text=True,
    )  # fmt: skip
    assert other.returncode != 0 and "Permission denied" in other.stderr
    # the owner can, but a HELLO from outside the job is dropped
    impostor = (
        "import socket\n"
        f"s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r}); s.settimeout(20)\n"
        "s.sendall(b'HELLO\\tjob=hj\\tpid=2\\trestored=1\\n')\n"
        "print('closed' if s.recv(100) == b'' else 'answered')\n"
    )
    out = subprocess.run(
        [PYTHON, "-c", impostor], user="nobody", group=NOBODY.pw_gid, extra_groups=[], capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "closed", out.stderr
    # the job's own processes still answer: it checkpoints
    assert c.checkpoint("hj")["processes"] == 1
    c.ctl("kill", "hj")


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_unknown_user_is_refused(root_ckptd: Ckptd, tmp_path: Path) -> None:
    c = root_ckptd
    r = launch_as(c, "no-such-user-x", "nu", [PYTHON, str(WORKLOADS / "counter.py"), "3"], tmp_path)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "user no-such-user-x does not exist on node" in lines[0], r.stderr
    # nothing was started or written for it (the coordinator may have made its empty directory)
    jd = tmp_path / "ckpts" / "nu"
    assert not jd.exists() or not any(jd.iterdir())


def test_non_root_agent_refuses_another_users_job() -> None:
    """Only a root agent switches users: resolving an owner other than
    itself in an unprivileged agent is a clear refusal."""
    code = (
        "from ckptd.agent.owner import resolve_owner\n"
        "from ckptd.errors import CkptdError\n"
        "try:\n"
        "    resolve_owner('root', 'n1')\n"
        "except CkptdError as e:\n"
        "    print(e.code.name, e.message)\n"
        "print(resolve_owner('', 'n1').switch, resolve_owner('nobody', 'n1').switch)\n"
    )
    with reachable_by_others(Path(PYTHON)):
        out = subprocess.run(
            [PYTHON, "-c", code], user="nobody", group=NOBODY.pw_gid, extra_groups=[], capture_output=True,
            text=True, cwd="/", timeout=60,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.startswith(
        "PERMISSION_DENIED node n1's agent runs as uid 65534, not root: it cannot run a job of user root"
    )
    assert second == "False False"


def test_owner_files_identity_is_per_thread() -> None:
    """files_as checks file access as the owner on this thread only, and
    gives the agent its own identity back."""
    import threading

    from ckptd.agent.owner import files_as, resolve_owner

    owner = resolve_owner("nobody", "n1")
    seen: list[bool] = []
    inside = threading.Event()
    done = threading.Event()

    def other() -> None:
        inside.wait(10)
        seen.append(os.access("/etc/shadow", os.R_OK, effective_ids=True))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with files_as(owner):
        assert not os.access("/etc/shadow", os.R_OK, effective_ids=True)
        with pytest.raises(PermissionError):
            open("/etc/shadow").close()
        inside.set()
        done.wait(10)
    t.join()
    assert seen == [True]  # the other thread stayed root
    open("/etc/shadow").close()


def test_a_checkpoint_directory_closed_to_the_owner_is_refused(root_ckptd: Ckptd, tmp_path: Path) -> None:
    """root does not make directories for a user where that user could not: `--ckpt-dir` must be writable by
    the job's owner."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o755)
    p = root_ckptd.run(
        CKPTD, "launch", "--detach", "--as-user", "nobody", "--job", "nowhere", "--ckpt-dir", str(closed),
        "--", PYTHON, "-c", "print(1)", cwd="/", check=False,
    )  # fmt: skip
    assert p.returncode == 6, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: user nobody may not write in --ckpt-dir {closed} on node "), p.stderr
    assert list(closed.iterdir()) == []  # nothing made there, not even the job's directory
    assert "nowhere" not in root_ckptd.ctl("jobs").stdout
