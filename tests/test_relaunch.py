"""A name used again (issue 16, day two): `ckptctl rm --keep-checkpoints`
leaves an ended job's checkpoints in place; a fresh job launched under the
same name and --ckpt-dir is refused rather than taking them for its own."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import CKPTD, PYTHON, Ckptd
from test_bad_input import one_line_error

PRECONDITION = 4


def test_launch_over_checkpoints_kept_by_rm_is_refused(ckptd: Ckptd, counter: Path, tmp_path: Path) -> None:
    argv = [PYTHON, str(counter), "400"]
    ckptd.launch("kept", argv)
    ckptd.wait_log("kept", r"^tick 3$")
    info = ckptd.checkpoint("kept")
    ckptd.ctl("kill", "kept")
    ckptd.ctl("rm", "kept", "--keep-checkpoints")
    kept = Path(info["path"])
    assert kept.is_dir()
    for extra in ([], ["--resume"]):
        p = ckptd.run(CKPTD, "launch", *extra, "--job", "kept", "--", *argv, check=False)
        assert p.returncode == PRECONDITION, p.stderr
        one_line_error(p, "kept", str(kept.parent), "1 checkpoint(s) of an earlier job", "--keep-checkpoints")
        assert kept.is_dir()  # untouched
        assert ckptd.run(CKPTD, "launch", "--detach", "--job", "kept", "--", "true", check=False).returncode == 4
    shutil.move(str(kept), str(tmp_path / "moved"))  # what the message says to do
    p = ckptd.run(CKPTD, "launch", "--job", "kept", "--", PYTHON, str(counter), "3")
    assert p.stdout == "tick 0\ntick 1\ntick 2\nfinished\n"
    assert ckptd.ctl_json("list", "kept") == []
