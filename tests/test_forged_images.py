"""Images that cannot be forged (issue 15): every manifest carries an
HMAC-SHA256 under the installation's manifest key, and a manifest edited by
hand, its xxh3 digests recomputed, is refused like a corrupt one (exit 5)
before anything is touched.  Independently of that, a restart writes only
where the job wrote: no `..`, no relative path, no symlink on any component,
no setuid/setgid/sticky bit; and a node restores only a job's own checkpoints,
from the job's own directory."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import xxhash
from ckptd.agent.rollback import WorldRollback, check_recorded, check_written_files
from conftest import CKPTCTL, CKPTD, PYTHON, Ckptd, flip_byte, reachable_by_others, run_plain
from test_bad_input import JOURNAL, one_line_error

from ckptd.errors import CkptdError, Code
from ckptd.image.checksum import ALGORITHM, hash_file
from ckptd.paths import Home, default_node
from ckptd.rpc import agent_stub, call
from ckptd.v1 import ckptd_pb2 as pb

CORRUPT, DENIED = 5, 6  # exit statuses (README)
NOBODY = (65534, 65534)


def forge(ckpt: Path, edit: Any) -> bytes:
    """What an attacker without the key can do: edit manifest.json and
    recompute its xxh3 digest, so that every checksum check passes.
    Returns the original bytes."""
    path = ckpt / "manifest.json"
    original = path.read_bytes()
    m = json.loads(original)
    edit(m)
    body = {k: v for k, v in m.items() if k != "digest"}
    m["digest"] = xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    return original


def tree_state(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under root with its mode, mtime and bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_mtime_ns, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
    return out


@pytest.fixture
def crashed(ckptd: Ckptd, tmp_path: Path) -> dict[str, Any]:
    """A job that writes a journal file: two checkpoints, then SIGKILL."""
    script = tmp_path / "journal.py"
    script.write_text(JOURNAL)
    journal, plain_journal = tmp_path / "journal.txt", tmp_path / "plain.txt"
    plain = run_plain([PYTHON, str(script), str(plain_journal)])  # the reference, run meanwhile
    ckptd.launch("forged", [PYTHON, str(script), str(journal)])
    ckptd.wait_log("forged", r"^tick 10$")
    first = ckptd.checkpoint("forged")
    ckptd.wait_log("forged", r"^tick 30$")
    second = ckptd.checkpoint("forged")
    ckptd.wait_log("forged", r"^tick 50$")
    ckptd.kill9("forged")
    return {"plain": plain, "journal": journal, "plain_journal": plain_journal,
            "first": Path(first["path"]), "second": Path(second["path"])}  # fmt: skip


def test_a_forged_manifest_is_refused_before_anything_is_touched(
    ckptd: Ckptd, crashed: dict[str, Any], tmp_path: Path
) -> None:
    journal, second = crashed["journal"], crashed["second"]
    at_crash = journal.read_bytes()
    log_before = ckptd.log_file("forged").read_bytes()
    target = tmp_path / "planted" / "suid-copy"
    data = json.loads((second / "manifest.json").read_text())["written_files"][0]["data"]

    def new_setuid_file(m: dict[str, Any]) -> None:
        m["written_files"].append({"path": str(target), "size": 1, "mode": 0o104755, "mtime_ns": 0,
                                   "index": 99, "saved": True, "data": data})  # fmt: skip

    def other_pages(m: dict[str, Any]) -> None:  # a memory image swapped, its checksum replaced
        flip_byte(second / "proc-2" / "pages.img")
        for e in m["files"]:
            if e["path"] == "proc-2/pages.img":
                e[ALGORITHM] = hash_file(second / "proc-2" / "pages.img")

    def no_mac(m: dict[str, Any]) -> None:  # as a checkpoint from before manifests were sealed
        del m["hmac_sha256"]

    cases = [(new_setuid_file, "fails its authentication"), (other_pages, "fails its authentication"),
             (no_mac, "no authentication code")]  # fmt: skip
    for edit, words in cases:
        pages = (second / "proc-2" / "pages.img").read_bytes()
        original = forge(second, edit)
        listed = {c["id"]: c for c in ckptd.ctl_json("list", "forged")}
        assert listed[2]["created"] == "corrupt" and listed[1]["created"] != "corrupt"
        # (a plain `restart` passes over a checkpoint listed corrupt, to the newest whole one)
        p = ckptd.ctl("restart", "forged", "--from", "2", check=False)
        assert p.returncode == CORRUPT, p.stderr
        one_line_error(p, "ckpt-000002", words, "--from")
        p = ckptd.ctl("inspect", str(second), "--verify", check=False)
        assert p.returncode == CORRUPT, p.stderr
        one_line_error(p, words)
        # nothing touched: no file made, the job's file and log as the crash left them, no process
        assert not target.exists() and not target.parent.exists()
        assert journal.read_bytes() == at_crash
        assert ckptd.log_file("forged").read_bytes() == log_before
        st = ckptd.status("forged")
        assert st["state"] == "failed" and st["pids"] == [], st
        assert not list(ckptd.home.rglob("undo-ckpt-*"))
        (second / "manifest.json").write_bytes(original)
        (second / "proc-2" / "pages.img").write_bytes(pages)

    # defence in depth, without the MAC: a written file the image did not record is refused
    m = json.loads((second / "manifest.json").read_text())
    check_recorded(second, m)  # the genuine list passes
    m["written_files"][0]["path"] = str(target)
    with pytest.raises(CkptdError) as e:
        check_recorded(second, m)
    assert e.value.code is Code.DATA_LOSS and "the job did not write" in e.value.message

    # the earlier checkpoint, untouched, still restarts the job exactly
    ckptd.ctl("restart", "forged", "--from", "1")
    assert ckptd.wait("forged") == 0
    assert ckptd.log("forged") == crashed["plain"].stdout
    assert journal.read_bytes() == crashed["plain_journal"].read_bytes()


def test_inspect_without_the_key_says_authenticity_was_not_checked(ckptd: Ckptd, tmp_path: Path) -> None:
    ckptd.launch("peek", [PYTHON, "-c", "import time\nfor i in range(300): print(i, flush=True); time.sleep(0.05)"])
    ckptd.wait_log("peek", r"^3$")
    ckpt = Path(ckptd.checkpoint("peek")["path"])
    ckptd.kill9("peek")
    key = ckptd.home / "manifest.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32  # made by the daemon
    p = ckptd.ctl("inspect", str(ckpt), "--verify", "--json")
    assert json.loads(p.stdout)["authenticity"] == "checked"

    # another user, who cannot read the key, with a readable copy of the checkpoint
    copy = tmp_path / "shared" / ckpt.name
    shutil.copytree(ckpt, copy)
    for p_ in [copy.parent, copy, *copy.rglob("*")]:
        os.chown(p_, *NOBODY)
    env = dict(ckptd.env, CKPTD_MANIFEST_KEY=str(key), HOME=str(copy.parent))
    with reachable_by_others(Path(PYTHON), Path(CKPTCTL), copy):
        p = subprocess.run([CKPTCTL, "inspect", str(copy), "--verify"], env=env, capture_output=True, text=True,
                           user=NOBODY[0], group=NOBODY[1], extra_groups=[], timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "checksums OK; authenticity not checked (cannot read the manifest key" in p.stdout, p.stdout
    assert str(key) in p.stdout


@pytest.mark.parametrize("problem", ["mode 0644", "another owner", "too short"])
def test_an_unsafe_manifest_key_stops_the_daemon(tmp_path: Path, problem: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(8 if problem == "too short" else 32))
    key.chmod(0o644 if problem == "mode 0644" else 0o600)
    if problem == "another owner":
        os.chown(key, *NOBODY)
    env = dict(os.environ, CKPTD_HOME=str(home))
    for var in ("CKPTD_COORDINATOR", "CKPTD_MANIFEST_KEY", "LD_PRELOAD"):
        env.pop(var, None)
    runs = [[CKPTD, "coordinator", "--listen", f"unix:{tmp_path}/c.sock", "--manifest-key", str(key)],
            [CKPTD, "daemon", "--idle-exit", "5"],
            [CKPTCTL, "checkpoint", "nosuch"]]  # the CLI starting the local daemon says its reason  # fmt: skip
    for argv in runs:
        run_env = env if "--manifest-key" in argv else dict(env, CKPTD_MANIFEST_KEY=str(key))
        p = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=60)
        assert p.returncode == DENIED, (argv, p.stderr)
        err = one_line_error(p, f"manifest key {key}")
        assert {"mode 0644": "mode 0644", "another owner": "owned by uid 65534", "too short": "8 bytes"}[problem] in err
    assert not (tmp_path / "c.sock").exists()
    assert key.stat().st_size == (8 if problem == "too short" else 32)  # left as it was


# ---- the rollback layer itself, on crafted lists ----


def crafted_checkpoint(tmp_path: Path, written: list[dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory with one saved file copy, and a manifest (as
    the rollback sees it once verified) listing `written`."""
    ckpt = tmp_path / "ckpt-000001"
    (ckpt / "proc-2" / "files").mkdir(parents=True)
    saved = ckpt / "proc-2" / "files" / "0.data"
    saved.write_bytes(b"restored contents\n")
    files = [{"path": "proc-2/files/0.data", "size": saved.stat().st_size, ALGORITHM: hash_file(saved)}]
    entries = [
        dict({"size": saved.stat().st_size, "mode": 0o100640, "mtime_ns": 10**18, "index": 0, "saved": True,
              "data": "proc-2/files/0.data"}, **w)
        for w in written
    ]  # fmt: skip
    return ckpt, {"files": files, "written_files": entries}


