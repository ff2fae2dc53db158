"""Corrupt and truncated bytes in each file a checkpoint is made of (issue
20's fault-injection matrix): manifest.json, output.log, output.idx, and
each process's core.img, pages.img and files/N.data, in a full checkpoint,
an incremental one, and the full one an incremental one reads its pages
from (the chain's base).

The checkpoints are built once per module (a job that writes a journal
file, with --full-every 2: ckpt-000001 full, ckpt-000002 incremental on
top of it, ckpt-000003 full); every case damages one file, checks the
refusal, and puts the file back.  The promise of every cell: the restart
is refused with exit 5 and a one-line error naming the file, no restored
process runs, the job's log and files stay as they were, and the job's
other good checkpoint restores it byte-identical to an uninterrupted run."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import faultmatrix
import pytest
from conftest import PYTHON, Ckptd, ckptd_at, flip_byte, run_plain
from test_bad_input import CORRUPT, one_line_error

JOURNAL = """
import sys, time
out = open(sys.argv[1], "w")
for i in range(250):
    out.write(f"step {i}\\n")
    out.flush()
    print(f"tick {i}", flush=True)
    time.sleep(0.01)
"""

FILES = ("manifest.json", "output.log", "output.idx", "proc-2/core.img", "proc-2/pages.img", "proc-2/files/0.data")
# which checkpoint is damaged, which one the restart asks for, which good one restores instead
KINDS = {
    "full": (3, 3, 2),  # a full checkpoint; the incremental one before it still restores
    "incremental": (2, 2, 1),  # an incremental one; its base still restores
    "base": (1, 2, 3),  # the base an incremental one reads its pages from; a later full one restores
}


WHOSE = {"full": "a full checkpoint", "incremental": "an incremental checkpoint", "base": "a chain's base (pages.img)"}
PROMISE = (
    "the restart is refused (exit 5, one line naming the file), nothing runs, the job's log and files are "
    "untouched, and another good checkpoint restores byte-identical"
)


@dataclass
class Built:
    c: Ckptd
    store: Path
    pristine: Path
    journal: Path
    plain_stdout: str
    plain_journal: bytes


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    tmp = tmp_path_factory.mktemp("damaged")
    (tmp / "home").mkdir()
    script = tmp / "journal.py"
    script.write_text(JOURNAL)
    plain_journal = tmp / "plain.txt"
    plain = run_plain([PYTHON, str(script), str(plain_journal)])
    with ckptd_at(tmp / "home") as c:
        journal, store = tmp / "journal.txt", tmp / "store"
        c.launch("dmg", [PYTHON, str(script), str(journal)], "--ckpt-dir", str(store), "--full-every", "2")
        for n, tick in ((1, 20), (2, 40), (3, 60)):
            c.wait_log("dmg", rf"^tick {tick}$")
            info = c.checkpoint("dmg")
            assert info["id"] == n and bool(info["depends_on"]) == (n == 2), info
        c.wait_log("dmg", r"^tick 80$")
        c.kill9("dmg")
        pristine = tmp / "pristine"
        shutil.copytree(store / "dmg", pristine, symlinks=True)
        yield Built(c, store / "dmg", pristine, journal, plain.stdout, plain_journal.read_bytes())


def damage_cells() -> list[object]:
    out = []
    for kind in KINDS:
        files = ("proc-2/pages.img",) if kind == "base" else FILES
        for name in files:
            for how in ("corrupt", "truncated"):
                fault = f"{how} bytes in each file of {WHOSE[kind]}"
                phase = "verify" if name != "proc-2/pages.img" else "rebuild"
                marks = [faultmatrix.cell(fault, phase, PROMISE)]
                out.append(pytest.param(kind, name, how, marks=marks, id=f"{kind}-{name.replace('/', '.')}-{how}"))
    return out


@pytest.mark.parametrize(("kind", "name", "how"), damage_cells())
def test_damaged_file_is_refused_and_a_good_checkpoint_restores(built: Built, kind: str, name: str, how: str) -> None:
    c = built.c
    damaged, asked, good = KINDS[kind]
    target = built.store / f"ckpt-{damaged:06d}" / name
    log_before = c.log_file("dmg").read_bytes()
    journal_before = built.journal.read_bytes()
    try:
        if how == "corrupt":
            flip_byte(target)
        else:
            os.truncate(target, os.path.getsize(target) // 2)
        p = c.ctl("restart", "dmg", "--from", str(asked), check=False)
        assert p.returncode == CORRUPT, (p.returncode, p.stderr)
        err = one_line_error(p, "--from")
        assert Path(name).name in err or (name == "manifest.json" and "manifest" in err), err
        st = c.status("dmg")
        assert st["state"] != "running" and st["pids"] == [], st  # nothing runs
        assert c.log_file("dmg").read_bytes() == log_before  # nothing touched
        assert built.journal.read_bytes() == journal_before
    finally:
        shutil.copy2(built.pristine / f"ckpt-{damaged:06d}" / name, target)
    c.ctl("restart", "dmg", "--from", str(good))
    assert c.wait("dmg") == 0
    assert c.log("dmg", "stdout") == built.plain_stdout
    assert built.journal.read_bytes() == built.plain_journal
