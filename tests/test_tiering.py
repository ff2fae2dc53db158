"""Tiering: `ckptd launch --stage-dir FAST --ckpt-dir SHARED [--compress ...]`.

Checkpoints commit on the stage and go up to the shared tier in the
background (memory images zstd-compressed); retention applies to both
tiers; after a node failure that takes the stage with it, a restart fetches
the chain back down and gives the uninterrupted run's output.  A failed
upload loses nothing: the stage copy stays, the job runs on, and the next
checkpoint uploads what is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import PYTHON, Ckptd, flip_byte, run_plain

from ckptd.image.transfer import worth_compressing


def tiers(ckptd: Ckptd, job: str) -> dict[str, str]:
    return {c["name"]: c.get("tier", "") for c in ckptd.ctl_json("list", job)}


def test_checkpoints_go_up_compressed_and_a_lost_stage_is_fetched_back(
    ckptd: Ckptd, counter: Path, tmp_path: Path
) -> None:
    plain = run_plain([PYTHON, str(counter), "140"])  # the reference, run meanwhile
    stage, shared = tmp_path / "stage", tmp_path / "shared"
    # ckpt 1 full, 2 on top of it, 3 full, 4 on top of 3; --keep 2 keeps 3 and 4 on both tiers
    ckptd.launch("tier", [PYTHON, str(counter), "140"], "--stage-dir", str(stage), "--ckpt-dir", str(shared),
                 "--compress", "zstd", "--full-every", "2", "--keep", "2")  # fmt: skip
    for n in range(4):
        ckptd.wait_log("tier", rf"^tick {5 + 5 * n}$")
        info = ckptd.ctl_json("checkpoint", "tier", "--wait-shared")
        assert info["tier"] == "local+shared", info  # answered once the upload is durable
    listed = ckptd.ctl_json("list", "tier")
    assert [c["name"] for c in listed] == ["ckpt-000003", "ckpt-000004"]
    assert sorted(p.name for p in (shared / "tier").iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-000003", "ckpt-000004",
    ]  # fmt: skip
    for c in listed:
        # the interpreter's memory compresses: the shared copy is smaller than the stage's
        assert 0 < int(c["shared_bytes"]) < int(c["size_bytes"]) // 2, c
        assert (shared / "tier" / c["name"] / "proc-2" / "pages.img.zst").is_file()
    assert str(stage) in listed[0]["path"]

    ckptd.kill9("tier")
    shutil.rmtree(stage)  # the node's fast disk is gone with it
    assert tiers(ckptd, "tier") == {"ckpt-000003": "shared", "ckpt-000004": "shared"}
    ckptd.ctl("restart", "tier")
    assert ckptd.wait("tier") == 0
    assert ckptd.log("tier") == plain.stdout
    # fetched back: both tiers hold the chain again, uncompressed on the stage
    assert tiers(ckptd, "tier") == {"ckpt-000003": "local+shared", "ckpt-000004": "local+shared"}
    assert (stage / "tier" / "ckpt-000004" / "proc-2" / "pages.img").is_file()
    ckptd.ctl("inspect", "--verify", str(stage / "tier" / "ckpt-000004"))
    ckptd.ctl("inspect", "--verify", str(shared / "tier" / "ckpt-000004"))  # decompressed on the fly


def test_a_corrupt_shared_copy_is_refused_and_nothing_is_fetched(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    plain = run_plain([PYTHON, str(counter), "100"])
    stage, shared = tmp_path / "stage", tmp_path / "shared"
    ckptd.launch("bad", [PYTHON, str(counter), "100"], "--stage-dir", str(stage), "--ckpt-dir", str(shared),
                 "--compress", "zstd", "--full-every", "1")  # fmt: skip
    for tick in (5, 10):
        ckptd.wait_log("bad", rf"^tick {tick}$")
        ckptd.ctl("checkpoint", "bad", "--wait-shared")
    ckptd.kill9("bad")
    shutil.rmtree(stage)
    flip_byte(shared / "bad" / "ckpt-000002" / "proc-2" / "pages.img.zst")

    p = ckptd.ctl("inspect", "--verify", str(shared / "bad" / "ckpt-000002"), check=False)
    assert p.returncode == 5 and "shared copy ckpt-000002" in p.stderr, p.stderr
    p = ckptd.ctl("restart", "bad", check=False)
    assert p.returncode == 5 and "the shared copy of ckpt-000002" in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert not (stage / "bad" / "ckpt-000002").exists()  # nothing half-fetched counts as a checkpoint
    assert ckptd.status("bad")["pids"] == []
    ckptd.ctl("restart", "bad", "--from", "1")
    assert ckptd.wait("bad") == 0
    assert ckptd.log("bad") == plain.stdout


def test_a_failed_upload_keeps_the_stage_copy_and_is_retried(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    plain = run_plain([PYTHON, str(counter), "120"])
    stage, shared = tmp_path / "stage", tmp_path / "shared"
    shared.mkdir()
    (shared / "up").write_text("in the way\n")  # the job's shared directory cannot be made
    ckptd.launch("up", [PYTHON, str(counter), "120"], "--stage-dir", str(stage), "--ckpt-dir", str(shared))
    ckptd.wait_log("up", r"^tick 5$")
    p = ckptd.ctl("checkpoint", "up", "--wait-shared", check=False)
    assert p.returncode == 7, (p.returncode, p.stderr)  # UNAVAILABLE: storage
    assert "committed on the stage, but its upload" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert tiers(ckptd, "up") == {"ckpt-000001": "local"}
    assert ckptd.status("up")["state"] == "running"  # the job runs on

    (shared / "up").unlink()  # fixed: the next checkpoint uploads both
    ckptd.wait_log("up", r"^tick 10$")
    ckptd.ctl("checkpoint", "up", "--wait-shared")
    ckptd.wait_log("up", r"^tick 12$")
    assert tiers(ckptd, "up") == {"ckpt-000001": "local+shared", "ckpt-000002": "local+shared"}
    ckptd.kill9("up")
    shutil.rmtree(stage)
    ckptd.ctl("restart", "up")
    assert ckptd.wait("up") == 0
    assert ckptd.log("up") == plain.stdout


def test_tiering_flags_are_checked(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    from conftest import CKPTD

    argv = ["--", PYTHON, str(counter), "5"]
    cases = [
        (["--stage-dir", str(tmp_path / "s")], "--stage-dir needs --ckpt-dir"),
        (["--compress", "zstd"], "--compress applies to the shared tier"),
        (["--stage-dir", str(tmp_path / "s"), "--ckpt-dir", str(tmp_path / "s")], "are the same directory"),
    ]
    for flags, message in cases:
        p = ckptd.run(CKPTD, "launch", "--detach", *flags, *argv, check=False)
        assert p.returncode == 2 and message in p.stderr, (flags, p.stderr)
    assert ckptd.ctl_json("jobs") == []  # nothing was launched

    ckptd.launch("plain", [PYTHON, str(counter), "200"])
    ckptd.wait_log("plain", r"^tick 2$")
    p = ckptd.ctl("checkpoint", "plain", "--wait-shared", check=False)
    assert p.returncode == 4 and "no shared tier" in p.stderr, p.stderr
    assert ckptd.status("plain")["state"] == "running" and ckptd.ctl_json("list", "plain") == []


def test_auto_compression_skips_what_does_not_shrink(tmp_path: Path) -> None:
    import os

    noise, zeros = tmp_path / "noise", tmp_path / "zeros"
    noise.write_bytes(os.urandom(32 << 20))
    zeros.write_bytes(bytes(32 << 20))
    assert not worth_compressing(noise)
    assert worth_compressing(zeros)
    # and only where compressing costs less time than the smaller write saves
    assert worth_compressing(zeros, write_bw=1e6)  # a 1 MB/s shared tier
    assert not worth_compressing(zeros, write_bw=1e15)