def test_rollback_writes_a_valid_list_exactly(tmp_path: Path) -> None:
    out = tmp_path / "job" / "sub" / "out.txt"  # its directory is gone: made again
    ckpt, m = crafted_checkpoint(tmp_path, [{"path": str(out)}])
    world = WorldRollback(tmp_path / "journal")
    assert world.roll_back_files(ckpt, m) == 1
    assert out.read_bytes() == b"restored contents\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o640 and out.stat().st_mtime_ns == 10**18
    world.undo()  # a failed restart: what it made goes again
    assert not (tmp_path / "job").exists()


def test_rollback_refuses_paths_outside_what_the_job_wrote(tmp_path: Path) -> None:
    victim = tmp_path / "root-owned"  # stands for /etc: a directory the job must never write in
    victim.mkdir(mode=0o755)
    os.chown(victim, 0, 0)
    job = tmp_path / "job"
    job.mkdir()
    (job / "link").symlink_to(victim)  # planted in a parent directory
    (job / "leaf.txt").symlink_to(victim / "passwd")  # planted as the file itself
    good = job / "fine.txt"  # a valid entry, listed first: not written either
    cases = [
        (f"{job}/../root-owned/evil", {}, "has a '..' component"),
        ("job/relative.txt", {}, "is a relative path"),
        (f"{job}/./x", {}, "is not a normalised absolute file path"),
        (f"{job}/link/evil", {}, f"lies beneath {job}/link, a symbolic link"),
        (f"{job}/leaf.txt", {}, "is a symbolic link now"),
        (f"{job}/setuid", {"mode": 0o104755}, "has mode 4755: setuid, setgid and sticky bits are never restored"),
        (f"{job}/setgid", {"mode": 0o102775}, "has mode 2775"),
        (f"{job}/elsewhere", {"data": "../../etc/shadow"}, "has no saved copy"),
    ]
    for path, extra, words in cases:
        before = tree_state(tmp_path)
        ckpt, m = crafted_checkpoint(tmp_path / "c", [{"path": str(good)}, dict({"path": path}, **extra)])
        with pytest.raises(CkptdError) as e:
            check_written_files(ckpt, m)
        assert e.value.code is Code.DATA_LOSS and words in e.value.message, e.value.message
        assert path in e.value.message and "\n" not in e.value.message
        world = WorldRollback(tmp_path / "journal")
        with pytest.raises(CkptdError) as e2:
            world.roll_back_files(ckpt, m)
        assert e2.value.message == e.value.message
        # nothing written anywhere: the victim is empty, the job's directory as it was
        assert list(victim.iterdir()) == [] and not good.exists()
        after = {k: v for k, v in tree_state(tmp_path).items() if not k.startswith(str(ckpt.parent))}
        assert after == before
        shutil.rmtree(ckpt.parent)


