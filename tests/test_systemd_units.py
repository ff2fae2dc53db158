"""examples/systemd/: the units pass `systemd-analyze verify` without a warning, and the config file
each one shows in its comment is one ckptd accepts."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CKPTD

from ckptd import config

UNITS = Path(__file__).resolve().parent.parent / "examples" / "systemd"
NAMES = ["ckptd-coordinator.service", "ckptd-agent.service"]


@pytest.mark.parametrize("name", NAMES)
def test_unit_verifies(name: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    text = (UNITS / name).read_text()
    assert "ExecStart=/usr/local/bin/ckptd " in text
    # the one change: the installed ckptd instead of pip's usual path (verify checks that it is executable)
    unit = tmp_path / name
    unit.write_text(text.replace("/usr/local/bin/ckptd", CKPTD))
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on an unknown key or a bad value, and only says so
    complaints = [x for x in (p.stdout + p.stderr).splitlines() if name in x]
    assert p.returncode == 0 and not complaints, p.stdout + p.stderr


@pytest.mark.parametrize("name", NAMES)
def test_the_config_in_its_comment_is_accepted(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.cli.ckptd_main import parser

    comment = [x[2:] for x in (UNITS / name).read_text().splitlines() if x.startswith("#   ")]
    toml = "\n".join(re.sub(r"\s+#.*", "", x).strip() for x in comment)
    path = tmp_path / "config.toml"
    path.write_text(toml)
    for var in config.ENV_KEYS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CKPTD_CONFIG", str(path))
    p = parser()
    config.apply(p)
    command = name.removeprefix("ckptd-").removesuffix(".service")
    args = p.parse_args([command])
    assert args.tls == "/etc/ckptd/tls" and args.metrics