# ---- Agent.Restore takes only a job's own checkpoints ----


def test_agent_restores_only_the_jobs_own_checkpoints(ckptd: Ckptd, crashed: dict[str, Any], tmp_path: Path) -> None:
    journal, first = crashed["journal"], crashed["first"]
    at_crash = journal.read_bytes()
    log_before = ckptd.log_file("forged").read_bytes()
    home = Home(ckptd.home)
    agent = agent_stub(f"unix:{home.agent_socket(default_node())}")
    spec = pb.JobSpec()
    spec.CopyFrom(call(agent.GetJob, pb.AgentJobRequest(job="forged"), 10, "agent").spec)
    assert spec.ckpt_dir and spec.name == "forged"

    # a copy of a real checkpoint in a directory the caller made, its manifest forged
    mine = tmp_path / "mine"
    copy = mine / "forged" / first.name
    shutil.copytree(first, copy)
    target = tmp_path / "planted"
    forge(copy, lambda m: m["written_files"].append(dict(m["written_files"][0], path=str(target), mode=0o104755)))
    (mine / "other").symlink_to(Path(spec.ckpt_dir) / "forged")

    def restore(ckpt_dir: str, checkpoint: Path) -> CkptdError:
        s = pb.JobSpec()
        s.CopyFrom(spec)
        s.ckpt_dir = ckpt_dir
        with pytest.raises(CkptdError) as e:
            call(agent.Restore, pb.RestoreRequest(spec=s, checkpoint_dir=str(checkpoint)), 60, "agent")
        return e.value

    cases = [
        (spec.ckpt_dir, copy, Code.PERMISSION_DENIED, "is not a checkpoint in job forged's own directory"),
        (spec.ckpt_dir, Path(spec.ckpt_dir) / "forged" / ".." / "forged" / first.name, Code.PERMISSION_DENIED,
         "own directory"),
        (str(mine), mine / "other" / first.name, Code.PERMISSION_DENIED, "own directory"),
        (str(mine / "other" / ".."), mine / "other" / ".." / "forged" / first.name, Code.PERMISSION_DENIED,
         "own directory"),
        (str(mine), copy, Code.DATA_LOSS, "fails its authentication"),
    ]  # fmt: skip
    for ckpt_dir, checkpoint, code, words in cases:
        e = restore(ckpt_dir, checkpoint)
        assert e.code is code and words in e.message, (checkpoint, e.message)
        assert "\n" not in e.message
        assert not target.exists()
        assert journal.read_bytes() == at_crash
        assert ckptd.log_file("forged").read_bytes() == log_before
        st = ckptd.status("forged")
        assert st["state"] == "failed" and st["pids"] == [], st
    (mine / "forged").rename(mine / "real")  # a symlink in place of the job's directory is refused too
    (mine / "forged").symlink_to(mine / "real")
    e = restore(str(mine), mine / "forged" / first.name)
    assert e.code is Code.PERMISSION_DENIED and "is a symbolic link" in e.message, e.message

    ckptd.ctl("restart", "forged", "--from", "1")  # the coordinator's own restart still works
    assert ckptd.wait("forged") == 0
    assert ckptd.log("forged") == crashed["plain"].stdout
